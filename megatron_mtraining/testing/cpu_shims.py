"""CPU shims that let megatron-core's model code run on CPU with gloo. TESTS AND DEMOS ONLY.

megatron-core assumes CUDA in a few places that a small GPTModel touches. ``apply_cpu_shims``
patches them (see docs/megatron-notes.md, "Running megatron-core on CPU"):

1. ``torch.cuda.current_device()`` returns ``"cpu"`` (RoPE, the global memory buffer and
   others use it as a ``device=``).
2. ``CudaRNGStatesTracker.fork`` is a null context for states that were never added (no CUDA
   RNG exists to fork).
3. ``model_parallel_cuda_manual_seed`` is a no-op (it seeds CUDA generators).
4. ``get_default_causal_mask`` builds its mask on the CPU (it is built on "cuda").
5. Activation recompute's CUDA RNG state save/restore (``_get_cuda_rng_state`` /
   ``_set_cuda_rng_state``) does nothing (the CPU generator is still saved and restored).

Also build the model with ``TransformerConfig(use_cpu_initialization=True,
gradient_accumulation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
apply_rope_fusion=False)`` and without sequence parallelism.

Never use these in a GPU run: they silently change process-wide behaviour. They are
reversible: ``apply_cpu_shims()`` returns a handle whose ``remove()`` (or the end of a
``with`` block) restores every patched attribute.

    with apply_cpu_shims():
        model = GPTModel(...)
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
from typing import Any, Callable, List, Tuple

import torch

logger = logging.getLogger(__name__)

__all__ = ["CpuShims", "apply_cpu_shims"]

_MISSING = object()


def _cpu_current_device():
    return "cpu"


@functools.lru_cache(maxsize=None)
def _cpu_default_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, device="cpu"), diagonal=1).bool()


def _noop_manual_seed(*args, **kwargs) -> None:
    return None


def _no_cuda_rng_state(*args, **kwargs) -> None:
    return None


def _make_cpu_fork(original_fork: Callable, default_name: str) -> Callable:
    def fork(self, name=default_name):
        if torch.cuda.is_available() and name in getattr(self, "states_", {}):
            return original_fork(self, name)
        return contextlib.nullcontext()

    fork.__doc__ = "CPU shim: a null context unless a CUDA RNG state named `name` was added."
    return fork


class CpuShims:
    """Handle of applied shims: ``remove()`` or leaving the ``with`` block restores them."""

    def __init__(self):
        self._saved: List[Tuple[Any, str, Any]] = []
        self.active = False

    def _patch(self, owner, name: str, value) -> None:
        self._saved.append((owner, name, owner.__dict__.get(name, _MISSING) if isinstance(owner, type)
                            else getattr(owner, name, _MISSING)))
        setattr(owner, name, value)
        logger.debug("cpu shim: patched %s.%s", getattr(owner, "__name__", owner), name)

    def apply(self) -> "CpuShims":
        if self.active:
            return self
        from megatron.core.tensor_parallel import random as tp_random

        self._patch(torch.cuda, "current_device", _cpu_current_device)
        tracker = tp_random.CudaRNGStatesTracker
        self._patch(tracker, "fork", _make_cpu_fork(tracker.fork, tp_random._MODEL_PARALLEL_RNG_TRACKER_NAME))
        # Activation recompute saves and restores the CUDA RNG state around the re-run forward.
        for name, shim in (("_get_cuda_rng_state", _no_cuda_rng_state), ("_set_cuda_rng_state", _noop_manual_seed)):
            if hasattr(tp_random, name):
                self._patch(tp_random, name, shim)
        for mod_name in ("megatron.core.tensor_parallel.random", "megatron.core.tensor_parallel"):
            mod = importlib.import_module(mod_name)
            if hasattr(mod, "model_parallel_cuda_manual_seed"):
                self._patch(mod, "model_parallel_cuda_manual_seed", _noop_manual_seed)
        for mod_name in ("megatron.core.transformer.utils", "megatron.core.fusions.fused_softmax"):
            mod = importlib.import_module(mod_name)
            if hasattr(mod, "get_default_causal_mask"):
                self._patch(mod, "get_default_causal_mask", _cpu_default_causal_mask)
        self.active = True
        return self

    def remove(self) -> None:
        """Restore everything patched, in reverse order. Safe to call twice."""
        while self._saved:
            owner, name, old = self._saved.pop()
            if old is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, old)
        self.active = False

    def __enter__(self) -> "CpuShims":
        return self.apply()

    def __exit__(self, *exc) -> None:
        self.remove()


def apply_cpu_shims() -> CpuShims:
    """Apply the CPU shims now; returns the handle (``.remove()``, or use it in ``with``).

    Test/demo only: never call this in a GPU training run.
    """
    return CpuShims().apply()
