"""The CP batch split in the MTraining layout (patches 1 and 3 of ``patches``).

Megatron splits every batch across context-parallel ranks in its zigzag layout; these
replacements cut each sequence tensor to this rank's tokens in the configured layout
(``striped`` or ``zigzag``), after reading the documents of the FULL micro-batch for the
layers (``packing.prepare_batch``). THD (packed) batches are split as one flat sequence, whole
documents in their global places; their ``cu_seqlens`` stay global.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict

import torch

from ...layout import local_positions_on
from .. import packing
from .cp import check_seq_len, group_size_rank, process_group
from .engine import current_config

__all__ = ["BATCH_REASON", "THD_REASON", "make_batch_split", "make_legacy_thd_batch_split",
           "make_thd_batch_split"]

# Batch entries that carry no sequence dimension to split (packed-sequence / hybrid-CP metadata).
_NON_SEQUENCE_KEYS = frozenset({"cu_seqlens", "cu_seqlens_padded", "max_seqlen", "local_cp_size",
                                "hybrid_cp_group"})


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
        check_seq_len(val.shape[seq_dim], layout, cp_size, block_size, f"{what} of {key!r}")
    for key, val, seq_dim in entries:
        # The positions as a device table: no copy from the host per micro-batch.
        pos = local_positions_on(val.device, val.shape[seq_dim], layout, cp_size, cp_rank, block_size)
        batch[key] = val.index_select(seq_dim, pos)
    return batch


def make_batch_split(original: Callable) -> Callable:
    """The per-sequence CP batch split in the configured layout; first the documents of the full
    micro-batch for the layers (``packing.prepare_batch``)."""

    @functools.wraps(original)
    def get_batch_on_this_cp_rank_mtraining(batch, cp_group=None, *args, **kwargs):
        cfg = current_config()
        packing.prepare_batch(batch, process_group(cp_group))
        cp_size, cp_rank = group_size_rank(cp_group)
        if cp_size <= 1:
            return original(batch, cp_group, *args, **kwargs)
        for key, val, seq_dim in _sequence_tensors(batch):
            check_seq_len(val.shape[seq_dim], cfg.layout, cp_size, cfg.block_size, f"batch split of {key!r}")
        if cfg.layout == "zigzag":  # Megatron's own split is the zigzag layout: it gets the sequence
            # tensors only (megatron-core <= 0.16 would also cut metadata such as a THD cu_seqlens)
            sequences = {key: val for key, val, _ in _sequence_tensors(batch)}
            batch.update(original(sequences, cp_group, *args, **kwargs))
            return batch
        return _split_in_layout(batch, cfg.layout, cp_size, cp_rank, cfg.block_size)

    get_batch_on_this_cp_rank_mtraining.__mtraining_patch__ = True
    return get_batch_on_this_cp_rank_mtraining


def make_thd_batch_split(original: Callable) -> Callable:
    """megatron-core >= 0.17: the per-document (THD) CP split, in the MTraining layout instead: the
    flat packed sequence is split like an unpacked one; cu_seqlens stay global."""

    @functools.wraps(original)
    def get_thd_batch_on_this_cp_rank_mtraining(batch, cp_group=None, *args, **kwargs):
        cfg = current_config()
        packing.prepare_batch(batch, process_group(cp_group))
        cp_size, cp_rank = group_size_rank(cp_group)
        if cp_size <= 1:
            return original(batch, cp_group, *args, **kwargs)
        return _split_in_layout(batch, cfg.layout, cp_size, cp_rank, cfg.block_size, "THD batch split")

    get_thd_batch_on_this_cp_rank_mtraining.__mtraining_patch__ = True
    return get_thd_batch_on_this_cp_rank_mtraining


def make_legacy_thd_batch_split(original: Callable) -> Callable:
    """megatron-core <= 0.16: ``get_thd_batch_on_this_cp_rank(batch, cu_seqlens, cu_seqlens_padded,
    max_seqlen, cp_size, cp_rank) -> (batch, packed_seq_params)`` in the MTraining layout."""

    @functools.wraps(original)
    def get_thd_batch_on_this_cp_rank_mtraining(batch, cu_seqlens, cu_seqlens_padded, max_seqlen,
                                                cp_size=None, cp_rank=None):
        cfg = current_config()
        packing.clear_batch_documents()  # THD documents travel in packed_seq_params
        batch, packed_seq_params = original(batch, cu_seqlens, cu_seqlens_padded, max_seqlen, cp_size=1, cp_rank=0)
        if cp_size is None or cp_rank is None:
            size, rank = group_size_rank(None)
            cp_size = size if cp_size is None else cp_size
            cp_rank = rank if cp_rank is None else cp_rank
        if cp_size > 1:
            _split_in_layout(batch, cfg.layout, cp_size, cp_rank, cfg.block_size, "THD batch split")
        return batch, packed_seq_params

    get_thd_batch_on_this_cp_rank_mtraining.__mtraining_patch__ = True
    return get_thd_batch_on_this_cp_rank_mtraining


BATCH_REASON = ("per-sequence CP batch split: tokens/labels/loss_mask/position_ids (dim 1) and "
                "attention_mask (dim 2) follow the MTraining layout instead of Megatron's zigzag")
THD_REASON = ("THD (packed) CP split: the flat packed sequence follows the MTraining layout instead of "
              "Transformer Engine's per-document zigzag; cu_seqlens stay global")
