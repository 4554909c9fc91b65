"""Checkpoint resume without Apex or Transformer Engine (patches 5 to 7 of ``patches``).

Megatron's DistributedOptimizer then holds torch's AdamW; three defects of megatron-core 0.16
to 0.19 break a resume there (the comments below). Each patch applies only where
``distrib_optimizer.HAVE_APEX_OR_TE`` is False (``torch_adam_distributed_optimizer``).
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable

import torch

__all__ = ["DISTRIB_OPTIMIZER", "LOAD_REASON", "OWN_STEP_REASON", "STEP_REASON", "make_load_state_dict_with_own_steps",
           "make_optimizer_state_before_load", "make_param_state_setter_keeping_step",
           "torch_adam_distributed_optimizer"]

# Checkpoint resume without Apex or Transformer Engine. megatron-core's DistributedOptimizer then
# holds torch's AdamW, whose per-parameter state (exp_avg, exp_avg_sq and a 0-dim ``step`` tensor)
# appears at the first step and whose ``step`` Megatron stores in the param_groups of its
# ``state_dict()``. Three defects of megatron-core 0.16 to 0.19 (checked in 0.16.1 and the 0.19.1 of
# Megatron-LM core_r0.19.0; line numbers are 0.19.1's distrib_optimizer.py) break a resume there;
# each patch below applies only where ``HAVE_APEX_OR_TE`` is False (Apex's / TE's FusedAdam keep
# ``step`` in the param groups and take other paths).


def make_optimizer_state_before_load(original: Callable) -> Callable:
    """5. An unstepped optimizer cannot be loaded into: ``sharded_state_dict(..., is_loading=True)``
    (torch_dist checkpoints) reads every state's ``step`` first (``state_dict()``, l. 839:
    ``assert len(steps) == 1``), and ``load_parameter_state_from_dp_zero`` (torch checkpoints)
    called before ``load_state_dict`` has allocated the states has none to write into. The
    replacement first gives an unstepped optimizer states with Megatron's own helper
    ``_init_optimizer_states_with_dummy_values`` (one step on zero gradients; with weight decay it
    moves the main parameters, and it sets ``step`` to 1). The checkpoint then overwrites the main
    parameters, exp_avg and exp_avg_sq, and ``step`` comes from its param groups, provided patches
    6 and 7 are installed too."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def with_optimizer_state(self, *args, **kwargs):
        # ChainedOptimizer passes is_loading by position.
        loading = original.__name__.startswith("load_") or \
            bool(signature.bind_partial(self, *args, **kwargs).arguments.get("is_loading", False))
        if loading and len(self.optimizer.state) == 0:
            self._init_optimizer_states_with_dummy_values()
        return original(self, *args, **kwargs)

    with_optimizer_state.__mtraining_patch__ = True
    return with_optimizer_state


def make_param_state_setter_keeping_step(original: Callable) -> Callable:
    """6. The parameter-state loaders must leave ``step`` alone: ``load_state_dict`` has just set
    it from the checkpoint's param groups (l. 1024-1032), which is where Megatron keeps it (the
    ``fully_reshardable`` and ``fully_sharded_model_space`` loaders skip ``step``, l. 2108, 2390).
    ``_set_main_param_and_optimizer_states`` (l. 1193) copies every tensor of the optimizer state
    from its ``tensors`` argument, ``step`` included, and

    - ``dp_reshardable`` (torch_dist's default sharding, ``--dist-ckpt-optim-fully-reshardable``
      off) passes the ``step`` of a ``LocalNonpersistentObject`` (l. 1953) taken when the
      loading sharded state dict was built: the in-memory value from before the load (1 after
      patch 5's dummy step), never the checkpoint's. The resumed run went on from step 1;
    - ``dp_zero_gather_scatter`` (torch checkpoints) passes no ``step``: ``KeyError: 'step'``.

    The replacement hands the original, as ``step``, the state's own ``step`` tensor (copied onto
    itself: unchanged), or no ``step`` where the state has none (0.16 copies every state key)."""

    @functools.wraps(original)
    def set_states_keeping_step(self, model_param, tensors, *args, **kwargs):
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        state = self.optimizer.state.get(main_param, {})
        tensors = {k: v for k, v in tensors.items() if k != "step"}
        if "step" in state:
            tensors["step"] = state["step"]
        return original(self, model_param, tensors, *args, **kwargs)

    set_states_keeping_step.__mtraining_patch__ = True
    return set_states_keeping_step


def make_load_state_dict_with_own_steps(original: Callable) -> Callable:
    """7. ``load_state_dict`` gives every parameter's state the SAME ``step`` tensor (l. 1028-1032:
    ``s["step"] = step`` in a loop; torch's ``Optimizer.load_state_dict`` does not copy ``step``),
    and torch's Adam/AdamW increment ``state["step"]`` in place once per parameter: after a resume
    each optimizer step advanced it by the number of parameters (3 -> 29 for 28 parameters), so
    the bias corrections, hence every update after the resume, were wrong (the first resumed
    iteration's loss and grad norm still equal the uninterrupted run's, the next ones do not).
    Megatron's own HybridDeviceOptimizer branch (l. 1043) clones it per state. The replacement
    gives each state whose ``step`` is shared a copy of its own, after the original has run."""

    @functools.wraps(original)
    def load_state_dict_with_own_steps(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        seen = set()
        for state in self.optimizer.state.values():
            step = state.get("step") if isinstance(state, dict) else None
            if torch.is_tensor(step):
                if id(step) in seen:
                    state["step"] = step.clone()
                else:
                    seen.add(id(step))
        return result

    load_state_dict_with_own_steps.__mtraining_patch__ = True
    return load_state_dict_with_own_steps


def torch_adam_distributed_optimizer(module) -> bool:
    return not getattr(module, "HAVE_APEX_OR_TE", True)


DISTRIB_OPTIMIZER = "megatron.core.optimizer.distrib_optimizer"
LOAD_REASON = ("resume without Apex/TE: an unstepped torch-Adam DistributedOptimizer gets its states "
               "before a checkpoint is loaded into it")
STEP_REASON = ("resume without Apex/TE: the parameter-state load keeps the optimizer step that "
               "load_state_dict took from the checkpoint")
OWN_STEP_REASON = ("resume without Apex/TE: every parameter's torch-Adam state gets its own step tensor "
                   "(one shared tensor is incremented once per parameter)")
