"""The attention layer's layout changes, differentiable: Megatron's ``[s, b, h, d]`` to the
kernels' ``[b, h, s, d]`` (``heads_major``) and back (``sequence_major``).

On CUDA each is one Triton copy that moves whole ``d``-element rows (256 bytes for bf16 and
d = 128): q/k/v and the output forward, the output's gradient backward. PyTorch's generic strided
copy, which ``.contiguous()`` of the permuted view runs, moves the same bytes at well under half
the memory bandwidth the row copy reaches (docs/performance.md, "the layer's transposes").
Elsewhere (CPU tensors) they are PyTorch's permute and copy.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

_ROWS_PER_PROGRAM = 64


@triton.jit
def _copy_rows_kernel(src, dst, S, H, D, S_TILES,
                      src_b, src_h, src_s, dst_b, dst_h, dst_s, NanIf,
                      BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, POISON: tl.constexpr):
    # One grid axis (up to 2^31 - 1 programs): the second and third are capped at 65535.
    pid = tl.program_id(0)
    pid_s = pid % S_TILES
    pid_bh = pid // S_TILES
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    rows = (pid_s * BLOCK_S + tl.arange(0, BLOCK_S)).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < S) & (cols[None, :] < D)
    x = tl.load(src + b * src_b + h * src_h + rows[:, None] * src_s + cols[None, :], mask=mask)
    if POISON:
        x = tl.where(tl.load(NanIf) != 0, float("nan"), x)
    tl.store(dst + b * dst_b + h * dst_h + rows[:, None] * dst_s + cols[None, :], x, mask=mask)


def copy_rows(x: torch.Tensor, out: Optional[torch.Tensor] = None, nan_if: Optional[torch.Tensor] = None
              ) -> torch.Tensor:
    """``x`` ``[b, h, s, d]`` (any strides, the last one 1) copied into ``out`` of the same shape
    (any strides, the last one 1, any floating dtype: the copy casts; default a new contiguous
    tensor in x's dtype) by the row-copy kernel. ``nan_if``: a one-element bool tensor on x's
    device; where it holds True the copy writes NaN everywhere (``agreement.poison``), read by the
    kernel: no host synchronisation."""
    if x.dim() != 4 or x.stride(-1) != 1:
        raise ValueError(f"copy_rows: x must be [b, h, s, d] with a contiguous last dim, got shape "
                         f"{tuple(x.shape)} and strides {x.stride()}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    if (out.shape != x.shape or not (out.dtype.is_floating_point and x.dtype.is_floating_point)
            or out.device != x.device or out.stride(-1) != 1):
        raise ValueError(f"copy_rows: out {tuple(out.shape)} {out.dtype} on {out.device} (strides {out.stride()}) "
                         f"does not fit x {tuple(x.shape)} {x.dtype} on {x.device}")
    if nan_if is not None and (nan_if.numel() != 1 or nan_if.device != x.device):
        raise ValueError(f"copy_rows: nan_if must be one element on {x.device}, got {tuple(nan_if.shape)} on "
                         f"{nan_if.device}")
    b, h, s, d = x.shape
    if x.numel():
        tiles = triton.cdiv(s, _ROWS_PER_PROGRAM)
        _copy_rows_kernel[(tiles * b * h,)](x, out, s, h, d, tiles, x.stride(0), x.stride(1), x.stride(2),
                                            out.stride(0), out.stride(1), out.stride(2),
                                            x if nan_if is None else nan_if,  # (storage; POISON=False)
                                            BLOCK_S=_ROWS_PER_PROGRAM, BLOCK_D=triton.next_power_of_2(d),
                                            POISON=nan_if is not None)
    return out


class _HeadsMajor(torch.autograd.Function):
    """[s, b, h, d] -> contiguous [b, h, s, d]; the gradient goes back as a [s, b, h, d] VIEW of the
    incoming one, as a permute's would. Its consumers (the fused RoPE's backward, Megatron's QKV
    split, whose backward is a cat into the fused QKV gradient) run their fast contiguous kernels
    only on contiguous [s, b, h, d] gradients: the ring writes its gradients in that memory order
    (``sequence_major_empty``), so the view is contiguous and nothing is copied here."""

    @staticmethod
    def forward(ctx, x):
        return copy_rows(x.permute(1, 2, 0, 3))

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return grad.permute(2, 0, 1, 3)


class _SequenceMajor(torch.autograd.Function):
    """[b, h, s, d] -> contiguous [s, b, h, d]; the gradient goes back as contiguous [b, h, s, d]."""

    @staticmethod
    def forward(ctx, x):
        b, h, s, d = x.shape
        out = torch.empty(s, b, h, d, dtype=x.dtype, device=x.device)
        copy_rows(x, out.permute(1, 2, 0, 3))
        return out

    @staticmethod
    @once_differentiable  # the copy builds no graph: a second derivative would be silently missing
    def backward(ctx, grad):
        grad = grad if grad.stride(-1) == 1 else grad.contiguous()
        return copy_rows(grad.permute(1, 2, 0, 3))


def sequence_major_empty(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialised ``[b, h, s, d]`` tensor laid out ``[s, b, h, d]`` in memory: a kernel that
    writes it hands Megatron a contiguous ``[s, b, h, d]`` tensor through a permute, no copy."""
    b, h, s, d = shape
    return torch.empty(s, b, h, d, dtype=dtype, device=device).permute(1, 2, 0, 3)


def copy_into(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``x`` ``[b, h, s, d]`` copied (cast) into ``out`` of the same shape, any layouts: the row
    copy on CUDA, PyTorch's copy elsewhere. Returns ``out``."""
    if row_copy_applies(x) and row_copy_applies(out):
        return copy_rows(x, out)
    return out.copy_(x)


def row_copy_applies(x: torch.Tensor) -> bool:
    """Whether ``copy_rows`` takes ``x``: a CUDA ``[b, h, s, d]`` tensor with a contiguous last dim."""
    return x.is_cuda and x.dim() == 4 and x.stride(-1) == 1


def heads_major(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[s, b, h, d]`` (Megatron's layout, any strides) as a contiguous ``[b, h, s, d]``."""
    if row_copy_applies(x):
        return _HeadsMajor.apply(x)
    return x.permute(1, 2, 0, 3).contiguous()


def sequence_major(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[b, h, s, d]`` (the kernels' layout, any strides) as a contiguous ``[s, b, h, d]``:
    a view where ``x`` already lies that way in memory (SDPA's output can), else a copy."""
    view = x.permute(2, 0, 1, 3)
    if view.is_contiguous():
        return view
    if row_copy_applies(x):
        return _SequenceMajor.apply(x)
    return view.contiguous()


__all__ = ["copy_into", "copy_rows", "row_copy_applies", "heads_major", "sequence_major", "sequence_major_empty"]
