"""Dense context-parallel baselines through the same ring engine.

* zigzag (what Transformer Engine does): each step is one or two dense attention calls on
  halves of the local chunks, with the fastest dense kernel that returns the lse (cuDNN, then
  flash, on GPUs; PyTorch on the CPU), merged in fp32 like the sparse steps.
* striped: stripes of one block make every step block-causal rather than token-causal, which no
  dense kernel expresses; it runs the sparse kernels with an all-blocks index (``VSIndex.dense``).
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch

from ..attention import check_qkv
from ..collective import agreement
from ..config import Settings, settings_or_default
from ..documents import Documents
from ..index import VSIndex
from ..kernels.dense_kernels import DenseFallback, dense_attention_backward, dense_attention_forward
from ..kernels.torch_step import merge_partials
from .sparse import RingAttentionFunction, _device_of, call_items, cp_group_of, sparse_ring_attention
from .comm import check_inner_size, ring_topology


class DenseZigzagSteps:
    """Rank ``r`` holds zigzag chunks (r, 2W-1-r), in that order, as the two halves of its tokens.

    Against the K/V of source ``s``: s == r is causal over the whole local sequence (the local
    order is increasing in position); s < r: every query sees the first key half, nothing of
    the second; s > r: only the second query half sees anything, and it sees all keys.
    """

    def __init__(self, rank: int, softmax_scale: float, impl: str):
        self.rank, self.softmax_scale, self.impl = rank, softmax_scale, impl
        self.fallback = DenseFallback()  # this call's: cuDNN that raised in one step is not tried in the others

    def _parts(self, n: int, source: int):
        half = n // 2
        if source == self.rank:
            return slice(0, n), slice(0, n), True
        if source < self.rank:
            return slice(0, n), slice(0, half), False
        return slice(half, n), slice(0, n), False

    def forward(self, q, k, v, source, out, lse):
        rows, cols, causal = self._parts(q.shape[2], source)
        part_out, part_lse = dense_attention_forward(q[:, :, rows], k[:, :, cols], v[:, :, cols], causal,
                                                     self.softmax_scale, self.impl, self.fallback)
        merged_out, merged_lse = merge_partials(out[:, :, rows], lse[:, :, rows], part_out.float(), part_lse)
        out[:, :, rows] = merged_out
        lse[:, :, rows] = merged_lse

    def delta(self, out, d_out):
        return None  # the dense kernels compute their own

    def backward_queries(self, q, k, v, d_out, out, lse, delta, source, dq, accumulate_dq: bool = True):
        """Nothing: one dense kernel gives all three gradients, in ``backward_keys``."""

    def backward_keys(self, q, k, v, d_out, out, lse, delta, source, dq, dk, dv):
        rows, cols, causal = self._parts(q.shape[2], source)
        g_q, g_k, g_v = dense_attention_backward(d_out[:, :, rows], q[:, :, rows], k[:, :, cols], v[:, :, cols],
                                                 out[:, :, rows], lse[:, :, rows].contiguous(), causal,
                                                 self.softmax_scale, self.impl, self.fallback)
        dq[:, :, rows] += g_q
        dk[:, :, cols] += g_k
        dv[:, :, cols] += g_v


def dense_ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, layout: str = "zigzag",
                         inner_size: Optional[int] = None, softmax_scale: Optional[float] = None,
                         impl: str = "auto", block_size: int = 64,
                         cu_seqlens: Union[Documents, torch.Tensor, None] = None,
                         sequence_major_grads: bool = False, settings: Optional[Settings] = None) -> torch.Tensor:
    """Dense causal attention across the context-parallel ``group`` (same conventions as
    ``sparse_ring_attention``). ``impl`` picks the dense kernel of the zigzag layout ("auto",
    "cudnn", "flash", "torch"); ``block_size`` is the stripe of the striped layout.

    ``cu_seqlens`` (packed documents of the global sequence: a ``documents.Documents`` or its
    tensor, as in ``sparse_ring_attention``) masks attention to each document.
    Either layout then runs the block-skipping sparse kernels with an all-blocks index: they skip
    whole key blocks of earlier documents and mask only blocks that straddle a boundary, which a
    per-step dense kernel call cannot express on these layouts (``impl`` is then unused).
    ``settings``: as in ``sparse_ring_attention``."""
    settings = settings_or_default(settings, "dense_ring_attention")
    cp_group, world = cp_group_of(group)
    if layout == "striped" or cu_seqlens is not None:
        with agreement.OwnChecks(cp_group, settings) as checks:
            check_qkv(q, k, v, "torch" if q.device.type == "cpu" else "cuda")  # names the expected shapes
            b, hq, n_local, d = q.shape
            index = VSIndex.dense(b, hq, n_local * world, block_size, device=q.device)
        if checks.error is not None:
            # Tell the peers (waiting in sparse_ring_attention's agreement), then raise the error here.
            checks.agree("dense_ring_attention", list, _device_of(q))
        return sparse_ring_attention(q, k, v, index, group, layout, inner_size, softmax_scale,
                                     cu_seqlens=cu_seqlens, sequence_major_grads=sequence_major_grads,
                                     settings=settings)
    if cp_group is not None:
        agreement.check_deferred(cp_group)
    with agreement.OwnChecks(cp_group, settings) as checks:  # on failure the peers are told in the agreement below
        if layout != "zigzag":
            raise ValueError(f"layout must be 'striped' or 'zigzag', got {layout!r}")
        check_qkv(q, k, v, "torch" if q.device.type == "cpu" else "cuda")
        seq_len = q.shape[2] * world
        if seq_len % (2 * world):
            raise ValueError(f"zigzag layout: sequence length {seq_len} is not divisible by 2 * context-parallel "
                             f"size = {2 * world}")
        if cp_group is not None:
            check_inner_size(inner_size, world)
        if softmax_scale is None:
            softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    verdict = checks.agree("dense_ring_attention", lambda: call_items(
        "dense_ring_attention (zigzag)", q, k, v, layout, world if inner_size is None else inner_size, softmax_scale,
        None, None), _device_of(q))
    topo = ring_topology(group, inner_size, settings.ring_timeout_s, settings.ring_arrival_hook)
    return RingAttentionFunction.apply(q, k, v, topo, DenseZigzagSteps(topo.rank, float(softmax_scale), impl),
                                       verdict, sequence_major_grads)
