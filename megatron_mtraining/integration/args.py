"""``--mtraining-*`` command-line flags for Megatron-LM.

``add_mtraining_args`` has the signature of Megatron's ``extra_args_provider``; defaults
come from ``MTrainingConfig``'s fields. The flags of ``Settings`` (how the attention runs) and
``--mtraining-resume-changes`` default to None: unset, their environment variable (read at
start-up, ``config.ENVIRONMENT_VARIABLES``) decides, else the field default.
``MTrainingConfig.from_args(args)`` turns the parsed namespace into the config;
``integration_options(args)`` returns the options that belong to the Megatron hooks rather than
to the attention itself.
"""

from __future__ import annotations

import dataclasses

from ..config import (AGREEMENT_MODES, BLOCK_SIZES, INDEX_BUILDERS, KERNEL_CHOICES, LAYOUTS, RESUME_POLICIES,
                      MTrainingConfig)

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
                       help="Index builder: vs (approximated vertical-slash), dense (all blocks), fixed, or "
                       "block-sparse: moba (MoBA's gate picks key blocks per query block) or xattn (XAttention's "
                       f"antidiagonal scores) (default: {d['index']}).")
    group.add_argument("--mtraining-moba-block-size", type=int, default=d["moba_block_size"],
                       help="With --mtraining-index moba: tokens per MoBA key block, a multiple of "
                       f"--mtraining-block-size (default: {d['moba_block_size']}).")
    group.add_argument("--mtraining-moba-top-k", type=int, default=d["moba_top_k"],
                       help="With --mtraining-index moba: MoBA key blocks each query block attends, its own "
                       f"included (default: {d['moba_top_k']}).")
    group.add_argument("--mtraining-xattn-stride", type=int, default=d["xattn_stride"],
                       help="With --mtraining-index xattn: antidiagonal stride, a power of two dividing "
                       f"--mtraining-block-size (default: {d['xattn_stride']}).")
    group.add_argument("--mtraining-xattn-threshold", type=float, default=d["xattn_threshold"],
                       help="With --mtraining-index xattn: share of each query block's score mass its key blocks "
                       f"must reach, in (0, 1] (default: {d['xattn_threshold']}).")
    group.add_argument("--mtraining-xattn-max-blocks", type=int, default=d["xattn_max_blocks"],
                       help="With --mtraining-index xattn: capacity, key blocks per query block, its own included "
                       f"(default: {d['xattn_max_blocks']}).")
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
    # How the attention runs (config.Settings); unset: the environment variable named, else "auto" / off.
    group.add_argument("--mtraining-forward-kernel", type=str, default=None, choices=KERNEL_CHOICES,
                       help="Sparse forward kernel on GPUs: auto (the Hopper kernel on sm_90 where it covers the "
                       "call), triton, or hopper (an error where it cannot run) (default: MTRAINING_FORWARD_KERNEL, "
                       "else auto).")
    group.add_argument("--mtraining-backward-kernel", type=str, default=None, choices=KERNEL_CHOICES,
                       help="Sparse backward kernels on GPUs, as --mtraining-forward-kernel "
                       "(default: MTRAINING_BACKWARD_KERNEL, else auto).")
    group.add_argument("--mtraining-ring-agreement", type=str, default=None, choices=AGREEMENT_MODES,
                       help="When the CP ranks' agreement on a call is read: eager (before any transfer, one host "
                       "synchronisation), deferred (no synchronisation: NaN output, the error at the next call) or "
                       "auto (deferred on GPUs with NCCL) (default: MTRAINING_RING_AGREEMENT, else auto).")
    group.add_argument("--mtraining-ring-timeout-s", type=float, default=None,
                       help="Seconds a ring transfer may wait before it fails, naming the step; debugging only on "
                       "NCCL, where it blocks the host (default: MTRAINING_RING_TIMEOUT_S, else the process group's "
                       "timeout, --distributed-timeout-minutes).")
    group.add_argument("--mtraining-validate", action="store_true", default=None,
                       help="Check the index's and cu_seqlens' values on GPUs too, one synchronisation per call "
                       "(default: MTRAINING_VALIDATE=1, else off; on the CPU they are always checked).")
    group.add_argument("--mtraining-resume-changes", type=str, default=None, choices=RESUME_POLICIES,
                       help="Resuming with other --mtraining-* flags than the checkpoint's: warn or error "
                       "(default: MTRAINING_RESUME_CHANGES, else warn).")
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
