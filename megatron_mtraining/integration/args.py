"""``--mtraining-*`` command-line flags for Megatron-LM.

``add_mtraining_args`` has the signature of Megatron's ``extra_args_provider``; defaults
come from ``MTrainingConfig``'s fields. ``MTrainingConfig.from_args(args)`` turns the
parsed namespace into the config; ``integration_options(args)`` returns the options that
belong to the Megatron hooks rather than to the attention itself.
"""

from __future__ import annotations

import dataclasses

from ..config import BLOCK_SIZES, INDEX_BUILDERS, LAYOUTS, MTrainingConfig

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(MTrainingConfig)}


def add_mtraining_args(parser):
    """Add the "MTraining sparse attention" argument group to ``parser`` and return it."""
    d = _DEFAULTS
    group = parser.add_argument_group(title="MTraining sparse attention")

    group.add_argument("--mtraining", action="store_true",
                       help="Replace core attention with MTraining dynamic sparse context-parallel "
                       "attention (default: off).")
    group.add_argument("--mtraining-top-p", type=float, default=d["top_p"],
                       help="Attention-mass share the vertical and slash budgets must cover, in (0, 1] "
                       f"(default: {d['top_p']}).")
    group.add_argument("--mtraining-last-q", type=int, default=d["last_q"],
                       help=f"Number of final queries the index approximator scores (default: {d['last_q']}).")
    group.add_argument("--mtraining-block-size", type=int, default=d["block_size"], choices=BLOCK_SIZES,
                       help=f"Block size of slash blocks and of the striped layout (default: {d['block_size']}).")
    group.add_argument("--mtraining-max-vertical", type=int, default=d["max_vertical"],
                       help=f"Capacity of vertical (column) indices per head (default: {d['max_vertical']}).")
    group.add_argument("--mtraining-max-slash", type=int, default=d["max_slash"],
                       help=f"Capacity of slash (diagonal block) indices per head (default: {d['max_slash']}).")
    group.add_argument("--mtraining-min-vertical", type=int, default=d["min_vertical"],
                       help="Lower clamp of the per-head vertical budget (default: min(256, "
                            "--mtraining-max-vertical); 0: the paper's pure top-p budget).")
    group.add_argument("--mtraining-min-slash", type=int, default=d["min_slash"],
                       help=f"Lower clamp of the per-head slash budget (default: {d['min_slash']}).")
    group.add_argument("--mtraining-sink-tokens", type=int, default=d["sink_tokens"],
                       help=f"Leading tokens always attended (attention sinks) (default: {d['sink_tokens']}).")
    group.add_argument("--mtraining-max-documents", type=int, default=d["max_documents"],
                       help="With packed documents (--reset-attention-mask, --sft, "
                       "--dataloader-inter-document-masking), how many documents the index approximator scores, "
                       f"each by its own last queries (default: {d['max_documents']}).")
    group.add_argument("--mtraining-local-window", type=int, default=d["local_window"],
                       help="Slash offsets 0..N-1 always kept; offset 0 is the diagonal "
                       f"(default: {d['local_window']}).")
    group.add_argument("--mtraining-layout", type=str, default=d["layout"], choices=LAYOUTS,
                       help=f"Token layout across context-parallel ranks (default: {d['layout']}).")
    group.add_argument("--mtraining-inner-ring-size", type=int, default=d["inner_ring_size"],
                       help="Ranks per inner (intra-node) ring of the two-level ring (default: ranks per "
                       "node from LOCAL_WORLD_SIZE or GPUS_PER_NODE; one flat ring if neither is set).")
    group.add_argument("--mtraining-index", type=str, default=d["index"], choices=INDEX_BUILDERS,
                       help="Index builder: vs (approximated vertical-slash), dense (all blocks) or fixed "
                       f"(default: {d['index']}).")
    group.add_argument("--mtraining-dense-max-seq-length", type=int, default=d["dense_max_seq_length"],
                       help="Sequences of at most N tokens attend densely (the dense index), e.g. the short "
                       "phases of a short-to-long schedule trained from scratch; 0 is never "
                       f"(default: {d['dense_max_seq_length']}).")
    group.add_argument("--mtraining-dense-layers", type=int, default=0,
                       help="The first N transformer layers keep dense attention (default: 0).")
    group.add_argument("--mtraining-log-interval", type=int, default=0,
                       help="Log sparse-attention telemetry every N iterations; 0 is off (default: 0).")
    group.add_argument("--mtraining-deterministic", action="store_true", default=d["deterministic"],
                       help="Backward without atomics, bit-identical from run to run "
                       f"(default: {d['deterministic']}).")
    group.add_argument("--no-mtraining-deterministic", action="store_false", dest="mtraining_deterministic",
                       default=d["deterministic"],
                       help="Let layers with a dense index (--mtraining-index dense, --mtraining-dense-layers) "
                       "run the dense kernels (cuDNN / flash), whose backward is not deterministic.")
    return parser


def integration_options(args) -> dict:
    """Options of the Megatron hooks (not ``MTrainingConfig`` fields): enabled, dense_layers, log_interval."""
    options = dict(enabled=bool(getattr(args, "mtraining", False)),
                   dense_layers=int(getattr(args, "mtraining_dense_layers", 0) or 0),
                   log_interval=int(getattr(args, "mtraining_log_interval", 0) or 0))
    if options["dense_layers"] < 0:
        raise ValueError(f"--mtraining-dense-layers must be >= 0, got {options['dense_layers']}")
    num_layers = getattr(args, "num_layers", None)
    if num_layers is not None and options["dense_layers"] > num_layers:
        raise ValueError(f"--mtraining-dense-layers ({options['dense_layers']}) exceeds --num-layers ({num_layers})")
    if options["log_interval"] < 0:
        raise ValueError(f"--mtraining-log-interval must be >= 0, got {options['log_interval']}")
    return options
