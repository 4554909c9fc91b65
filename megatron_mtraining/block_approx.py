"""Block-sparse index builders (``BlockIndex``), distributed over the context-parallel group.

MoBA (``moba_index``, ``config.index == "moba"``): the keys are cut into MoBA blocks of
``moba_block_size`` tokens; each query block of the index (``block_size`` tokens) is gated like a
mixture of experts: its mean query against each MoBA block's mean key, ``s_j = mean(q) . mean(k_j)``
(the query head's key/value head), over the MoBA blocks that are not after it. Its own MoBA block
is always in; the ``moba_top_k`` highest gates (the own block counted) are its key blocks, every
index block of a chosen MoBA block up to the query block (causal inside the query block). With
packed documents, MoBA blocks that end before the document of the query block's first token hold
none of its keys and are not gated.

Communication per layer is block summaries only: one all-reduce of the MoBA blocks' key sums
(``[b, hkv, N / moba_block_size, d]`` fp32) and one all-gather of each rank's selections
(``[b, hq, N / (B W), moba_top_k]`` int32). Each rank gates its own query blocks; the gathered
selections are the same on every rank, so every rank builds the same index. No host
synchronisation; every shape is fixed by the inputs and the config.

XAttention (``xattn_index``, ``config.index == "xattn"``): with stride ``S``, query group ``t``
(tokens ``tS .. tS+S-1``) and key group ``u`` score ``s_tu = sum_i q[tS+S-1-i] . k[uS+i] / (S sqrt(d))``,
the mean of one antidiagonal of their ``S x S`` tile; ``p_tu`` is the softmax of ``s_t.`` over the
key groups ``u <= t``. A (query block, key block) pair scores the sum of ``p_tu`` over its groups.
Each query block keeps its own block, then its other blocks by descending score (ties: the
earlier block) until the kept mass reaches ``xattn_threshold`` of its total, at most
``xattn_max_blocks`` blocks in all. The scores are token-level statistics of every key, so, unlike
MoBA's and the vertical-slash approximator's, they cannot be made from block summaries: each
rank scores its own query groups against every rank's strided keys, sent round by one broadcast
per rank and pass (two passes: the softmax statistics, then the block scores; K's volume twice
per layer, in fp32), and the ranks then exchange their selections only (``[b, hq, N / (B W),
xattn_max_blocks]`` int32). Packed documents are not scored by this builder (a clear error).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from .block_index import BlockIndex
from .config import MTrainingConfig
from .documents import Documents
from .layout import layout_table, local_block_ids, local_positions_on


def _block_ids(device, seq_len: int, layout: str, world: int, block_size: int):
    """Every rank's global block ids one after the other (rank r's at slot r), int64, cached."""
    return layout_table("block index builder, block ids", device, (seq_len, layout, world, block_size),
                        lambda: torch.cat([local_block_ids(seq_len, layout, world, r, block_size)
                                           for r in range(world)]))


def moba_gate(q: torch.Tensor, k_means: torch.Tensor, query_blocks: torch.Tensor, config: MTrainingConfig,
              documents: Optional[Documents] = None) -> torch.Tensor:
    """The MoBA blocks each query block attends: int64 ``[b, hq, nqb, min(top_k, n_moba)]``,
    ascending, ``n_moba`` past the chosen ones. ``q [b, hq, nqb * B, d]`` holds the query blocks
    ``query_blocks`` (global ids, in q's order); ``k_means [b, hkv, n_moba, d]`` fp32."""
    B, Bm = config.block_size, config.moba_block_size
    b, hq, n, d = q.shape
    hkv, n_moba = k_means.shape[1], k_means.shape[2]
    nqb = n // B
    q_means = q.float().reshape(b, hkv, hq // hkv, nqb, B, d).mean(4)  # q may be a strided view
    gate = torch.einsum("bkgqd,bkjd->bkgqj", q_means, k_means).reshape(b, hq, nqb, n_moba)
    own = (query_blocks.long() * B // Bm)[:, None]                      # [nqb, 1]
    moba = torch.arange(n_moba, device=q.device)
    dead = moba > own                                                    # after the query block
    if documents is not None:  # ends before the document of the block's first token
        first_doc = documents.blocks(B, q.device).doc_start[query_blocks.long() * B].long()
        dead |= (moba + 1) * Bm <= first_doc[:, None]
    gate = gate.masked_fill(dead, float("-inf")).masked_fill(moba == own, float("inf"))
    values, chosen = gate.topk(min(config.moba_top_k, n_moba), dim=-1)
    chosen = torch.where(values > float("-inf"), chosen, n_moba)
    return chosen.sort(-1).values


def moba_blocks(chosen: torch.Tensor, config: MTrainingConfig, num_blocks: int) -> BlockIndex:
    """The ``BlockIndex`` of the chosen MoBA blocks ``[b, hq, num_blocks, k]`` (``moba_gate`` of
    every query block of the sequence, in global order): each MoBA block's index blocks up to the
    query block."""
    B, Bm = config.block_size, config.moba_block_size
    per = Bm // B
    n_moba = -(-num_blocks // per)
    b, hq, nb, kk = chosen.shape
    blocks = (chosen[..., None] * per + torch.arange(per, device=chosen.device)).reshape(b, hq, nb, kk * per)
    query = torch.arange(nb, device=chosen.device)[:, None]
    valid = (chosen < n_moba).repeat_interleave(per, -1) & (blocks <= query)
    capacity = min(kk * per, num_blocks)
    slot = torch.cumsum(valid, -1) - 1
    target = torch.where(valid & (slot < capacity), slot, capacity)
    out = torch.zeros(b, hq, nb, capacity + 1, dtype=torch.int32, device=chosen.device)
    out.scatter_(-1, target, (blocks * valid).to(torch.int32))
    counts = valid.sum(-1, dtype=torch.int32).clamp_(max=capacity)
    return BlockIndex(out[..., :capacity].contiguous(), counts, B)


def _placement(q: torch.Tensor, config: MTrainingConfig, group):
    """(CP size, this rank, the whole sequence's length, the layout of the local tokens): one device
    (``group=None``) holds the whole sequence in order."""
    world = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    return world, rank, q.shape[2] * world, config.layout if world > 1 else "striped"


def moba_index(q: torch.Tensor, k: torch.Tensor, config: MTrainingConfig, group=None,
               documents: Optional[Documents] = None) -> BlockIndex:
    """MoBA's block index for one layer (module docstring). q ``[b, hq, n_local, d]``, k
    ``[b, hkv, n_local, d]``: this rank's tokens in ``config.layout`` order (``group=None``: the
    full sequence on one device, in order). Returns the same ``BlockIndex`` on every rank."""
    world, rank, seq_len, layout = _placement(q, config, group)
    B, Bm = config.block_size, config.moba_block_size
    b, d = q.shape[0], q.shape[3]
    hkv = k.shape[1]
    n_moba = math.ceil(seq_len / Bm)
    positions = local_positions_on(q.device, seq_len, layout, world, rank, B)
    # Block summaries: each MoBA block's key sum over the whole sequence (fp32).
    k_sums = torch.zeros(b, hkv, n_moba, d, dtype=torch.float32, device=k.device)
    k_sums.index_add_(2, positions // Bm, k.float())
    if world > 1:
        dist.all_reduce(k_sums, group=group)
    sizes = (seq_len - torch.arange(n_moba, device=k.device) * Bm).clamp(max=Bm)
    k_means = k_sums / sizes[:, None].to(torch.float32)
    all_ids = _block_ids(q.device, seq_len, layout, world, B)
    mine = all_ids.view(world, -1)[rank]
    chosen = moba_gate(q, k_means, mine, config, documents).to(torch.int32)
    if world > 1:
        parts = [torch.empty_like(chosen) for _ in range(world)]
        dist.all_gather(parts, chosen.contiguous(), group=group)
        chosen = torch.cat(parts, 2)
    rows = torch.empty_like(chosen)
    rows[:, :, all_ids] = chosen                                          # global query block order
    return moba_blocks(rows.long(), config, seq_len // B)


def _strided(x: torch.Tensor, stride: int, antidiagonal: bool) -> torch.Tensor:
    """``[b, h, n / S, S * d]`` fp32: each group of ``S`` tokens concatenated along the features,
    reversed for the queries, so that a product of a query row and a key row is one antidiagonal
    of their ``S x S`` tile."""
    b, h, n, d = x.shape
    groups = x.float().reshape(b, h, n // stride, stride, d)  # x may be a strided view
    if antidiagonal:
        groups = groups.flip(3)
    return groups.reshape(b, h, n // stride, stride * d)


def _sources(keys: torch.Tensor, group, world: int, rank: int):
    """(source rank, its strided keys) for every rank of the group in turn: one broadcast each."""
    for source in range(world):
        if source == rank or world == 1:
            chunk = keys
        else:
            chunk = torch.empty_like(keys)
        if world > 1:
            dist.broadcast(chunk, src=dist.get_global_rank(group, source), group=group)
        yield source, chunk


def xattn_scores(q: torch.Tensor, k: torch.Tensor, config: MTrainingConfig, group=None) -> torch.Tensor:
    """fp32 ``[b, hq, nqb_local, N / B]``: XAttention's score of each (local query block, key
    block) pair (module docstring). q, k: this rank's tokens in ``config.layout`` order."""
    world, rank, seq_len, layout = _placement(q, config, group)
    S, B = config.xattn_stride, config.block_size
    b, hq, n_local, d = q.shape
    hkv = k.shape[1]
    nb = seq_len // B
    ids = _block_ids(q.device, seq_len, layout, world, B).view(world, -1)
    groups_of = (ids[:, :, None] * (B // S) + torch.arange(B // S, device=q.device)).reshape(world, -1)
    rows = groups_of[rank]                                                 # global query group of each row
    qs = _strided(q, S, True).view(b, hkv, hq // hkv, -1, S * d)
    ks = _strided(k, S, False)
    scale = 1.0 / (S * math.sqrt(d))

    def scores(chunk, source):
        s = torch.matmul(qs, chunk[:, :, None].transpose(-1, -2)).reshape(b, hq, rows.numel(), -1) * scale
        return s.masked_fill(groups_of[source][None, :] > rows[:, None], float("-inf"))

    # Pass 1: each row's softmax statistics over every key group (online max and sum).
    row_max = torch.full((b, hq, rows.numel()), float("-inf"), device=q.device)
    row_sum = torch.zeros(b, hq, rows.numel(), device=q.device)
    for source, chunk in _sources(ks, group, world, rank):
        s = scores(chunk, source)
        new_max = torch.maximum(row_max, s.amax(-1))
        safe = torch.where(torch.isfinite(new_max), new_max, torch.zeros_like(new_max))
        row_sum = row_sum * torch.exp(row_max - safe) + torch.exp(s - safe[..., None]).sum(-1)
        row_max = new_max
    # Pass 2: probabilities summed per (query block, key block).
    block_scores = torch.zeros(b, hq, n_local // B, nb, device=q.device)
    for source, chunk in _sources(ks, group, world, rank):
        p = torch.exp(scores(chunk, source) - row_max[..., None]) / row_sum[..., None]
        per_query_block = p.view(b, hq, n_local // B, B // S, -1).sum(3)
        block_scores.index_add_(3, groups_of[source] * S // B, per_query_block)
    return block_scores


def xattn_select(block_scores: torch.Tensor, query_blocks: torch.Tensor, config: MTrainingConfig):
    """(counts int32 ``[b, hq, nqb]``, key blocks int32 ``[b, hq, nqb, cap]``) of XAttention's rule
    for the query blocks ``query_blocks`` (global ids) from their ``xattn_scores``."""
    b, hq, nqb, nb = block_scores.shape
    cap = min(config.xattn_max_blocks, nb)
    qg = query_blocks.long()[:, None]
    blocks = torch.arange(nb, device=block_scores.device)
    total = (block_scores * (blocks <= qg)).sum(-1, keepdim=True)
    own = block_scores.gather(-1, qg.expand(b, hq, nqb, 1))
    others = block_scores.masked_fill(blocks >= qg, -1.0)  # every earlier block scores >= 0
    values, order = others.sort(dim=-1, descending=True, stable=True)
    before = torch.cumsum(values.clamp(min=0), -1) - values.clamp(min=0)
    keep = (values >= 0) & (own + before < config.xattn_threshold * total)
    keep &= torch.arange(nb, device=block_scores.device) < cap - 1
    chosen = torch.where(keep, order, nb)[..., :cap - 1]
    chosen = torch.cat([chosen, qg.expand(b, hq, nqb, 1)], -1).sort(-1).values  # own block: the last valid
    counts = keep.sum(-1, dtype=torch.int32) + 1
    return counts, torch.where(chosen < nb, chosen, 0).to(torch.int32)


def xattn_index(q: torch.Tensor, k: torch.Tensor, config: MTrainingConfig, group=None,
                documents: Optional[Documents] = None) -> BlockIndex:
    """XAttention's block index for one layer (module docstring); arguments as ``moba_index``."""
    if documents is not None and documents.cu_seqlens.numel() > 2:
        raise ValueError("the xattn index builder does not score packed documents (cu_seqlens with more than one "
                         "document); use --mtraining-index vs or moba for packed data")
    world = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    B = config.block_size
    seq_len = q.shape[2] * world
    layout = config.layout if world > 1 else "striped"
    all_ids = _block_ids(q.device, seq_len, layout, world, B)
    mine = all_ids.view(world, -1)[rank]
    counts, blocks = xattn_select(xattn_scores(q, k, config, group), mine, config)
    if world > 1:
        parts = [torch.empty_like(blocks) for _ in range(world)]
        dist.all_gather(parts, blocks, group=group)
        blocks = torch.cat(parts, 2)
        parts = [torch.empty_like(counts) for _ in range(world)]
        dist.all_gather(parts, counts, group=group)
        counts = torch.cat(parts, 2)
    key_blocks, n_key_blocks = torch.empty_like(blocks), torch.empty_like(counts)
    key_blocks[:, :, all_ids] = blocks                                     # global query block order
    n_key_blocks[:, :, all_ids] = counts
    return BlockIndex(key_blocks, n_key_blocks, B)
