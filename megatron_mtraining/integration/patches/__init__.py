"""Patches that let an unmodified megatron-core run MTraining context parallelism (docs/design.md §6).

Megatron splits every batch across context-parallel (CP) ranks in its zigzag layout and slices
the RoPE frequency table the same way. MTraining's default ``striped`` layout gives rank ``r`` of
``W`` the global blocks ``r, r+W, ...`` of ``block_size`` tokens, so both splits must follow it:

1. the per-sequence CP batch split (``megatron.core.utils``): in megatron-core <= 0.16 the
   public ``get_batch_on_this_cp_rank`` itself; in newer versions the dispatcher
   ``get_batch_on_this_cp_rank`` calls the module global
   ``_get_batch_on_this_cp_rank_per_sequence_balancing`` at call time, and only that is patched;
2. the RoPE CP slicing ``get_pos_emb_on_this_cp_rank`` in ``rope_utils`` *and* in every module
   that imported it by name (``rotary_pos_embedding``, ``yarn_rotary_pos_embedding``, and any
   other loaded ``megatron.*`` module whose namespace holds the same function object).

Packed documents (``packing.py``): the batch split also reads the document boundaries of the FULL
micro-batch (``--reset-attention-mask``: EOD tokens or position-id resets) for the layers. THD
batches (``--sft``, ``--dataloader-inter-document-masking``) are split in the MTraining layout as
one flat sequence, whole documents in their global places, no per-document zigzag padding:

3. the per-document CP split of THD batches: ``_get_batch_on_this_cp_rank_per_document_balancing``
   (megatron-core >= 0.17-ish, Transformer Engine's ``thd_get_partitioned_indices``) and
   ``get_thd_batch_on_this_cp_rank`` (megatron-core <= 0.16);
4. ``apply_rotary_pos_emb`` (``rope_utils`` and its by-name importers, ``attention.py`` among them)
   for THD inputs over CP > 1 only: each token takes the RoPE row of its position within its
   document, from its global position in the MTraining layout (Megatron's own THD RoPE assumes the
   per-document zigzag split). Everything else goes to the original unchanged.

Checkpoint resume without Apex or Transformer Engine (Megatron's DistributedOptimizer then holds
torch's AdamW; applied only where ``distrib_optimizer.HAVE_APEX_OR_TE`` is False):

5. ``DistributedOptimizer.sharded_state_dict`` / ``load_parameter_state_from_dp_zero``: an unstepped
   optimizer gets its states (Megatron's dummy step) before a checkpoint is loaded into it;
6. ``DistributedOptimizer._set_main_param_and_optimizer_states``: the parameter-state loaders keep
   the ``step`` that ``load_state_dict`` took from the checkpoint's param groups;
7. ``DistributedOptimizer.load_state_dict``: each parameter's state gets its own ``step`` tensor.

Without 6 and 7 a resumed run's first optimizer step already differs from an uninterrupted run's
(see the comments above ``_make_optimizer_state_before_load``).

``install(config)`` applies them (idempotent: a second call only updates the config the patched
functions read), ``uninstall()`` restores the exact original objects, ``installed()`` tells.
Every replaced attribute is logged once at INFO. Every patch is listed in ``PATCHES``.

Install after importing the Megatron modules that import the patched functions by name (for
example ``megatron.training.utils`` / ``pretrain_gpt``): a module imported later still holds the
original function. ``validate_megatron_config`` (``integration/validate.py``) rejects unsupported
settings at start-up.

One module per concern: ``engine`` (``Patch``, install / uninstall, the by-name importer scan),
``batch`` (1, 3), ``rope`` (2, 4), ``optimizer`` (5-7); this file holds the one table of them.
"""

from __future__ import annotations

from typing import Tuple

from ...config import MTrainingConfig
from ..validate import validate_megatron_config
from . import batch, engine, optimizer, rope
from .engine import Patch, installed, uninstall

__all__ = ["PATCHES", "Patch", "install", "uninstall", "installed", "validate_megatron_config"]

_UTILS = "megatron.core.utils"
_EMBEDDINGS = "megatron.core.models.common.embeddings."
_TORCH_ADAM = dict(optional=True, when=optimizer.torch_adam_distributed_optimizer)

PATCHES: Tuple[Patch, ...] = (
    # 1. megatron-core >= 0.17-ish: the dispatcher calls this module global at call time.
    Patch(_UTILS, "_get_batch_on_this_cp_rank_per_sequence_balancing", batch.make_batch_split,
          batch.BATCH_REASON, optional=True),
    # 1. megatron-core <= 0.16: the public function does the zigzag split itself.
    Patch(_UTILS, "get_batch_on_this_cp_rank", batch.make_batch_split, batch.BATCH_REASON,
          unless_attr="_get_batch_on_this_cp_rank_per_sequence_balancing", scan_importers=True),
    # 2. RoPE CP slicing, where it is defined and where it is imported by name.
    Patch(rope.ROPE_UTILS, "get_pos_emb_on_this_cp_rank", rope.make_pos_emb_slicer, rope.ROPE_REASON,
          scan_importers=True),
    Patch(_EMBEDDINGS + "rotary_pos_embedding", "get_pos_emb_on_this_cp_rank", rope.make_pos_emb_slicer,
          rope.ROPE_REASON + " (imported by name)"),
    Patch(_EMBEDDINGS + "yarn_rotary_pos_embedding", "get_pos_emb_on_this_cp_rank", rope.make_pos_emb_slicer,
          rope.ROPE_REASON + " (imported by name)", optional=True),
    # 3. Packed THD batches (--sft, --dataloader-inter-document-masking; packing.py).
    Patch(_UTILS, "_get_batch_on_this_cp_rank_per_document_balancing", batch.make_thd_batch_split,
          batch.THD_REASON, optional=True),
    Patch(_UTILS, "get_thd_batch_on_this_cp_rank", batch.make_legacy_thd_batch_split, batch.THD_REASON,
          optional=True, unless_attr="_get_batch_on_this_cp_rank_per_document_balancing", scan_importers=True),
    # 4. THD RoPE over CP.
    Patch(rope.ROPE_UTILS, "apply_rotary_pos_emb", rope.make_rope_apply, rope.THD_ROPE_REASON, scan_importers=True),
    # 5-7. Checkpoint resume on installs without Apex or Transformer Engine.
    Patch(optimizer.DISTRIB_OPTIMIZER, "DistributedOptimizer.sharded_state_dict",
          optimizer.make_optimizer_state_before_load, optimizer.LOAD_REASON, **_TORCH_ADAM),
    Patch(optimizer.DISTRIB_OPTIMIZER, "DistributedOptimizer.load_parameter_state_from_dp_zero",
          optimizer.make_optimizer_state_before_load, optimizer.LOAD_REASON, **_TORCH_ADAM),
    Patch(optimizer.DISTRIB_OPTIMIZER, "DistributedOptimizer._set_main_param_and_optimizer_states",
          optimizer.make_param_state_setter_keeping_step, optimizer.STEP_REASON, **_TORCH_ADAM),
    Patch(optimizer.DISTRIB_OPTIMIZER, "DistributedOptimizer.load_state_dict",
          optimizer.make_load_state_dict_with_own_steps, optimizer.OWN_STEP_REASON, **_TORCH_ADAM),
)


def install(config: MTrainingConfig) -> None:
    """Apply every patch of ``PATCHES`` for ``config``. Idempotent: when already installed, only
    the config the patched functions read is updated (and logged if it changed)."""
    engine.install(config, PATCHES)
