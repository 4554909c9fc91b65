"""RoPE in the MTraining layout (patches 2 and 4 of ``patches``): each CP rank takes the
rows of the frequency table for its own tokens, and THD (packed) inputs over CP take the row of
each token's position within its document."""

from __future__ import annotations

import functools
from typing import Callable

from ...layout import local_positions_on
from .. import packing
from .cp import check_seq_len, group_size_rank
from .engine import current_config

__all__ = ["ROPE_REASON", "ROPE_UTILS", "THD_ROPE_REASON", "make_pos_emb_slicer", "make_rope_apply"]

ROPE_UTILS = "megatron.core.models.common.embeddings.rope_utils"
ROPE_REASON = "RoPE CP slicing: each rank takes the RoPE rows of its own tokens in the MTraining layout"
THD_ROPE_REASON = ("THD RoPE over CP: each token takes the row of its position in its document, in the "
                   "MTraining layout (other calls unchanged)")


def make_pos_emb_slicer(original: Callable) -> Callable:
    """RoPE table rows of this CP rank's tokens, in the configured layout (device-agnostic)."""

    @functools.wraps(original)
    def get_pos_emb_on_this_cp_rank_mtraining(pos_emb, seq_dim, cp_group=None, *args, **kwargs):
        cfg = current_config()
        cp_size, cp_rank = group_size_rank(cp_group)
        if cp_size <= 1:
            return pos_emb
        seq_len = pos_emb.shape[seq_dim]
        check_seq_len(seq_len, cfg.layout, cp_size, cfg.block_size, "RoPE table slicing")
        pos = local_positions_on(pos_emb.device, seq_len, cfg.layout, cp_size, cp_rank, cfg.block_size)
        return pos_emb.index_select(seq_dim, pos)

    get_pos_emb_on_this_cp_rank_mtraining.__mtraining_patch__ = True
    return get_pos_emb_on_this_cp_rank_mtraining


def make_rope_apply(original: Callable) -> Callable:
    """``apply_rotary_pos_emb``: THD inputs over CP > 1 take their rows by position within their
    document in the MTraining layout (``packing.thd_rope_freqs``), then the original's unpacked
    path (fused or not) applies them; every other call is the original's."""

    @functools.wraps(original)
    def apply_rotary_pos_emb_mtraining(t, freqs, config, cu_seqlens=None, *args, **kwargs):
        if cu_seqlens is None:
            return original(t, freqs, config, cu_seqlens, *args, **kwargs)
        cp_group = kwargs.get("cp_group", args[1] if len(args) > 1 else None)  # (mscale, cp_group, ...)
        cp_size, cp_rank = group_size_rank(cp_group)
        if cp_size <= 1:
            return original(t, freqs, config, cu_seqlens, *args, **kwargs)
        cfg = current_config()
        rows = packing.thd_rope_freqs(freqs, cu_seqlens, t.shape[0], cp_size, cp_rank, cfg.layout, cfg.block_size)
        return original(t.unsqueeze(1), rows, config, None, *args, **kwargs).squeeze(1)

    apply_rotary_pos_emb_mtraining.__mtraining_patch__ = True
    return apply_rotary_pos_emb_mtraining

