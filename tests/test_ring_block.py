"""sparse_ring_attention with a BlockIndex (block-sparse) on CPU processes (gloo), against
single-device sparse_attention with the same index (itself checked against the float64 oracle in
test_block_index.py): forward and all gradients at W = 2, 3 and 4, striped and zigzag, flat and
hierarchical rings, packed documents, both backward paths (dQ per step, and dQ in one pass after
the ring on the Triton kernels); and ranks that disagree on the index fail on every rank.

One ``run_distributed`` call per spawn runs all of its cases (spawning is slow); each case gets its
own test id that checks that call's results.
"""

from __future__ import annotations

import dataclasses
import functools
import traceback
from typing import Optional

import numpy as np
import pytest
import torch

from dist_utils import interpreter_works, run_distributed
from megatron_mtraining import BlockIndex, VSIndex, sparse_attention
from megatron_mtraining.layout import gather_sequence, shard_sequence
from oracle import rel_err

B = 16
TOL = 1e-5


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    layout: str
    seq_len: int
    index: str = "random"      # random | own | all | sink
    inner_size: Optional[int] = None
    ends: Optional[tuple] = None
    batch: int = 2
    hq: int = 4
    hkv: int = 2
    backend: str = "torch"
    seed: int = 0


def make_index(case: Case) -> BlockIndex:
    b, h, nb = case.batch, case.hq, case.seq_len // B
    if case.index == "random":
        return BlockIndex.random(b, h, case.seq_len, B, density=0.3, generator=torch.Generator().manual_seed(case.seed))
    if case.index == "own":
        return BlockIndex.from_mask(torch.zeros(b, h, nb, nb, dtype=torch.bool), B)
    if case.index == "all":
        return BlockIndex.dense(b, h, case.seq_len, B)
    if case.index == "sink":  # every query block reads block 0 and its two predecessors (MoBA-like)
        mask = torch.zeros(b, h, nb, nb, dtype=torch.bool)
        mask[..., 0] = True
        mask |= torch.ones(nb, nb, dtype=torch.bool).tril(-1) & ~torch.ones(nb, nb, dtype=torch.bool).tril(-3)
        return BlockIndex.from_mask(mask, B, max_blocks=4)
    raise ValueError(case.index)


def make_inputs(case: Case):
    g = torch.Generator().manual_seed(case.seed + 1)
    n, d = case.seq_len, 16
    q = torch.randn(case.batch, case.hq, n, d, generator=g)
    k = torch.randn(case.batch, case.hkv, n, d, generator=g)
    v = torch.randn(case.batch, case.hkv, n, d, generator=g)
    grad = torch.randn(case.batch, case.hq, n, d, generator=g)
    return q, k, v, grad, make_index(case)


def _run_case(case: Case, rank: int, world: int) -> dict:
    from megatron_mtraining import sparse_ring_attention

    q, k, v, grad, index = make_inputs(case)

    def shard(x):
        return shard_sequence(x, 2, case.layout, world, rank, B)

    q, k, v = (shard(x).requires_grad_() for x in (q, k, v))
    cu = None if case.ends is None else torch.tensor(case.ends, dtype=torch.int32)
    out = sparse_ring_attention(q, k, v, index, layout=case.layout, inner_size=case.inner_size,
                                backend=case.backend, cu_seqlens=cu)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), shard(grad))
    return {"out": out, "dq": dq, "dk": dk, "dv": dv}


def _worker(rank: int, world: int, cases) -> dict:
    results = {}
    for case in cases:
        try:
            results[case.name] = _run_case(case, rank, world)
        except Exception:
            results[case.name] = traceback.format_exc()
    return results


def documents_for(n: int) -> tuple:
    return (0, 1, 37, 64, 80, 81, 150, n)


def cases_for(spawn: str) -> list:
    if spawn == "w2":
        return [Case(f"w2-{layout}-{kind}", layout, n, index=kind, seed=s)
                for s, (layout, n, kind) in enumerate([("striped", 128, "random"), ("zigzag", 128, "random"),
                                                       ("striped", 96, "own"), ("zigzag", 128, "all"),
                                                       ("striped", 128, "sink")])] + [
            Case("w2-zigzag-documents", "zigzag", 192, ends=documents_for(192), seed=9),
            Case("w2-striped-documents-mha", "striped", 192, ends=documents_for(192), hq=2, hkv=2, seed=10)]
    if spawn == "w3":
        return [Case("w3-striped-random", "striped", 144, seed=20), Case("w3-zigzag-random", "zigzag", 192, seed=21),
                Case("w3-striped-documents", "striped", 192, ends=documents_for(192), seed=22),
                Case("w3-zigzag-sink", "zigzag", 96, index="sink", seed=23)]
    if spawn == "w4":
        return [Case("w4-striped-random", "striped", 128, seed=30), Case("w4-zigzag-random", "zigzag", 256, seed=31),
                Case("w4-hier2-striped-random", "striped", 128, inner_size=2, seed=32),
                Case("w4-hier2-zigzag-documents", "zigzag", 256, inner_size=2, ends=documents_for(256), seed=33),
                Case("w4-hier1-striped-sink", "striped", 192, index="sink", inner_size=1, seed=34)]
    if spawn == "w2-triton":  # the kernels in the CPU interpreter (the workers set TRITON_INTERPRET=1)
        return [
            # 4 query heads over 2 K/V heads on 2 ranks: dQ per step (added into the fp32 buffer)
            Case("triton-striped-dq-per-step", "striped", 64, batch=1, hq=4, hkv=2, backend="triton", seed=40),
            # 4 query heads over 1 K/V head: the whole K/V fit where the fp32 dQ was, dQ in one pass
            Case("triton-zigzag-dq-one-pass", "zigzag", 128, batch=1, hq=4, hkv=1, backend="triton", seed=41),
            Case("triton-striped-dq-one-pass-documents", "striped", 64, batch=1, hq=4, hkv=1, backend="triton",
                 ends=(0, 5, 30, 64), seed=42)]
    if spawn == "w4-triton":  # 2 x 2 hierarchical rings, 8 query heads over 1 K/V head: dQ in one pass
        return [Case("triton-hier2-striped-dq-one-pass", "striped", 128, batch=1, hq=8, hkv=1, inner_size=2,
                     backend="triton", seed=50)]
    raise ValueError(spawn)


SPAWNS = {"w2": 2, "w3": 3, "w4": 4, "w2-triton": 2, "w4-triton": 4}


@functools.lru_cache(maxsize=None)
def ring_results(spawn: str) -> list:
    return run_distributed(_worker, SPAWNS[spawn], cases_for(spawn), timeout=400)


def expected(case: Case) -> dict:
    q, k, v, grad, index = make_inputs(case)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    cu = None if case.ends is None else torch.tensor(case.ends, dtype=torch.int32)
    out = sparse_attention(q, k, v, index, backend="torch", cu_seqlens=cu)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    return {"out": out, "dq": dq, "dk": dk, "dv": dv}


CASE_IDS = [(spawn, c.name) for spawn in SPAWNS for c in cases_for(spawn)]


@pytest.mark.parametrize("spawn,name", CASE_IDS, ids=[f"{s}-{n}" for s, n in CASE_IDS])
def test_block_ring_equals_single_device(spawn, name):
    case = next(c for c in cases_for(spawn) if c.name == name)
    if case.backend == "triton" and not interpreter_works():
        pytest.skip(f"Triton 3.6's CPU interpreter needs numpy < 2.4 (found {np.__version__})")
    per_rank = [r[name] for r in ring_results(spawn)]
    for rank, r in enumerate(per_rank):
        assert not isinstance(r, str), f"rank {rank} raised:\n{r}"
    want = expected(case)
    for key in ("out", "dq", "dk", "dv"):
        got = gather_sequence([r[key] for r in per_rank], 2, case.layout, B)
        assert got.shape == want[key].shape, key
        assert rel_err(got, want[key]) < TOL, f"{key}: {rel_err(got, want[key])}"


# ------------------------------------------------------------------------------------ disagreement

def _mismatch_worker(rank: int, world: int) -> dict:
    """Calls whose indices differ across ranks; each must raise on every rank (none may hang)."""
    from megatron_mtraining import sparse_ring_attention

    n, results = 128, {}
    g = torch.Generator().manual_seed(0)
    q, k, v = (shard_sequence(torch.randn(1, 2, n, 16, generator=g), 2, "striped", world, rank, B) for _ in range(3))
    same = BlockIndex.random(1, 2, n, B, generator=torch.Generator().manual_seed(1))
    calls = {
        "block contents": BlockIndex.random(1, 2, n, B, generator=torch.Generator().manual_seed(1 + rank)),
        "kind": same if rank == 0 else VSIndex.random(1, 2, n, B, generator=torch.Generator().manual_seed(1)),
        "wrong length on one rank": same if rank == 0 else BlockIndex.dense(1, 2, 2 * n, B),
    }
    for name, index in calls.items():
        try:
            sparse_ring_attention(q, k, v, index, backend="torch")
            results[name] = ("no error", "")
        except Exception as e:  # noqa: BLE001 (the type is checked in the parent)
            results[name] = (type(e).__name__, str(e))
    out = sparse_ring_attention(q, k, v, same, backend="torch")  # the group still works
    results["after"] = out
    return results


@functools.lru_cache(maxsize=None)
def mismatch_results() -> list:
    return run_distributed(_mismatch_worker, 2, timeout=120)


@pytest.mark.parametrize("name, kinds, words", [
    ("block contents", {"RingAgreementError"}, ("key blocks",)),
    ("kind", {"RingAgreementError"}, ("index kind", "index batch and heads")),  # each rank names its own item
    ("wrong length on one rank", {"RingAgreementError", "ValueError"},
     ("query blocks", "failed their own input checks")),  # rank 1's own error; rank 0 hears of it
])
def test_ranks_that_disagree_on_the_block_index_fail_on_every_rank(name, kinds, words):
    per_rank = mismatch_results()
    for rank, results in enumerate(per_rank):
        kind, message = results[name]
        assert kind in kinds, f"{name}: rank {rank} gave {kind}: {message}"
        assert any(w in message for w in words), f"{name}: rank {rank}: {message}"
    n = 128
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g) for _ in range(3))
    want = sparse_attention(q, k, v, BlockIndex.random(1, 2, n, B, generator=torch.Generator().manual_seed(1)),
                            backend="torch")
    got = gather_sequence([r["after"] for r in per_rank], 2, "striped", B)
    assert rel_err(got, want) < TOL
