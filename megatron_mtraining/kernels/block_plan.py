"""Per-step conversion of a ``BlockIndex`` (docs/design.md §5): the key blocks of the source chunk.

The same plan as the vertical-slash conversion (``step_plan.py``), so the same kernels and ring steps
run it: per local query block the local key blocks it reads (ascending global order, the diagonal
block last), the transpose (per local key block the local query blocks reading it, ascending
global order), and no columns. Both lists have one capacity (the Triton backward reads the
transposed lists with the forward lists' row length): the larger of the index's capacity (at most
the chunk's key blocks) and the chunk's query blocks (a key block may be read by every one of
them).

PyTorch only, on any device (the compiled extension converts vertical-slash indices only:
``plan.build_step_plan`` routes a ``BlockIndex`` here). No host synchronisation; memory is the
plan itself plus O(entries of the chunk's rows) for the transpose's sort.
"""

from __future__ import annotations

from typing import Optional

import torch


def inverse_map(block_ids: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """global block -> local block, -1 where the chunk does not hold it (slot ``num_blocks``: none)."""
    inv = torch.full((num_blocks + 1,), -1, dtype=torch.long, device=block_ids.device)
    inv[block_ids.long()] = torch.arange(block_ids.numel(), device=block_ids.device)
    return inv


def compact(values: torch.Tensor, valid: torch.Tensor, capacity: int):
    """(counts int32, values int32 [..., capacity]): the valid entries of the last dim moved to the
    front in order, padded with 0 (entries past ``capacity`` drop: only a block index with duplicate
    key blocks, which ``BlockIndex.validate`` rejects, has them; the vertical-slash conversion's
    capacity is the last dim, which holds every entry)."""
    slot = torch.cumsum(valid, -1) - 1
    target = torch.where(valid & (slot < capacity), slot, capacity)
    out = torch.zeros(*values.shape[:-1], capacity + 1, dtype=torch.int32, device=values.device)
    out.scatter_(-1, target, values.to(torch.int32) * valid)
    return valid.sum(-1, dtype=torch.int32).clamp_(max=capacity), out[..., :capacity].contiguous()


def convert_block_step(key_blocks: torch.Tensor, n_key_blocks: torch.Tensor, q_block_ids: torch.Tensor,
                       k_block_ids: torch.Tensor, num_blocks: int, key_block_floor: Optional[torch.Tensor] = None):
    """(kv_count, kv_blocks, q_count, q_blocks, col_count, cols) of ``plan.convert_step_reference``
    for a block index ``key_blocks [b, hq, num_blocks, cap]`` / ``n_key_blocks [b, hq, num_blocks]``.
    ``key_block_floor`` (packed documents): int32 ``[num_blocks]``, per global query block the first
    key block that shares a document with it; earlier blocks drop, as in the vertical-slash
    conversion."""
    dev = key_blocks.device
    b, hq, _, cap = key_blocks.shape
    qg = q_block_ids.long()
    nqb, nkb = qg.numel(), k_block_ids.numel()
    capacity = max(min(cap, nkb), nqb, 1)

    # Forward lists: the query block's own row of the index, kept where the chunk holds the block.
    rows = key_blocks.index_select(2, qg).long()                       # [b, hq, nqb, cap]
    counts = n_key_blocks.index_select(2, qg)
    ok = (torch.arange(cap, device=dev) < counts[..., None]) & (rows >= 0) & (rows <= qg[:, None])
    if key_block_floor is not None:
        ok &= rows >= key_block_floor.long()[qg][:, None]
    local_k = inverse_map(k_block_ids, num_blocks)[torch.where(ok, rows, num_blocks)]
    ok &= local_k >= 0
    kv_count, kv_blocks = compact(local_k, ok, capacity)

    # Transpose: sort the (key block, query block's global rank) pairs per head; each key block's
    # readers then lie together, in ascending global order.
    order = torch.argsort(qg)                                           # rank -> local query block
    rank = torch.empty_like(order)
    rank[order] = torch.arange(nqb, device=dev)
    none = nkb * nqb                                                     # after every real pair
    pair = torch.where(ok, local_k * nqb + rank[:, None], none).reshape(b * hq, -1)
    pair = torch.sort(pair, -1).values
    real = pair < none
    key = torch.where(real, pair // nqb, nkb)
    q_count = torch.zeros(b * hq, nkb + 1, dtype=torch.int32, device=dev)
    q_count.scatter_add_(1, key, real.int())
    start = torch.cumsum(q_count, 1) - q_count                           # first pair of each key block
    slot = torch.arange(pair.shape[1], device=dev) - start.gather(1, key)
    target = torch.where(real & (slot < capacity), key * capacity + slot, nkb * capacity)
    q_blocks = torch.zeros(b * hq, nkb * capacity + 1, dtype=torch.int32, device=dev)
    q_blocks.scatter_(1, target, order[torch.where(real, pair % nqb, 0)].to(torch.int32))
    q_count = q_count[:, :nkb].reshape(b, hq, nkb).contiguous()
    q_blocks = q_blocks[:, :nkb * capacity].reshape(b, hq, nkb, capacity).contiguous()

    col_count = torch.zeros(b, hq, dtype=torch.int32, device=dev)
    cols = torch.zeros(b, hq, 0, dtype=torch.int32, device=dev)
    return kv_count, kv_blocks, q_count, q_blocks, col_count, cols
