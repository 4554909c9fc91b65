"""approximate_index and vs_statistics against an independent float64 oracle of docs/design.md §2
(tests/approx_oracle.py): one device and CP ranks (gloo: striped W=2, zigzag W=3), unpacked and
packed, attention concentrated on a few columns or spread over ~900 of them, the PyTorch
statistics and the Triton kernel (its CPU interpreter here, the GPU under ``-m gpu``)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import approx_oracle as oracle
from dist_utils import run_distributed
from megatron_mtraining import MTrainingConfig, shard_sequence
from megatron_mtraining.approx import approximate_index, vs_statistics

N = 960  # 60 blocks of 16: striped at W = 2 and 3, zigzag at W = 2 and 3
B = 16
# Short documents with and without a block boundary inside ([150, 158), [158, 165)), two of equal
# length ([300, 460), [460, 620): the later one first), more long documents than 4 slots, a
# scored document shorter than last_q ([936, 960)).
DOCS = (0, 3, 150, 158, 165, 300, 460, 620, 936, 960)
# q scale -> attention of the last queries: a few columns (perplexity < 10) to ~900 (> 500).
TEMPERATURES = {"few": 6.0, "some": 1.0, "spread": 0.02}


def config(**overrides) -> MTrainingConfig:
    """Pure top-p by default (no vertical floor); block_size 16 keeps CPU shapes small
    (MTrainingConfig allows 64/128 only, so it is set past the check)."""
    values = dict(block_size=64, top_p=0.9, last_q=64, max_vertical=N, max_slash=N // B, min_vertical=0,
                  min_slash=1, sink_tokens=4, local_window=1, max_documents=4)
    values.update(overrides)
    cfg = MTrainingConfig(**values)
    object.__setattr__(cfg, "block_size", B)
    return cfg


# Budgets, floors, sinks, windows and capacities that bind.
CONFIGS = {
    "top_p": config(),
    "clamped": config(top_p=0.95, max_vertical=200, min_vertical=64, max_slash=12, min_slash=3, sink_tokens=9,
                      local_window=3),
    "low_p": config(top_p=0.5, max_documents=16, sink_tokens=1),
    "floor": config(top_p=0.3, max_vertical=400, min_vertical=96, max_slash=20, min_slash=4, sink_tokens=9,
                    local_window=3),
}


def qk(temperature: float, seed: int = 0, n: int = N, hq: int = 4, hkv: int = 2, d: int = 16, batch: int = 2):
    """Random q/k with a few strong key columns and local similarity; q scaled by ``temperature``."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, hq, n, d, generator=g)
    k = torch.randn(batch, hkv, n, d, generator=g)
    k[:, :, torch.randint(0, n, (6,), generator=g)] += 2.5 * q[:, :1, -1:].mean(1, keepdim=True)
    k = k + 0.5 * q[:, ::hq // hkv]
    return temperature * q, k


def cu(ends):
    return None if ends is None else torch.tensor(ends, dtype=torch.int32)


def last_query_perplexity(q, k) -> float:
    """exp(entropy) of the last query's attention over all keys, averaged over heads (float64)."""
    group = q.shape[1] // k.shape[1]
    s = q[:, :, -1:].double() @ k.double().repeat_interleave(group, 1).transpose(-1, -2) / math.sqrt(q.shape[-1])
    p = torch.softmax(s, -1)
    return torch.exp(-(p * torch.log(p.clamp_min(1e-300))).sum(-1)).mean().item()


def test_temperatures_concentrate_and_spread_attention():
    assert last_query_perplexity(*qk(TEMPERATURES["few"])) < 10
    assert last_query_perplexity(*qk(TEMPERATURES["spread"])) > 500


def test_oracle_on_uniform_attention():
    """The oracle against masses computed by hand: identical keys make every row's softmax
    uniform over its visible keys, so column m holds sum over rows n >= m of 1 / (n + 1)."""
    n, L = 128, 8
    cfg = config(last_q=L)
    q, k = torch.randn(1, 2, n, 4), torch.ones(1, 1, n, 4)
    vertical, slash, total = oracle.statistics(q, k, cfg)
    rows = range(n - L, n)
    want = torch.tensor([sum(1 / (r + 1) for r in rows if r >= m) for m in range(n)], dtype=torch.float64)
    torch.testing.assert_close(vertical[0, 1], want, rtol=1e-12, atol=0)
    want_slash = torch.zeros(n // B, dtype=torch.float64)
    for r in rows:
        for m in range(r + 1):
            want_slash[r // B - m // B] += 1 / (r + 1)
    torch.testing.assert_close(slash[0, 0], want_slash, rtol=1e-12, atol=0)
    assert total == L
    # Two documents of 64: each scores its own last 8 rows over its own keys, weighted 1.
    vertical, _, total = oracle.statistics(q, k, cfg, ends=(0, 64, 128))
    want = [sum(1 / (r - 64 * (m // 64) + 1) for r in range(64 * (m // 64) + 56, 64 * (m // 64) + 64) if r >= m)
            for m in range(n)]
    torch.testing.assert_close(vertical[0, 0], torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=0)
    assert total == 2 * L


def test_oracle_selection_rules():
    """The selection rules of design §2 on hand-made masses."""
    values = [0.0, 5.0, 1.0, 3.0, 3.0, 0.5, 0.0]
    mandatory = [True, False, False, False, False, False, False]
    # Ranked: 0 (mandatory), 1 (5), 3 (3), 4 (3, later), 2, 5; 0.7 x 12.5 = 8.75 needs 0, 1, 3, 4.
    assert oracle.selection(values, mandatory, 12.5, 0.7, 0, 7, 7) == [0, 1, 3, 4]
    assert oracle.selection(values, mandatory, 12.5, 0.5, 0, 7, 7) == [0, 1, 3]  # equal masses: lower first
    assert oracle.selection(values, mandatory, 12.5, 0.5, 0, 2, 7) == [0, 1]      # max clamp
    assert oracle.selection(values, mandatory, 12.5, 0.1, 5, 7, 7) == [0, 1, 2, 3, 4]  # floor
    assert oracle.selection(values, mandatory, 12.5, 1.0, 7, 7, 7) == [0, 1, 2, 3, 4, 5]  # never zero mass
    assert oracle.selection(values, [True] * 3 + [False] * 4, 12.5, 0.1, 0, 7, 2) == [0, 1]  # capacity


STAT_CASES = [(t, ends) for t in TEMPERATURES for ends in (None, DOCS)]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("temperature, ends", STAT_CASES,
                         ids=[f"{t}-{'packed' if e else 'unpacked'}" for t, e in STAT_CASES])
def test_statistics_equal_the_oracle(temperature, ends, backend):
    """Vertical and slash masses against float64. Measured worst absolute error 6e-6 (attention on
    a few columns, fp32 exponentials of large scores), 2e-7 to 2e-6 otherwise; bound: 1e-6 of the
    total mass (64 per scored document) plus 1e-5 relative."""
    q, k = qk(TEMPERATURES[temperature], batch=1)
    cfg = CONFIGS["low_p"] if ends else CONFIGS["top_p"]
    vertical, slash, _ = vs_statistics(q, k, cfg, backend=backend, cu_seqlens=cu(ends))
    want_v, want_s, total = oracle.statistics(q, k, cfg, ends)
    torch.testing.assert_close(vertical.double(), want_v, rtol=1e-5, atol=1e-6 * total)
    torch.testing.assert_close(slash, want_s, rtol=1e-5, atol=1e-6 * total)
    torch.testing.assert_close(slash.sum(-1), torch.full_like(slash[..., 0], total), rtol=1e-6, atol=0)


INDEX_CASES = [(t, c, ends) for t in TEMPERATURES for c in CONFIGS for ends in (None, DOCS)]


@pytest.mark.parametrize("temperature, name, ends", INDEX_CASES,
                         ids=[f"{t}-{c}-{'packed' if e else 'unpacked'}" for t, c, e in INDEX_CASES])
def test_index_equals_the_oracle(temperature, name, ends):
    q, k = qk(TEMPERATURES[temperature])
    cfg = CONFIGS[name]
    index = approximate_index(q, k, cfg, backend="torch", cu_seqlens=cu(ends))
    index.validate(N)
    exact = oracle.check_index(index, q, k, cfg, ends, what=f"{temperature} {name}")
    assert exact >= 0.9  # up to near-ties of fp32 masses, the oracle's selection itself


def test_index_equals_the_oracle_at_block_64_with_a_softmax_scale():
    """The product's block size and the default floor, and a caller's softmax scale."""
    cfg = MTrainingConfig(last_q=64, max_vertical=512, max_slash=16)
    q, k = qk(1.0, n=2048, batch=1)
    for ends, scale in ((None, 0.1), ((0, 700, 1300, 2048), None)):
        index = approximate_index(q, k, cfg, softmax_scale=scale, cu_seqlens=cu(ends))
        assert oracle.check_index(index, q, k, cfg, ends, scale=scale) >= 0.9


@pytest.mark.parametrize("temperature, ends", STAT_CASES,
                         ids=[f"{t}-{'packed' if e else 'unpacked'}" for t, e in STAT_CASES])
def test_triton_index_equals_the_oracle(temperature, ends):
    q, k = qk(TEMPERATURES[temperature], batch=1)
    cfg = CONFIGS["clamped"]
    index = approximate_index(q, k, cfg, backend="triton", cu_seqlens=cu(ends))
    assert oracle.check_index(index, q, k, cfg, ends) >= 0.9


# ------------------------------------------------------------------------------- CP ranks (gloo)
DIST_CASES = [("few", "top_p", None, "torch"), ("spread", "top_p", None, "torch"), ("some", "clamped", None, "torch"),
              ("few", "clamped", DOCS, "torch"), ("spread", "low_p", DOCS, "torch"), ("some", "top_p", DOCS, "torch"),
              # the Triton statistics kernel, in its CPU interpreter in the gloo workers
              ("few", "floor", None, "triton"), ("spread", "floor", DOCS, "triton")]


def _distributed_worker(rank, world, layout):
    import torch.distributed as dist
    out = []
    for temperature, name, ends, backend in DIST_CASES:
        q, k = qk(TEMPERATURES[temperature])
        shard = lambda x: shard_sequence(x, 2, layout, world, rank, B)  # noqa: E731
        cfg = copy.copy(CONFIGS[name])
        object.__setattr__(cfg, "layout", layout)
        index = approximate_index(shard(q), shard(k), cfg, group=dist.group.WORLD, backend=backend,
                                  cu_seqlens=cu(ends))
        out.append(index)
    return out


@pytest.fixture(scope="module", params=[(2, "striped"), (3, "zigzag")], ids=["striped-2", "zigzag-3"])
def distributed(request):
    """One gloo run per (world, layout) computes every case (spawning is slow)."""
    world, layout = request.param
    return run_distributed(_distributed_worker, world, layout, timeout=300)


@pytest.mark.parametrize("case", range(len(DIST_CASES)),
                         ids=[f"{t}-{c}-{'packed' if e else 'unpacked'}-{b}" for t, c, e, b in DIST_CASES])
def test_distributed_index_equals_the_oracle(distributed, case):
    temperature, name, ends, _ = DIST_CASES[case]
    q, k = qk(TEMPERATURES[temperature])
    for rank, indices in enumerate(distributed):
        assert oracle.check_index(indices[case], q, k, CONFIGS[name], ends, what=f"rank {rank}") >= 0.9


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", list(TEMPERATURES))
@pytest.mark.parametrize("ends", [None, (0, 1000, 1100, 1109, 3000, 5000, 7000, 8192)], ids=["unpacked", "packed"])
def test_gpu_triton_index_equals_the_oracle(temperature, ends):
    """The fused statistics kernel on the GPU, at the product's block size and config."""
    cfg = MTrainingConfig(last_q=64, max_vertical=1024, max_slash=64, max_documents=4)
    q, k = qk(TEMPERATURES[temperature], n=8192, hq=8, hkv=2, d=64, batch=1)
    vertical, slash, _ = vs_statistics(q.cuda(), k.cuda(), cfg, backend="triton", cu_seqlens=cu(ends))
    want_v, want_s, total = oracle.statistics(q, k, cfg, ends)
    torch.testing.assert_close(vertical.double().cpu(), want_v, rtol=1e-5, atol=1e-5 * total)
    torch.testing.assert_close(slash.cpu(), want_s, rtol=1e-5, atol=1e-5 * total)
    index = approximate_index(q.cuda(), k.cuda(), cfg, backend="triton", cu_seqlens=cu(ends))
    assert oracle.check_index(index.to("cpu"), q, k, cfg, ends) >= 0.9
