"""MTrainingAttention inside a real megatron-core GPTModel, on CPU (gloo, world size 1).

Needs megatron-core (skipped without it). The model code runs on the CPU through the
test-only shims of ``megatron_mtraining.testing.cpu_shims``.
"""

import types
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core")

from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec  # noqa: E402
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from megatron_mtraining import MTrainingConfig  # noqa: E402
from megatron_mtraining.integration import core_attention as mt_attention  # noqa: E402
from megatron_mtraining.integration.core_attention import MTrainingAttention  # noqa: E402
from megatron_mtraining.testing.cpu_shims import apply_cpu_shims  # noqa: E402
from megatron_mtraining.integration.spec import get_gpt_layer_spec  # noqa: E402

SEQ, VOCAB, BATCH = 256, 128, 2


# ---------------------------------------------------------------------------- fixtures


def transformer_config(**overrides) -> TransformerConfig:
    kwargs = dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
        use_cpu_initialization=True, gradient_accumulation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, apply_rope_fusion=False, attention_dropout=0.0, hidden_dropout=0.0,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_gpt(layer_spec, seed=1234) -> GPTModel:
    torch.manual_seed(seed)
    return GPTModel(config=transformer_config(), transformer_layer_spec=layer_spec, vocab_size=VOCAB,
                    max_sequence_length=SEQ, position_embedding_type="rope")


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    # True = masked out; the stock local attention needs it, MTraining is causal by construction.
    causal_mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    return tokens, position_ids, causal_mask, labels


def logits_and_grads(model: GPTModel, data):
    tokens, position_ids, mask, labels = data
    model.zero_grad(set_to_none=True)
    logits = model(tokens, position_ids, mask)
    loss = model(tokens, position_ids, mask, labels=labels).float().mean()
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), loss.detach(), grads


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def core_attentions(model):
    return [layer.self_attention.core_attention for layer in model.decoder.layers]


# ---------------------------------------------------------------------------- GPTModel end to end


def test_dense_mtraining_equals_local_attention(megatron_cpu):
    reference = build_gpt(get_gpt_layer_local_spec())
    model = build_gpt(get_gpt_layer_spec(MTrainingConfig(index="dense", block_size=64)))
    model.load_state_dict(reference.state_dict())
    assert all(isinstance(m, MTrainingAttention) for m in core_attentions(model))
    assert not any(isinstance(m, MTrainingAttention) for m in core_attentions(reference))

    data = batch()
    ref_logits, ref_loss, ref_grads = logits_and_grads(reference, data)
    logits, loss, grads = logits_and_grads(model, data)

    assert logits.shape == (BATCH, SEQ, VOCAB)
    assert rel_err(logits, ref_logits) < 1e-5
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    assert grads.keys() == ref_grads.keys()
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert rel_err(grads[qkv], ref_grads[qkv]) < 1e-5
    for name, g in grads.items():
        assert rel_err(g, ref_grads[name]) < 1e-5, name


# top_p=0.9 keeps every block of this small random model; the second config is really sparse.
@pytest.mark.parametrize("sparse_kwargs", [dict(top_p=0.9), dict(top_p=0.5, max_vertical=32, min_vertical=0, max_slash=2)])
def test_vs_index_forward_backward(megatron_cpu, sparse_kwargs):
    """Every layer's output and its q/k/v gradients equal the reference attention under the index
    the layer approximated (fp32: measured 3e-7 at most; bound 1e-5); the model's gradients are finite."""
    from megatron_mtraining.kernels.reference import reference_attention

    cfg = MTrainingConfig(index="vs", block_size=64, last_q=64, **sparse_kwargs)
    model = build_gpt(get_gpt_layer_spec(cfg))
    seen = []
    hooks = [attn.register_forward_hook(lambda module, args, out: seen.append((module, args[:3], out)))
             for attn in core_attentions(model)]
    tokens, position_ids, mask, labels = batch(1)
    try:
        loss = model(tokens, position_ids, mask, labels=labels).float().mean()
    finally:
        for hook in hooks:
            hook.remove()
    assert torch.isfinite(loss)
    assert len(seen) == len(core_attentions(model))
    for layer, (attn, qkv_in, out) in enumerate(seen):
        grad_out = torch.randn_like(out)
        grads = torch.autograd.grad(out, qkv_in, grad_out, retain_graph=True)
        q, k, v = (x.detach().permute(1, 2, 0, 3).requires_grad_() for x in qkv_in)  # [b, heads, s, d]
        ref, _ = reference_attention(q, k, v, attn.last_index, softmax_scale=attn.softmax_scale)
        ref = ref.permute(2, 0, 1, 3).reshape(out.shape)
        assert rel_err(out, ref) < 1e-5, layer
        ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out)
        for name, g, r in zip("qkv", grads, ref_grads):
            assert rel_err(g, r.permute(2, 0, 1, 3)) < 1e-5, (layer, name)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    for attn in core_attentions(model):
        assert attn.last_index is not None and attn.last_index.block_size == 64
        assert attn.last_index.heads == 4 and attn.last_index.batch == BATCH
        if cfg.max_slash < SEQ // 64:
            assert attn.last_index.density(SEQ).mean().item() < 0.9


def test_dense_layers_use_dense_index(megatron_cpu):
    model = build_gpt(get_gpt_layer_spec(MTrainingConfig(index="vs", top_p=0.5, block_size=64), dense_layers=1))
    first, second = core_attentions(model)
    assert first.dense and first.indexer.mtraining_config.index == "dense"
    assert not second.dense and second.indexer.mtraining_config.index == "vs"
    tokens, position_ids, mask, _ = batch(2)
    with torch.no_grad():
        model(tokens, position_ids, mask)
    nb = SEQ // 64
    assert bool((first.last_index.n_slash == nb).all())  # every causal block


# ---------------------------------------------------------------------------- constructor / errors


def pg_collection_stub():
    return types.SimpleNamespace(tp=None, cp=None)


@pytest.mark.parametrize("keyword", ["pg_collection", "model_comm_pgs"])
def test_constructor_accepts_both_pg_keywords(keyword):
    pgs = pg_collection_stub()
    attn = MTrainingAttention(config=transformer_config(), layer_number=1, attn_mask_type=AttnMaskType.causal,
                              attention_type="self", cp_comm_type="p2p", softmax_scale=None, **{keyword: pgs})
    assert attn.pg_collection is pgs
    assert attn.cp_group() is None  # cp=None: single device
    assert attn.softmax_scale == pytest.approx(1.0 / 4.0)  # head dim 16


def test_constructor_ignores_unknown_kwargs():
    attn = MTrainingAttention(config=transformer_config(), layer_number=2, attn_mask_type=AttnMaskType.causal,
                              attention_type="self", some_future_argument=3)
    assert attn.layer_number == 2


def test_config_comes_from_the_spec_params():
    """Megatron builds core attention with ``submodules.core_attention(config=..., ...)``: a
    ModuleSpec adds its params as keyword arguments, and the attention hands the config on to
    its indexer. Two specs with different configs build two differently configured modules."""
    sparse, fixed = MTrainingConfig(index="vs", top_p=0.5), MTrainingConfig(index="fixed", block_size=128)
    attention_spec = get_gpt_layer_spec(sparse, dense_layers=1).submodules.self_attention.submodules.core_attention
    assert isinstance(attention_spec, ModuleSpec) and attention_spec.module is MTrainingAttention
    assert attention_spec.params == {"mtraining_config": sparse, "dense_layers": 1}
    other_spec = get_gpt_layer_spec(fixed).submodules.self_attention.submodules.core_attention
    built = {}
    for name, spec, layer in (("first", attention_spec, 1), ("second", attention_spec, 2), ("fixed", other_spec, 1)):
        built[name] = spec(config=transformer_config(), layer_number=layer, attn_mask_type=AttnMaskType.causal,
                           attention_type="self", cp_comm_type=None, softmax_scale=None, pg_collection=None)
    assert built["first"].mtraining_config is sparse and built["first"].dense
    assert built["first"].indexer.mtraining_config.index == "dense"  # a dense layer
    assert built["second"].indexer.mtraining_config is sparse and not built["second"].dense
    assert built["fixed"].mtraining_config is fixed and built["fixed"].indexer.mtraining_config is fixed
    assert not built["fixed"].dense
    with pytest.raises(TypeError, match="MTrainingConfig"):
        get_gpt_layer_spec({"index": "vs"})
    with pytest.raises(ValueError, match="dense_layers"):
        get_gpt_layer_spec(sparse, dense_layers=-1)
    with pytest.raises(TypeError, match="mtraining_config must be an MTrainingConfig"):
        make_attention(mtraining_config={"index": "vs"})


def test_no_module_level_config():
    """Building specs and modules leaves no module-level MTraining state behind: a spec without
    params builds the defaults, whatever was built before."""
    get_gpt_layer_spec(MTrainingConfig(index="fixed"), dense_layers=2)
    make_attention(mtraining_config=MTrainingConfig(index="fixed"), dense_layers=2)
    plain = MTrainingAttention(config=transformer_config(), layer_number=1, attn_mask_type=AttnMaskType.causal,
                               attention_type="self")
    assert plain.mtraining_config == MTrainingConfig() and plain.dense_layers == 0 and not plain.dense


def test_no_module_level_config_shim():
    """The config reaches every module through the spec; the module keeps no setter of defaults."""
    for name in ("set_mtraining_config", "get_mtraining_config", "get_dense_layers", "_legacy_config"):
        assert not hasattr(mt_attention, name), name


def make_attention(layer_number=1, softmax_scale=None, mtraining_config=None, dense_layers=None,
                   **config_overrides):
    return MTrainingAttention(config=transformer_config(**config_overrides), layer_number=layer_number,
                              attn_mask_type=AttnMaskType.causal, attention_type="self",
                              softmax_scale=softmax_scale, pg_collection=pg_collection_stub(),
                              mtraining_config=mtraining_config, dense_layers=dense_layers)


def qkv(s=128, b=1, np_=4, ng=2, hn=16):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(s, b, np_, hn, generator=g), torch.randn(s, b, ng, hn, generator=g),
            torch.randn(s, b, ng, hn, generator=g))


def test_forward_single_device_matches_reference():
    attn = make_attention(mtraining_config=MTrainingConfig(index="dense"))
    q, k, v = qkv()
    out = attn(q, k, v, None)
    assert out.shape == (128, 1, 64)
    # dense causal attention with GQA expanded, [s, b, h, d] -> [b, h, s, d]
    qb, kb, vb = (x.permute(1, 2, 0, 3) for x in (q, k, v))
    kb, vb = kb.repeat_interleave(2, dim=1), vb.repeat_interleave(2, dim=1)
    ref = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=True)
    assert rel_err(out, ref.permute(2, 0, 1, 3).reshape(128, 1, 64)) < 1e-5


@pytest.mark.parametrize("deterministic,index,dense_kernels", [
    (False, "dense", True), (True, "dense", False), (False, "vs", False)])
def test_dense_index_runs_the_dense_kernels_unless_deterministic(monkeypatch, deterministic, index, dense_kernels):
    """A dense-index layer attends with the dense kernels (SDPA on one device) only when the
    backward need not be deterministic; either way it computes causal attention exactly."""
    import megatron_mtraining.integration.core_attention as mt_attention

    scale = 0.37  # not 1/sqrt(d): the scale must reach whichever kernels run
    attn = make_attention(softmax_scale=scale, mtraining_config=MTrainingConfig(
        index=index, deterministic=deterministic, top_p=1.0, last_q=64))
    assert attn.uses_dense_kernels(None, qkv()[0]) is dense_kernels
    calls = []
    sparse = mt_attention.sparse_attention
    monkeypatch.setattr(mt_attention, "sparse_attention", lambda *a, **kw: calls.append(1) or sparse(*a, **kw))
    q, k, v = (x.requires_grad_() for x in qkv())
    out = attn(q, k, v, None)
    assert calls == ([] if dense_kernels else [1])
    qr, kr, vr = (x.detach().double().requires_grad_() for x in (q, k, v))
    qb, kb, vb = (x.permute(1, 2, 0, 3) for x in (qr, kr, vr))
    ref = torch.nn.functional.scaled_dot_product_attention(
        qb, kb.repeat_interleave(2, dim=1), vb.repeat_interleave(2, dim=1), is_causal=True, scale=scale)
    ref = ref.permute(2, 0, 1, 3).reshape(128, 1, 64)
    if index == "vs":  # top_p 1.0 over two blocks: the approximated index holds both offsets (dense)
        assert attn.last_index is not None and bool((attn.last_index.n_slash == 2).all())
    assert rel_err(out, ref) < 1e-5
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    ref.backward(grad_out.double())
    for x, xr in zip((q, k, v), (qr, kr, vr)):
        assert rel_err(x.grad, xr.grad) < 1e-5


def test_dense_layers_run_the_dense_kernels_unless_deterministic():
    """--mtraining-dense-layers: the first layers take the dense kernels too (the decision reads
    the layer's own settings, so a custom indexer without a config does not matter)."""
    for deterministic in (False, True):
        cfg = MTrainingConfig(index="vs", deterministic=deterministic)
        first, second = (make_attention(layer_number=n, mtraining_config=cfg, dense_layers=1) for n in (1, 2))
        first.indexer = second.indexer = torch.nn.Identity()  # a custom indexer that keeps no config
        q = qkv()[0]
        assert first.uses_dense_kernels(None, q) is (not deterministic)
        assert not second.uses_dense_kernels(None, q)


@pytest.mark.parametrize("bound,dense_kernels", [(128, True), (127, False), (0, False)])
def test_short_sequences_run_the_dense_kernels_unless_deterministic(monkeypatch, bound, dense_kernels):
    """--mtraining-dense-max-seq-length: a sequence of at most that many tokens is a dense layer
    (the dense kernels when the backward need not be deterministic, exact causal attention)."""
    import megatron_mtraining.integration.core_attention as mt_attention

    attn = make_attention(mtraining_config=MTrainingConfig(index="vs", deterministic=False,
                                                           dense_max_seq_length=bound))
    q, k, v = qkv()  # [s, b, heads, d], 128 tokens
    q_bhsd = q.permute(1, 2, 0, 3)  # as the forward asks it
    assert attn.uses_dense_kernels(None, q_bhsd) is dense_kernels
    deterministic = MTrainingConfig(index="vs", deterministic=True, dense_max_seq_length=bound)
    assert not make_attention(mtraining_config=deterministic).uses_dense_kernels(None, q_bhsd)
    calls = []
    sparse = mt_attention.sparse_attention
    monkeypatch.setattr(mt_attention, "sparse_attention", lambda *a, **kw: calls.append(1) or sparse(*a, **kw))
    out = attn(q, k, v, None)
    assert calls == ([] if dense_kernels else [1])
    if dense_kernels:
        qb, kb, vb = (x.permute(1, 2, 0, 3) for x in (q, k, v))
        ref = torch.nn.functional.scaled_dot_product_attention(
            qb, kb.repeat_interleave(2, dim=1), vb.repeat_interleave(2, dim=1), is_causal=True)
        assert rel_err(out, ref.permute(2, 0, 1, 3).reshape(128, 1, 64)) < 1e-5


@pytest.mark.parametrize("layout", ["striped", "zigzag"])
def test_dense_kernels_over_cp_only_on_the_zigzag_ring(layout):
    """Over CP the dense kernels need the zigzag ring (striped steps are block-causal) and, on
    CUDA, fp16/bf16 inputs (the fp32 dense step would materialise its scores)."""
    attn = make_attention(mtraining_config=MTrainingConfig(index="dense", deterministic=False, layout=layout))
    group = object()  # any CP group: the decision does not talk to it
    q = qkv()[0]
    assert attn.uses_dense_kernels(group, q) is (layout == "zigzag")
    fp32_cuda = types.SimpleNamespace(is_cuda=True, dtype=torch.float32)
    bf16_cuda = types.SimpleNamespace(is_cuda=True, dtype=torch.bfloat16)
    assert not attn.uses_dense_kernels(group, fp32_cuda)
    assert attn.uses_dense_kernels(group, bf16_cuda) is (layout == "zigzag")
    assert attn.uses_dense_kernels(None, fp32_cuda)  # one device: SDPA takes fp32


@pytest.mark.parametrize("index", ["dense", "vs"])
def test_forward_under_autocast_runs_in_the_autocast_dtype(index):
    """fp32 q/k/v inside an autocast region (what megatron-core's layers hand over) are attended in
    the autocast dtype, like torch's fused attention: the same numbers as bf16 inputs outside it,
    and gradients flow back to the fp32 inputs."""
    attn = make_attention(mtraining_config=MTrainingConfig(index=index, last_q=64))
    q, k, v = (x.requires_grad_() for x in qkv())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attn(q, k, v, None)
    assert out.dtype == torch.bfloat16
    expected = attn(*(x.detach().bfloat16() for x in (q, k, v)), None)
    assert torch.equal(out, expected)
    out.float().sum().backward()
    assert all(x.grad is not None and x.grad.dtype == torch.float32 and x.grad.abs().sum() > 0 for x in (q, k, v))


def test_megatron_recompute_under_autocast_attends_as_the_forward(megatron_cpu):
    """Megatron's activation recompute re-runs the forward in the backward outside the autocast
    region: the re-run attends in the first pass's dtype (same index, same numbers), so the
    gradients equal those without recompute; the kept dtype does not leak into later forwards."""
    from megatron.core.tensor_parallel.random import CheckpointFunction

    attn = make_attention(mtraining_config=MTrainingConfig(index="vs", last_q=64))

    def grads(recompute):
        q, k, v = (x.clone().requires_grad_() for x in qkv())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if recompute:
                out = CheckpointFunction.apply(lambda a, b, c: attn(a, b, c, None), False, q, k, v)
            else:
                out = attn(q, k, v, None)
        out.float().sum().backward()
        return out, q.grad

    (out, grad), (out_r, grad_r) = grads(False), grads(True)
    assert torch.equal(out, out_r) and torch.equal(grad, grad_r)
    assert attn._recompute_dtype is None
    q, k, v = qkv()  # a plain fp32 forward afterwards stays fp32
    assert attn(q, k, v, None).dtype == torch.float32


def test_forward_rejects_packed_sequences():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="packed"):
        make_attention()(q, k, v, None, packed_seq_params=object())


def test_forward_rejects_attention_bias():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="attention_bias"):
        make_attention()(q, k, v, None, attention_bias=torch.zeros(1))


def test_forward_rejects_non_causal_mask():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="causal"):
        make_attention()(q, k, v, None, attn_mask_type=AttnMaskType.padding)
    with pytest.raises(ValueError, match="causal"):
        MTrainingAttention(config=transformer_config(), layer_number=1, attn_mask_type=AttnMaskType.no_mask,
                           attention_type="self")


def test_attention_dropout_only_rejected_in_training():
    q, k, v = qkv()
    attn = make_attention(attention_dropout=0.1)
    attn.train()
    with pytest.raises(ValueError, match="dropout"):
        attn(q, k, v, None)
    attn.eval()
    assert attn(q, k, v, None).shape == (128, 1, 64)
    # an explicit attention_dropout argument overrides the config's
    explicit = MTrainingAttention(config=transformer_config(attention_dropout=0.1), layer_number=1,
                                  attn_mask_type=AttnMaskType.causal, attention_type="self",
                                  attention_dropout=0.0)
    assert explicit.training and explicit(q, k, v, None).shape == (128, 1, 64)


def test_rejects_cross_attention_and_window():
    with pytest.raises(ValueError, match="self attention"):
        MTrainingAttention(config=transformer_config(), layer_number=1, attn_mask_type=AttnMaskType.causal,
                           attention_type="cross")
    with pytest.raises(ValueError, match="window"):
        make_attention(window_size=(64, 0))


# ---------------------------------------------------------------------------- spec rewrite


def test_spec_rewrites_local_spec_and_keeps_the_base():
    base = get_gpt_layer_local_spec()
    original = base.submodules.self_attention.submodules.core_attention
    spec = get_gpt_layer_spec(base_spec=base)
    assert attention_module(spec.submodules.self_attention.submodules.core_attention) is MTrainingAttention
    assert base.submodules.self_attention.submodules.core_attention is original  # deep copy
    assert spec.submodules.self_attention.submodules.linear_qkv is \
        base.submodules.self_attention.submodules.linear_qkv


def attention_module(core_attention):
    """The class a core-attention slot builds (a ModuleSpec's ``module``, or the class itself)."""
    return core_attention.module if isinstance(core_attention, ModuleSpec) else core_attention


def test_spec_default_is_local_spec_and_carries_the_config():
    cfg = MTrainingConfig(top_p=0.8)
    spec = get_gpt_layer_spec(cfg, dense_layers=2)
    core = spec.submodules.self_attention.submodules.core_attention
    assert attention_module(core) is MTrainingAttention
    assert core.params == {"mtraining_config": cfg, "dense_layers": 2}
    local = get_gpt_layer_local_spec()
    assert spec.submodules.self_attention.submodules.linear_qkv is local.submodules.self_attention.submodules.linear_qkv


class TEDotProductAttention:  # stand-ins for TE classes: the rewrite must not import TE
    pass


class TELayerNormColumnParallelLinear:
    pass


class TERowParallelLinear:
    pass


@dataclass
class FakeSelfAttentionSubmodules:
    linear_qkv: object = None
    core_attention: object = None
    linear_proj: object = None


@dataclass
class FakeLayerSubmodules:
    self_attention: object = None
    mlp: object = None


def fake_te_layer_spec():
    """The structure of get_gpt_layer_with_transformer_engine_spec(), with dummy TE classes."""
    return ModuleSpec(
        module=("megatron.core.transformer.transformer_layer", "TransformerLayer"),
        submodules=FakeLayerSubmodules(
            self_attention=ModuleSpec(
                module=("megatron.core.transformer.attention", "SelfAttention"),
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=FakeSelfAttentionSubmodules(
                    linear_qkv=TELayerNormColumnParallelLinear,
                    core_attention=TEDotProductAttention,
                    linear_proj=TERowParallelLinear,
                ),
            ),
            mlp=ModuleSpec(module=("megatron.core.transformer.mlp", "MLP")),
        ),
    )


def test_spec_rewrites_te_structure_without_te():
    base = fake_te_layer_spec()
    spec = get_gpt_layer_spec(base_spec=base)
    attn = spec.submodules.self_attention
    assert attention_module(attn.submodules.core_attention) is MTrainingAttention
    assert attn.submodules.linear_qkv is TELayerNormColumnParallelLinear  # fused LN-linear kept
    assert attn.params == {"attn_mask_type": AttnMaskType.causal}
    assert base.submodules.self_attention.submodules.core_attention is TEDotProductAttention


def test_spec_rewrites_every_layer_of_a_block_spec():
    block = TransformerBlockSubmodules(layer_specs=[fake_te_layer_spec(), get_gpt_layer_local_spec()])
    spec = get_gpt_layer_spec(base_spec=block)
    assert isinstance(spec, TransformerBlockSubmodules) and spec is not block
    for layer in spec.layer_specs:
        assert attention_module(layer.submodules.self_attention.submodules.core_attention) is MTrainingAttention
    assert block.layer_specs[0].submodules.self_attention.submodules.core_attention is TEDotProductAttention


def test_spec_rejects_non_attention_and_mla_specs():
    with pytest.raises(ValueError, match="core_attention"):
        get_gpt_layer_spec(base_spec=ModuleSpec(module=torch.nn.Identity))
    mla = get_gpt_layer_local_spec(multi_latent_attention=True)
    with pytest.raises(ValueError, match="MLA"):
        get_gpt_layer_spec(base_spec=mla)


def test_cpu_shims_are_reversible():
    original = torch.cuda.current_device
    from megatron.core.tensor_parallel import random as tp_random

    fork = tp_random.CudaRNGStatesTracker.__dict__["fork"]
    with apply_cpu_shims():
        assert torch.cuda.current_device() == "cpu"
        with tp_random.CudaRNGStatesTracker().fork():
            pass
    assert torch.cuda.current_device is original
    assert tp_random.CudaRNGStatesTracker.__dict__["fork"] is fork


# ---------------------------------------------------------------------------- context parallel (gloo)

CP_BLOCK = 64


def _cp_worker(rank, world_size, cases, data):
    """One CP rank: for each ``(cfg, state_dict)``, the GPTModel on this rank's tokens in
    ``cfg.layout`` order. Returns per case the local logits and the loss gradients summed over
    the CP group, and how many attention calls took the dense ring. (One spawn for all cases:
    starting workers dominates the runtime.)"""
    import megatron_mtraining.integration.core_attention as mt_attention
    from megatron_mtraining.integration import patches
    from megatron_mtraining.layout import shard_sequence

    dense_ring_calls = []
    dense_ring = mt_attention.dense_ring_attention
    mt_attention.dense_ring_attention = lambda *a, **kw: dense_ring_calls.append(1) or dense_ring(*a, **kw)
    shims = apply_cpu_shims()
    parallel_state.initialize_model_parallel(context_parallel_size=world_size)
    try:
        results = []
        for cfg, state_dict in cases:
            dense_ring_calls.clear()
            patches.install(cfg)  # RoPE tables sliced in cfg.layout (a new config replaces the old)
            torch.manual_seed(1234)
            model = GPTModel(config=transformer_config(context_parallel_size=world_size),
                             transformer_layer_spec=get_gpt_layer_spec(cfg), vocab_size=VOCAB,
                             max_sequence_length=SEQ, position_embedding_type="rope")
            model.load_state_dict(state_dict)
            tokens, position_ids, _, labels = data
            tokens, position_ids, labels = (shard_sequence(x, 1, cfg.layout, world_size, rank, CP_BLOCK)
                                            for x in (tokens, position_ids, labels))
            logits = model(tokens, position_ids, None)
            loss = model(tokens, position_ids, None, labels=labels).float().sum() / (BATCH * SEQ)
            loss.backward()
            grads = {}
            for name, p in model.named_parameters():
                dist.all_reduce(p.grad, group=parallel_state.get_context_parallel_group())
                grads[name] = p.grad
            results.append((logits.detach(), grads, len(dense_ring_calls)))
        return results
    finally:
        mt_attention.dense_ring_attention = dense_ring
        parallel_state.destroy_model_parallel()
        patches.uninstall()
        shims.remove()


def _check_context_parallel(world_size, settings):
    """GPTModel at CP = ``world_size`` (gloo) equals one device, logits and every gradient:
    the dense index against megatron-core's own local attention, the approximated ``vs``
    index against the plugin on one device. ``settings``: (layout, index, inner_ring_size)."""
    from dist_utils import run_distributed

    from megatron_mtraining.layout import gather_sequence

    data = batch(3)
    tokens, position_ids, mask, labels = data
    cases, references = [], []
    for layout, index, inner, *deterministic in settings:
        cfg = MTrainingConfig(index=index, layout=layout, block_size=CP_BLOCK, top_p=0.5, max_slash=2,
                              max_vertical=32, min_vertical=0, inner_ring_size=inner,
                              deterministic=deterministic[0] if deterministic else True)
        reference = build_gpt(get_gpt_layer_local_spec() if index == "dense" else get_gpt_layer_spec(cfg))
        ref_logits = reference(tokens, position_ids, mask).detach()
        reference(tokens, position_ids, mask, labels=labels).float().mean().backward()
        state = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in reference.state_dict().items()}
        cases.append((cfg, state))
        references.append((ref_logits, {name: p.grad for name, p in reference.named_parameters()}))

    results = run_distributed(_cp_worker, world_size, cases, data, timeout=240)
    for i, (cfg, _) in enumerate(cases):
        what = f"CP={world_size} {cfg.layout}/{cfg.index}/inner={cfg.inner_ring_size}/det={cfg.deterministic}"
        ref_logits, ref_grads = references[i]
        logits = gather_sequence([r[i][0] for r in results], 1, cfg.layout, CP_BLOCK)
        assert rel_err(logits, ref_logits) < 1e-5, what
        dense_ring_expected = cfg.index == "dense" and cfg.layout == "zigzag" and not cfg.deterministic
        assert all((r[i][2] > 0) is dense_ring_expected for r in results), what
        for name, ref_grad in ref_grads.items():
            for r in results:
                assert rel_err(r[i][1][name], ref_grad) < 1e-5, (what, name)


def test_context_parallel_2_matches_single_device(megatron_cpu):
    """Both layouts; cases with inner ring size 1 have one CP rank per "node" (the two-level
    ring's set-up); the non-deterministic dense zigzag cases run the dense kernels' ring
    (``dense_ring_attention``), flat and two-level. (CP = 4 would need 512 tokens for zigzag.)"""
    _check_context_parallel(2, [("striped", "dense", None), ("zigzag", "dense", None),
                                ("striped", "vs", None), ("zigzag", "vs", 1), ("zigzag", "dense", None, False),
                                ("zigzag", "dense", 1, False)])


def test_context_parallel_4_matches_single_device(megatron_cpu):
    """Flat and hierarchical 2x2 rings (inner_ring_size=2: two "nodes" of two CP ranks)."""
    _check_context_parallel(4, [("striped", "dense", None), ("striped", "dense", 2), ("striped", "vs", 2)])


def _placement_worker(rank, world_size, pairs):
    """For each (config given to install(), config in the layer spec): the error of a CP forward
    of a GPTModel built with that spec, or None when it ran."""
    from megatron_mtraining.integration import patches
    from megatron_mtraining.layout import shard_sequence

    shims = apply_cpu_shims()
    parallel_state.initialize_model_parallel(context_parallel_size=world_size)
    try:
        outcomes = []
        for installed, in_spec in pairs:
            patches.install(installed)
            model = GPTModel(config=transformer_config(context_parallel_size=world_size),
                             transformer_layer_spec=get_gpt_layer_spec(in_spec), vocab_size=VOCAB,
                             max_sequence_length=SEQ, position_embedding_type="rope")
            tokens, position_ids, _, _ = batch(0)
            tokens, position_ids = (shard_sequence(x, 1, installed.layout, world_size, rank, CP_BLOCK)
                                    for x in (tokens, position_ids))
            try:
                model(tokens, position_ids, None)
                outcomes.append(None)
            except ValueError as err:
                outcomes.append(str(err))
        return outcomes
    finally:
        parallel_state.destroy_model_parallel()
        patches.uninstall()
        shims.remove()


def test_install_and_spec_configs_that_place_tokens_differently_are_refused(megatron_cpu):
    """install() (the CP batch split and RoPE slicing) and the layer spec (the attention) each
    carry a config: where they differ in layout or block size, the first CP forward refuses, naming
    both values; where they differ in anything else (top_p), the model runs."""
    from dist_utils import run_distributed

    base = dict(index="dense", block_size=CP_BLOCK)
    pairs = [(MTrainingConfig(layout="zigzag", **base), MTrainingConfig(layout="striped", **base)),
             (MTrainingConfig(layout="striped", **base), MTrainingConfig(layout="striped", index="dense",
                                                                        block_size=128)),
             (MTrainingConfig(top_p=0.5, **base), MTrainingConfig(top_p=0.9, **base))]
    for outcomes in run_distributed(_placement_worker, 2, pairs, timeout=240):
        layout, block, other = outcomes
        assert layout is not None and "layout 'zigzag' in the config given to install()" in layout \
            and "'striped' in layer 1's spec" in layout, layout
        assert block is not None and "block_size 64 in the config given to install()" in block \
            and "128 in layer 1's spec" in block, block
        assert other is None, other


def test_inner_ring_size_counts_cp_ranks_per_node():
    from megatron_mtraining.integration.core_attention import inner_ring_size

    assert inner_ring_size([0, 1, 2, 3], None) is None
    assert inner_ring_size([0, 1, 2, 3], 8) is None  # one node: flat ring
    assert inner_ring_size([0, 1, 2, 3, 4, 5, 6, 7], 4) == 4
    assert inner_ring_size([0, 2, 4, 6, 8, 10, 12, 14], 8) == 4  # TP = 2 strides the CP group
    assert inner_ring_size([0, 8], 8) == 1  # one CP rank per node
    with pytest.raises(ValueError, match="evenly"):
        inner_ring_size([0, 1, 2, 8], 8)
