"""Packed documents through Megatron's data paths (integration/packing.py), megatron-core GPTModel on CPU.

The reference is megatron-core's own attention (the local spec's ``DotProductAttention``) with the
S x S mask Megatron's GPT dataset builds for ``--reset-attention-mask``
(``gpt_dataset._get_ltor_masks_and_position_ids``), on one device. MTraining gets the same documents
without any mask:

* pretraining batches (``--reset-attention-mask``, documents from the EOD tokens or from
  ``--reset-position-ids``) go through the real CP batch split (``get_batch_on_this_cp_rank``, patched
  by ``patches.install``), which leaves the documents for the layers;
* THD batches (``--sft``, ``--dataloader-inter-document-masking``) go through the real THD CP split
  and reach the layers as ``PackedSeqParams``; RoPE restarts per document (Megatron's THD RoPE at
  CP = 1, the plugin's patch over CP).

Dense index: equal to the reference (logits, loss, every gradient; fp32, 1e-5), at CP = 1 and CP = 2
(striped and zigzag). Sparse ``vs`` index: CP = 2 equal to the plugin at CP = 1. Documents fed as
separate sequences give the same logits. Bad input gives clear errors.
"""

import inspect
import logging

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

pytest.importorskip("megatron.core")

from megatron.core import parallel_state  # noqa: E402
from megatron.core import utils as core_utils  # noqa: E402
from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from megatron_mtraining import MTrainingConfig  # noqa: E402
from megatron_mtraining.integration import core_attention as mt_attention  # noqa: E402
from megatron_mtraining.integration import packing, patches  # noqa: E402
from megatron_mtraining.testing.cpu_shims import apply_cpu_shims  # noqa: E402
from megatron_mtraining.integration.spec import get_gpt_layer_spec  # noqa: E402
from megatron_batch import FakeGroup, cp_split  # noqa: E402
from oracle import rel_err  # noqa: E402

SEQ, VOCAB, EOD, BLOCK = 512, 128, 7, 64
EOD_AT = (37, 100, 101, 250, 400)  # documents end after these tokens: lengths 38, 63, 1, 149, 150, 111
CU = (0, 38, 101, 102, 251, 401, 512)
TOL = 1e-5


# ---------------------------------------------------------------------------- helpers


pytestmark = pytest.mark.usefixtures("clean_mtraining_state")


def transformer_config(**overrides) -> TransformerConfig:
    kwargs = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, use_cpu_initialization=True,
                  gradient_accumulation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
                  apply_rope_fusion=False, attention_dropout=0.0, hidden_dropout=0.0)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_gpt(layer_spec, seed=1234, **config) -> GPTModel:
    torch.manual_seed(seed)
    return GPTModel(config=transformer_config(**config), transformer_layer_spec=layer_spec, vocab_size=VOCAB,
                    max_sequence_length=SEQ, position_embedding_type="rope")


def mt_config(index="dense", layout="striped"):
    return MTrainingConfig(index=index, layout=layout, block_size=BLOCK, top_p=0.5, max_slash=2, max_vertical=32,
                           min_vertical=0, last_q=64)


def sample(seed=0, eod_at=EOD_AT):
    """One packed pretraining sample ``[1, SEQ]`` as Megatron's GPT dataset builds it
    (``--reset-attention-mask --eod-mask-loss``): tokens, labels, loss mask, the reset position ids,
    the global position ids and the S x S mask (True = masked)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(EOD + 1, VOCAB, (SEQ,), generator=g)
    tokens[list(eod_at)] = EOD
    labels = torch.randint(0, VOCAB, (SEQ,), generator=g)
    mask, loss_mask, reset_ids = _get_ltor_masks_and_position_ids(tokens, EOD, True, True, True, True)
    return dict(tokens=tokens[None], labels=labels[None], loss_mask=loss_mask[None], reset_ids=reset_ids[None],
                position_ids=torch.arange(SEQ)[None], mask=mask[None])


def loss_of(logits, labels, loss_mask, total_tokens):
    """Megatron's masked LM loss summed locally, over the global token count (CP ranks add up)."""
    losses = F.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1), reduction="none")
    return (losses * loss_mask.reshape(-1)).sum() / total_tokens


def run_reference(model, data, mask=True):
    """megatron-core's own attention with Megatron's reset mask (one device)."""
    model.zero_grad(set_to_none=True)
    logits = model(data["tokens"], data["position_ids"], data["mask"] if mask else None)
    loss = loss_of(logits, data["labels"], data["loss_mask"], data["tokens"].numel())
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def cp_split_thd(batch, cu, max_seqlen, cp_group=None, per_sequence=False):
    """The THD CP split of this megatron-core version and the PackedSeqParams its forward_step builds:
    ``--sft`` (the per-document split) or, ``per_sequence``, ``--dataloader-inter-document-masking``
    (Megatron-LM 0.19 splits those batches like unpacked ones, cu_seqlens kept as metadata)."""
    if hasattr(core_utils, "get_thd_batch_on_this_cp_rank") and not per_sequence:  # megatron-core <= 0.16
        return core_utils.get_thd_batch_on_this_cp_rank(batch, cu, None, torch.tensor([max_seqlen]))
    batch.update(cu_seqlens=cu[None], cu_seqlens_padded=None, max_seqlen=torch.tensor([max_seqlen]))
    if "use_per_sequence_balancing" in inspect.signature(core_utils.get_batch_on_this_cp_rank).parameters:
        batch = core_utils.get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=cp_group,
                                                     use_per_sequence_balancing=per_sequence)
    else:
        batch = cp_split(batch, cp_group)
    return batch, PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_seqlen,
                                  max_seqlen_kv=max_seqlen)


def run_packed(model, data, kind, cp_group=None, with_mask=False, backward=True):
    """One MTraining forward/backward on a packed batch through the real split: ``kind`` is "eod"
    (documents from EOD tokens), "reset" (from --reset-position-ids), "thd" (--sft) or "thd-seq"
    (--dataloader-inter-document-masking)."""
    model.zero_grad(set_to_none=True)
    position_ids = data["position_ids"] if kind == "eod" else data["reset_ids"]
    batch = dict(tokens=data["tokens"], labels=data["labels"], loss_mask=data["loss_mask"], position_ids=position_ids,
                 attention_mask=data["mask"] if with_mask else None)
    psp = None
    if kind.startswith("thd"):
        cu = torch.tensor(CU, dtype=torch.int32)
        batch.pop("attention_mask")
        batch, psp = cp_split_thd(batch, cu, max(b - a for a, b in zip(CU, CU[1:])), cp_group, kind == "thd-seq")
    else:
        packing.configure_packing(reset_attention_mask=True, reset_position_ids=kind == "reset", eod_token=EOD)
        batch = cp_split(batch, cp_group)
    logits = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), packed_seq_params=psp)
    loss = loss_of(logits, batch["labels"], batch["loss_mask"], data["tokens"].numel())
    if backward:
        loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def state_of(model):
    return {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in model.state_dict().items()}


def assert_close(got, ref, what):
    (logits, loss, grads), (ref_logits, ref_loss, ref_grads) = got, ref
    assert rel_err(logits, ref_logits) < TOL, what
    assert abs(loss.item() - ref_loss.item()) <= TOL * abs(ref_loss.item()), what
    assert grads.keys() == ref_grads.keys(), what
    for name, g in ref_grads.items():
        assert rel_err(grads[name], g) < TOL, (what, name)


# ---------------------------------------------------------------------------- CP = 1


@pytest.mark.parametrize("kind", ["eod", "reset", "thd", "thd-seq"])
def test_cp1_dense_equals_megatron_reset_mask(megatron_cpu, kind):
    """The three data paths at CP = 1 equal Megatron's own attention with its reset mask; the
    dataloader's S x S mask, when it comes, is ignored (documents arrive as cu_seqlens)."""
    data = sample(1)
    reference = build_gpt(get_gpt_layer_local_spec())
    ref = run_reference(reference, data)
    cfg = mt_config()
    patches.install(cfg)
    model = build_gpt(get_gpt_layer_spec(cfg))
    model.load_state_dict(reference.state_dict())
    got = run_packed(model, data, kind, with_mask=kind == "eod")
    assert_close(got, ref, kind)
    if not kind.startswith("thd"):
        docs = packing.current_batch_documents()
        assert docs.cu_seqlens.tolist() == list(CU) and docs.source == ("eod" if kind == "eod" else "position_ids")
    # without the documents the result differs (the test can see a wrong mask)
    packing.reset_packing()
    model.zero_grad(set_to_none=True)
    plain = model(data["tokens"], data["position_ids"], None)
    assert rel_err(plain.detach(), ref[0]) > 1e-2


def test_cp1_documents_as_separate_sequences(megatron_cpu):
    """Each document of the packed THD run has the logits of that document run alone (Megatron's
    local attention, causal): RoPE restarts per document, and depends on relative positions only."""
    data = sample(2)
    cfg = mt_config()
    patches.install(cfg)
    model = build_gpt(get_gpt_layer_spec(cfg))
    alone = build_gpt(get_gpt_layer_local_spec())
    alone.load_state_dict(model.state_dict())
    with torch.no_grad():
        packed, _, _ = run_packed(model.eval(), data, "thd", backward=False)
        for a, b in zip(CU, CU[1:]):
            n = b - a
            causal = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)[None, None]
            logits = alone(data["tokens"][:, a:b], torch.arange(n)[None], causal)
            assert rel_err(packed[:, a:b], logits) < TOL, (a, b)


def test_micro_batch_of_two(megatron_cpu):
    """Two samples with the same documents share cu_seqlens (equal to the reference per sample);
    different documents are a clear error naming --micro-batch-size 1."""
    cfg = mt_config()
    patches.install(cfg)
    packing.configure_packing(reset_attention_mask=True, eod_token=EOD)
    model = build_gpt(get_gpt_layer_spec(cfg))
    reference = build_gpt(get_gpt_layer_local_spec())
    reference.load_state_dict(model.state_dict())
    one, two = sample(3), sample(4)
    both = {k: torch.cat([one[k], two[k]]) for k in ("tokens", "labels", "loss_mask", "position_ids")}
    batch = cp_split(dict(both, attention_mask=None))
    with torch.no_grad():
        logits = model(batch["tokens"], batch["position_ids"], None)
        for i, data in enumerate((one, two)):
            ref = reference(data["tokens"], data["position_ids"], data["mask"])
            assert rel_err(logits[i:i + 1], ref) < TOL
    other = sample(5, eod_at=(10, 300))
    mixed = {k: torch.cat([one[k], other[k]]) for k in ("tokens", "labels", "loss_mask", "position_ids")}
    with pytest.raises(ValueError, match="--micro-batch-size 1"):
        cp_split(dict(mixed, attention_mask=None))


def test_full_recompute_keeps_the_documents_of_its_forward(megatron_cpu):
    """--recompute-granularity full: the backward re-runs the forward; it attends with the documents
    of its own forward even if a batch split of another batch came in between (sparse index, so the
    approximator sees them too). Gradients equal those without recompute."""
    cfg = mt_config(index="vs")
    patches.install(cfg)
    data, other = sample(6), sample(7, eod_at=(200,))
    plain = build_gpt(get_gpt_layer_spec(cfg))
    ref = run_packed(plain, data, "eod")
    model = build_gpt(get_gpt_layer_spec(cfg), recompute_granularity="full", recompute_method="uniform",
                      recompute_num_layers=1)
    model.load_state_dict(plain.state_dict())
    batch = cp_split(dict(tokens=data["tokens"], labels=data["labels"], loss_mask=data["loss_mask"],
                          position_ids=data["position_ids"], attention_mask=None))
    logits = model(batch["tokens"], batch["position_ids"], None)
    loss = loss_of(logits, batch["labels"], batch["loss_mask"], SEQ)
    cp_split(dict(tokens=other["tokens"], position_ids=other["position_ids"]))  # the next batch's documents
    assert packing.current_batch_documents().cu_seqlens.tolist() == [0, 201, SEQ]
    loss.backward()
    assert_close((logits.detach(), loss.detach(), {n: p.grad for n, p in model.named_parameters()}), ref, "recompute")
    assert all(m._recompute_documents is None for m in model.modules() if hasattr(m, "_recompute_documents"))


def test_dataloader_mask_is_logged_once(megatron_cpu, caplog):
    patches.install(mt_config())
    packing.configure_packing(reset_attention_mask=True, eod_token=EOD)
    packing._LOGGED.clear()
    data = sample(8)
    with caplog.at_level(logging.INFO, logger=packing.__name__):
        for _ in range(2):
            cp_split(dict(tokens=data["tokens"], position_ids=data["position_ids"], attention_mask=data["mask"]))
    assert sum("attention_mask is ignored" in r.getMessage() for r in caplog.records) == 1
    assert sum("EOD tokens" in r.getMessage() for r in caplog.records) == 1


def test_no_documents_without_reset_attention_mask(megatron_cpu):
    """--reset-position-ids or --eod-mask-loss alone keep Megatron's plain causal attention."""
    patches.install(mt_config())
    packing.configure_packing(reset_attention_mask=False, reset_position_ids=True, eod_token=EOD)
    data = sample(9)
    cp_split(dict(tokens=data["tokens"], position_ids=data["reset_ids"]))
    assert packing.current_batch_documents() is None


def test_bad_packed_input_errors(megatron_cpu):
    from megatron.core.transformer.enums import AttnMaskType

    patches.install(mt_config())
    attn = mt_attention.MTrainingAttention(config=transformer_config(), layer_number=1,
                                           attn_mask_type=AttnMaskType.causal, attention_type="self")
    q, k = torch.randn(128, 4, 16), torch.randn(128, 2, 16)
    cu = torch.tensor([0, 50, 128], dtype=torch.int32)
    with pytest.raises(ValueError, match="THD format only"):
        attn(q[:, None], k[:, None], k[:, None], None, packed_seq_params=PackedSeqParams(qkv_format="sbhd"))
    with pytest.raises(ValueError, match="int32"):
        attn(q, k, k, None, packed_seq_params=PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu.long()))
    with pytest.raises(ValueError, match="end at the global sequence length 128"):
        attn(q, k, k, None, packed_seq_params=PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu[:2]))
    out = attn(q, k, k, None, packed_seq_params=PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu))
    assert out.shape == (128, 64)
    # documents of another length than the attention sees
    packing.configure_packing(reset_attention_mask=True, eod_token=EOD)
    cp_split(dict(tokens=sample(0)["tokens"]))
    with pytest.raises(ValueError, match="cover 1 x 512 tokens"):
        attn(q[:, None], k[:, None], k[:, None], None)
    # EOD documents without an EOD id
    packing.configure_packing(reset_attention_mask=True)
    with pytest.raises(ValueError, match="--reset-position-ids"):
        cp_split(dict(tokens=sample(0)["tokens"]))


@pytest.mark.parametrize("index,deterministic", [("vs", True), ("dense", False)])
def test_thd_attention_equals_reference(megatron_cpu, index, deterministic):
    """MTrainingAttention on a THD batch equals ``reference_attention(..., cu_seqlens=...)`` with the
    index it built (the approximator sees the documents too); a dense layer that would take the
    dense kernels (which know no documents) runs the sparse kernels with the dense index instead."""
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_mtraining.kernels.reference import reference_attention

    cfg = MTrainingConfig(index=index, deterministic=deterministic, block_size=BLOCK, top_p=0.5, max_slash=2,
                          max_vertical=32, min_vertical=0)
    attn = mt_attention.MTrainingAttention(config=transformer_config(), layer_number=1,
                                           attn_mask_type=AttnMaskType.causal, attention_type="self",
                                           mtraining_config=cfg)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(SEQ, h, 16, generator=g, requires_grad=True) for h in (4, 2, 2))
    cu = torch.tensor(CU, dtype=torch.int32)
    out = attn(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu))
    assert out.shape == (SEQ, 64)
    if index == "vs":
        assert attn.last_index.density(SEQ).mean() < 0.9  # really sparse
    ref, _ = reference_attention(*(x.permute(1, 0, 2)[None] for x in (q, k, v)), attn.last_index, cu_seqlens=cu)
    ref = ref[0].permute(1, 0, 2).reshape(SEQ, 64)
    assert rel_err(out, ref) < TOL
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    expected = torch.autograd.grad(ref, (q, k, v), grad)
    for a, b in zip(got, expected):
        assert rel_err(a, b) < TOL


def test_thd_rope_over_cp_matches_megatron_on_one_device():
    """The patched apply_rotary_pos_emb on each CP rank's THD tokens (MTraining layout) equals
    Megatron's THD RoPE of the whole packed sequence at those positions."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_mtraining.layout import local_positions

    with apply_cpu_shims():
        freqs = RotaryEmbedding(kv_channels=16, rotary_percent=1.0, use_cpu_initialization=True)(150)
    config = transformer_config()
    cu = torch.tensor(CU, dtype=torch.int32)
    t = torch.randn(SEQ, 4, 16)
    full = rope_utils.apply_rotary_pos_emb(t, freqs, config, cu_seqlens=cu, cp_group=FakeGroup(1, 0))
    for layout in ("striped", "zigzag"):
        patches.install(mt_config(layout=layout))
        for rank in range(2):
            pos = local_positions(SEQ, layout, 2, rank, BLOCK)
            local = rope_utils.apply_rotary_pos_emb(t[pos], freqs, config, cu_seqlens=cu, cp_group=FakeGroup(2, rank))
            assert torch.allclose(local, full[pos], atol=1e-6), (layout, rank)
        patches.uninstall()


# ---------------------------------------------------------------------------- CP = 2 (gloo)


def _cp_worker(rank, world_size, cases, data):
    """Every case on this CP rank: local logits, loss and the gradients summed over the CP group."""
    from megatron_mtraining import documents

    checks = []  # cross-rank checks of cu_seqlens that were not found done (each one synchronises on GPUs)
    checksum = documents._checksum
    documents._checksum = lambda *a, **kw: checks.append(1) or checksum(*a, **kw)
    shims = apply_cpu_shims()
    parallel_state.initialize_model_parallel(context_parallel_size=world_size)
    try:
        group = parallel_state.get_context_parallel_group()
        results = []
        for cfg, kind, with_mask, state in cases:
            patches.install(cfg)
            packing.reset_packing()
            checks.clear()
            model = build_gpt(get_gpt_layer_spec(cfg), context_parallel_size=world_size)
            model.load_state_dict(state)
            logits, loss, grads = run_packed(model, data, kind, cp_group=group, with_mask=with_mask)
            # One cross-rank check of the documents per batch in the split (EOD / position ids); THD
            # documents are compared by the ring's per-call agreement (no synchronisation on GPUs).
            assert len(checks) == (0 if kind.startswith("thd") else 1), (kind, len(checks))
            dist.all_reduce(loss, group=group)
            for g in grads.values():
                dist.all_reduce(g, group=group)
            results.append((logits, loss, grads))
        return results
    finally:
        documents._checksum = checksum
        parallel_state.destroy_model_parallel()
        patches.uninstall()
        packing.reset_packing()
        shims.remove()


def test_context_parallel_2_equals_one_device(megatron_cpu):
    """CP = 2 (gloo) through the real batch splits equals one device: the dense index against
    Megatron's attention with its reset mask, the sparse index against the plugin at CP = 1."""
    from dist_utils import run_distributed

    from megatron_mtraining.layout import gather_sequence

    data = sample(10)
    reference = build_gpt(get_gpt_layer_local_spec())
    dense_ref = run_reference(reference, data)
    state = state_of(reference)
    settings = [("striped", "dense", "eod", True), ("zigzag", "dense", "reset", False),
                ("striped", "dense", "thd", False), ("zigzag", "dense", "thd", False),
                ("striped", "dense", "thd-seq", False), ("zigzag", "dense", "thd-seq", False),
                ("striped", "vs", "eod", False), ("striped", "vs", "thd", False)]
    cases, refs = [], []
    for layout, index, kind, with_mask in settings:
        cfg = mt_config(index, layout)
        cases.append((cfg, kind, with_mask, state))
        if index == "dense":
            refs.append(dense_ref)
        else:  # the plugin on one device, same documents, same path
            patches.install(cfg)
            model = build_gpt(get_gpt_layer_spec(cfg))
            model.load_state_dict(state)
            refs.append(run_packed(model, data, kind))
            patches.uninstall()
            packing.reset_packing()
    results = run_distributed(_cp_worker, 2, cases, data, timeout=240)
    for i, (layout, index, kind, with_mask) in enumerate(settings):
        what = f"CP=2 {layout}/{index}/{kind}"
        logits = gather_sequence([r[i][0] for r in results], 1, layout, BLOCK)
        assert_close((logits, results[0][i][1], results[0][i][2]), refs[i], what)
        for name, g in results[1][i][2].items():
            assert torch.equal(g, results[0][i][2][name]), (what, name)


# ---------------------------------------------------------------------------- one Documents per micro-batch


@pytest.fixture
def count_documents(monkeypatch):
    """Counts ``Documents`` constructions (every path builds through the one constructor)."""
    from megatron_mtraining.documents import Documents
    built = []
    init = Documents.__init__

    def counting(self, *args, **kwargs):
        init(self, *args, **kwargs)
        built.append(self)

    monkeypatch.setattr(Documents, "__init__", counting)
    return built


@pytest.mark.parametrize("kind", ["eod", "reset", "thd", "thd-seq"])
def test_documents_are_built_once_per_micro_batch(megatron_cpu, count_documents, kind):
    """Both layers, the indexer, the kernels and the backward of a micro-batch share one object;
    the next micro-batch builds one more. Sparse index, so the approximator reads them too."""
    cfg = mt_config(index="vs")
    patches.install(cfg)
    model = build_gpt(get_gpt_layer_spec(cfg))
    run_packed(model, sample(10), kind)
    assert len(count_documents) == 1
    assert count_documents[0].cu_seqlens.tolist() == list(CU) and count_documents[0].seq_len == SEQ
    run_packed(model, sample(10), kind)
    assert len(count_documents) == 2


def test_full_recompute_builds_the_documents_once(megatron_cpu, count_documents):
    cfg = mt_config(index="vs")
    patches.install(cfg)
    model = build_gpt(get_gpt_layer_spec(cfg), recompute_granularity="full", recompute_method="uniform",
                      recompute_num_layers=1)
    run_packed(model, sample(11), "eod")
    assert len(count_documents) == 1


def test_thd_rope_and_attention_share_the_documents_of_the_tensor(count_documents):
    """THD: the documents ride on the cu_seqlens tensor of PackedSeqParams; RoPE over CP builds
    them (its rows equal a token's position within its document), the attention finds them; an
    in-place change of the tensor builds (and checks) them anew."""
    cu = torch.tensor(CU, dtype=torch.int32)
    freqs = torch.randn(256, 1, 1, 8)
    rows = packing.thd_rope_freqs(freqs, cu, SEQ // 2, 2, 1, "striped", BLOCK)
    from megatron_mtraining.layout import local_positions
    pos = local_positions(SEQ, "striped", 2, 1, BLOCK)
    starts = torch.tensor([max(c for c in CU[:-1] if c <= p) for p in pos.tolist()])
    assert torch.equal(rows, freqs[pos - starts])
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu.clone())
    documents = packing.thd_documents(psp, SEQ)
    assert len(count_documents) == 1 and documents is count_documents[0]
    assert packing.thd_documents(psp, SEQ) is documents  # cu_seqlens_kv (equal values) checked once
    assert torch.equal(packing.thd_rope_freqs(freqs, psp.cu_seqlens_kv, SEQ // 2, 2, 1, "striped", BLOCK), rows)
    assert len(count_documents) == 1
    cu[-1] = SEQ - 1
    with pytest.raises(ValueError, match="THD cu_seqlens .*must end at the global sequence length 512, got 511"):
        packing.thd_documents(psp, SEQ)
