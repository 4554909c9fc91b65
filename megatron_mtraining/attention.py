"""sparse_attention: single-device sparse attention (vertical-slash or block-sparse) over a full causal sequence."""

from __future__ import annotations

import math
from typing import Optional, Union

import torch

from .block_index import BlockIndex, check_index
from .config import Settings, settings_or_default
from .documents import Documents
from .index import VSIndex
from .kernels.step_plan import single_device_plan
from .kernels.dispatch import resolve_backend
from .kernels.step import backward_delta, single_step_backward, step_forward

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_qkv(q, k, v, backend: str) -> None:
    """Shape, dtype and device checks of q, k, v with clear errors; no host synchronisation."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor [batch, heads, tokens, head_dim], "
                             f"got {getattr(x, 'shape', type(x))}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    b, hq, n, d = q.shape
    if k.shape[0] != b or k.shape[2] != n or k.shape[3] != d:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch, tokens or head_dim: q, k, v "
                         "are [batch, heads, tokens, head_dim] (a [batch, tokens, heads, head_dim] tensor: "
                         ".transpose(1, 2))")
    if hq % k.shape[1]:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({k.shape[1]})")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    allowed = SUPPORTED_DTYPES + ((torch.float64,) if backend == "torch" else ())
    if q.dtype not in allowed:
        raise ValueError(f"dtype {q.dtype} is not supported by backend {backend!r}; use one of {allowed}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")


def check_attention_inputs(q, k, v, index: Union[VSIndex, BlockIndex], backend: str) -> None:
    """``check_qkv`` plus the index: device, batch and heads, block divisibility, head_dim."""
    check_qkv(q, k, v, backend)
    b, hq, n, d = q.shape
    if index.device != q.device:
        raise ValueError(f"the index is on {index.device} but q, k, v are on {q.device}")
    index.check_matches(b, hq)
    if n % index.block_size:
        raise ValueError(f"sequence length {n} is not a multiple of block_size {index.block_size}")
    if backend == "triton" and (d < 16 or d > 256 or d & (d - 1)):
        raise ValueError(f"the Triton kernels need a power-of-two head_dim in [16, 256], got {d}")


def _contiguous_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


class _SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan, softmax_scale, backend, settings):
        b, hq, n, _ = q.shape
        q, k, v = _contiguous_last(q), _contiguous_last(k), _contiguous_last(v)
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        lse = torch.empty(b, hq, n, dtype=torch.float32, device=q.device)
        step_forward(backend, q, k, v, plan, out, lse, softmax_scale, accumulate=False, settings=settings)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.softmax_scale, ctx.backend, ctx.settings = plan, softmax_scale, backend, settings
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, _d_lse):
        q, k, v, out, lse = ctx.saved_tensors
        d_out = d_out.contiguous()
        delta = backward_delta(ctx.backend, out, d_out)
        dq, dk, dv = single_step_backward(ctx.backend, q, k, v, d_out, lse, delta, ctx.plan, ctx.softmax_scale,
                                          ctx.settings)
        return dq, dk, dv, None, None, None, None


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: Union[VSIndex, BlockIndex],
                     softmax_scale: Optional[float] = None, backend: str = "auto",
                     return_lse: bool = False, cu_seqlens: Union[Documents, torch.Tensor, None] = None,
                     settings: Optional[Settings] = None):
    """Sparse causal attention on one device (docs/design.md §1).

    q ``[b, hq, n, d]``, k/v ``[b, hkv, n, d]`` (GQA when ``hkv < hq``), ``index`` a
    ``VSIndex`` (vertical-slash) or a ``BlockIndex`` (block-sparse, built for ``n`` tokens) for
    batch ``b`` and ``hq`` heads on the same device. Differentiable in q, k, v.
    ``backend``: "auto" (Triton on CUDA, PyTorch on CPU), "triton" or "torch".
    ``cu_seqlens``: packed documents, a ``documents.Documents`` (built once per batch) or its
    int32 tensor ``[0, e1, ..., n]``, shared by the batch; attention stays within each document.
    The index's values, and a bare tensor's, are checked here on CPU tensors; on a GPU only with
    ``settings.validate`` (``index.value_checks``), since the check synchronises.
    ``settings``: how it runs (``config.Settings``: kernels, value checks); None: the
    environment's (``config.environment_settings``, read at start-up).
    Returns the output ``[b, hq, n, d]`` in q's dtype (and the fp32 lse with ``return_lse``).
    """
    settings = settings_or_default(settings, "sparse_attention")
    backend = resolve_backend(backend, q.device)
    if not isinstance(index, (VSIndex, BlockIndex)):
        raise ValueError(f"index must be a VSIndex or a BlockIndex, got {type(index).__name__}")
    check_attention_inputs(q, k, v, index, backend)
    check_index(index, q.shape[2], settings.validate)  # values where that is free; a bare cu_seqlens likewise
    documents = Documents.of(cu_seqlens, q.shape[2], validate=settings.validate)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    blocks = None if documents is None else documents.blocks(index.block_size, q.device)
    plan = single_device_plan(index, q.shape[2], documents=blocks)
    out, lse = _SparseAttention.apply(q, k, v, plan, float(softmax_scale), backend, settings)
    return (out, lse) if return_lse else out
