"""One entry point per direction for a (query chunk, key chunk) step, whatever the backend.

Ring attention calls ``step_forward`` / ``step_backward`` once per ring step with that step's
plan; single-device attention is the one-step case.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os

import torch

from .torch_step import vs_attention_bwd_torch, vs_attention_fwd_torch
from .triton_fwd import interpreting

logger = logging.getLogger(__name__)
_ANNOUNCED = set()  # (variable, kernel, reason) already logged: each choice is said once per process

BACKENDS = ("auto", "triton", "torch")
# On the "triton" backend, where the Hopper kernels (Gluon, sm_90) cover a call they replace the
# Triton ones: the forward (kernels/hopper_fwd.py) and the backward (kernels/hopper_bwd.py).
# MTRAINING_FORWARD_KERNEL / MTRAINING_BACKWARD_KERNEL = triton or hopper force one ("hopper"
# fails with the reason where it cannot run).
KERNEL_CHOICES = ("auto", "triton", "hopper")
FORWARD_KERNEL_ENV = "MTRAINING_FORWARD_KERNEL"
BACKWARD_KERNEL_ENV = "MTRAINING_BACKWARD_KERNEL"


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


@functools.lru_cache(maxsize=None)
def hopper_device_reason(device: torch.device) -> str:
    """Why the Hopper kernels cannot run on ``device`` ('' when they can): they need an sm_90 GPU
    (H100, H200, GH200, H20) and Triton's Gluon dialect (Triton >= 3.5)."""
    if device.type != "cuda" or interpreting():
        return f"not a CUDA device ({device}{', TRITON_INTERPRET=1' if interpreting() else ''})"
    capability = torch.cuda.get_device_capability(device)
    if capability != (9, 0):
        return f"compute capability {capability[0]}.{capability[1]} (sm_90 only)"
    try:
        have_gluon = importlib.util.find_spec("triton.experimental.gluon.language.nvidia.hopper") is not None
    except ModuleNotFoundError:
        have_gluon = False
    return "" if have_gluon else "this Triton has no Gluon (triton.experimental.gluon)"


def _kernel_choice(env: str, plan, tensors: dict) -> str:
    """"hopper" or "triton" for one call of the "triton" backend (``env``: the variable that forces one)."""
    choice = os.environ.get(env, "auto") or "auto"
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"{env} must be one of {KERNEL_CHOICES}, got {choice!r}")
    if choice == "triton":
        return "triton"
    q = next(iter(tensors.values()))
    reason = hopper_device_reason(q.device)
    if not reason:
        from .hopper_common import unsupported_reason
        reason = unsupported_reason(plan, tensors)
    if not reason:
        _announce(env, "hopper", "")
        return "hopper"
    if choice == "hopper":
        raise ValueError(f"{env}=hopper, but the Hopper kernel cannot run this call: {reason}")
    _announce(env, "triton", reason)
    return "triton"


def _announce(env: str, kernel: str, reason: str) -> None:
    """Log once which kernel a direction runs (and why not the Hopper one), as a user wants to see
    at start-up; a later call that chooses differently (another dtype, say) logs again."""
    key = (env, kernel, reason)
    if key in _ANNOUNCED:
        return
    _ANNOUNCED.add(key)
    part = "forward" if env == FORWARD_KERNEL_ENV else "backward"
    if kernel == "hopper":
        logger.info("MTraining: %s on the Hopper kernel (sm_90, Gluon); %s=triton for the Triton one", part, env)
    else:
        logger.info("MTraining: %s on the Triton kernel (the Hopper one does not cover this call: %s)", part, reason)


def forward_kernel(q, k, v, plan, out) -> str:
    """The forward that runs this step on the "triton" backend: "hopper" or "triton"."""
    return _kernel_choice(FORWARD_KERNEL_ENV, plan, dict(q=q, k=k, v=v, out=out))


def backward_kernel(q, k, v, do, plan) -> str:
    """The backward's kernels for this step on the "triton" backend: "hopper" or "triton"."""
    return _kernel_choice(BACKWARD_KERNEL_ENV, plan, dict(q=q, k=k, v=v, do=do))


def step_forward(backend: str, q, k, v, plan, out, lse, softmax_scale: float, accumulate: bool) -> None:
    """Write (or merge, with ``accumulate``) this step's attention into ``out`` and fp32 ``lse``."""
    if backend == "triton" and forward_kernel(q, k, v, plan, out) == "hopper":
        from .hopper_fwd import vs_attention_fwd_hopper
        vs_attention_fwd_hopper(q, k, v, plan, out, lse, softmax_scale, accumulate)
    elif backend == "triton":
        from .triton_fwd import vs_attention_fwd_triton
        vs_attention_fwd_triton(q, k, v, plan, out, lse, softmax_scale, accumulate)
    else:
        vs_attention_fwd_torch(q, k, v, plan, out, lse, softmax_scale, accumulate)


def backward_delta(backend: str, out: torch.Tensor, d_out: torch.Tensor) -> torch.Tensor:
    """``rowsum(out * d_out)`` ``[b, h, n]`` for the backward, in fp32 (fp64 for fp64 inputs on the
    PyTorch backend); the same for every ring step, so computed once per backward."""
    if backend == "triton":
        from .triton_delta import attention_delta_triton
        return attention_delta_triton(out, d_out)
    acc = torch.float64 if out.dtype == torch.float64 else torch.float32
    return (d_out.to(acc) * out.to(acc)).sum(-1)


def step_backward(backend: str, q, k, v, do, lse, delta, plan, dq, dk, dv, softmax_scale: float) -> None:
    """Add this step's gradients into fp32 ``dq``, ``dk``, ``dv`` (final ``lse`` and ``delta``)."""
    if backend == "triton":
        from .triton_bwd import vs_attention_bwd_triton
        vs_attention_bwd_triton(q, k, v, do, lse, delta, plan, dq, dk, dv, softmax_scale,
                                kernels=backward_kernel(q, k, v, do, plan))
    else:
        vs_attention_bwd_torch(q, k, v, do, lse, delta, plan, dq, dk, dv, softmax_scale)


def single_step_backward(backend: str, q, k, v, do, lse, delta, plan, softmax_scale: float):
    """(dq, dk, dv) in the inputs' dtypes for a one-step attention. The Triton dQ kernel is then
    the only writer of each dq row and stores it directly in q's dtype: no fp32 dq buffer to
    fill, add into and cast (at 128K, 16 heads: 1 GB of fp32 and ~0.9 ms)."""
    acc = delta.dtype
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc, device=q.device)
    if backend == "triton":
        from .triton_bwd import vs_attention_bwd_triton
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        vs_attention_bwd_triton(q, k, v, do, lse, delta, plan, dq, dk, dv, softmax_scale, accumulate_dq=False,
                                kernels=backward_kernel(q, k, v, do, plan))
    else:
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        step_backward(backend, q, k, v, do, lse, delta, plan, dq, dk, dv, softmax_scale)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
