"""``enable_mtraining(args)``: everything ``--mtraining`` turns on in a Megatron run, in one call.

Shared by the three ways in (the launcher, the fork patch and ``examples/pretrain_gpt_mtraining.py``)
so that they cannot drift apart. From the parsed Megatron arguments it

1. builds ``MTrainingConfig.from_args(args)`` and the hook options (dense layers, log interval),
   and runs the start-up validation (``patches.validate_megatron_config``: sequence length,
   attention dropout, hierarchical or hybrid CP, packed or per-document masking, MTP with CP,
   Transformer Engine CP options) on the parsed arguments, whose names match megatron-core's
   ``TransformerConfig`` fields, and, on TE layers, the TE version (``transformer_engine.py``),
2. calls ``patches.install(config)`` (striped batch split, RoPE slicing),
3. turns on the training telemetry when ``--mtraining-log-interval`` > 0,
4. refuses an ``--mtraining-inner-ring-size`` that the launch cannot honour (it must divide the
   world size, and the CP groups must split evenly across nodes of that many ranks), where it
   would otherwise be ignored or fail in the first forward,
5. with ``--pretrained-checkpoint`` a converted model (``python -m megatron_mtraining.convert``),
   checks the run's model flags against it (``convert.pretrained``),
6. when resuming (``--load``), compares the ``--mtraining-*`` flags saved in the checkpoint with
   this run's and says what changed: a ``ResumeConfigWarning`` (MTraining keeps no state, so a
   change is allowed, but it changes the attention the model was trained with), or a ValueError
   with ``--mtraining-resume-changes error`` (or ``MTRAINING_RESUME_CHANGES=error``),

and returns the GPT layer-spec hook (``spec -> spec`` with MTrainingAttention as core attention)
that the caller applies to the spec every ``GPTModel`` is built with.
"""

from __future__ import annotations

import glob
import os
import warnings
from typing import Callable, List, Optional, Tuple

import torch

from ..config import RESUME_POLICIES, MTrainingConfig, resume_policy
from ..convert.pretrained import check_pretrained_run
from . import patches, telemetry
from .transformer_engine import check_transformer_engine
from .args import integration_options
from .spec import get_gpt_layer_spec

__all__ = ["ResumeConfigWarning", "SpecHook", "check_inner_ring_size", "enable_mtraining", "resume_changes"]

# Flags that do not change what the model computes (how it runs, what it logs).
_NOT_MATH = ("mtraining_log_interval", "mtraining_resume_changes", "mtraining_forward_kernel",
             "mtraining_backward_kernel", "mtraining_ring_agreement", "mtraining_ring_timeout_s", "mtraining_validate")


class ResumeConfigWarning(UserWarning):
    """The run resumes from a checkpoint saved with other --mtraining-* flags."""


def check_inner_ring_size(args, config: MTrainingConfig) -> None:
    """ValueError for an inner ring size this launch cannot use (module docstring, item 4).
    Megatron's CP groups are strided by tensor parallelism (rank order tp-cp-...): the first one
    is ``[0, tp, 2 tp, ...]``; the others have the same shape."""
    size = config.inner_ring_size
    world = getattr(args, "world_size", None)
    cp = int(getattr(args, "context_parallel_size", 1) or 1)
    if size is None or world is None or cp <= 1:
        return
    from .core_attention import inner_ring_size  # megatron imports

    source = ("--mtraining-inner-ring-size" if getattr(args, "mtraining_inner_ring_size", None) is not None
              else "the default of --mtraining-inner-ring-size (LOCAL_WORLD_SIZE / GPUS_PER_NODE)")
    if int(world) % int(size):
        raise ValueError(f"MTraining: {source} = {size} does not divide the world size {world}: nodes of {size} "
                         "ranks cannot hold this launch. Set it to the number of ranks per node, or leave it unset")
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    try:
        inner_ring_size([i * tp for i in range(cp)], size)
    except ValueError as err:
        raise ValueError(f"{err} ({source} = {size}, --context-parallel-size {cp}, "
                         f"--tensor-model-parallel-size {tp})") from None


def _saved_args(load_dir: str, ckpt_step: Optional[int]):
    """The argument namespace saved in the checkpoint ``--load`` resumes from, or None."""
    tracker = os.path.join(load_dir, "latest_checkpointed_iteration.txt")
    if not os.path.isfile(tracker):
        return None
    with open(tracker) as f:
        text = f.read().strip()
    directory = "release" if text == "release" and not ckpt_step else f"iter_{int(ckpt_step or text):07d}"
    base = os.path.join(load_dir, directory)
    # torch_dist checkpoints keep the args in common.pt; legacy ones in every model_optim_rng.pt
    for path in [os.path.join(base, "common.pt")] + sorted(glob.glob(os.path.join(base, "mp_rank_*",
                                                                                   "model_optim_rng.pt"))):
        if os.path.isfile(path):
            state = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
            return state.get("args") if isinstance(state, dict) else None
    return None


def resume_changes(args) -> List[Tuple[str, object, object]]:
    """``(flag, saved value, this run's value)`` of every ``--mtraining-*`` flag that changes the
    attention and differs from the checkpoint ``args.load`` resumes from (empty when not resuming,
    or when the checkpoint has no saved arguments)."""
    load = getattr(args, "load", None)
    if not load or getattr(args, "finetune", False):
        return []
    try:
        saved = _saved_args(load, getattr(args, "ckpt_step", None))
    except Exception as err:  # an unreadable checkpoint fails in Megatron's own load, with its error
        warnings.warn(f"MTraining: could not read the arguments saved in the checkpoint in {load} to compare the "
                      f"--mtraining-* flags ({type(err).__name__}: {err})", ResumeConfigWarning, stacklevel=3)
        return []
    if saved is None:
        return []
    names = sorted(name for name in set(vars(args)) | set(vars(saved))
                   if name.startswith("mtraining") and name not in _NOT_MATH)
    missing = object()
    changes = []
    for name in names:
        before, now = getattr(saved, name, missing), getattr(args, name, missing)
        if before is missing:
            before = "(not set: saved without MTraining's flags)"
        if now is not missing and before != now:
            changes.append(("--" + name.replace("_", "-"), before, now))
    return changes


def check_resume(args) -> None:
    """Say what changed since the checkpoint (module docstring, item 6): ``--mtraining-resume-changes``
    ("warn" or "error"; unset: ``MTRAINING_RESUME_CHANGES``, read at start-up, else "warn")."""
    how = getattr(args, "mtraining_resume_changes", None) or resume_policy()
    if how not in RESUME_POLICIES:
        raise ValueError(f"--mtraining-resume-changes must be one of {RESUME_POLICIES}, got {how!r}")
    changes = resume_changes(args)
    if not changes:
        return
    listed = "; ".join(f"{flag}: {before!r} in the checkpoint, {now!r} now" for flag, before, now in changes)
    message = (f"MTraining: resuming from {args.load} with other MTraining settings than the checkpoint was "
               f"saved with: {listed}. The attention now differs from the one the model was trained with; "
               "pass --mtraining-resume-changes error (or set MTRAINING_RESUME_CHANGES=error) to refuse such a "
               "resume. See docs/troubleshooting.md.")
    if how == "error":
        raise ValueError(message)
    warnings.warn(message, ResumeConfigWarning, stacklevel=3)


class SpecHook:
    """``hook(spec)``: ``get_gpt_layer_spec(config, base_spec=spec, dense_layers=...)``."""

    def __init__(self, config: MTrainingConfig, dense_layers: int):
        self.config = config
        self.dense_layers = dense_layers

    def __call__(self, spec):
        return get_gpt_layer_spec(self.config, base_spec=spec, dense_layers=self.dense_layers)


def enable_mtraining(args) -> Callable:
    """Install MTraining for a run with these parsed arguments; returns the layer-spec hook.
    Idempotent (a second call re-installs with the same settings). ValueError on bad flags."""
    config = MTrainingConfig.from_args(args)
    options = integration_options(args)
    patches.validate_megatron_config(args, config, seq_length=getattr(args, "seq_length", None))
    if getattr(args, "transformer_impl", "local") == "transformer_engine":
        check_transformer_engine(required=True)
    check_inner_ring_size(args, config)
    check_pretrained_run(args)
    check_resume(args)
    patches.install(config)
    if options["log_interval"] > 0:
        telemetry.enable_telemetry(options["log_interval"])
    else:
        telemetry.disable_telemetry()
    return SpecHook(config, options["dense_layers"])
