"""Packed documents over the ring (gloo, CPU): sparse_ring_attention and dense_ring_attention with
``cu_seqlens`` at W = 2, 3 and 4 (striped, zigzag, 2 x 2 hierarchical) against single-device
``sparse_attention`` with the same documents (itself checked against the oracle in
test_documents.py), forward and all gradients; and ranks that disagree on ``cu_seqlens`` fail
with a clear error on every rank.

One ``run_distributed`` call per world size runs all of its cases (spawning is slow); each case
gets its own test id that checks that call's results.
"""

from __future__ import annotations

import dataclasses
import functools
import traceback
from typing import Optional

import pytest
import torch

from dist_utils import interpreter_works, run_distributed
from megatron_mtraining import VSIndex, sparse_attention
from megatron_mtraining.layout import gather_sequence, shard_sequence
from oracle import rel_err

B = 16
TOL = 1e-5


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    layout: str
    seq_len: int
    ends: tuple
    inner_size: Optional[int] = None
    dense: bool = False      # dense_ring_attention instead of the sparse ring
    hq: int = 4
    hkv: int = 2
    backend: str = "torch"   # "triton": the kernels in the CPU interpreter (the workers set TRITON_INTERPRET=1)


def documents_for(n: int) -> tuple:
    """One-token documents, boundaries inside blocks, a one-block document, a long last one."""
    ends = [0, 1, 37, 64, 80, 81, 150]
    ends += [e for e in (300, 301, 333) if e < n - 1]
    return tuple(ends + [n])


def cases_for(world: int) -> list:
    n = {2: 192, 3: 192, 4: 384}[world]
    out = [Case(f"W{world}-{layout}", layout, n, documents_for(n)) for layout in ("striped", "zigzag")]
    out.append(Case(f"W{world}-zigzag-tiny-docs", "zigzag", n, tuple(range(0, 40)) + (n,), hq=2, hkv=2))
    if world == 4:
        out += [Case("W4-striped-hierarchical-2x2", "striped", n, documents_for(n), inner_size=2),
                Case("W4-zigzag-hierarchical-2x2", "zigzag", n, documents_for(n), inner_size=2)]
    if world == 2:
        out += [Case("W2-dense-zigzag", "zigzag", n, documents_for(n), dense=True),
                Case("W2-dense-striped", "striped", n, documents_for(n), dense=True),
                # Triton's kernels, 4 query heads over 1 K/V head: dQ in one pass after the ring
                Case("W2-striped-triton-dq-one-pass", "striped", n, documents_for(n), hkv=1, backend="triton")]
    return out


def make_inputs(case: Case):
    g = torch.Generator().manual_seed(len(case.name))
    n, d = case.seq_len, 16
    q = torch.randn(2, case.hq, n, d, generator=g)
    k = torch.randn(2, case.hkv, n, d, generator=g)
    v = torch.randn(2, case.hkv, n, d, generator=g)
    grad = torch.randn(2, case.hq, n, d, generator=g)
    index = VSIndex.dense(2, case.hq, n, B) if case.dense else \
        VSIndex.random(2, case.hq, n, B, max_slash=6, max_vertical=24, generator=g)
    return q, k, v, grad, index


def _run_case(case: Case, rank: int, world: int) -> dict:
    from megatron_mtraining import Documents, dense_ring_attention, sparse_ring_attention
    q, k, v, grad, index = make_inputs(case)
    cu = torch.tensor(case.ends, dtype=torch.int32)

    def shard(x):
        return shard_sequence(x, 2, case.layout, world, rank, B)

    q, k, v = (shard(x).requires_grad_() for x in (q, k, v))
    if case.dense:  # the built object (the sparse cases pass the bare tensor)
        out = dense_ring_attention(q, k, v, layout=case.layout, inner_size=case.inner_size, block_size=B,
                                   cu_seqlens=Documents(cu, case.seq_len))
    else:
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


@functools.lru_cache(maxsize=None)
def ring_results(world: int) -> list:
    return run_distributed(_worker, world, cases_for(world), timeout=300)


def expected(case: Case) -> dict:
    q, k, v, grad, index = make_inputs(case)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = sparse_attention(q, k, v, index, backend="torch", cu_seqlens=torch.tensor(case.ends, dtype=torch.int32))
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    return {"out": out, "dq": dq, "dk": dk, "dv": dv}


@pytest.mark.parametrize("world,name", [(w, c.name) for w in (2, 3, 4) for c in cases_for(w)])
def test_ring_with_documents_equals_single_device(world, name):
    case = next(c for c in cases_for(world) if c.name == name)
    if case.backend == "triton" and not interpreter_works():
        pytest.skip("Triton 3.6's CPU interpreter needs numpy < 2.4; tests/ring_gpu_worker.py runs the Triton ring on GPUs")
    per_rank = [r[name] for r in ring_results(world)]
    for rank, r in enumerate(per_rank):
        assert not isinstance(r, str), f"rank {rank} raised:\n{r}"
    want = expected(case)
    for key in ("out", "dq", "dk", "dv"):
        got = gather_sequence([r[key] for r in per_rank], 2, case.layout, B)
        assert rel_err(got, want[key]) < TOL, f"{key}: {rel_err(got, want[key])}"


def _mismatch_worker(rank: int, world: int) -> str:
    from megatron_mtraining import sparse_ring_attention
    n = 128
    g = torch.Generator().manual_seed(0)
    q, k, v = (shard_sequence(torch.randn(1, 2, n, 16, generator=g), 2, "striped", world, rank, B) for _ in range(3))
    index = VSIndex.random(1, 2, n, B, generator=g)
    # Rank 1 passes the documents of its own shard instead of the global ones.
    ends = [0, 50, n] if rank == 0 else [0, 20, n]
    try:
        sparse_ring_attention(q, k, v, index, backend="torch", cu_seqlens=torch.tensor(ends, dtype=torch.int32))
    except ValueError as e:
        return str(e)
    return "no error"


def test_ranks_that_disagree_on_documents_fail_on_every_rank():
    messages = run_distributed(_mismatch_worker, 2, timeout=120)
    for m in messages:
        assert "cu_seqlens differ across the context-parallel ranks" in m, m
