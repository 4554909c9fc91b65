"""Triton preprocess of the attention backward: delta = rowsum(out * d_out) in fp32.

The backward kernels need delta_i = sum_d out[i, d] * d_out[i, d] for every query row. Computed
in PyTorch (two fp32 casts, a product and a reduction) it moves several times the bytes of reading
the two bf16 tensors once, and took about ten times as long: this kernel reads them in their own
dtype and accumulates in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import int64_offsets
from .triton_common import head_offset, tile_ptrs, wide

# Rows per program: two [rows, d] fp32 tiles stay at 8K elements (64 rows at d128), in registers.
TILE_ELEMENTS = 8192


@triton.jit
def _delta_kernel(O, DO, Delta, n, H,
                  so_b, so_h, so_n, sdo_b, sdo_h, sdo_n,
                  BLOCK_R: tl.constexpr, D: tl.constexpr, INT64: tl.constexpr):
    pid_r, pid_bh = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // H, pid_bh % H
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    dims = tl.arange(0, D)
    ok = rows < n
    o = tl.load(tile_ptrs(O + head_offset(b, h, so_b, so_h, INT64), rows, so_n, dims, INT64),
                mask=ok[:, None], other=0.0).to(tl.float32)
    do = tl.load(tile_ptrs(DO + head_offset(b, h, sdo_b, sdo_h, INT64), rows, sdo_n, dims, INT64),
                 mask=ok[:, None], other=0.0).to(tl.float32)
    tl.store(Delta + wide(pid_bh, INT64) * n + rows, tl.sum(o * do, axis=1), mask=ok)


def attention_delta_triton(out: torch.Tensor, d_out: torch.Tensor) -> torch.Tensor:
    """fp32 ``[b, h, n]`` rowsum of ``out * d_out`` (``[b, h, n, d]``, last dim contiguous, d a power of 2)."""
    if out.shape != d_out.shape or out.dim() != 4:
        raise ValueError(f"out and d_out must both be [b, h, n, d], got {tuple(out.shape)}, {tuple(d_out.shape)}")
    b, h, n, d = out.shape
    if d & (d - 1) or out.stride(-1) != 1 or d_out.stride(-1) != 1:
        raise ValueError(f"attention_delta_triton needs a power-of-2 head dim with unit stride, got d={d}, "
                         f"strides {out.stride()}, {d_out.stride()}")
    delta = torch.empty(b, h, n, dtype=torch.float32, device=out.device)
    rows = max(16, TILE_ELEMENTS // d)
    grid = (triton.cdiv(n, rows), b * h)
    _delta_kernel[grid](out, d_out, delta, n, h, *out.stride()[:3], *d_out.stride()[:3], BLOCK_R=rows, D=d,
                        INT64=int64_offsets(out, d_out, delta))
    return delta
