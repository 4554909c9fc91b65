"""A copy between two [b, h, s, d] tensors of any strides (last dim contiguous), one 256-byte row
per (b, h, s): Megatron's [s, b, h, d] layout to the kernels' [b, h, s, d] and back."""

import torch
import triton
import triton.language as tl


@triton.jit
def _copy_rows_kernel(src, dst, S, H,
                      s_b, s_h, s_s, d_b, d_h, d_s,
                      BLOCK_S: tl.constexpr, D: tl.constexpr):
    pid_s = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    rows = (pid_s * BLOCK_S + tl.arange(0, BLOCK_S)).to(tl.int64)
    cols = tl.arange(0, D)
    mask = rows[:, None] < S
    x = tl.load(src + b.to(tl.int64) * s_b + h.to(tl.int64) * s_h + rows[:, None] * s_s + cols[None, :], mask=mask)
    tl.store(dst + b.to(tl.int64) * d_b + h.to(tl.int64) * d_h + rows[:, None] * d_s + cols[None, :], x, mask=mask)


def copy_rows(x: torch.Tensor, out: torch.Tensor = None, block_s: int = 64) -> torch.Tensor:
    """``x`` ([b, h, s, d], any strides with a contiguous last dim) copied into ``out`` (default: a
    contiguous [b, h, s, d] tensor)."""
    b, h, s, d = x.shape
    if x.stride(-1) != 1 or d & (d - 1):
        raise ValueError(f"copy_rows needs a contiguous, power-of-two last dim, got strides {x.stride()}, d={d}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    if out.shape != x.shape or out.stride(-1) != 1:
        raise ValueError(f"out {tuple(out.shape)} / {out.stride()} does not fit x {tuple(x.shape)}")
    grid = (triton.cdiv(s, block_s), b * h)
    _copy_rows_kernel[grid](x, out, s, h, x.stride(0), x.stride(1), x.stride(2),
                            out.stride(0), out.stride(1), out.stride(2), BLOCK_S=block_s, D=d)
    return out
