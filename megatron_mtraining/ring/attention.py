"""sparse_ring_attention: vertical-slash attention over a context-parallel group.

Every rank holds its layout's tokens of q, k, v and the same global ``VSIndex``. The K/V chunks
go round the ring (flat or hierarchical, ``schedule.py``); at each step the index is converted
for (this rank's blocks, the source rank's blocks) and the step kernel merges the partial
result into fp32 accumulators. The backward recomputes from the saved lse; dQ stays local,
dK/dV travel home with their K/V. The result equals ``sparse_attention`` on the full sequence.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from ..attention import check_attention_inputs, check_qkv
from ..documents import as_documents, check_documents_across_ranks
from ..index import VSIndex, value_checks
from ..kernels.plan import build_step_plan
from ..kernels.dispatch import resolve_backend
from ..kernels.step import backward_delta, step_backward, step_forward
from ..layout import check_layout, local_block_ids
from .comm import RingTopology, ring_topology
from .schedule import ring_backward, ring_forward

_CHECKED_SIGNATURES = set()
_BLOCK_IDS = {}


def _block_ids_on(device, seq_len: int, layout: str, world_size: int, block_size: int):
    """Every rank's global block ids, on ``device``; cached so steady-state calls copy nothing
    from the host (a host-to-device copy would synchronise)."""
    key = (str(device), seq_len, layout, world_size, block_size)
    if key not in _BLOCK_IDS:
        _BLOCK_IDS[key] = [local_block_ids(seq_len, layout, world_size, r, block_size).to(device)
                           for r in range(world_size)]
    return _BLOCK_IDS[key]


def _check_same_on_all_ranks(topo: RingTopology, group, q, k, index: VSIndex, layout: str) -> None:
    """First call per signature: all-gather shapes and dtypes, so a mismatch is a clear error on
    every rank instead of a hang or a crash inside a transfer."""
    signature = (tuple(q.shape), tuple(k.shape), str(q.dtype), tuple(index.slash.shape),
                 tuple(index.vertical.shape), index.block_size, layout, topo.inner_size)
    if topo.world_size == 1 or signature in _CHECKED_SIGNATURES:
        return
    dtype_code = [torch.float16, torch.bfloat16, torch.float32, torch.float64].index(q.dtype) \
        if q.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64) else -1
    numbers = [*q.shape, *k.shape, dtype_code, *index.slash.shape, *index.vertical.shape, index.block_size,
               ("striped", "zigzag").index(layout), topo.inner_size]
    device = q.device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    mine = torch.tensor(numbers, dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(topo.world_size)]
    dist.all_gather(everyone, mine, group=group)
    rows = [tuple(t.tolist()) for t in everyone]
    if len(set(rows)) != 1:
        raise ValueError("sparse_ring_attention: ranks disagree on shapes, dtype, index capacity, block size, "
                         "layout or inner_size. Per rank (q shape, k shape, dtype, slash shape, vertical "
                         f"shape, block, layout, inner): {rows}")
    _CHECKED_SIGNATURES.add(signature)


class SparseSteps:
    """Ring steps of vertical-slash attention: one converted index (plan) per source rank."""

    def __init__(self, plans, softmax_scale: float, backend: str):
        self.plans, self.softmax_scale, self.backend = plans, softmax_scale, backend

    def forward(self, q, k, v, source, out, lse):
        step_forward(self.backend, q, k, v, self.plans[source], out, lse, self.softmax_scale, accumulate=True)

    def delta(self, out, d_out):
        return backward_delta(self.backend, out, d_out)

    def backward(self, q, k, v, d_out, out, lse, delta, source, dq, dk, dv):
        step_backward(self.backend, q, k, v, d_out, lse, delta, self.plans[source], dq, dk, dv, self.softmax_scale)


class RingAttentionFunction(torch.autograd.Function):
    """Autograd around the ring schedules for any ``steps`` object (sparse or dense)."""

    @staticmethod
    def forward(ctx, q, k, v, topo, steps):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        b, hq, n, d = q.shape
        out = torch.zeros(b, hq, n, d, dtype=torch.float32, device=q.device)
        lse = torch.full((b, hq, n), float("-inf"), dtype=torch.float32, device=q.device)
        ring_forward(topo, (k, v), lambda kv, source: steps.forward(q, kv[0], kv[1], source, out, lse))
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.topo, ctx.steps = topo, steps
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        d_out = d_out.contiguous()
        delta = ctx.steps.delta(out, d_out)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)

        def gradients(kv, source):
            dk = torch.zeros(kv[0].shape, dtype=torch.float32, device=q.device)
            dv = torch.zeros_like(dk)
            ctx.steps.backward(q, kv[0], kv[1], d_out, out, lse, delta, source, dq, dk, dv)
            return dk, dv

        dk, dv = ring_backward(ctx.topo, (k, v), gradients)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def sparse_ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: VSIndex, group=None,
                          layout: str = "striped", inner_size: Optional[int] = None,
                          softmax_scale: Optional[float] = None, backend: str = "auto",
                          cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Vertical-slash sparse attention across the context-parallel ``group`` (DESIGN.md 3-4).

    q ``[b, hq, n_local, d]`` and k/v ``[b, hkv, n_local, d]`` hold this rank's tokens in the
    ``layout``'s local order ("striped" or "zigzag"); ``index`` is the same global ``VSIndex`` on
    every rank. ``inner_size`` (ranks per node, dividing the group size) selects the
    hierarchical ring; None runs one flat ring. Returns this rank's output ``[b, hq, n_local,
    d]`` in q's dtype, equal to ``sparse_attention`` on the full sequence at these positions.
    ``cu_seqlens``: packed documents of the GLOBAL sequence (int32 ``[0, e1, ..., N]``, the same on
    every rank; ``documents.py``): checked across ranks once per new tensor (one synchronisation,
    so pass one tensor to every layer of an iteration), and key blocks of earlier documents are
    skipped in every step.
    """
    topo = ring_topology(group, inner_size)
    backend = resolve_backend(backend, q.device)
    check_qkv(q, k, v, backend)
    seq_len = q.shape[2] * topo.world_size
    check_layout(seq_len, layout, topo.world_size, index.block_size)  # names the global length
    check_attention_inputs(q, k, v, index, backend)
    cp_group = (group if group is not None else dist.group.WORLD) if topo.world_size > 1 else None
    if cp_group is not None:
        _check_same_on_all_ranks(topo, cp_group, q, k, index, layout)
    if value_checks(q.device):  # the CPU always; a GPU with MTRAINING_VALIDATE=1 (it synchronises)
        index.validate(seq_len)
    if cu_seqlens is not None:
        check_documents_across_ranks(cu_seqlens, seq_len, cp_group)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    B, nb = index.block_size, seq_len // index.block_size
    blocks = _block_ids_on(q.device, seq_len, layout, topo.world_size, B)
    bitmap = index.slash_bitmap(nb)
    documents = as_documents(cu_seqlens, seq_len, B, q.device)
    plans = [build_step_plan(index, blocks[topo.rank], blocks[src], nb, slash_bitmap=bitmap, documents=documents)
             for src in range(topo.world_size)]
    return RingAttentionFunction.apply(q, k, v, topo, SparseSteps(plans, float(softmax_scale), backend))
