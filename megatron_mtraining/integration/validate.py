"""Start-up validation of a Megatron configuration for MTraining (docs/design.md §6):
``validate_megatron_config`` rejects unsupported combinations with one error naming every flag."""

from __future__ import annotations

from typing import List, Optional

from ..config import MTrainingConfig

__all__ = ["validate_megatron_config"]


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
