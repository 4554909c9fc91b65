"""Loads the optional compiled extension ``megatron_mtraining._C``; everything works without it."""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("megatron_mtraining")

# Cost: the compiled extension is imported (or found missing) once per process, not per call.
_module = None
_error = None
_loaded = False


def _load():
    global _module, _error, _loaded
    if _loaded:
        return
    _loaded = True
    try:
        from . import _C  # noqa: F401  (built by setup.py from csrc/)
        _module = _C
    except ImportError as exc:  # not built: the PyTorch reference stands in
        _error = str(exc)
        logger.warning("megatron_mtraining: compiled extension _C not available (%s); "
                       "using the PyTorch index conversion", exc)


def module():
    _load()
    if _module is None:
        raise RuntimeError(f"megatron_mtraining._C is not built: {_error}")
    return _module


def available() -> bool:
    _load()
    return _module is not None


def supports(device: torch.device) -> bool:
    """True when the extension is built and has a kernel for this device type."""
    if not available():
        return False
    if device.type == "cuda":
        return bool(_module.has_cuda())
    return device.type == "cpu"


def status() -> str:
    _load()
    if _module is None:
        return f"not built ({_error})"
    return "built with CUDA" if _module.has_cuda() else "built for CPU only"
