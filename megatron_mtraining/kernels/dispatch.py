"""The one place that picks the backend, the kernels and their schedule for a call.

Every other module asks here and runs what it is told (``step.py`` for the sparse kernels,
``dense_kernels.py`` for the dense ones, ``step_plan.py`` for the index conversion). This module imports none
of the kernels (only ``common`` and the extension's status), so it answers on any machine: the
CPU tests walk its whole table with the capabilities monkeypatched (``tests/test_dispatch.py``).

Decision table (first matching row wins):

  What                           Inputs                                  Choice
  -----------------------------  --------------------------------------  ------------------------------
  backend (``resolve_backend``)  "auto", CUDA tensors                    "triton"
                                 "auto", other devices                   "torch"
                                 "triton", not CUDA, no TRITON_INTERPRET  error
                                 "triton" / "torch"                      as asked
  approximator statistics        backend "triton" (as resolved above)    Triton (``triton_approx``)
  (``approx_kernel``)            backend "torch"                         PyTorch (``approx.py``'s passes)
  sparse forward kernel          backend "torch"                         PyTorch (``torch_step``)
  (``forward_kernel``; on the    Settings.forward_kernel "triton"        "triton"
  "triton" backend)              Hopper covers the call (below)          "hopper"
                                 Settings.forward_kernel "hopper", not   error, with the reason
                                 covered
                                 otherwise ("auto", the default)         "triton"
  Hopper forward schedule        B = 128                                 128-row programs: ping-pong
  (``hopper_forward_rows``)      other B                                 64-row programs: lockstep
  sparse backward kernels        backend "torch"                         PyTorch (``torch_step``)
  (``backward_kernel``, then     Settings.backward_kernel, as forward    "triton" / "hopper" / error
  ``backward_parts``)            "hopper", B = 128                       dQ, key blocks, columns: Hopper
                                 "hopper", other B                       dQ, key blocks: Triton; columns: Hopper
                                 "triton"                                all three: Triton
  Hopper covers a call           device: CUDA, not interpreted, sm_90,   covered when all hold, else
  (``hopper_device_reason``,     Triton with Gluon; dtype bf16/fp16;     the first reason that fails
  ``hopper_unsupported_reason``) head_dim 64/128; B a multiple of 64;
                                 every tensor's rows 16-byte aligned
  column words                   CUDA tensors                            Triton (``column_words_triton``)
  (``column_words_kernel``)      other devices                           PyTorch (``column_words_reference``)
  index conversion               "torch"                                 PyTorch
  (``conversion_impl``)          "auto"/"ext", extension has the device  the compiled extension
                                 "ext", extension lacks the device       error
                                 "auto", extension lacks the device      PyTorch
  dense kernel (``dense_impl``)  "cudnn" / "flash" / "torch"             as asked
                                 "auto", CUDA, fp16/bf16                 cuDNN; flash once cuDNN failed
                                                                         or is missing
                                 "auto", otherwise                       "torch"
  dense or sparse kernels for a  not a dense layer, or deterministic     sparse
  dense layer                    one device                              dense (SDPA)
  (``use_dense_kernels``)        a ring: zigzag, and fp16/bf16 on CUDA   dense (the dense ring)
                                 (any dtype off CUDA)
                                 a ring otherwise                        sparse (all-blocks index)

The forward's and the backward's kernel choices are logged once per process and choice.
The backward is deterministic on every row of the table (no atomics: one writer per row,
fixed-order sums of the column partials), except the dense kernels, hence the last rule.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from typing import NamedTuple

import torch

from .. import _ext
from ..config import KERNEL_CHOICES
from .common import HOPPER_TILE, interpreting

logger = logging.getLogger(__name__)
# (direction, kernel, reason) already logged: each choice is said once per process. Kept for the
# log only (a set that grows to a few entries; it changes no result).
_ANNOUNCED = set()

# ----------------------------------------------------------------------------------------- backend

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


def approx_kernel(backend: str, device: torch.device) -> str:
    """The index approximator's statistics kernels (``approx.py``): "triton" (``triton_approx.py``)
    or "torch" (its PyTorch passes), as ``resolve_backend`` resolves ``backend`` (same errors)."""
    return resolve_backend(backend, device)


# ------------------------------------------------------------------- the sparse kernels on "triton"

# On the "triton" backend, where the Hopper kernels (Gluon, sm_90) cover a call they replace the
# Triton ones: the forward (kernels/hopper_fwd.py) and the backward (kernels/hopper_bwd.py).
# Settings.forward_kernel / backward_kernel (MTRAINING_FORWARD_KERNEL / MTRAINING_BACKWARD_KERNEL,
# --mtraining-forward-kernel / --mtraining-backward-kernel) = triton or hopper force one ("hopper"
# fails with the reason where it cannot run).
_SOURCES = {"forward": "MTRAINING_FORWARD_KERNEL, --mtraining-forward-kernel",
            "backward": "MTRAINING_BACKWARD_KERNEL, --mtraining-backward-kernel"}
HOPPER_DTYPES = (torch.bfloat16, torch.float16)
HOPPER_HEAD_DIMS = (64, 128)
# The index block size at which dQ and the key-block dK/dV run on the Hopper kernels: their
# programs hold a whole 128-token block, two warpgroups sharing every streamed tile. At B = 64
# Triton's are as fast or faster (docs/performance.md). The column gradients run on the Hopper
# kernel at any block size.
HOPPER_SLASH_BLOCK = 128
# The index block size at which the Hopper forward runs 128-row programs (the ping-pong kernel).
HOPPER_PINGPONG_BLOCK = 128


def _has_gluon() -> bool:
    """Whether this Triton has the Gluon dialect's Hopper module (Triton >= 3.5)."""
    try:
        return importlib.util.find_spec("triton.experimental.gluon.language.nvidia.hopper") is not None
    except ModuleNotFoundError:
        return False


@functools.lru_cache(maxsize=None)  # cost: asked on every ring step; a device's answer never changes
def hopper_device_reason(device: torch.device) -> str:
    """Why the Hopper kernels cannot run on ``device`` ('' when they can): they need an sm_90 GPU
    (H100, H200, GH200, H20) and Triton's Gluon dialect (Triton >= 3.5)."""
    if device.type != "cuda" or interpreting():
        return f"not a CUDA device ({device}{', TRITON_INTERPRET=1' if interpreting() else ''})"
    capability = torch.cuda.get_device_capability(device)
    if capability != (9, 0):
        return f"compute capability {capability[0]}.{capability[1]} (sm_90 only)"
    return "" if _has_gluon() else "this Triton has no Gluon (triton.experimental.gluon)"


def hopper_unsupported_reason(block_size: int, tensors: dict) -> str:
    """Why the Hopper kernels cannot run a call on these tensors (name -> tensor; the first one's
    dtype and head dim are the call's) with index blocks of ``block_size``; '' when they can. The
    device is ``hopper_device_reason``'s."""
    first = next(iter(tensors.values()))
    d = first.shape[-1]
    if first.dtype not in HOPPER_DTYPES:
        return f"dtype {first.dtype} (bf16 or fp16 only)"
    if d not in HOPPER_HEAD_DIMS:
        return f"head_dim {d} (64 or 128 only)"
    if block_size % HOPPER_TILE:
        return f"block size {block_size} (a multiple of {HOPPER_TILE} only)"
    for name, x in tensors.items():
        # cp.async moves 16-byte pieces: rows must start on 16 bytes.
        if x.stride(-1) != 1 or x.data_ptr() % 16 or any(s * x.element_size() % 16 for s in x.stride()[:-1]):
            return f"{name}'s rows are not 16-byte aligned (strides {tuple(x.stride())})"
    return ""


def _kernel_choice(direction: str, choice: str, block_size: int, tensors: dict) -> str:
    """"hopper" or "triton" for one call of the "triton" backend; ``choice``: the setting of this
    ``direction`` ("forward" or "backward"), "auto", "triton" or "hopper"."""
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"the {direction} kernel must be one of {KERNEL_CHOICES}, got {choice!r}")
    if choice == "triton":
        return "triton"
    q = next(iter(tensors.values()))
    reason = hopper_device_reason(q.device) or hopper_unsupported_reason(block_size, tensors)
    if not reason:
        _announce(direction, "hopper", "")
        return "hopper"
    if choice == "hopper":
        raise ValueError(f"the {direction} kernel is set to hopper ({_SOURCES[direction]}), but the Hopper kernel "
                         f"cannot run this call: {reason}")
    _announce(direction, "triton", reason)
    return "triton"


def _announce(direction: str, kernel: str, reason: str) -> None:
    """Log once which kernel a direction runs (and why not the Hopper one), as a user wants to see
    at start-up; a later call that chooses differently (another dtype, say) logs again."""
    key = (direction, kernel, reason)
    if key in _ANNOUNCED:
        return
    _ANNOUNCED.add(key)
    if kernel == "hopper":
        logger.info("MTraining: %s on the Hopper kernel (sm_90, Gluon); set it to triton (%s) for the Triton one",
                    direction, _SOURCES[direction])
    else:
        logger.info("MTraining: %s on the Triton kernel (the Hopper one does not cover this call: %s)", direction,
                    reason)


def forward_kernel(q, k, v, plan, out, choice: str = "auto") -> str:
    """The forward that runs this step on the "triton" backend: "hopper" or "triton";
    ``choice``: ``Settings.forward_kernel``."""
    return _kernel_choice("forward", choice, plan.block_size, dict(q=q, k=k, v=v, out=out))


def backward_kernel(q, k, v, do, plan, choice: str = "auto") -> str:
    """The backward's kernels for this step on the "triton" backend: "hopper" or "triton";
    ``choice``: ``Settings.backward_kernel``."""
    return _kernel_choice("backward", choice, plan.block_size, dict(q=q, k=k, v=v, do=do))


def hopper_forward_rows(block_size: int) -> int:
    """Query rows per program of the Hopper forward: 128 at B = 128 (the ping-pong kernel, two
    consumer warpgroups sharing every K/V tile), else 64 (one warpgroup, lockstep)."""
    return 128 if block_size == HOPPER_PINGPONG_BLOCK else 64


class BackwardParts(NamedTuple):
    """The kernels ("triton" or "hopper") of the backward's three parts."""
    query: str    # dQ
    blocks: str   # dK, dV of the key blocks (the transposed slash lists)
    columns: str  # dK, dV of the columns (partials per query-range split)


def backward_parts(kernel: str, block_size: int) -> BackwardParts:
    """Each part's kernels for a backward on ``kernel`` (``backward_kernel``'s answer)."""
    if kernel not in ("triton", "hopper"):
        raise ValueError(f"backward_parts: kernel must be 'triton' or 'hopper', got {kernel!r}")
    if kernel == "triton":
        return BackwardParts("triton", "triton", "triton")
    slash = "hopper" if block_size == HOPPER_SLASH_BLOCK else "triton"
    return BackwardParts(slash, slash, "hopper")


# ------------------------------------------------------------------------- the plan's conversions

CONVERSION_IMPLS = ("auto", "ext", "torch")


def column_words_kernel(device: torch.device) -> str:
    """The column words (``column_words.py``): "triton" on a GPU, "torch" elsewhere (CPU tests, the
    interpreter)."""
    return "triton" if device.type == "cuda" else "torch"


def conversion_impl(impl: str, device: torch.device) -> str:
    """The index conversion of a step (``plan.convert_step``): "ext" (the compiled extension) where
    it has this device and ``impl`` allows it, else "torch"; ``impl="ext"`` without it is an error."""
    if impl not in CONVERSION_IMPLS:
        raise ValueError(f"convert_step: impl must be 'auto', 'ext' or 'torch', got {impl!r}")
    if impl != "torch" and _ext.supports(device):
        return "ext"
    if impl == "ext":
        raise RuntimeError(f"convert_step: the compiled extension is not available for {device} ({_ext.status()})")
    return "torch"


# ----------------------------------------------------------------------------------- dense kernels

DENSE_IMPLS = ("auto", "cudnn", "flash", "torch")
_FUSED_DTYPES = (torch.float16, torch.bfloat16)


def dense_impls_available(device) -> list:
    """Dense implementations that can run on ``device`` (the fused ones need fp16/bf16 inputs)."""
    device = torch.device(device)
    impls = ["torch"]
    if device.type == "cuda" and torch.cuda.is_available():
        if torch.backends.cuda.is_flash_attention_available():
            impls.insert(0, "flash")
        if torch.backends.cudnn.is_available():
            impls.insert(0, "cudnn")
    return impls


def dense_impl(impl: str, q: torch.Tensor, cudnn_failed: bool = False) -> str:
    """The dense attention that runs for ``impl`` on ``q`` (``kernels/dense_kernels.py``): "auto" is cuDNN
    on CUDA for fp16/bf16 (flash where cuDNN is missing or ``cudnn_failed``: it raised earlier in
    the same call, ``dense_kernels.DenseFallback``), "torch" otherwise."""
    if impl not in DENSE_IMPLS:
        raise ValueError(f"dense attention: impl must be one of {DENSE_IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    if q.is_cuda and q.dtype in _FUSED_DTYPES:
        return "flash" if cudnn_failed or not torch.backends.cudnn.is_available() else "cudnn"
    return "torch"


def use_dense_kernels(dense_layer: bool, deterministic: bool, ring: bool, layout: str, q: torch.Tensor) -> bool:
    """Whether a layer attends with the dense kernels (cuDNN or flash on GPUs) rather than the
    sparse ones. ``dense_layer``: the layer computes full causal attention (a dense index, a dense
    layer, or a short sequence); ``ring``: context parallel. The dense kernels' backward is not
    guaranteed deterministic, so ``deterministic`` keeps the sparse ones (on the all-blocks
    index). A ring runs them only where a dense kernel can express every step: the zigzag ring
    with fp16/bf16 on CUDA (fp32 steps would materialise the scores; the striped ring's steps are
    block-causal); off CUDA the PyTorch steps take any dtype (tests and demos)."""
    if not dense_layer or deterministic:
        return False
    if not ring:
        return True
    fused_dtype = not q.is_cuda or q.dtype in _FUSED_DTYPES
    return layout == "zigzag" and fused_dtype
