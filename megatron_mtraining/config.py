"""MTrainingConfig: every knob of the plugin, validated once at construction."""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Optional

LAYOUTS = ("striped", "zigzag")
INDEX_BUILDERS = ("vs", "dense", "fixed")
BLOCK_SIZES = (64, 128)
VERTICAL_FLOOR = 256  # default min_vertical (capped by max_vertical): see MTrainingConfig


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
    index: index builder, "vs" (approximated), "dense" (all blocks) or "fixed".
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
    dense_max_seq_length: int = 0
    deterministic: bool = True

    def __post_init__(self):
        def fail(msg):
            raise ValueError(f"MTrainingConfig: {msg}")

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

    @classmethod
    def from_args(cls, args) -> "MTrainingConfig":
        """Build the config from a parsed Megatron namespace (``args.mtraining_<field>``).

        Missing or None attributes keep the field defaults. A None ``inner_ring_size`` is
        taken from the launcher: ``LOCAL_WORLD_SIZE`` (torchrun), else ``GPUS_PER_NODE``,
        else None (one flat ring). Validation errors are ValueErrors naming the flag.
        """
        values = {f.name: getattr(args, "mtraining_" + f.name, None) for f in dataclasses.fields(cls)}
        values = {name: value for name, value in values.items() if value is not None}
        if "inner_ring_size" not in values:
            for var in ("LOCAL_WORLD_SIZE", "GPUS_PER_NODE"):
                if os.environ.get(var):
                    try:
                        values["inner_ring_size"] = int(os.environ[var])
                    except ValueError:
                        raise ValueError(f"MTrainingConfig: {var}={os.environ[var]!r} is not an integer "
                                         "(sets the default of --mtraining-inner-ring-size)") from None
                    break
        try:
            return cls(**values)
        except ValueError as e:
            flags = [f"--mtraining-{f.name.replace('_', '-')}" for f in dataclasses.fields(cls)
                     if re.search(rf"\b{f.name}\b", str(e))]
            raise ValueError(f"{e} (check {', '.join(flags)})" if flags else str(e)) from None
