"""What the batch-split and RoPE patches share: this rank's place in the CP group and the
sequence-length check with its message (the positions it holds: ``layout.local_positions_on``)."""

from __future__ import annotations

from typing import Tuple

from ...layout import check_layout

__all__ = ["check_seq_len", "group_size_rank", "process_group"]


def group_size_rank(cp_group) -> Tuple[int, int]:
    """CP size and rank from ``cp_group`` (``group.size()`` / ``group.rank()``, as Megatron's RoPE
    slicer does), or from ``parallel_state`` when it is None (looked up at call time)."""
    if cp_group is None:
        from megatron.core import parallel_state

        return parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()
    return cp_group.size(), cp_group.rank()


def process_group(cp_group):
    """The CP process group the batch split runs over (``cp_group``, else ``parallel_state``'s)."""
    if cp_group is not None:
        return cp_group
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized() and parallel_state.get_context_parallel_world_size() > 1:
        return parallel_state.get_context_parallel_group()
    return None


def check_seq_len(seq_len: int, layout: str, cp_size: int, block_size: int, what: str) -> None:
    try:
        check_layout(seq_len, layout, cp_size, block_size)
    except ValueError as err:
        raise ValueError(f"MTraining context parallelism ({what}): {err}. Choose a sequence length "
                         f"that is a multiple of the layout unit, or another block_size / CP size.") from None

