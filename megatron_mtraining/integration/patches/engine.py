"""The patch engine: a ``Patch`` names one Megatron attribute to replace; ``install(config, table)``
applies a table of them (idempotent, reversible, every replacement logged once at INFO),
``uninstall()`` restores the exact original objects, ``installed()`` tells, and
``current_config()`` is the config the replacements read at call time; ``check_placement``
refuses a layer config that places tokens otherwise. ``scan_importers`` patches also reach
every loaded ``megatron.*`` module that imported the function by name.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import sys
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ...config import MTrainingConfig

logger = logging.getLogger(__name__)

__all__ = ["PLACEMENT_FIELDS", "Patch", "check_placement", "current_config", "install", "installed", "uninstall"]

# The settings that decide which tokens a context-parallel rank holds and at which positions: the
# batch split and the RoPE slicing read them from the installed config, the attention from its own.
PLACEMENT_FIELDS = ("layout", "block_size")

# Modules scanned for by-name imports of a patched function.
_SCAN_PREFIXES = ("megatron.",)
_SCAN_NAMES = ("megatron", "__main__")


@dataclasses.dataclass(frozen=True)
class Patch:
    """One module attribute to replace.

    replacement_factory(original) -> replacement. The replacement reads the installed config at
    call time (``current_config()``), so re-installing with another config needs no re-patching.
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

# Megatron's API: the installed patches replace Megatron's own functions (batch split, RoPE), which
# take no argument of ours; the config they read and what to undo live here.
_lock = threading.RLock()
_config: Optional[MTrainingConfig] = None
# (module, attribute, original, replacement), in the order applied.
_applied: List[Tuple[Any, str, Any, Any]] = []


def current_config() -> MTrainingConfig:
    """The config of the installed patches (their replacements read it at call time)."""
    cfg = _config
    if cfg is None:  # only reachable if someone kept a reference to a replacement after uninstall
        raise RuntimeError("megatron_mtraining patches are not installed (call install(config))")
    return cfg


def installed() -> bool:
    """Whether ``install`` is in effect."""
    return _config is not None


def check_placement(config: MTrainingConfig, where: str) -> None:
    """ValueError naming both values when the installed patches split batches and slice RoPE with
    another layout or block size (``PLACEMENT_FIELDS``) than ``config``, the one ``where`` (the
    attention) computes with: its rank would hold other tokens, at other positions, than it
    assumes. Nothing to compare when the patches are not installed (the caller shards the tokens)."""
    cfg = _config
    if cfg is None or cfg is config:
        return
    differ = [(name, getattr(cfg, name), getattr(config, name)) for name in PLACEMENT_FIELDS
              if getattr(cfg, name) != getattr(config, name)]
    if differ:
        listed = "; ".join(f"{name} {theirs!r} in the config given to install() (batch split, RoPE), {mine!r} in "
                           f"{where}" for name, theirs, mine in differ)
        raise ValueError(f"MTraining: two configs disagree on which tokens a context-parallel rank holds: {listed}. "
                         "Give install() and get_gpt_layer_spec() the same MTrainingConfig (the launcher and "
                         "enable_mtraining do).")


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



def install(config: MTrainingConfig, table: Sequence[Patch]) -> None:
    """Apply every patch of ``table`` for ``config``. Idempotent: when already installed, only
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
            for patch in table:
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

