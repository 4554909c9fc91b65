"""Which Transformer Engine versions MTraining runs with, checked once at start-up.

With ``--transformer-impl transformer_engine`` (Megatron's default) MTraining replaces TE's core
attention (``TEDotProductAttention``) and keeps everything else TE gives the layer: the fused
LayerNorm + linear layers, FP8 GEMMs and the fused RoPE kernel. The fused RoPE is where a TE
version matters to us: on one sequence Megatron hands TE the frequency rows that
``patches.install`` already sliced for this rank's striped tokens; on packed (THD) sequences the
patched ``apply_rotary_pos_emb`` gives each token the row of its position in its document and calls
TE's unpacked kernel, never TE's own per-CP-rank position logic (which assumes TE's zigzag split).

* ``TESTED`` is the version series this release is built, tested and benchmarked with (the GPU
  scripts install it: ``scripts/gpu_te.sh``); another 2.x release logs a warning once.
* Below ``MINIMUM`` (TE 1.x, whose fused RoPE and FP8 recipes megatron-core 0.19 no longer
  drives) is refused with an error that names the flag to change.
"""

from __future__ import annotations

import logging
import re
from typing import Optional, Tuple

logger = logging.getLogger(__name__)

__all__ = ["MINIMUM", "TESTED", "check_transformer_engine", "installed_version"]

MINIMUM = (2, 0)
TESTED = (2, 20)
_warned = set()  # warn once: versions already warned about (changes no result)


def installed_version() -> Optional[str]:
    """``transformer_engine.__version__``, or None when TE does not import."""
    try:
        import transformer_engine
    except Exception:  # not installed, or a broken install (missing core library): both "no TE"
        return None
    return getattr(transformer_engine, "__version__", None) or "unknown"


def _major_minor(version: str) -> Optional[Tuple[int, int]]:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def check_transformer_engine(version: Optional[str] = None, required: bool = False) -> Optional[str]:
    """Check the installed (or given) TE version for an MTraining run on TE layers.

    Returns the version, or None when TE is absent and not ``required``. Raises ValueError when
    TE is required but absent, or older than ``MINIMUM``; logs a warning once for a version
    outside the ``TESTED`` series."""
    if version is None:
        version = installed_version()
    if version is None:
        if required:
            raise ValueError("--transformer-impl transformer_engine needs Transformer Engine, which does not import "
                             "here; install transformer-engine[pytorch] "
                             f"{TESTED[0]}.{TESTED[1]}.x or pass --transformer-impl local")
        return None
    parsed = _major_minor(version)
    if parsed is None or parsed < MINIMUM:
        raise ValueError(f"Transformer Engine {version} is not supported by MTraining (needs >= "
                         f"{MINIMUM[0]}.{MINIMUM[1]}; tested with {TESTED[0]}.{TESTED[1]}.x): upgrade TE or pass "
                         "--transformer-impl local")
    if parsed[:2] != TESTED and version not in _warned:
        _warned.add(version)
        logger.warning("Transformer Engine %s: MTraining is tested with %d.%d.x; other 2.x releases are expected "
                       "to work but are not covered by its tests", version, *TESTED)
    return version
