"""One entry point per direction for a (query chunk, key chunk) step, whatever the backend.

Ring attention calls ``step_forward`` / ``step_backward`` once per ring step with that step's
plan; single-device attention is the one-step case.
"""

from __future__ import annotations

import torch

from .torch_step import vs_attention_bwd_torch, vs_attention_fwd_torch
from .triton_fwd import interpreting

BACKENDS = ("auto", "triton", "torch")


def resolve_backend(backend: str, device: torch.device) -> str:
    """'auto' is Triton on CUDA and PyTorch elsewhere; 'triton' off-GPU needs TRITON_INTERPRET=1."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend == "triton" and device.type != "cuda" and not interpreting():
        raise ValueError("backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 for the CPU interpreter); "
                         f"got tensors on {device}")
    return backend


def step_forward(backend: str, q, k, v, plan, out, lse, softmax_scale: float, accumulate: bool) -> None:
    """Write (or merge, with ``accumulate``) this step's attention into ``out`` and fp32 ``lse``."""
    if backend == "triton":
        from .triton_fwd import vs_attention_fwd_triton
        vs_attention_fwd_triton(q, k, v, plan, out, lse, softmax_scale, accumulate)
    else:
        vs_attention_fwd_torch(q, k, v, plan, out, lse, softmax_scale, accumulate)


def step_backward(backend: str, q, k, v, do, lse, delta, plan, dq, dk, dv, softmax_scale: float) -> None:
    """Add this step's gradients into fp32 ``dq``, ``dk``, ``dv`` (final ``lse`` and ``delta``)."""
    if backend == "triton":
        from .triton_bwd import vs_attention_bwd_triton
        vs_attention_bwd_triton(q, k, v, do, lse, delta, plan, dq, dk, dv, softmax_scale)
    else:
        vs_attention_bwd_torch(q, k, v, do, lse, delta, plan, dq, dk, dv, softmax_scale)
