"""Token layouts across context-parallel ranks (docs/design.md §3).

* ``striped`` (default, balanced): rank ``r`` of ``W`` holds global blocks ``r, r+W, r+2W, ...``
  of ``block_size`` tokens, in order. Every slash diagonal meets every rank in exactly one ring
  step, so all ranks do the same work at every step.
* ``zigzag`` (Megatron / Transformer Engine): ``2W`` equal chunks, rank ``r`` holds chunks ``r``
  and ``2W-1-r``. The sparse kernels need whole blocks, so each chunk must be a multiple of
  ``block_size`` tokens.
"""

from __future__ import annotations

import collections
from typing import Callable, Sequence, TypeVar

import torch

LAYOUTS = ("striped", "zigzag")

T = TypeVar("T")
# A layout's static tables (positions, block ids, their inverses) on the devices that use them, built
# once: copying a table from the host on every call would synchronise the host with the GPU, which
# the hot paths must not (docs/design.md §1). Bounded: a run uses a few shapes.
_TABLES: "collections.OrderedDict[tuple, object]" = collections.OrderedDict()
_TABLE_ENTRIES = 64


def check_layout(seq_len: int, layout: str, world_size: int, block_size: int) -> None:
    """Clear errors for layouts that cannot split this sequence."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    unit = block_size * world_size * (2 if layout == "zigzag" else 1)
    if seq_len % unit:
        what = "block_size * world_size" if layout == "striped" else "2 * world_size * block_size"
        raise ValueError(f"{layout} layout: sequence length {seq_len} is not divisible by {what} = {unit} "
                         f"(block_size {block_size}, context-parallel size {world_size})")


def local_block_ids(seq_len: int, layout: str, world_size: int, rank: int, block_size: int) -> torch.Tensor:
    """Global block id of each local block of ``rank``, in local order (int64)."""
    check_layout(seq_len, layout, world_size, block_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, {world_size})")
    num_blocks = seq_len // block_size
    if layout == "striped":
        return torch.arange(rank, num_blocks, world_size)
    per_chunk = num_blocks // (2 * world_size)
    first = torch.arange(rank * per_chunk, (rank + 1) * per_chunk)
    last = 2 * world_size - 1 - rank
    return torch.cat([first, torch.arange(last * per_chunk, (last + 1) * per_chunk)])


def local_positions(seq_len: int, layout: str, world_size: int, rank: int, block_size: int) -> torch.Tensor:
    """Global token position of each local token of ``rank`` (int64, ``seq_len // world_size``)."""
    blocks = local_block_ids(seq_len, layout, world_size, rank, block_size)
    return (blocks[:, None] * block_size + torch.arange(block_size)).reshape(-1)


def shard_sequence(x: torch.Tensor, dim: int, layout: str, world_size: int, rank: int,
                   block_size: int) -> torch.Tensor:
    """The tokens of ``rank`` from a full sequence along ``dim``, in the layout's local order."""
    pos = local_positions(x.shape[dim], layout, world_size, rank, block_size).to(x.device)
    return x.index_select(dim, pos)


def gather_sequence(shards: Sequence[torch.Tensor], dim: int, layout: str, block_size: int) -> torch.Tensor:
    """Inverse of ``shard_sequence``: the full sequence from every rank's shard (rank order)."""
    world_size = len(shards)
    seq_len = shards[0].shape[dim] * world_size
    shape = list(shards[0].shape)
    shape[dim] = seq_len
    full = shards[0].new_empty(shape)
    for rank, shard in enumerate(shards):
        pos = local_positions(seq_len, layout, world_size, rank, block_size).to(shard.device)
        full.index_copy_(dim, pos, shard)
    return full


def layout_table(name: str, device, key: tuple, build: Callable[[], T]) -> T:
    """``build()`` (a host tensor, or a tuple or list of them, returned as a tuple) on ``device``,
    built and copied once per ``(name, device, key)`` and kept (the least recently used of more
    than 64 entries goes). Shared and read-only: never write into what it returns. ``key`` must
    hold everything ``build`` depends on."""
    full_key = (name, str(device), key)
    if full_key in _TABLES:
        _TABLES.move_to_end(full_key)
        return _TABLES[full_key]
    value = build()
    if isinstance(value, torch.Tensor):
        value = value.to(device)
    else:
        value = tuple(t.to(device) for t in value)
    _TABLES[full_key] = value
    if len(_TABLES) > _TABLE_ENTRIES:
        _TABLES.popitem(last=False)
    return value


def local_positions_on(device, seq_len: int, layout: str, world_size: int, rank: int, block_size: int) -> torch.Tensor:
    """``local_positions`` as a ``layout_table`` on ``device`` (read-only)."""
    return layout_table("positions", device, (seq_len, layout, world_size, rank, block_size),
                        lambda: local_positions(seq_len, layout, world_size, rank, block_size))
