"""The MoBA index builder (``--mtraining-index moba``, ``block_approx.moba_index``): against a
plain-PyTorch rule written block by block here, on one device and over gloo CP groups (striped and
zigzag, W = 2 and 3; every rank gets the same index), with packed documents, through
``approximate_index``, and the resulting index through the ring."""

from __future__ import annotations

import dataclasses
import functools
import traceback

import pytest
import torch

from dist_utils import run_distributed
from megatron_mtraining import BlockIndex, MTrainingConfig, approximate_index, sparse_attention
from megatron_mtraining.block_approx import moba_index
from megatron_mtraining.documents import Documents
from megatron_mtraining.layout import gather_sequence, shard_sequence
from oracle import rel_err

B = 64


def config(**kw):
    return MTrainingConfig(block_size=B, index="moba", moba_block_size=kw.pop("moba_block_size", 128),
                           moba_top_k=kw.pop("moba_top_k", 3), **kw)


def inputs(n, b=2, hq=4, hkv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, hq, n, d, generator=g), torch.randn(b, hkv, n, d, generator=g)


def moba_rule(q, k, cfg, ends=None):
    """{(b, h, query block): set of key blocks} by MoBA's rule, one query block at a time."""
    Bm, top_k = cfg.moba_block_size, cfg.moba_top_k
    b, hq, n, _ = q.shape
    group = hq // k.shape[1]
    out = {}
    for bi in range(b):
        for h in range(hq):
            kh = k[bi, h // group]
            for qb in range(n // B):
                first = qb * B
                doc_start = 0 if ends is None else max(e for e in ends if e <= first)
                own = first // Bm
                gates = {}
                for j in range(own):
                    if (j + 1) * Bm <= doc_start:  # no key of the block's documents
                        continue
                    gates[j] = float(q[bi, h, first:first + B].mean(0) @ kh[j * Bm:(j + 1) * Bm].mean(0))
                chosen = {own} | set(sorted(gates, key=lambda j: -gates[j])[:top_k - 1])
                out[bi, h, qb] = {kb for kb in range(qb + 1) if kb * B // Bm in chosen}
    return out


def as_sets(index: BlockIndex):
    return {(b, h, i): set(index.key_blocks[b, h, i, :int(index.n_key_blocks[b, h, i])].tolist())
            for b in range(index.batch) for h in range(index.heads) for i in range(index.num_blocks)}


@pytest.mark.parametrize("top_k, moba_block_size, n", [(3, 128, 12 * B), (1, 128, 8 * B), (2, 256, 14 * B),
                                                       (50, 128, 8 * B)])
def test_single_device_matches_the_rule(top_k, moba_block_size, n):
    cfg = config(moba_top_k=top_k, moba_block_size=moba_block_size)
    q, k = inputs(n, seed=top_k)
    index = moba_index(q, k, cfg).validate(n)
    want = moba_rule(q, k, cfg)
    assert as_sets(index) == want
    widest, per = max(len(s) for s in want.values()), moba_block_size // B
    if top_k == 1:  # the own MoBA block only
        assert widest <= per
    else:  # the case selects more than the own MoBA block somewhere
        assert widest > per
    if top_k >= n // moba_block_size:  # every causal block: the dense causal index
        assert torch.equal(index.to_mask(), BlockIndex.dense(2, 4, n, B).to_mask())


def test_documents_drop_blocks_before_the_query_blocks_document():
    n, ends = 12 * B, (0, 300, 301, 520, 12 * B)
    cfg = config(moba_top_k=4)
    q, k = inputs(n, seed=5)
    index = moba_index(q, k, cfg, documents=Documents(torch.tensor(ends, dtype=torch.int32), n))
    want = moba_rule(q, k, cfg, ends)
    assert as_sets(index) == want
    assert want != moba_rule(q, k, cfg), "the documents must change the selection in this case"


def test_approximate_index_builds_moba():
    n = 8 * B
    q, k = inputs(n, seed=3)
    index = approximate_index(q, k, config())
    assert isinstance(index, BlockIndex) and as_sets(index) == moba_rule(q, k, config())
    short = approximate_index(q, k, config(dense_max_seq_length=n))  # short sequences: the dense index
    assert not isinstance(short, BlockIndex)


@pytest.mark.parametrize("kw, flag", [(dict(moba_block_size=96), "moba_block_size"),
                                      (dict(moba_top_k=0), "moba_top_k")])
def test_config_errors(kw, flag):
    with pytest.raises(ValueError, match=flag):
        config(**kw)


# ---------------------------------------------------------------------------------- CP groups

@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    layout: str
    n: int
    top_k: int = 3
    ends: tuple = None


CASES = {
    2: (Case("striped", "striped", 12 * B), Case("zigzag", "zigzag", 12 * B, top_k=2),
        Case("zigzag-documents", "zigzag", 16 * B, top_k=3, ends=(0, 300, 301, 700, 16 * B))),
    3: (Case("striped", "striped", 12 * B), Case("zigzag", "zigzag", 12 * B, top_k=4)),
}


def _worker(rank: int, world: int, cases) -> dict:
    from megatron_mtraining import sparse_ring_attention

    results = {}
    for case in cases:
        try:
            cfg = config(moba_top_k=case.top_k, layout=case.layout)
            q, k = inputs(case.n, seed=len(case.name))
            v = torch.randn(k.shape, generator=torch.Generator().manual_seed(7))
            ql, kl, vl = (shard_sequence(x, 2, case.layout, world, rank, B) for x in (q, k, v))
            cu = None if case.ends is None else torch.tensor(case.ends, dtype=torch.int32)
            index = approximate_index(ql, kl, cfg, group=torch.distributed.group.WORLD, cu_seqlens=cu)
            out = sparse_ring_attention(ql, kl, vl, index, layout=case.layout, backend="torch", cu_seqlens=cu)
            results[case.name] = {"key_blocks": index.key_blocks, "n_key_blocks": index.n_key_blocks, "out": out}
        except Exception:
            results[case.name] = traceback.format_exc()
    return results


@functools.lru_cache(maxsize=None)
def cp_results(world: int) -> list:
    return run_distributed(_worker, world, CASES[world], timeout=240)


@pytest.mark.parametrize("world, name", [(w, c.name) for w in CASES for c in CASES[w]])
def test_cp_group_builds_the_single_device_index(world, name):
    case = next(c for c in CASES[world] if c.name == name)
    per_rank = [r[name] for r in cp_results(world)]
    for rank, r in enumerate(per_rank):
        assert not isinstance(r, str), f"rank {rank} raised:\n{r}"
    cfg = config(moba_top_k=case.top_k, layout=case.layout)
    q, k = inputs(case.n, seed=len(case.name))
    documents = None if case.ends is None else Documents(torch.tensor(case.ends, dtype=torch.int32), case.n)
    want = moba_index(q, k, cfg, documents=documents)
    assert as_sets(want) == moba_rule(q, k, cfg, case.ends)
    for rank, r in enumerate(per_rank):
        assert torch.equal(r["key_blocks"], want.key_blocks) and torch.equal(r["n_key_blocks"], want.n_key_blocks), \
            f"rank {rank} built another index"
    v = torch.randn(k.shape, generator=torch.Generator().manual_seed(7))
    expected = sparse_attention(q, k, v, want, backend="torch", cu_seqlens=None if documents is None else documents)
    got = gather_sequence([r["out"] for r in per_rank], 2, case.layout, B)
    assert rel_err(got, expected) < 1e-5


# ------------------------------------------------------------------------------ in a GPTModel

def test_megatron_layers_attend_with_their_moba_index(megatron_cpu):
    """Every layer of a megatron-core GPTModel builds a MoBA BlockIndex (here one index block per
    MoBA block, 2 of the 4 per query block) and attends by it: its output and q/k/v gradients
    equal reference_attention under that index."""
    tma = pytest.importorskip("test_megatron_attention")
    from megatron_mtraining.integration.spec import get_gpt_layer_spec
    from megatron_mtraining.kernels.reference import reference_attention

    cfg = MTrainingConfig(index="moba", block_size=B, moba_block_size=B, moba_top_k=2)
    model = tma.build_gpt(get_gpt_layer_spec(cfg))
    seen = []
    hooks = [attn.register_forward_hook(lambda module, args, out: seen.append((module, args[:3], out)))
             for attn in tma.core_attentions(model)]
    tokens, position_ids, mask, labels = tma.batch(1)
    try:
        loss = model(tokens, position_ids, mask, labels=labels).float().mean()
    finally:
        for hook in hooks:
            hook.remove()
    assert len(seen) == len(tma.core_attentions(model)) and torch.isfinite(loss)
    for layer, (attn, qkv_in, out) in enumerate(seen):
        index = attn.last_index
        assert isinstance(index, BlockIndex) and index.density(tma.SEQ).max() < 0.9, layer
        grad_out = torch.randn_like(out)
        grads = torch.autograd.grad(out, qkv_in, grad_out, retain_graph=True)
        q, k, v = (x.detach().permute(1, 2, 0, 3).requires_grad_() for x in qkv_in)
        ref, _ = reference_attention(q, k, v, index, softmax_scale=attn.softmax_scale)
        ref = ref.permute(2, 0, 1, 3).reshape(out.shape)
        assert rel_err(out, ref) < 1e-5, layer
        for name, g, r in zip("qkv", grads, torch.autograd.grad(ref, (q, k, v), grad_out)):
            assert rel_err(g, r.permute(2, 0, 1, 3)) < 1e-5, (layer, name)


def test_megatron_context_parallel_2_with_moba_matches_single_device(megatron_cpu):
    """CP = 2 (gloo), striped and zigzag: logits and every gradient equal the single-device model
    with the same builder (the CP ranks' consistency check of the index runs in the first forward)."""
    tma = pytest.importorskip("test_megatron_attention")
    from megatron_mtraining.integration.spec import get_gpt_layer_spec

    data = tma.batch(3)
    tokens, position_ids, mask, labels = data
    cases, references = [], []
    for layout in ("striped", "zigzag"):
        cfg = MTrainingConfig(index="moba", block_size=B, moba_block_size=B, moba_top_k=2, layout=layout)
        reference = tma.build_gpt(get_gpt_layer_spec(cfg))
        ref_logits = reference(tokens, position_ids, mask).detach()
        reference(tokens, position_ids, mask, labels=labels).float().mean().backward()
        state = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in reference.state_dict().items()}
        cases.append((cfg, state))
        references.append((ref_logits, {name: p.grad for name, p in reference.named_parameters()}))
    results = run_distributed(tma._cp_worker, 2, cases, data, timeout=240)
    for i, (cfg, _) in enumerate(cases):
        ref_logits, ref_grads = references[i]
        logits = gather_sequence([r[i][0] for r in results], 1, cfg.layout, B)
        assert rel_err(logits, ref_logits) < 1e-5, cfg.layout
        for name, ref_grad in ref_grads.items():
            for r in results:
                assert rel_err(r[i][1][name], ref_grad) < 1e-5, (cfg.layout, name)


def test_telemetry_records_a_block_index():
    """Density, no columns, and the key blocks per query block in the "slash" figure."""
    from megatron_mtraining.integration.telemetry import IterationRecord

    n = 8 * B
    index = BlockIndex.random(2, 3, n, B, density=0.4, generator=torch.Generator().manual_seed(4))
    record = IterationRecord(1, None)
    record.record_index(3, index, n)
    stats = record.layers[3]
    assert float(stats["density"]) == pytest.approx(float(index.density(n).mean()))
    assert float(stats["vertical"]) == 0.0
    assert float(stats["slash"]) == pytest.approx(float(index.n_key_blocks.float().mean()))
    assert 1.0 < float(stats["slash"]) < 8.0


def test_megatrons_strided_bf16_views_give_the_contiguous_index():
    """The builders get Megatron's [b, h, s, d] views of [s, b, h, d] tensors, in bf16."""
    n, cfg = 8 * B, config(moba_top_k=2)
    q, k = (x.bfloat16() for x in inputs(n, seed=6))
    views = [x.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3) for x in (q, k)]
    assert not views[0].is_contiguous()
    assert torch.equal(moba_index(*views, cfg).to_mask(), moba_index(q, k, cfg).to_mask())
