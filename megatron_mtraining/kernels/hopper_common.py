"""What the Hopper kernels (``hopper_fwd.py``, ``hopper_pingpong.py``, ``hopper_bwd.py``; Gluon,
sm_90) share: their tile, their layouts, and which calls they cover.

They compute in warpgroups over 64-row tiles (wgmma's m64 atom across the 4 warps of each), with
tiles moved by cp.async in 16-byte pieces into wgmma-ready (swizzled) shared memory.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

TILE = gl.constexpr(64)  # rows per program tile (one warpgroup's m64 wgmma) and keys per tile
HEAD_DIMS = (64, 128)
DTYPES = (torch.bfloat16, torch.float16)


@gluon.jit
def _wide(x, INT64: gl.constexpr):
    """``x`` in int64 when element offsets can pass 2^31 (``int64_offsets``)."""
    if INT64:
        x = x.to(gl.int64)
    return x


@gluon.constexpr_function
def copy_layout(head_dim, warps=4):
    """Registers of a [rows, head_dim] tile for cp.async: 16-byte pieces, a warp covers whole rows."""
    return gl.BlockedLayout([1, 8], [32 // (head_dim // 8), head_dim // 8], [warps, 1], [1, 0])


@gluon.constexpr_function
def mma_layout(n, warps=4):
    """The wgmma accumulator of a [16 * warps, n] tile: the m64 atom over each warpgroup, the
    warpgroups (``warps // 4``) over consecutive 64-row slices."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, n, 16])


@gluon.constexpr_function
def register_operand_layout(head_dim, warps=4):
    """A [16 * warps, 64] A operand in registers (P or dS) of a product into a [16 * warps,
    head_dim] accumulator."""
    return gl.DotOperandLayout(operand_index=0, parent=mma_layout(head_dim, warps), k_width=2)


def shared_layout(head_dim: int, dtype: torch.dtype):
    """The wgmma-ready (swizzled) shared-memory layout of a [rows, head_dim] tile (the swizzle
    depends on the row's bytes only)."""
    element = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return gl.NVMMASharedLayout.get_default_for([TILE.value, head_dim], element)


def unsupported_reason(plan, tensors: dict) -> str:
    """Why the Hopper kernels cannot run a call on these tensors (name -> tensor; '' when they
    can). The device is checked by the caller (``step.hopper_device_reason``)."""
    first = next(iter(tensors.values()))
    d = first.shape[-1]
    if first.dtype not in DTYPES:
        return f"dtype {first.dtype} (bf16 or fp16 only)"
    if d not in HEAD_DIMS:
        return f"head_dim {d} (64 or 128 only)"
    if plan.block_size % TILE.value:
        return f"block size {plan.block_size} (a multiple of 64 only)"
    for name, x in tensors.items():
        # cp.async moves 16-byte pieces: rows must start on 16 bytes.
        if x.stride(-1) != 1 or x.data_ptr() % 16 or any(s * x.element_size() % 16 for s in x.stride()[:-1]):
            return f"{name}'s rows are not 16-byte aligned (strides {tuple(x.stride())})"
    return ""
