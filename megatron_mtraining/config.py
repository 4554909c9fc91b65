"""MTrainingConfig: every knob of the plugin, validated once at construction; ``Settings``: how it
runs (kernels, agreement, timeout, checks); and the one place that reads the environment.

The environment is read once, when this module is imported (``ENVIRONMENT``), and only here; every
other module takes its settings from the config or ``Settings`` it is given (docs/design.md,
"Environment variables", has the table of variables and their flags).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import types
from typing import Callable, Mapping, Optional

LAYOUTS = ("striped", "zigzag")
INDEX_BUILDERS = ("vs", "dense", "fixed", "moba", "xattn")
BLOCK_SIZES = (64, 128)
VERTICAL_FLOOR = 256  # default min_vertical (capped by max_vertical): see MTrainingConfig
KERNEL_CHOICES = ("auto", "triton", "hopper")
AGREEMENT_MODES = ("auto", "eager", "deferred")
RESUME_POLICIES = ("warn", "error")

# Every environment variable the plugin reads -> the flag that takes precedence over it (None: no flag).
ENVIRONMENT_VARIABLES = {
    "MTRAINING_FORWARD_KERNEL": "--mtraining-forward-kernel",
    "MTRAINING_BACKWARD_KERNEL": "--mtraining-backward-kernel",
    "MTRAINING_RING_AGREEMENT": "--mtraining-ring-agreement",
    "MTRAINING_RING_TIMEOUT_S": "--mtraining-ring-timeout-s",
    "MTRAINING_VALIDATE": "--mtraining-validate",
    "MTRAINING_RESUME_CHANGES": "--mtraining-resume-changes",
    "LOCAL_WORLD_SIZE": "--mtraining-inner-ring-size",
    "GPUS_PER_NODE": "--mtraining-inner-ring-size",
    "TRITON_INTERPRET": None,  # Triton's own switch (its CPU interpreter), read by Triton too
}
# Read once, at import (start-up): the variables above that are set. Immutable.
ENVIRONMENT: Mapping[str, str] = types.MappingProxyType(
    {name: os.environ[name] for name in ENVIRONMENT_VARIABLES if name in os.environ})
# Settings field -> its environment variable.
_SETTINGS_ENV = {"forward_kernel": "MTRAINING_FORWARD_KERNEL", "backward_kernel": "MTRAINING_BACKWARD_KERNEL",
                 "ring_agreement": "MTRAINING_RING_AGREEMENT", "ring_timeout_s": "MTRAINING_RING_TIMEOUT_S",
                 "validate": "MTRAINING_VALIDATE"}


def interpreting(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether Triton runs its CPU interpreter (``TRITON_INTERPRET=1`` at start-up)."""
    return (ENVIRONMENT if environ is None else environ).get("TRITON_INTERPRET", "0") == "1"


def resume_policy(environ: Optional[Mapping[str, str]] = None) -> str:
    """``MTRAINING_RESUME_CHANGES`` ("warn", the default, or "error"): the default of the launcher's
    ``--mtraining-resume-changes``."""
    value = (ENVIRONMENT if environ is None else environ).get("MTRAINING_RESUME_CHANGES", "") or "warn"
    if value not in RESUME_POLICIES:
        raise ValueError(f"MTRAINING_RESUME_CHANGES must be one of {RESUME_POLICIES}, got {value!r}")
    return value


def ranks_per_node(environ: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """Ranks per node from the launcher: ``LOCAL_WORLD_SIZE`` (torchrun), else ``GPUS_PER_NODE``,
    else None: the default of ``--mtraining-inner-ring-size``."""
    environ = ENVIRONMENT if environ is None else environ
    for var in ("LOCAL_WORLD_SIZE", "GPUS_PER_NODE"):
        if environ.get(var):
            try:
                return int(environ[var])
            except ValueError:
                raise ValueError(f"MTrainingConfig: {var}={environ[var]!r} is not an integer "
                                 "(sets the default of --mtraining-inner-ring-size)") from None
    return None


@dataclasses.dataclass(frozen=True)
class Settings:
    """How the attention runs, not what it computes (names follow the ``--mtraining-*`` flags).

    forward_kernel / backward_kernel: on the "triton" backend, "auto" (the Hopper kernels where
        they cover a call, else the Triton ones), "triton", or "hopper" (an error where they
        cannot run the call); ``kernels/dispatch.py``.
    ring_agreement: when the CP ranks' agreement verdict is read: "auto" (eager on CPU/gloo or
        with ``validate``, deferred on GPUs with NCCL), "eager" or "deferred";
        ``collective/agreement.py``.
    ring_timeout_s: seconds a ring transfer or agreement may wait; None: the process group's
        own timeout (on NCCL an explicit one makes every wait block the host: debugging only).
    validate: check the index's and cu_seqlens' values on GPU tensors too (one device
        synchronisation per call; on the CPU they are always checked).
    kernel_launch: the Triton kernels' launch settings and tile options per kernel family, "fwd"
        or "bwd", instead of ``kernels/triton_common.py``'s defaults, e.g. ``{"bwd": {"num_warps":
        8, "num_stages": 3}}`` (stored as sorted pairs); empty in training (no flag, no variable):
        ``benchmarks/kernel.py --launch`` compares settings with it.
    ring_arrival_hook: None in training (no flag, no variable): called as ``hook(ring, received)``
        when a ring transfer is posted, it may return a CUDA event the data is taken to arrive at
        (``ring/comm.py``); the ring benchmark's emulated slow links (``benchmarks/slow_link.py``).
    """

    forward_kernel: str = "auto"
    backward_kernel: str = "auto"
    ring_agreement: str = "auto"
    ring_timeout_s: Optional[float] = None
    validate: bool = False
    kernel_launch: tuple = dataclasses.field(default=(), metadata={"flag": False})
    ring_arrival_hook: Optional[Callable] = dataclasses.field(default=None, metadata={"flag": False})

    def __post_init__(self):
        for name in ("forward_kernel", "backward_kernel"):
            if getattr(self, name) not in KERNEL_CHOICES:
                raise ValueError(f"Settings: {name} must be one of {KERNEL_CHOICES}, got {getattr(self, name)!r}")
        if self.ring_agreement not in AGREEMENT_MODES:
            raise ValueError(f"Settings: ring_agreement must be one of {AGREEMENT_MODES}, got {self.ring_agreement!r}")
        if self.ring_timeout_s is not None and not (isinstance(self.ring_timeout_s, (int, float))
                                                    and not isinstance(self.ring_timeout_s, bool)
                                                    and self.ring_timeout_s > 0):
            raise ValueError(f"Settings: ring_timeout_s must be None or a positive number of seconds, "
                             f"got {self.ring_timeout_s!r}")
        if not isinstance(self.validate, bool):
            raise ValueError(f"Settings: validate must be True or False, got {self.validate!r}")
        object.__setattr__(self, "kernel_launch", _launch_pairs(self.kernel_launch))  # frozen: normalise in place
        if self.ring_arrival_hook is not None and not callable(self.ring_arrival_hook):
            raise ValueError(f"Settings: ring_arrival_hook must be None or callable, got {self.ring_arrival_hook!r}")

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None, **fields) -> "Settings":
        """The settings the environment gives (``environ``, default: ``ENVIRONMENT``, read at
        start-up); ``fields`` (not None) take precedence. Errors name the variable."""
        environ = ENVIRONMENT if environ is None else environ
        values = {}
        for name, var in _SETTINGS_ENV.items():
            if fields.get(name) is not None or not environ.get(var):
                continue
            raw = environ[var]
            if name == "validate":
                if raw not in ("0", "1"):
                    raise ValueError(f"{var} must be 0 or 1, got {raw!r}")
                values[name] = raw == "1"
            elif name == "ring_timeout_s":
                try:
                    values[name] = float(raw)
                except ValueError:
                    values[name] = -1.0
                if not values[name] > 0:
                    raise ValueError(f"{var} must be a positive number of seconds, got {raw!r}")
            else:
                allowed = KERNEL_CHOICES if name.endswith("kernel") else AGREEMENT_MODES
                if raw not in allowed:
                    raise ValueError(f"{var} must be one of {allowed}, got {raw!r}")
                values[name] = raw
        values.update({name: value for name, value in fields.items() if value is not None})
        return cls(**values)


LAUNCH_KEYS = ("num_warps", "num_stages", "BLOCK_M", "BLOCK_N", "BLOCK_COL", "MASK_EVERY_TILE", "COLUMN_PROGRAMS")


def _launch_pairs(launch) -> tuple:
    """``Settings.kernel_launch`` as sorted ``(family, ((key, value), ...))`` pairs (hashable),
    from a mapping or such pairs; a ValueError names an unknown family or key."""
    try:
        families = dict(launch)
        pairs = tuple(sorted((family, tuple(sorted(dict(options).items()))) for family, options in families.items()))
    except (TypeError, ValueError):
        raise ValueError(f"Settings: kernel_launch must map 'fwd' / 'bwd' to {{setting: value}}, "
                         f"got {launch!r}") from None
    for family, options in pairs:
        if family not in ("fwd", "bwd"):
            raise ValueError(f"Settings: kernel_launch families are 'fwd' and 'bwd', got {family!r}")
        unknown = [key for key, _ in options if key not in LAUNCH_KEYS]
        if unknown:
            raise ValueError(f"Settings: kernel_launch[{family!r}] has unknown settings {unknown}; "
                             f"known: {LAUNCH_KEYS}")
    return pairs


@functools.lru_cache(maxsize=None)
def environment_settings() -> Settings:
    """``Settings.from_env()`` of ``ENVIRONMENT`` (immutable, so computed once): the settings of a
    call or config given none."""
    return Settings.from_env()


def settings_or_default(settings: Optional[Settings], where: str) -> Settings:
    """``settings``, or the environment's where None; a clear error for anything else."""
    if settings is None:
        return environment_settings()
    if not isinstance(settings, Settings):
        raise ValueError(f"{where}: settings must be a megatron_mtraining.config.Settings or None, "
                         f"got {type(settings).__name__}")
    return settings


@dataclasses.dataclass(frozen=True)
class MTrainingConfig:
    """Settings of MTraining sparse attention (names follow the ``--mtraining-*`` flags).

    block_size: granularity of slash blocks and of the striped layout (64 or 128).
    top_p: attention-mass share the approximator's vertical and slash budgets must cover.
    last_q: number of final queries the approximator scores against all keys.
    max_vertical / max_slash: index capacity (fixed shapes); budgets are clamped to it.
    min_vertical / min_slash: lower clamps of the per-head budgets. The vertical floor defaults
        (None) to min(VERTICAL_FLOOR = 256, max_vertical): top-p alone lets the local columns of
        the many rows that do not retrieve crowd out a retrieval head's needle columns, which
        then get no gradient (quality benchmark, 32K: retrieval 0.48 with min_vertical 0, 0.95
        with 256; dense 0.73). At long context 256 columns cost little density; 0 gives the
        paper's pure top-p budget.
    sink_tokens: leading columns always kept (attention sinks); with packed documents also the
        first ``sink_tokens`` columns of every document the approximator scores.
    max_documents: with packed documents (``cu_seqlens``), how many documents the approximator
        scores (each by its own last ``last_q`` queries): a fixed capacity, so shapes stay fixed.
        The longest documents longer than one block get the slots (ties: the later one first);
        see ``approx.approximate_index``.
    local_window: slash offsets 0..local_window-1 always kept (the diagonal is offset 0).
    layout: token layout across context-parallel ranks, "striped" (balanced) or "zigzag".
    inner_ring_size: ranks per inner (intra-node) ring; None runs one flat ring.
    index: index builder, "vs" (approximated), "dense" (all blocks), "fixed", or a block-sparse
        ``BlockIndex``: "moba" (MoBA's gate, ``block_approx.moba_index``) or "xattn" (XAttention's
        antidiagonal scores, ``block_approx.xattn_index``).
    moba_block_size / moba_top_k: MoBA's key blocks (tokens, a multiple of ``block_size``) and how
        many of them each query block attends, its own included (the paper's 4096 and 12).
    xattn_stride / xattn_threshold / xattn_max_blocks: XAttention's antidiagonal stride (a power
        of two dividing ``block_size``), the share of each query block's score mass its key blocks
        must reach (the paper's 16 and 0.9; its blocks are ``block_size``, 128 in the paper), and
        the index capacity (key blocks per query block, its own included; fixed shapes).
    dense_max_seq_length: sequences of at most this many tokens (the whole sequence, over all CP
        ranks) get the dense index, whatever ``index`` says; 0 (default) never. For short-to-long
        schedules that train from scratch: sparse attention from the first step kept a small model
        from ever forming its retrieval circuit (packed quality benchmark, 1-3 documents per
        sequence, first phase at 512 tokens: retrieval 0.27 against dense 0.62; the recipes that
        start at 1-3 blocks, where the index is dense anyway, learn it). MTraining's paper
        continues pretrained models, where this is not needed.
    deterministic: backward without atomics, bit-identical from run to run. The sparse kernels'
        backward always is (split reductions, no atomics). False lets layers with a dense index
        (``index="dense"``, or the dense layers) run the dense kernels (cuDNN / flash), whose
        backward is not deterministic; see ``MTrainingAttention.uses_dense_kernels``.
    settings: how the attention runs (``Settings``: kernels, agreement, timeout, value checks);
        default: the environment's (``environment_settings``).
    """

    block_size: int = 64
    top_p: float = 0.9
    last_q: int = 64
    max_vertical: int = 1024
    max_slash: int = 256
    min_vertical: Optional[int] = None  # None: min(VERTICAL_FLOOR, max_vertical)
    min_slash: int = 1
    sink_tokens: int = 4
    max_documents: int = 16
    local_window: int = 1
    layout: str = "striped"
    inner_ring_size: Optional[int] = None
    index: str = "vs"
    moba_block_size: int = 4096
    moba_top_k: int = 12
    xattn_stride: int = 16
    xattn_threshold: float = 0.9
    xattn_max_blocks: int = 1024
    dense_max_seq_length: int = 0
    deterministic: bool = True
    settings: Settings = dataclasses.field(default_factory=environment_settings)

    def __post_init__(self):
        def fail(msg):
            raise ValueError(f"MTrainingConfig: {msg}")

        if not isinstance(self.settings, Settings):
            fail(f"settings must be a Settings, got {type(self.settings).__name__}")

        if self.min_vertical is None:  # frozen dataclass: resolve the default in place
            object.__setattr__(self, "min_vertical", min(VERTICAL_FLOOR, max(0, int(self.max_vertical))))
        if self.block_size not in BLOCK_SIZES:
            fail(f"block_size must be one of {BLOCK_SIZES}, got {self.block_size}")
        if not (0.0 < float(self.top_p) <= 1.0):
            fail(f"top_p must be in (0, 1], got {self.top_p}")
        if int(self.last_q) <= 0:
            fail(f"last_q must be positive, got {self.last_q}")
        for name in ("max_vertical", "max_slash", "min_vertical", "min_slash", "sink_tokens", "local_window",
                     "dense_max_seq_length"):
            if int(getattr(self, name)) < 0:
                fail(f"{name} must be >= 0, got {getattr(self, name)}")
        if int(self.max_documents) < 1:
            fail(f"max_documents must be >= 1, got {self.max_documents}")
        if self.max_slash < 1:
            fail("max_slash must be >= 1: the diagonal block (offset 0) is always selected")
        if self.max_vertical < self.min_vertical:
            fail(f"max_vertical ({self.max_vertical}) is below min_vertical ({self.min_vertical}); "
                 "lower min_vertical (--mtraining-min-vertical) with it")
        if self.max_slash < self.min_slash:
            fail(f"max_slash ({self.max_slash}) is below min_slash ({self.min_slash})")
        if self.local_window > self.max_slash:
            fail(f"local_window ({self.local_window}) exceeds max_slash ({self.max_slash})")
        if self.sink_tokens > self.max_vertical:
            fail(f"sink_tokens ({self.sink_tokens}) exceeds max_vertical ({self.max_vertical})")
        if self.layout not in LAYOUTS:
            fail(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.inner_ring_size is not None and int(self.inner_ring_size) < 1:
            fail(f"inner_ring_size must be None or >= 1, got {self.inner_ring_size}")
        if self.index not in INDEX_BUILDERS:
            fail(f"index must be one of {INDEX_BUILDERS}, got {self.index!r}")
        if int(self.moba_block_size) < 1 or self.moba_block_size % self.block_size:
            fail(f"moba_block_size must be a positive multiple of block_size ({self.block_size}), "
                 f"got {self.moba_block_size}")
        if int(self.moba_top_k) < 1:
            fail(f"moba_top_k must be >= 1 (the query's own block), got {self.moba_top_k}")
        stride = int(self.xattn_stride)
        if stride < 1 or stride & (stride - 1) or self.block_size % stride:
            fail(f"xattn_stride must be a power of two dividing block_size ({self.block_size}), "
                 f"got {self.xattn_stride}")
        if not (0.0 < float(self.xattn_threshold) <= 1.0):
            fail(f"xattn_threshold must be in (0, 1], got {self.xattn_threshold}")
        if int(self.xattn_max_blocks) < 1:
            fail(f"xattn_max_blocks must be >= 1 (the query's own block), got {self.xattn_max_blocks}")

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None, **fields) -> "MTrainingConfig":
        """The config with ``fields``, the rest from the environment (``environ``, default:
        ``ENVIRONMENT``, read at start-up): the ``Settings`` fields, and ``inner_ring_size`` from
        ``LOCAL_WORLD_SIZE`` / ``GPUS_PER_NODE``. Fields given (not None) take precedence."""
        names = {f.name for f in dataclasses.fields(Settings)}
        settings = Settings.from_env(environ, **{k: fields.pop(k) for k in list(fields) if k in names})
        if fields.get("inner_ring_size") is None:
            fields["inner_ring_size"] = ranks_per_node(environ)
        return cls(settings=settings, **fields)

    @classmethod
    def from_args(cls, args, environ: Optional[Mapping[str, str]] = None) -> "MTrainingConfig":
        """Build the config from a parsed Megatron namespace (``args.mtraining_<field>``, the
        ``Settings`` fields included). Missing or None attributes come from the environment
        (``from_env``: the ``Settings`` fields; ``inner_ring_size`` from ``LOCAL_WORLD_SIZE``,
        else ``GPUS_PER_NODE``, else None: one flat ring), else keep the field defaults.
        Validation errors are ValueErrors naming the flag."""
        names = [f.name for f in dataclasses.fields(cls) if f.name != "settings"]
        names += [f.name for f in dataclasses.fields(Settings) if f.metadata.get("flag", True)]
        values = {name: getattr(args, "mtraining_" + name, None) for name in names}
        values = {name: value for name, value in values.items() if value is not None}
        try:
            return cls.from_env(environ, **values)
        except ValueError as e:
            flags = [f"--mtraining-{name.replace('_', '-')}" for name in names if re.search(rf"\b{name}\b", str(e))]
            raise ValueError(f"{e} (check {', '.join(flags)})" if flags else str(e)) from None
