"""approximate_index: distributed equals single device, top-p budgets, mandatory entries, errors."""

import pytest
import torch

from dist_utils import interpreter_works, run_distributed
from megatron_mtraining import MTrainingConfig, VSIndex, shard_sequence
from megatron_mtraining.approx import _top_by_value, approximate_index, fixed_index, vs_statistics

# The Triton statistics kernels run on the GPU, or in Triton's CPU interpreter (CPU tensors).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_interpreter = pytest.mark.skipif(not interpreter_works(), reason="Triton's CPU interpreter needs numpy < 2.4")
needs_triton = pytest.mark.skipif(DEVICE == "cpu" and not interpreter_works(),
                                  reason="Triton's CPU interpreter needs numpy < 2.4")

B = 16
CFG = MTrainingConfig(block_size=64, top_p=0.9, last_q=32, max_vertical=48, max_slash=12, min_vertical=2,
                      min_slash=1, sink_tokens=3, local_window=2)


def config(**overrides):
    # block_size 16 keeps CPU shapes small; MTrainingConfig only allows 64/128, so bypass it.
    cfg = MTrainingConfig(**{**CFG.__dict__, **overrides, "block_size": 64})
    object.__setattr__(cfg, "block_size", B)
    return cfg


def structured_qk(n, hq=4, hkv=2, d=16, seed=0):
    """Random q/k with a few strong key columns and locality, so budgets vary per head."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, hq, n, d, generator=g)
    k = torch.randn(2, hkv, n, d, generator=g)
    k[:, :, torch.randint(0, n, (6,), generator=g)] += 2.5 * q[:, :1, -1:].mean(1, keepdim=True)
    k = k + 0.8 * torch.roll(q[:, ::hq // hkv], shifts=0, dims=2)
    return q, k


def assert_same_index(a: VSIndex, b: VSIndex):
    for name in ("slash", "n_slash", "vertical", "n_vertical"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def _approx_worker(rank, world, n, layout, backend):
    import torch.distributed as dist
    q, k = structured_qk(n)
    cfg = config(layout=layout)
    shard = lambda x: shard_sequence(x, 2, layout, world, rank, B)  # noqa: E731
    idx = approximate_index(shard(q), shard(k), cfg, group=dist.group.WORLD, backend=backend)
    return {name: getattr(idx, name) for name in ("slash", "n_slash", "vertical", "n_vertical")}


@pytest.mark.parametrize("world, layout, backend", [
    (1, "striped", "torch"), (2, "striped", "torch"), (2, "zigzag", "torch"), (4, "striped", "torch"),
    (4, "zigzag", "torch"),
    # The fused statistics kernels (Triton's interpreter in the gloo workers).
    pytest.param(2, "striped", "triton", marks=needs_interpreter),
    pytest.param(4, "zigzag", "triton", marks=needs_interpreter),
])
def test_distributed_index_equals_single_device(world, layout, backend):
    n = 16 * 4 * world * 2
    q, k = structured_qk(n)
    single = approximate_index(q, k, config())
    single.validate(n)
    per_rank = run_distributed(_approx_worker, world, n, layout, backend, timeout=180)
    for got in per_rank:
        assert_same_index(VSIndex(**got, block_size=B), single)


@needs_triton
@pytest.mark.parametrize("n, last_q, block, hq, hkv, d, batch", [
    (256, 32, 16, 4, 2, 16, 2),    # GQA, batch 2, the last queries inside one query block
    (320, 40, 16, 4, 1, 24, 1),    # 20 key blocks: the last program holds a partial run; d not a power of 2
    (512, 96, 16, 6, 2, 32, 1),    # the last queries span several query blocks
    (1024, 200, 64, 2, 1, 16, 1),  # last_q over one row tile (128): two row tiles per head
    (1024, 200, 16, 2, 1, 16, 1),  # some rows see none of a program's run of 8 key blocks
])
def test_triton_statistics_equal_the_pytorch_ones(n, last_q, block, hq, hkv, d, batch):
    """The fused kernels compute what the chunked PyTorch passes compute (fp32 vs fp64 sums)."""
    cfg = config()
    for name, value in (("block_size", block), ("last_q", last_q)):
        object.__setattr__(cfg, name, value)
    g = torch.Generator().manual_seed(n)
    q, k = torch.randn(batch, hq, n, d, generator=g), torch.randn(batch, hkv, n, d, generator=g)
    k[:, :, 5] += 3 * q[:, :hkv, -1]  # a strong column, so the statistics are not flat
    q, k = q.to(DEVICE), k.to(DEVICE)
    v_torch, s_torch, _ = vs_statistics(q, k, cfg, backend="torch")
    v_triton, s_triton, _ = vs_statistics(q, k, cfg, backend="triton")
    torch.testing.assert_close(v_triton, v_torch, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s_triton, s_torch, rtol=1e-5, atol=1e-5)
    # Each query's weights sum to one: the statistics hold last_q of mass per head.
    torch.testing.assert_close(s_triton.sum(-1), torch.full((batch, hq), float(last_q), dtype=torch.float64,
                                                            device=DEVICE))
    assert_same_index(approximate_index(q, k, cfg, backend="triton"), approximate_index(q, k, cfg, backend="torch"))
    again = vs_statistics(q, k, cfg, backend="triton")
    assert torch.equal(again[0], v_triton) and torch.equal(again[1], s_triton)


def test_top_by_value_is_a_stable_descending_sort_head():
    values = torch.tensor([[0.5, 2.0, 0.5, float("inf"), 0.0, 2.0, 0.5, 1e-30]])
    want = torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :6]
    assert torch.equal(_top_by_value(values, 6), want)
    assert _top_by_value(values, 6).tolist() == [[3, 1, 5, 0, 2, 6]]


def test_unknown_backend_is_rejected():
    q, k = structured_qk(64)
    with pytest.raises(ValueError, match="backend must be one of"):
        approximate_index(q, k, config(), backend="cuda")


def test_budgets_are_top_p_minimal_and_clamped():
    n = 256
    q, k = structured_qk(n, seed=3)
    cfg = config()
    idx = approximate_index(q, k, cfg)
    vertical, slash, _ = vs_statistics(q, k, cfg)
    total = cfg.last_q
    for b in range(2):
        for h in range(4):
            ns, nv = int(idx.n_slash[b, h]), int(idx.n_vertical[b, h])
            offsets = idx.slash[b, h, :ns].tolist()
            cols = idx.vertical[b, h, :nv].tolist()
            assert offsets[0] == 0 and set(range(cfg.local_window)) <= set(offsets)
            assert set(range(cfg.sink_tokens)) <= set(cols)
            assert max(1, cfg.min_slash) <= ns <= cfg.max_slash
            assert cfg.min_vertical <= nv <= cfg.max_vertical
            for stat, chosen, count, cap, mandatory in ((slash[b, h], offsets, ns, cfg.max_slash, cfg.local_window),
                                                        (vertical[b, h], cols, nv, cfg.max_vertical, cfg.sink_tokens)):
                mass = stat[chosen].sum().item()
                if count < cap:  # not clamped at the top: the selection reaches top_p
                    assert mass >= cfg.top_p * total - 1e-9
                # Minimal: without its lightest non-mandatory entry the selection falls short,
                # unless the lower clamps or mandatory entries forced the count.
                optional = [c for c in chosen if c >= mandatory]
                if optional and count > max(mandatory, 1, cfg.min_slash if stat is slash[b, h] else cfg.min_vertical):
                    lightest = min(stat[c].item() for c in optional)
                    assert mass - lightest < cfg.top_p * total + 1e-9
                # The chosen non-mandatory entries are the heaviest ones.
                others = [c for c in range(stat.numel()) if c not in set(chosen)]
                if optional and others:
                    assert min(stat[c].item() for c in optional) >= max(stat[c].item() for c in others) - 1e-12


def test_dense_and_fixed_builders():
    q, k = structured_qk(256)
    dense = approximate_index(q, k, MTrainingConfig(index="dense"))
    assert torch.all(dense.n_slash == 4)  # 256 / 64 blocks
    fixed = approximate_index(q, k, MTrainingConfig(index="fixed", max_slash=3, max_vertical=10, min_vertical=0))
    fixed.validate(256)
    assert torch.all(fixed.n_vertical == 10) and torch.all(fixed.slash[..., 0] == 0)
    big = fixed_index(1, 2, 4096, MTrainingConfig(max_slash=16, max_vertical=64, min_vertical=0))
    big.validate(4096)
    assert torch.all(big.n_slash == 16) and torch.all(big.n_vertical == 64)


def test_sequences_up_to_dense_max_seq_length_get_the_dense_index():
    """--mtraining-dense-max-seq-length: the vs and fixed builders give the dense index to a
    sequence of at most that many tokens (the whole sequence: over CP ranks too), and build their
    own index above it."""
    q, k = structured_qk(384)
    dense = VSIndex.dense(q.shape[0], 4, 384, B)
    sparse = approximate_index(q, k, config())
    assert not torch.equal(sparse.n_slash, dense.n_slash)  # the vs index is sparse here
    for builder in ("vs", "fixed"):
        got = approximate_index(q, k, config(index=builder, dense_max_seq_length=384))
        assert torch.equal(got.n_slash, dense.n_slash) and torch.equal(got.n_vertical, dense.n_vertical), builder
        assert torch.equal(got.slash[..., :24], dense.slash[..., :24]), builder
    assert torch.equal(approximate_index(q, k, config(dense_max_seq_length=383)).n_slash, sparse.n_slash)


def _dense_max_worker(rank, world):
    import torch.distributed as dist
    q, k = structured_qk(384)
    shard = lambda x: shard_sequence(x, 2, "striped", world, rank, B)  # noqa: E731
    # 384 tokens over 2 ranks, 192 each: the bound counts the whole sequence, not a rank's share.
    return [approximate_index(shard(q), shard(k), config(dense_max_seq_length=bound), group=dist.group.WORLD).n_slash
            for bound in (384, 300)]


def test_dense_max_seq_length_counts_the_whole_cp_sequence():
    for at_384, at_300 in run_distributed(_dense_max_worker, 2, timeout=120):
        assert torch.all(at_384 == 384 // B)
        assert not torch.all(at_300 == 384 // B)


def test_maxima_larger_than_the_sequence_clamp():
    q, k = structured_qk(64)
    cfg = config()
    object.__setattr__(cfg, "max_vertical", 500)
    object.__setattr__(cfg, "max_slash", 300)
    object.__setattr__(cfg, "top_p", 1.0)
    idx = approximate_index(q, k, cfg)
    idx.validate(64)
    assert idx.slash.shape[-1] == 300 and int(idx.n_slash.max()) <= 4
    assert int(idx.n_vertical.max()) <= 64


@pytest.mark.parametrize("kwargs, message", [
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.2), "top_p"), (dict(last_q=0), "last_q"),
    (dict(max_vertical=2, min_vertical=3), "max_vertical"), (dict(max_slash=1, min_slash=2), "max_slash"),
])
def test_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MTrainingConfig(**kwargs)


def test_entry_errors():
    q, k = structured_qk(64)
    cfg = config()
    object.__setattr__(cfg, "last_q", 65)
    with pytest.raises(ValueError, match="last_q"):
        approximate_index(q, k, cfg)
    with pytest.raises(ValueError, match="multiple of key heads"):
        approximate_index(q[:, :3], k, config())
    # One device: the error speaks of the block size only (no layout, no context-parallel size).
    with pytest.raises(ValueError, match="sequence length 40 is not a multiple of the block size 16") as err:
        approximate_index(q[:, :, :40], k[:, :, :40], config())
    assert "layout" not in str(err.value) and "context-parallel" not in str(err.value)


def test_one_device_ignores_the_layout():
    """On one device the sequence is in order whatever config.layout says: zigzag takes a length
    of an odd number of blocks (its CP rule, 2 * CP blocks, does not apply) and gives the striped index."""
    q, k = structured_qk(13 * B)  # 13 blocks: not a multiple of 2 blocks
    assert_same_index(approximate_index(q, k, config(last_q=16, layout="zigzag")),
                      approximate_index(q, k, config(last_q=16)))


def test_recall_on_synthetic_vertical_slash_data():
    """top-p 0.9 covers >= 85% of the true attention mass at < 15% density (measured at this
    size: recall 0.92-0.96, density 0.13 on seeds 0-1; benchmarks/results/approx_*.json)."""
    from synthetic import attention_recall, synthetic_vs_qk
    n = 8192
    q, k = synthetic_vs_qk(1, 8, 2, n, 64, seed=0)
    index = approximate_index(q, k, MTrainingConfig(top_p=0.9, max_vertical=512, min_vertical=0, max_slash=32))
    r = attention_recall(q, k, index)
    assert r["mean_recall"] >= 0.85, r
    assert r["mean_density"] < 0.15, r
