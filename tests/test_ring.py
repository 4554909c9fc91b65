"""sparse_ring_attention on CPU processes (gloo) against single-device sparse_attention.

Spawning is slow, so each group of cases runs in ONE ``run_distributed`` call (cached for the
module) and every case gets its own test id that only checks that call's results. In each worker
every rank builds the same full q/k/v, index and output gradient from the case's seed, keeps its
shard (``shard_sequence``), runs the ring forward and backward and returns its local out, dq, dk,
dv. The parent gathers the shards (``gather_sequence``) and compares them with
``sparse_attention`` on the full sequence: relative L2 error < 1e-5 (fp32).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import traceback
from typing import Optional

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dist_utils import interpreter_works, run_distributed
from megatron_mtraining import VSIndex, sparse_attention
from megatron_mtraining.layout import gather_sequence, shard_sequence
from oracle import rel_err

B = 16
TOL = 1e-5
GRADS = ("dq", "dk", "dv")

RING_MISSING = importlib.util.find_spec("megatron_mtraining.ring") is None
requires_ring = pytest.mark.skipif(RING_MISSING, reason="megatron_mtraining.ring is not written yet")


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    layout: str
    seq_len: int
    index: str = "random"          # random | dense | diagonal | columns
    batch: int = 2
    hq: int = 4
    hkv: int = 2
    head_dim: int = 16
    inner_size: Optional[int] = None
    softmax_scale: Optional[float] = None
    backend: str = "torch"
    group: str = "world"           # world (group=None) | explicit (new_group of all) | halves (2 CP groups)
    seed: int = 0
    megatron_layout: bool = False  # q/k/v as Megatron hands them: [b, h, s, d] views of [s, b, h, d] tensors

    def cp_size(self, world_size: int) -> int:
        return world_size // 2 if self.group == "halves" else world_size


# ----------------------------------------------------------------------------- inputs

def make_index(case: Case, seq_len: int, seed: int) -> VSIndex:
    b, h, nb = case.batch, case.hq, seq_len // B
    g = torch.Generator().manual_seed(seed)
    if case.index == "random":
        return VSIndex.random(b, h, seq_len, B, max_slash=5, max_vertical=24, generator=g)
    if case.index == "dense":
        return VSIndex.dense(b, h, seq_len, B)
    if case.index == "diagonal":
        return VSIndex.from_lists([[[0]] * h] * b, [[[]] * h] * b, block_size=B)
    if case.index == "columns":
        # Sink columns plus random ones; every other head also reads the farthest diagonal.
        slash = [[[0] if j % 2 else [0, nb - 1] for j in range(h)] for _ in range(b)]
        vertical = [[sorted({0, 1, 2, 3} | set(torch.randperm(seq_len, generator=g)[:8].tolist()))
                     for _ in range(h)] for _ in range(b)]
        return VSIndex.from_lists(slash, vertical, block_size=B, max_slash=2)
    raise ValueError(f"unknown index kind {case.index!r}")


def make_inputs(case: Case, seed: int):
    """Full-sequence fp32 q, k, v, output gradient and index; identical on every process."""
    g = torch.Generator().manual_seed(seed)
    n, d = case.seq_len, case.head_dim
    q = torch.randn(case.batch, case.hq, n, d, generator=g)
    k = torch.randn(case.batch, case.hkv, n, d, generator=g)
    v = torch.randn(case.batch, case.hkv, n, d, generator=g)
    grad = torch.randn(case.batch, case.hq, n, d, generator=g)
    return q, k, v, grad, make_index(case, n, seed + 1)


def cp_groups(case: Case, world_size: int):
    """[(group ranks, seed)] of the CP groups of this case (each group gets its own data)."""
    size = case.cp_size(world_size)
    return [(list(range(start, start + size)), case.seed + 1000 * i)
            for i, start in enumerate(range(0, world_size, size))]


# ----------------------------------------------------------------------------- workers

def _run_case(case: Case, rank: int, world_size: int) -> dict:
    from megatron_mtraining import sparse_ring_attention

    group, seed, cp_rank, cp_size = None, case.seed, rank, world_size
    if case.group != "world":
        for ranks, group_seed in cp_groups(case, world_size):
            new = dist.new_group(ranks)  # every rank creates every group, in the same order
            if rank in ranks:
                group, seed, cp_rank, cp_size = new, group_seed, ranks.index(rank), len(ranks)
    q, k, v, grad, index = make_inputs(case, seed)

    def shard(x):
        return shard_sequence(x, 2, case.layout, cp_size, cp_rank, B)

    if not case.megatron_layout:
        q, k, v = (shard(x).requires_grad_() for x in (q, k, v))
        out = sparse_ring_attention(q, k, v, index, group=group, layout=case.layout, inner_size=case.inner_size,
                                    softmax_scale=case.softmax_scale, backend=case.backend)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), shard(grad))
        return {"out": out, "dq": dq, "dk": dk, "dv": dv}
    # As the Megatron layer calls it: permuted views in, the output permuted back and flattened, the
    # gradient arriving that way, the gradients asked back in [s, b, h, d] memory.
    leaves = [shard(x).permute(2, 0, 1, 3).contiguous().requires_grad_() for x in (q, k, v)]
    q, k, v = (x.permute(1, 2, 0, 3) for x in leaves)
    out = sparse_ring_attention(q, k, v, index, group=group, layout=case.layout, inner_size=case.inner_size,
                                softmax_scale=case.softmax_scale, backend=case.backend, sequence_major_grads=True)
    flat = out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)
    d_flat = shard(grad).permute(2, 0, 1, 3).reshape(flat.shape)
    grads = torch.autograd.grad(flat, leaves, d_flat)
    dq, dk, dv = (x.permute(1, 2, 0, 3) for x in grads)
    return {"out": out, "dq": dq, "dk": dk, "dv": dv, "sequence_major": [g.is_contiguous() for g in grads]}


def _ring_worker(rank: int, world_size: int, cases) -> dict:
    """{case name: tensors, or the traceback text if the case raised on this rank}."""
    results = {}
    for case in cases:
        try:
            results[case.name] = _run_case(case, rank, world_size)
        except Exception:
            results[case.name] = traceback.format_exc()
    return results


# ----------------------------------------------------------------------------- cases

def standard_cases(world_size: int) -> list:
    """Both layouts x GQA/MHA random, dense, diagonal-only and column-heavy indices."""
    W, cases = world_size, []
    for layout in ("striped", "zigzag"):
        unit = B * W * (2 if layout == "zigzag" else 1)   # smallest valid sequence
        cases += [
            Case(f"{layout}-random-gqa", layout, 2 * unit),
            Case(f"{layout}-random-mha", layout, (3 if layout == "striped" else 1) * unit, hq=2, hkv=2,
                 head_dim=32),
            Case(f"{layout}-dense-gqa", layout, 2 * unit, index="dense"),
            Case(f"{layout}-diagonal-only", layout, unit * (3 if layout == "striped" else 1), index="diagonal",
                 hq=2, hkv=1),
            Case(f"{layout}-columns", layout, 2 * unit, index="columns", hq=4, hkv=1),
        ]
    return cases


def hierarchical_cases() -> list:
    """W = 4: two inner rings of 2, plus the degenerate splits 1 x 4 and 4 x 1."""
    cases = []
    for layout, n in (("striped", 128), ("zigzag", 256)):
        cases += [
            Case(f"hier2-{layout}-random-gqa", layout, n, inner_size=2),
            Case(f"hier2-{layout}-random-mha", layout, n, inner_size=2, hq=2, hkv=2, head_dim=32),
            Case(f"hier2-{layout}-dense-gqa", layout, n, index="dense", inner_size=2),
            Case(f"hier2-{layout}-columns", layout, n, index="columns", inner_size=2, hkv=1),
        ]
    cases += [
        Case("hier1-striped-random-gqa", "striped", 192, inner_size=1),
        Case("hier4-zigzag-random-gqa", "zigzag", 128, inner_size=4),
    ]
    return cases


def with_seeds(cases: list, base: int) -> tuple:
    return tuple(dataclasses.replace(c, seed=base + i) for i, c in enumerate(cases))


# Every ring property keeps a case at 3 or more ranks: at 2 the previous and the next rank are one
# rank, so a reversed source order (or a ring turning the wrong way) computes the same thing
# there; w3 and w4 catch it (scripts/mutation_check.py, ring-source-order).
SPAWNS = {
    # name: (world size, cases)
    "w1": (1, with_seeds(standard_cases(1) + [Case("hier1-striped-random-gqa", "striped", 64, inner_size=1)],
                         100)),
    "w2": (2, with_seeds(standard_cases(2) + [
        Case("striped-random-scale0.3", "striped", 96, softmax_scale=0.3),
        Case("zigzag-random-explicit-group", "zigzag", 128, group="explicit"),
        Case("striped-random-megatron-layout", "striped", 128, megatron_layout=True),
        Case("zigzag-dense-megatron-layout", "zigzag", 128, index="dense", megatron_layout=True),
    ], 200)),
    "w3": (3, with_seeds(standard_cases(3) + [
        Case("striped-random-explicit-group", "striped", 96, group="explicit"),
    ], 300)),
    "w4": (4, with_seeds(standard_cases(4) + hierarchical_cases() + [
        Case("striped-random-two-cp-groups", "striped", 64, group="halves"),
        Case("zigzag-random-two-cp-groups", "zigzag", 128, group="halves"),
    ], 400)),
    # The Triton kernels in the CPU interpreter (the workers set TRITON_INTERPRET=1): tiny shapes.
    "w2-triton": (2, with_seeds([
        Case("triton-striped-random", "striped", 64, batch=1, hq=2, hkv=1, backend="triton"),
        Case("triton-zigzag-random", "zigzag", 64, batch=1, hq=2, hkv=1, backend="triton"),
        Case("triton-striped-megatron-layout", "striped", 64, batch=2, hq=2, hkv=1, backend="triton",
             megatron_layout=True),
        # hq = 4 over hkv = 1 on 2 ranks: the whole K/V fit where the fp32 dQ was, so dQ is one pass
        # after the ring (SparseSteps.dq_in_one_pass); the cases above keep the per-step dQ.
        Case("triton-striped-dq-one-pass", "striped", 64, batch=2, hq=4, hkv=1, backend="triton"),
        Case("triton-zigzag-dq-one-pass-columns", "zigzag", 128, index="columns", batch=1, hq=4, hkv=1,
             backend="triton"),
        Case("triton-striped-dq-one-pass-megatron-layout", "striped", 64, batch=2, hq=4, hkv=1, backend="triton",
             megatron_layout=True),
    ], 500)),
    # The same over 2 x 2 hierarchical rings (8 query heads over 1 K/V head: dQ in one pass).
    "w4-triton": (4, with_seeds([
        Case("triton-hier2-striped-dq-one-pass", "striped", 128, batch=1, hq=8, hkv=1, inner_size=2,
             backend="triton"),
    ], 600)),
}

_SPAWN_RESULTS = {}


def spawn_results(spawn: str) -> list:
    """Per-rank results of one spawn, run once per session; a failure is re-raised in every test."""
    if spawn not in _SPAWN_RESULTS:
        world_size, cases = SPAWNS[spawn]
        try:
            _SPAWN_RESULTS[spawn] = run_distributed(_ring_worker, world_size, cases, timeout=240)
        except Exception as e:  # noqa: BLE001 (stored, re-raised below)
            _SPAWN_RESULTS[spawn] = e
    result = _SPAWN_RESULTS[spawn]
    if isinstance(result, Exception):
        raise result
    return result


# ----------------------------------------------------------------------------- checks

def reference(case: Case, seed: int):
    """Single-device out and grads of the full sequence (PyTorch backend, fp32)."""
    q, k, v, grad, index = make_inputs(case, seed)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = sparse_attention(q, k, v, index, softmax_scale=case.softmax_scale, backend="torch")
    grads = torch.autograd.grad(out, (q, k, v), grad)
    return dict(zip(("out",) + GRADS, (out.detach(),) + grads)), (q.detach(), k.detach(), v.detach(), grad)


def gathered(case: Case, per_rank: list, ranks: list) -> dict:
    """Each rank's local tensors, checked for shape and dtype, gathered into full sequences."""
    failures = {r: per_rank[r][case.name] for r in ranks if isinstance(per_rank[r][case.name], str)}
    if failures:
        pytest.fail(f"{case.name}: the ring raised on ranks {sorted(failures)}:\n"
                    + "\n".join(f"--- rank {r}:\n{tb}" for r, tb in failures.items()))
    n_local = case.seq_len // len(ranks)
    full = {}
    for name in ("out",) + GRADS:
        heads = case.hq if name in ("out", "dq") else case.hkv
        shards = [per_rank[r][case.name][name] for r in ranks]
        for r, s in zip(ranks, shards):
            assert s.dtype == torch.float32, f"{case.name}: rank {r} {name} dtype {s.dtype}"
            assert tuple(s.shape) == (case.batch, heads, n_local, case.head_dim), \
                f"{case.name}: rank {r} {name} shape {tuple(s.shape)}"
        full[name] = gather_sequence(shards, 2, case.layout, B)
    return full


def assert_close(case: Case, got: dict, want: dict, what: str) -> None:
    errors = {name: rel_err(got[name], want[name]) for name in want}
    bad = {name: e for name, e in errors.items() if not e < TOL}
    assert not bad, (f"{case.name} ({what}): relative L2 error above {TOL:g} for {sorted(bad)}; "
                     f"all errors: " + ", ".join(f"{n}={e:.3g}" for n, e in errors.items()))


def sdpa_reference(q, k, v, grad, scale):
    """Dense causal attention through PyTorch's SDPA, K/V repeated for GQA."""
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                         is_causal=True, scale=scale)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    return dict(zip(("out",) + GRADS, (out.detach(),) + grads))


CASE_IDS = [(spawn, case) for spawn, (_, cases) in SPAWNS.items() for case in cases]


@requires_ring
@pytest.mark.parametrize("spawn,case", CASE_IDS, ids=[f"{s}-{c.name}" for s, c in CASE_IDS])
def test_ring_matches_single_device(spawn, case):
    if case.backend == "triton" and not interpreter_works():
        pytest.skip(f"Triton 3.6's CPU interpreter needs numpy < 2.4 (found {np.__version__}); on GPU "
                    "machines tests/ring_gpu_worker.py runs the Triton ring instead")
    world_size = SPAWNS[spawn][0]
    per_rank = spawn_results(spawn)
    for ranks, seed in cp_groups(case, world_size):
        got = gathered(case, per_rank, ranks)
        if case.megatron_layout:  # the gradients came back in [s, b, h, d] memory: no copy to reach it
            for r in ranks:
                assert per_rank[r][case.name]["sequence_major"] == [True] * 3, (case.name, r)
        want, (q, k, v, grad) = reference(case, seed)
        assert_close(case, got, want, f"ranks {ranks} vs sparse_attention")
        if case.index == "dense":
            assert_close(case, got, sdpa_reference(q, k, v, grad, case.softmax_scale),
                         f"ranks {ranks} vs causal SDPA")


# ----------------------------------------------------------------------------- errors

ERROR_WORLD = 2
ERROR_CASES = {
    # name: (global seq_len, overrides of the good call, the message names one of these)
    "striped_seq_len_not_divisible": (48, {}, ("48", "24")),  # striped, 2 ranks: N % 32 == 0 (local 24)
    "zigzag_seq_len_not_divisible": (96, {"layout": "zigzag"}, ("96", "48")),  # zigzag, 2 ranks: N % 64 == 0
    "inner_size_not_dividing_world": (64, {"inner_size": 3}, ("inner",)),
    "unknown_layout": (64, {"layout": "ring"}, ("ring",)),
    "index_for_other_head_count": (64, {"index_heads": 8}, ("head",)),
    "index_for_other_batch": (64, {"index_batch": 3}, ("batch",)),
}


def _error_worker(rank: int, world_size: int) -> dict:
    """{case: (exception type name or 'no error', message)}, then a good call to show the group works."""
    from megatron_mtraining import sparse_ring_attention

    results = {}
    for name, (seq_len, overrides, _) in ERROR_CASES.items():
        kw = dict(overrides)
        b, hq, hkv, d = 2, 4, 2, 16
        index = VSIndex.random(kw.pop("index_batch", b), kw.pop("index_heads", hq), seq_len, B,
                               generator=torch.Generator().manual_seed(1))
        g = torch.Generator().manual_seed(2)
        n_local = seq_len // world_size  # local tensors as a (wrong) data loader would hand them out
        q = torch.randn(b, hq, n_local, d, generator=g)
        k, v = (torch.randn(b, hkv, n_local, d, generator=g) for _ in range(2))
        try:
            sparse_ring_attention(q, k, v, index, **{"layout": "striped", **kw}, backend="torch")
            results[name] = ("no error", "")
        except Exception as e:  # noqa: BLE001 (the type is checked in the parent)
            results[name] = (type(e).__name__, str(e))
    good = Case("after-errors", "striped", 64, seed=7)
    results["after-errors"] = _run_case(good, rank, world_size)
    return results


_ERROR_RESULTS = []


def error_results() -> list:
    if not _ERROR_RESULTS:
        try:
            _ERROR_RESULTS.append(run_distributed(_error_worker, ERROR_WORLD, timeout=120))
        except Exception as e:  # noqa: BLE001
            _ERROR_RESULTS.append(e)
    if isinstance(_ERROR_RESULTS[0], Exception):
        raise _ERROR_RESULTS[0]
    return _ERROR_RESULTS[0]


@requires_ring
@pytest.mark.parametrize("name", sorted(ERROR_CASES))
def test_bad_calls_raise_value_error_on_every_rank(name):
    per_rank = error_results()  # returning at all means no rank hung
    words = ERROR_CASES[name][2]
    for rank, results in enumerate(per_rank):
        kind, message = results[name]
        assert kind == "ValueError", f"{name}: rank {rank} gave {kind}: {message}"
        assert any(w in message.lower() for w in words), \
            f"{name}: rank {rank} message names none of {words}: {message}"


@requires_ring
def test_group_still_works_after_errors():
    per_rank = error_results()
    case = Case("after-errors", "striped", 64, seed=7)
    want, _ = reference(case, case.seed)
    assert_close(case, gathered(case, per_rank, list(range(ERROR_WORLD))), want, "after the error calls")


# ----------------------------------------------------------------------------- the hop home

def _hop_home_worker(rank: int, world_size: int) -> dict:
    """ring_backward with synthetic fp32 gradients (a function of this rank and the source), flat,
    hierarchical and inner size 1, once with ``home_dtype=bf16`` and once without; records the
    dtypes of every backward transfer through the arrival hook."""
    from megatron_mtraining.ring import comm
    from megatron_mtraining.ring.schedule import ring_backward

    results = {}
    for inner in (None, 2, 1):
        sent = []
        topo = comm.ring_topology(None, inner, arrival_hook=lambda ring, received: sent.append(
            [str(t.dtype) for t in received]))
        kv = (torch.full((3, 5), float(rank)), torch.full((3, 5), float(rank) + 0.5))

        def compute(held, source):  # values that round differently in bf16, different on every rank
            g = torch.Generator().manual_seed(100 * rank + source)
            return tuple(torch.randn(t.shape, generator=g, dtype=torch.float32) * 1.001 ** source for t in held)

        home = ring_backward(topo, kv, compute, home_dtype=torch.bfloat16)
        transfers, sent[:] = list(sent), []
        fp32 = ring_backward(topo, kv, compute)
        wider, sent[:] = ring_backward(topo, kv, compute, home_dtype=torch.float64), []  # cast on arrival
        assert comm.ring_topology(None, inner).inner.arrival_hook is None  # the cached rings carry none
        results[str(inner)] = {"home": home, "fp32": fp32, "transfers": transfers, "fp64": wider}
    return results


@requires_ring
def test_gradients_go_home_in_the_inputs_dtype_with_the_fp32_sums():
    """The last hop carries complete sums: cast before it, they are bit for bit the fp32 ring's
    gradients cast after it, and only that one transfer (two tensors) travels in bf16."""
    per_rank = run_distributed(_hop_home_worker, 4, timeout=120)
    for rank, results in enumerate(per_rank):
        for inner, got in results.items():
            for home, fp32 in zip(got["home"], got["fp32"]):
                assert home.dtype == torch.bfloat16, (rank, inner)
                assert torch.equal(home, fp32.to(torch.bfloat16)), (rank, inner)
            for wide, fp32 in zip(got["fp64"], got["fp32"]):  # wider than the sums: sent as fp32, cast home
                assert wide.dtype == torch.float64 and torch.equal(wide, fp32.double()), (rank, inner)
            dtypes = [d for transfer in got["transfers"] for d in transfer]
            assert dtypes.count("torch.bfloat16") == 2, (rank, inner, got["transfers"])
            assert got["transfers"][-1] == ["torch.bfloat16"] * 2, (rank, inner, got["transfers"])  # the last


def _arrival_hook_worker(rank: int, world_size: int) -> dict:
    """Transfers each call's arrival hook saw: a sparse and a dense ring call given the hook in
    ``settings`` ("hooked"), and after the same calls given none ("after")."""
    from megatron_mtraining import dense_ring_attention, sparse_ring_attention
    from megatron_mtraining.config import Settings

    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, 2, 64, 16, generator=g, requires_grad=True) for _ in range(3))
    index = VSIndex.dense(1, 2, 64 * world_size, 16)
    counts = {}
    for name in ("sparse", "dense"):
        seen = []
        for settings in (Settings(ring_arrival_hook=lambda ring, received: seen.append(ring.name)), None):
            out = sparse_ring_attention(q, k, v, index, settings=settings) if name == "sparse" else \
                dense_ring_attention(q, k, v, layout="zigzag", impl="torch", settings=settings)
            out.sum().backward()
            counts[name, "hooked" if settings is not None else "after"] = len(seen)
    return counts


@requires_ring
def test_the_arrival_hook_travels_in_the_calls_settings():
    """A ring call's ``Settings.ring_arrival_hook`` sees its transfers (forward and backward);
    a later call given no hook runs without it (nothing is left behind in the process)."""
    for counts in run_distributed(_arrival_hook_worker, 2, timeout=120):
        for name in ("sparse", "dense"):
            assert counts[name, "hooked"] > 0 and counts[name, "after"] == counts[name, "hooked"], counts


# ----------------------------------------------------------------------------- dQ in one pass

def test_dq_in_one_pass_where_the_whole_kv_fits_in_the_fp32_dq_buffer():
    """The backward keeps every source's K/V and computes dQ once when 2 x W x kv heads x itemsize
    <= 4 x query heads (no more memory than the fp32 dQ buffer), on the Triton kernels, W > 1."""
    from megatron_mtraining.ring.sparse import SparseSteps

    def rule(world, hq, hkv, dtype, backend="triton", query_plan=True):
        steps = SparseSteps(lambda source: None, world, 1.0, backend, (lambda: None) if query_plan else None)
        return steps.dq_in_one_pass(torch.empty(1, hq, 8, 4, dtype=dtype), torch.empty(1, hkv, 8, 4, dtype=dtype))

    assert rule(4, 16, 2, torch.bfloat16) and rule(8, 16, 2, torch.bfloat16)  # Qwen2.5-3B's heads, 4 and 8 GPUs
    assert not rule(16, 16, 2, torch.bfloat16)  # the whole K/V would outgrow the fp32 dQ
    assert rule(2, 4, 1, torch.float32) and not rule(2, 2, 1, torch.float32)  # the test ring's Triton cases
    assert not rule(1, 16, 2, torch.bfloat16)  # one rank: nothing to keep
    assert not rule(4, 16, 2, torch.bfloat16, backend="torch")  # the PyTorch path: dQ with the key side
    assert not rule(4, 16, 2, torch.bfloat16, query_plan=False)


# ----------------------------------------------------------------------------- the cached rings

def _remade_group_worker(rank: int, world_size: int, store: str) -> dict:
    """The cached rings of a group that was destroyed and made again (same ranks, a new group object)."""
    from megatron_mtraining.ring import comm

    first = comm.ring_topology(None, None)
    same = comm.ring_topology(None, None) is first
    old_group = dist.group.WORLD
    dist.barrier()
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    again = comm.ring_topology(None, None)
    # The new group's ring moves data: a neighbour exchange on it works.
    got = again.inner.exchange((torch.full((2,), float(rank)),), ("forward", 0, world_size, "K/V", 0)).wait(
        ("forward", 0, world_size, "K/V", 0))
    comm.forget_topologies()
    return {"same": same, "forgotten": not comm._TOPOLOGIES, "new_group": again.inner.group is dist.group.WORLD,
            "not_old": again.inner.group is not old_group, "received": float(got[0][0])}


@requires_ring
def test_a_remade_group_gets_new_rings_and_the_cache_lets_go_of_destroyed_ones(tmp_path):
    """ring_topology caches a group's rings per group object: after destroy_process_group and a new
    group of the same ranks, the rings are the new group's (a cache keyed by ranks alone would hand
    back the destroyed one); forget_topologies drops every cached group (it runs at exit, before the
    interpreter's finalisation destructs what is left)."""
    for rank, got in enumerate(run_distributed(_remade_group_worker, 2, str(tmp_path / "store"), timeout=120)):
        assert got["same"] and got["forgotten"] and got["new_group"] and got["not_old"], (rank, got)
        assert got["received"] == float((rank - 1) % 2), (rank, got)
