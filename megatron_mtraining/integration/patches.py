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
original function. ``validate_megatron_config`` rejects unsupported settings at start-up.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import logging
import sys
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..config import MTrainingConfig
from ..layout import check_layout, local_positions
from . import packing

logger = logging.getLogger(__name__)

__all__ = ["PATCHES", "Patch", "install", "uninstall", "installed", "validate_megatron_config"]

# Batch entries that carry no sequence dimension to split (packed-sequence / hybrid-CP metadata).
_NON_SEQUENCE_KEYS = frozenset({"cu_seqlens", "cu_seqlens_padded", "max_seqlen", "local_cp_size",
                                "hybrid_cp_group"})
# Modules scanned for by-name imports of a patched function.
_SCAN_PREFIXES = ("megatron.",)
_SCAN_NAMES = ("megatron", "__main__")


@dataclasses.dataclass(frozen=True)
class Patch:
    """One module attribute to replace.

    replacement_factory(original) -> replacement. The replacement reads the installed config at
    call time (``_current_config()``), so re-installing with another config needs no re-patching.
    attribute may be dotted (``Class.method``): the last part is replaced on the object the rest names.
    optional: skip (with a DEBUG log) when the attribute does not exist in this Megatron version.
    unless_attr: skip when the module has this attribute (a newer version patched elsewhere).
    when: apply only if ``when(module)`` is true (a known problem of some installs only).
    scan_importers: also replace the attribute in every loaded ``megatron.*`` module whose
    namespace holds the same original object (imported by name).
    """

    module_name: str
    attribute: str
    replacement_factory: Callable[[Callable], Callable]
    reason: str
    optional: bool = False
    unless_attr: Optional[str] = None
    scan_importers: bool = False
    when: Optional[Callable[[Any], bool]] = None


# ------------------------------------------------------------------------------ installed state

_lock = threading.RLock()
_config: Optional[MTrainingConfig] = None
# (module, attribute, original, replacement), in the order applied.
_applied: List[Tuple[Any, str, Any, Any]] = []


def _current_config() -> MTrainingConfig:
    cfg = _config
    if cfg is None:  # only reachable if someone kept a reference to a replacement after uninstall
        raise RuntimeError("megatron_mtraining patches are not installed (call install(config))")
    return cfg


def installed() -> bool:
    """Whether ``install`` is in effect."""
    return _config is not None


# ------------------------------------------------------------------------------ helpers

@functools.lru_cache(maxsize=256)
def _positions(seq_len: int, layout: str, world_size: int, rank: int, block_size: int) -> torch.Tensor:
    return local_positions(seq_len, layout, world_size, rank, block_size)


def _group_size_rank(cp_group) -> Tuple[int, int]:
    """CP size and rank from ``cp_group`` (``group.size()`` / ``group.rank()``, as Megatron's RoPE
    slicer does), or from ``parallel_state`` when it is None (looked up at call time)."""
    if cp_group is None:
        from megatron.core import parallel_state

        return parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()
    return cp_group.size(), cp_group.rank()


def _process_group(cp_group):
    """The CP process group the batch split runs over (``cp_group``, else ``parallel_state``'s)."""
    if cp_group is not None:
        return cp_group
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized() and parallel_state.get_context_parallel_world_size() > 1:
        return parallel_state.get_context_parallel_group()
    return None


def _check_seq_len(seq_len: int, layout: str, cp_size: int, block_size: int, what: str) -> None:
    try:
        check_layout(seq_len, layout, cp_size, block_size)
    except ValueError as err:
        raise ValueError(f"MTraining context parallelism ({what}): {err}. Choose a sequence length "
                         f"that is a multiple of the layout unit, or another block_size / CP size.") from None


def _sequence_tensors(batch: Dict[str, Any]):
    """(key, tensor, seq_dim) of every batch entry Megatron splits along the sequence:
    ``attention_mask`` on dim 2, the others (``[b, s]``) on dim 1."""
    for key, val in batch.items():
        if val is None or key in _NON_SEQUENCE_KEYS or not isinstance(val, torch.Tensor):
            continue
        seq_dim = 2 if key == "attention_mask" else 1
        if val.dim() <= seq_dim:  # per-sample metadata without a sequence dimension
            continue
        yield key, val, seq_dim


# ------------------------------------------------------------------------------ replacements

def _split_in_layout(batch: Dict[str, Any], layout: str, cp_size: int, cp_rank: int, block_size: int,
                     what: str = "batch split") -> Dict[str, Any]:
    """Every sequence tensor of ``batch`` cut to this rank's tokens in ``layout`` (metadata kept)."""
    entries = list(_sequence_tensors(batch))
    for key, val, seq_dim in entries:
        _check_seq_len(val.shape[seq_dim], layout, cp_size, block_size, f"{what} of {key!r}")
    for key, val, seq_dim in entries:
        pos = _positions(val.shape[seq_dim], layout, cp_size, cp_rank, block_size)
        batch[key] = val.index_select(seq_dim, pos.to(val.device))
    return batch


def _make_batch_split(original: Callable) -> Callable:
    """The per-sequence CP batch split in the configured layout; first the documents of the full
    micro-batch for the layers (``packing.prepare_batch``)."""

    @functools.wraps(original)
    def get_batch_on_this_cp_rank_mtraining(batch, cp_group=None, *args, **kwargs):
        cfg = _current_config()
        packing.prepare_batch(batch, _process_group(cp_group))
        cp_size, cp_rank = _group_size_rank(cp_group)
        if cp_size <= 1:
            return original(batch, cp_group, *args, **kwargs)
        for key, val, seq_dim in _sequence_tensors(batch):
            _check_seq_len(val.shape[seq_dim], cfg.layout, cp_size, cfg.block_size, f"batch split of {key!r}")
        if cfg.layout == "zigzag":  # Megatron's own split is the zigzag layout: it gets the sequence
            # tensors only (megatron-core <= 0.16 would also cut metadata such as a THD cu_seqlens)
            sequences = {key: val for key, val, _ in _sequence_tensors(batch)}
            batch.update(original(sequences, cp_group, *args, **kwargs))
            return batch
        return _split_in_layout(batch, cfg.layout, cp_size, cp_rank, cfg.block_size)

    get_batch_on_this_cp_rank_mtraining.__mtraining_patch__ = True
    return get_batch_on_this_cp_rank_mtraining


def _make_thd_batch_split(original: Callable) -> Callable:
    """megatron-core >= 0.17: the per-document (THD) CP split, in the MTraining layout instead: the
    flat packed sequence is split like an unpacked one; cu_seqlens stay global."""

    @functools.wraps(original)
    def get_thd_batch_on_this_cp_rank_mtraining(batch, cp_group=None, *args, **kwargs):
        cfg = _current_config()
        packing.prepare_batch(batch, _process_group(cp_group))
        cp_size, cp_rank = _group_size_rank(cp_group)
        if cp_size <= 1:
            return original(batch, cp_group, *args, **kwargs)
        return _split_in_layout(batch, cfg.layout, cp_size, cp_rank, cfg.block_size, "THD batch split")

    get_thd_batch_on_this_cp_rank_mtraining.__mtraining_patch__ = True
    return get_thd_batch_on_this_cp_rank_mtraining


def _make_legacy_thd_batch_split(original: Callable) -> Callable:
    """megatron-core <= 0.16: ``get_thd_batch_on_this_cp_rank(batch, cu_seqlens, cu_seqlens_padded,
    max_seqlen, cp_size, cp_rank) -> (batch, packed_seq_params)`` in the MTraining layout."""

    @functools.wraps(original)
    def get_thd_batch_on_this_cp_rank_mtraining(batch, cu_seqlens, cu_seqlens_padded, max_seqlen,
                                                cp_size=None, cp_rank=None):
        cfg = _current_config()
        packing.clear_batch_documents()  # THD documents travel in packed_seq_params
        batch, packed_seq_params = original(batch, cu_seqlens, cu_seqlens_padded, max_seqlen, cp_size=1, cp_rank=0)
        if cp_size is None or cp_rank is None:
            size, rank = _group_size_rank(None)
            cp_size = size if cp_size is None else cp_size
            cp_rank = rank if cp_rank is None else cp_rank
        if cp_size > 1:
            _split_in_layout(batch, cfg.layout, cp_size, cp_rank, cfg.block_size, "THD batch split")
        return batch, packed_seq_params

    get_thd_batch_on_this_cp_rank_mtraining.__mtraining_patch__ = True
    return get_thd_batch_on_this_cp_rank_mtraining


def _make_pos_emb_slicer(original: Callable) -> Callable:
    """RoPE table rows of this CP rank's tokens, in the configured layout (device-agnostic)."""

    @functools.wraps(original)
    def get_pos_emb_on_this_cp_rank_mtraining(pos_emb, seq_dim, cp_group=None, *args, **kwargs):
        cfg = _current_config()
        cp_size, cp_rank = _group_size_rank(cp_group)
        if cp_size <= 1:
            return pos_emb
        seq_len = pos_emb.shape[seq_dim]
        _check_seq_len(seq_len, cfg.layout, cp_size, cfg.block_size, "RoPE table slicing")
        pos = _positions(seq_len, cfg.layout, cp_size, cp_rank, cfg.block_size)
        return pos_emb.index_select(seq_dim, pos.to(pos_emb.device))

    get_pos_emb_on_this_cp_rank_mtraining.__mtraining_patch__ = True
    return get_pos_emb_on_this_cp_rank_mtraining


def _make_rope_apply(original: Callable) -> Callable:
    """``apply_rotary_pos_emb``: THD inputs over CP > 1 take their rows by position within their
    document in the MTraining layout (``packing.thd_rope_freqs``), then the original's unpacked
    path (fused or not) applies them; every other call is the original's."""

    @functools.wraps(original)
    def apply_rotary_pos_emb_mtraining(t, freqs, config, cu_seqlens=None, *args, **kwargs):
        if cu_seqlens is None:
            return original(t, freqs, config, cu_seqlens, *args, **kwargs)
        cp_group = kwargs.get("cp_group", args[1] if len(args) > 1 else None)  # (mscale, cp_group, ...)
        cp_size, cp_rank = _group_size_rank(cp_group)
        if cp_size <= 1:
            return original(t, freqs, config, cu_seqlens, *args, **kwargs)
        cfg = _current_config()
        rows = packing.thd_rope_freqs(freqs, cu_seqlens, t.shape[0], cp_size, cp_rank, cfg.layout, cfg.block_size)
        return original(t.unsqueeze(1), rows, config, None, *args, **kwargs).squeeze(1)

    apply_rotary_pos_emb_mtraining.__mtraining_patch__ = True
    return apply_rotary_pos_emb_mtraining


_ROPE_UTILS = "megatron.core.models.common.embeddings.rope_utils"
_BATCH_REASON = ("per-sequence CP batch split: tokens/labels/loss_mask/position_ids (dim 1) and "
                 "attention_mask (dim 2) follow the MTraining layout instead of Megatron's zigzag")
_ROPE_REASON = "RoPE CP slicing: each rank takes the RoPE rows of its own tokens in the MTraining layout"
_THD_REASON = ("THD (packed) CP split: the flat packed sequence follows the MTraining layout instead of "
               "Transformer Engine's per-document zigzag; cu_seqlens stay global")
_THD_ROPE_REASON = ("THD RoPE over CP: each token takes the row of its position in its document, in the "
                    "MTraining layout (other calls unchanged)")

# Checkpoint resume without Apex or Transformer Engine. megatron-core's DistributedOptimizer then
# holds torch's AdamW, whose per-parameter state (exp_avg, exp_avg_sq and a 0-dim ``step`` tensor)
# appears at the first step and whose ``step`` Megatron stores in the param_groups of its
# ``state_dict()``. Three defects of megatron-core 0.16 to 0.19 (checked in 0.16.1 and the 0.19.1 of
# Megatron-LM core_r0.19.0; line numbers are 0.19.1's distrib_optimizer.py) break a resume there;
# each patch below applies only where ``HAVE_APEX_OR_TE`` is False (Apex's / TE's FusedAdam keep
# ``step`` in the param groups and take other paths).


def _make_optimizer_state_before_load(original: Callable) -> Callable:
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


def _make_param_state_setter_keeping_step(original: Callable) -> Callable:
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


def _make_load_state_dict_with_own_steps(original: Callable) -> Callable:
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


def _torch_adam_distributed_optimizer(module) -> bool:
    return not getattr(module, "HAVE_APEX_OR_TE", True)


_DISTRIB_OPTIMIZER = "megatron.core.optimizer.distrib_optimizer"
_LOAD_REASON = ("resume without Apex/TE: an unstepped torch-Adam DistributedOptimizer gets its states "
                "before a checkpoint is loaded into it")
_STEP_REASON = ("resume without Apex/TE: the parameter-state load keeps the optimizer step that "
                "load_state_dict took from the checkpoint")
_OWN_STEP_REASON = ("resume without Apex/TE: every parameter's torch-Adam state gets its own step tensor "
                    "(one shared tensor is incremented once per parameter)")

PATCHES: Tuple[Patch, ...] = (
    # megatron-core >= 0.17-ish: the dispatcher calls this module global at call time.
    Patch("megatron.core.utils", "_get_batch_on_this_cp_rank_per_sequence_balancing", _make_batch_split,
          _BATCH_REASON, optional=True),
    # megatron-core <= 0.16: the public function does the zigzag split itself.
    Patch("megatron.core.utils", "get_batch_on_this_cp_rank", _make_batch_split, _BATCH_REASON,
          unless_attr="_get_batch_on_this_cp_rank_per_sequence_balancing", scan_importers=True),
    Patch(_ROPE_UTILS, "get_pos_emb_on_this_cp_rank", _make_pos_emb_slicer, _ROPE_REASON, scan_importers=True),
    Patch("megatron.core.models.common.embeddings.rotary_pos_embedding", "get_pos_emb_on_this_cp_rank",
          _make_pos_emb_slicer, _ROPE_REASON + " (imported by name)"),
    Patch("megatron.core.models.common.embeddings.yarn_rotary_pos_embedding", "get_pos_emb_on_this_cp_rank",
          _make_pos_emb_slicer, _ROPE_REASON + " (imported by name)", optional=True),
    # Packed THD batches (--sft, --dataloader-inter-document-masking; packing.py).
    Patch("megatron.core.utils", "_get_batch_on_this_cp_rank_per_document_balancing", _make_thd_batch_split,
          _THD_REASON, optional=True),
    Patch("megatron.core.utils", "get_thd_batch_on_this_cp_rank", _make_legacy_thd_batch_split, _THD_REASON,
          optional=True, unless_attr="_get_batch_on_this_cp_rank_per_document_balancing", scan_importers=True),
    Patch(_ROPE_UTILS, "apply_rotary_pos_emb", _make_rope_apply, _THD_ROPE_REASON, scan_importers=True),
    # Checkpoint resume on installs without Apex or Transformer Engine (the GPU machines' image).
    Patch(_DISTRIB_OPTIMIZER, "DistributedOptimizer.sharded_state_dict", _make_optimizer_state_before_load,
          _LOAD_REASON, optional=True, when=_torch_adam_distributed_optimizer),
    Patch(_DISTRIB_OPTIMIZER, "DistributedOptimizer.load_parameter_state_from_dp_zero",
          _make_optimizer_state_before_load, _LOAD_REASON, optional=True, when=_torch_adam_distributed_optimizer),
    Patch(_DISTRIB_OPTIMIZER, "DistributedOptimizer._set_main_param_and_optimizer_states",
          _make_param_state_setter_keeping_step, _STEP_REASON, optional=True,
          when=_torch_adam_distributed_optimizer),
    Patch(_DISTRIB_OPTIMIZER, "DistributedOptimizer.load_state_dict", _make_load_state_dict_with_own_steps,
          _OWN_STEP_REASON, optional=True, when=_torch_adam_distributed_optimizer),
)


# ------------------------------------------------------------------------------ install / uninstall

def _import_optional(name: str, optional: bool):
    try:
        return importlib.import_module(name)
    except ImportError:
        if optional:
            return None
        raise


def _importers(original: Any, skip: Any) -> List[Any]:
    """Loaded megatron modules (other than ``skip``) whose namespace holds ``original``."""
    found = []
    for name, mod in list(sys.modules.items()):
        if mod is None or mod is skip or not (name in _SCAN_NAMES or name.startswith(_SCAN_PREFIXES)):
            continue
        found.append(mod)
    return [m for m in found if any(v is original for v in list(vars(m).values()))]


def _replace(module, attribute: str, original, replacement, reason: str, done: Dict[Tuple[int, str], bool]):
    key = (id(module), attribute)
    if key in done:
        return
    done[key] = True
    setattr(module, attribute, replacement)
    _applied.append((module, attribute, original, replacement))
    logger.info("megatron_mtraining: replaced %s.%s (%s)", module.__name__, attribute, reason)


def install(config: MTrainingConfig) -> None:
    """Apply every patch of ``PATCHES`` for ``config``. Idempotent: when already installed, only
    the config the patched functions read is updated (and logged if it changed)."""
    global _config
    if not isinstance(config, MTrainingConfig):
        raise TypeError(f"install() needs an MTrainingConfig, got {type(config).__name__}")
    with _lock:
        if _config is not None:
            if config != _config:
                logger.info("megatron_mtraining: patches already installed; config updated to layout=%s "
                            "block_size=%d", config.layout, config.block_size)
            _config = config
            return
        done: Dict[Tuple[int, str], bool] = {}
        try:
            for patch in PATCHES:
                module = _import_optional(patch.module_name, patch.optional)
                if module is None or (patch.unless_attr and hasattr(module, patch.unless_attr)):
                    continue
                if patch.when is not None and not patch.when(module):
                    continue
                *owner_path, attribute = patch.attribute.split(".")
                owner = functools.reduce(lambda obj, name: getattr(obj, name, None), owner_path, module)
                if owner is None or not hasattr(owner, attribute):
                    if patch.optional:
                        logger.debug("megatron_mtraining: %s.%s not present, patch skipped",
                                     patch.module_name, patch.attribute)
                        continue
                    raise RuntimeError(f"megatron_mtraining: cannot patch {patch.module_name}.{patch.attribute}: "
                                       f"not found in this megatron-core version")
                original = getattr(owner, attribute)
                if getattr(original, "__mtraining_patch__", False):
                    continue  # already replaced through another entry (same function object)
                replacement = patch.replacement_factory(original)
                _replace(owner, attribute, original, replacement, patch.reason, done)
                if patch.scan_importers:
                    for other in _importers(original, module):
                        for attr, val in list(vars(other).items()):
                            if val is original:
                                _replace(other, attr, original, replacement,
                                         f"{patch.reason}; imported by name from {patch.module_name}", done)
        except BaseException:
            _restore()
            raise
        _config = config


def _restore() -> None:
    while _applied:
        module, attribute, original, replacement = _applied.pop()
        current = getattr(module, attribute, None)
        if current is not replacement:
            logger.warning("megatron_mtraining: %s.%s was changed by someone else after install; "
                           "restoring the original anyway", module.__name__, attribute)
        setattr(module, attribute, original)
        logger.info("megatron_mtraining: restored %s.%s", module.__name__, attribute)


def uninstall() -> None:
    """Restore every attribute ``install`` replaced (the exact original objects). Safe to repeat."""
    global _config
    with _lock:
        _restore()
        _config = None


# ------------------------------------------------------------------------------ validation

def validate_megatron_config(transformer_config, mtraining_config: MTrainingConfig,
                             seq_length: Optional[int] = None, cp_size: Optional[int] = None) -> None:
    """Start-up check of a Megatron ``TransformerConfig`` for MTraining; one ValueError listing
    every problem. ``cp_size`` defaults to ``transformer_config.context_parallel_size``;
    the sequence-length check runs when ``seq_length`` is given."""
    problems: List[str] = []
    if cp_size is None:
        cp_size = int(getattr(transformer_config, "context_parallel_size", 1) or 1)
    layout, block = mtraining_config.layout, mtraining_config.block_size
    if seq_length is not None:
        unit = block * cp_size * (2 if layout == "zigzag" else 1)
        if seq_length % unit:
            what = "block_size * CP" if layout == "striped" else "2 * CP * block_size"
            problems.append(f"seq_length {seq_length} is not divisible by {what} = {unit} "
                            f"({layout} layout, block_size {block}, CP {cp_size})")
    dropout = getattr(transformer_config, "attention_dropout", 0.0)
    if dropout:
        problems.append(f"attention_dropout must be 0 (--attention-dropout 0: MTraining sparse attention has no "
                        f"dropout; Megatron's default is 0.1), got {dropout}")
    # Parsed Megatron arguments only (a TransformerConfig has none of these).
    if getattr(transformer_config, "hybrid_context_parallel", False):
        problems.append("--hybrid-context-parallel (hybrid_context_parallel) is not supported: it splits each batch "
                        "over CP ranks its own way; MTraining's ring needs the striped or zigzag split")
    # Packed documents (packing.py): THD batches (--sft, --dataloader-inter-document-masking) work with
    # any CP and pipeline size; the EOD / position-id path of --reset-attention-mask needs the whole
    # micro-batch in the CP batch split of every stage, and one set of documents per micro-batch.
    if getattr(transformer_config, "reset_attention_mask", False):
        thd = [flag for field, flag in (("sft", "--sft"),
                                        ("dataloader_inter_document_masking", "--dataloader-inter-document-masking"))
               if getattr(transformer_config, field, False)]
        pp = int(getattr(transformer_config, "pipeline_model_parallel_size", 1) or 1)
        mbs = int(getattr(transformer_config, "micro_batch_size", 1) or 1)
        if pp > 1 and not thd:
            problems.append(f"--reset-attention-mask with pipeline parallelism (pipeline_model_parallel_size={pp}) is "
                            "not supported: Megatron hands the intermediate pipeline stages no batch, so they cannot "
                            "see the document boundaries; use --dataloader-inter-document-masking (its cu_seqlens "
                            "reach every stage) or --pipeline-model-parallel-size 1")
        if mbs > 1 and not thd:
            problems.append(f"--reset-attention-mask with --micro-batch-size {mbs} is not supported: MTraining's "
                            "documents (cu_seqlens) are shared by the micro-batch and the samples of a micro-batch "
                            "have different document boundaries; use --micro-batch-size 1, or "
                            "--dataloader-inter-document-masking (one packed sequence per micro-batch)")
    hcp = getattr(transformer_config, "hierarchical_context_parallel_sizes", None)
    if hcp:
        problems.append(f"hierarchical context parallelism (hierarchical_context_parallel_sizes={hcp}) is not "
                        f"supported; use MTraining's inner_ring_size for a two-level ring")
    mtp = getattr(transformer_config, "mtp_num_layers", None)
    if mtp and cp_size > 1:
        problems.append(f"multi-token prediction (mtp_num_layers={mtp}) with context parallelism (CP {cp_size}) "
                        f"is not supported yet")
    if hasattr(transformer_config, "cp_comm_type"):
        comm = transformer_config.cp_comm_type
        comms = comm if isinstance(comm, (list, tuple)) else [comm]
        bad = [c for c in comms if c not in (None, "p2p")]
        if bad:
            problems.append(f"cp_comm_type={comm!r}: Transformer Engine's context-parallel options are not used "
                            f"by MTraining attention (it runs its own ring); leave cp_comm_type unset or 'p2p'")
    if problems:
        raise ValueError("MTraining cannot run with this Megatron configuration:\n  - " + "\n  - ".join(problems))
