"""Distributed online vertical-slash index approximator (paper Algorithm 1, made robust).

Every context-parallel rank holds its layout's share of one layer's post-RoPE q and k. The
last ``last_q`` queries of the global sequence are scored against all keys; their softmax
(normalised across ranks) gives two statistics:
  * vertical: attention mass per key column (token level);
  * slash: attention mass per block offset ``q//B - k//B`` (block level).
Per head, the budget is the smallest count whose top entries hold ``top_p`` of the mass,
clamped to [min, max], plus the mandatory diagonal, local window and sink columns. Ties break
by position, and every rank reduces the same data, so every rank selects the same index.

Communication is independent of the sequence length per rank except for the slash statistic
(one value per block offset): the ``last_q`` queries (all-reduce), row max and normaliser
(all-reduce of ``last_q`` values per head), the block-offset statistic (all-reduce of ``N/B``
values per head) and each rank's top ``max_vertical`` column candidates (all-gather). No host
synchronisation; every shape is fixed by the inputs and the config.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from .config import MTrainingConfig
from .index import VSIndex
from .kernels.step import resolve_backend
from .layout import check_layout, local_positions

KEY_CHUNK = 8192  # keys scored at a time (a multiple of every block size): memory O(last_q x chunk) per head

_POSITIONS: Dict[tuple, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _world(group) -> Tuple[int, int]:
    """(size, rank) of the CP group; ``group=None`` means one device holding the full sequence."""
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _layout_positions(device, seq_len, layout, world, rank, block_size, last_q):
    """(key positions, local rows holding last queries, their slots in Q_last), cached on device."""
    key = (str(device), seq_len, layout, world, rank, block_size, last_q)
    if key not in _POSITIONS:
        pos = local_positions(seq_len, layout, world, rank, block_size)
        rows = torch.nonzero(pos >= seq_len - last_q).flatten()
        slots = pos[rows] - (seq_len - last_q)
        _POSITIONS[key] = (pos.to(device), rows.to(device), slots.to(device))
    return _POSITIONS[key]


def _all_reduce(x, op, group, world):
    if world > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


def _budget_select(values: torch.Tensor, positions: torch.Tensor, mandatory: torch.Tensor, total: torch.Tensor,
                   top_p: float, lo: int, hi: int, capacity: int):
    """Top-p selection with fixed shapes.

    ``values`` [b, h, C] masses of candidates at ``positions`` (ascending within the last dim),
    ``mandatory`` [b, h, C] bool, ``total`` [b, h] the whole mass. Returns (sorted selected
    positions padded to ``capacity``, counts).
    """
    # Mandatory entries first, then by mass; stable sort keeps ascending positions among ties.
    key = torch.where(mandatory, torch.full_like(values, float("inf")), values)
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    ranked_values = values.gather(-1, order)
    ranked_positions = positions.gather(-1, order)
    reached = torch.cumsum(ranked_values.double(), -1) >= top_p * total[..., None]
    budget = (~reached).sum(-1) + 1                       # smallest count holding top_p of the mass
    n_mandatory = mandatory.sum(-1)
    available = (values > 0).sum(-1).clamp_min(n_mandatory)  # never select zero-mass padding
    count = torch.maximum(budget, n_mandatory).clamp(min=max(lo, 1), max=hi)
    count = torch.minimum(count, available.clamp(max=capacity)).clamp_min(n_mandatory.clamp(max=capacity))
    width = min(capacity, ranked_positions.shape[-1])  # count <= width
    keep = torch.arange(width, device=values.device) < count[..., None]
    # The first `count` ranked positions, in ascending order, then zero padding.
    chosen = torch.where(keep, ranked_positions[..., :width], torch.iinfo(torch.int64).max)
    chosen = torch.where(keep, torch.sort(chosen, dim=-1).values, 0)
    out = torch.zeros(*values.shape[:-1], capacity, dtype=torch.int32, device=values.device)
    out[..., :width] = chosen.to(torch.int32)
    return out, count.to(torch.int32)


def _torch_row_partials(q_grouped, k, key_pos, q_pos0, scale, L):
    """PyTorch pass 1 (CPU): online row max and normaliser over the local keys, chunk by chunk."""
    q_pos = torch.arange(q_pos0, q_pos0 + L, device=k.device)
    b, hkv = q_grouped.shape[:2]
    hq = q_grouped.shape[2] // L * hkv
    row_max = torch.full((b, hq, L), float("-inf"), device=k.device)
    normaliser = torch.zeros(b, hq, L, dtype=torch.float64, device=k.device)
    for start in range(0, k.shape[2], KEY_CHUNK):
        s = _chunk_scores(q_grouped, k, key_pos, q_pos, scale, L, start)
        new_max = torch.maximum(row_max, s.amax(-1))
        m = _finite(new_max)
        normaliser = (normaliser * torch.exp(row_max - m).double()
                      + torch.exp(s - m[..., None]).double().sum(-1))
        row_max = new_max
    return row_max, normaliser


def _torch_vs_masses(q_grouped, k, key_pos, q_pos0, scale, L, B, row_max, normaliser, q_block_rows):
    """PyTorch pass 2 (CPU): recompute the weights chunk by chunk (rather than keep last_q x
    n_local of them per head) and fold them into the vertical statistic and the block masses."""
    q_pos = torch.arange(q_pos0, q_pos0 + L, device=k.device)
    b, hkv = q_grouped.shape[:2]
    hq = q_grouped.shape[2] // L * hkv
    n_local = k.shape[2]
    vertical = torch.zeros(b, hq, n_local, dtype=torch.float64, device=k.device)
    block_mass = torch.zeros(b, hq, len(q_block_rows), n_local // B, dtype=torch.float64, device=k.device)
    for start in range(0, n_local, KEY_CHUNK):
        s = _chunk_scores(q_grouped, k, key_pos, q_pos, scale, L, start)
        p = torch.exp(s - row_max[..., None]).double() / normaliser[..., None]
        stop = start + p.shape[-1]
        vertical[..., start:stop] = p.sum(-2)
        per_row = p.reshape(b, hq, L, -1, B).sum(-1)
        for j, (row0, row1) in enumerate(q_block_rows):
            block_mass[:, :, j, start // B:stop // B] = per_row[:, :, row0:row1].sum(-2)
    return vertical.float(), block_mass


def _chunk_scores(q_grouped, k, key_pos, q_pos, scale, L, start):
    """Scaled scores [b, hq, L, chunk] of the last queries against keys start.., -inf where masked.
    GQA without copying K per query head: the g query heads of one KV head are one matmul."""
    b = q_grouped.shape[0]
    kc = k[:, :, start:start + KEY_CHUNK].float()
    s = torch.matmul(q_grouped, kc.transpose(-1, -2)).view(b, -1, L, kc.shape[2]) * scale
    visible = key_pos[start:start + KEY_CHUNK][None, :] <= q_pos[:, None]
    return s.masked_fill(~visible, float("-inf"))


def _finite(m):
    """A row with no visible key has max -inf: use 0 there, so exp(-inf - 0) gives exact zeros."""
    return torch.where(torch.isinf(m), torch.zeros_like(m), m)


def vs_statistics(q, k, config: MTrainingConfig, group=None, layout: str = "striped", softmax_scale=None,
                  backend: str = "auto"):
    """Vertical (per local column, fp32) and slash (per global block offset, fp64) attention mass
    of the last ``last_q`` queries, identical to a single device's up to summation order.

    ``backend``: "auto" (fused Triton kernels on CUDA, PyTorch passes elsewhere), "triton" or "torch".
    """
    world, rank = _world(group)
    backend = resolve_backend(backend, q.device)
    b, hq, n_local, d = q.shape
    hkv = k.shape[1]
    B, L = config.block_size, config.last_q
    seq_len = n_local * world
    nb = seq_len // B
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    key_pos, rows, slots = _layout_positions(q.device, seq_len, layout, world, rank, B, L)

    # Q_last from whichever ranks hold it: scatter into zeros, sum across ranks (exact: one
    # nonzero term per entry).
    q_last = torch.zeros(b, hq, L, d, dtype=torch.float32, device=q.device)
    q_last[:, :, slots] = q[:, :, rows].float()
    _all_reduce(q_last, dist.ReduceOp.SUM, group, world)
    q_grouped = q_last.reshape(b, hkv, (hq // hkv) * L, d)
    q_pos0 = seq_len - L  # global position of the first of the last queries
    # The last queries span a few query blocks (host-known); rows of one share their offsets.
    first_qb = q_pos0 // B
    q_block_rows = [(max(qb * B, q_pos0) - q_pos0, min((qb + 1) * B, seq_len) - q_pos0)
                    for qb in range(first_qb, (seq_len - 1) // B + 1)]

    # Pass 1: row max and normaliser over the local keys, then combined across ranks.
    if backend == "triton":
        from .kernels.triton_approx import row_partials
        # Exact when q and k share a dtype (q_last holds q's values); the attention requires it.
        q_grouped = q_grouped.to(k.dtype).contiguous()
        k = k if k.stride(-1) == 1 else k.contiguous()
        part_max, part_sum = row_partials(q_grouped, k, key_pos, q_pos0, scale, L, B)
        row_max = part_max.amax(-1)
        rescale = torch.exp(part_max - _finite(row_max)[..., None]).double()
        normaliser = (part_sum.double() * rescale).sum(-1)
    else:
        row_max, normaliser = _torch_row_partials(q_grouped, k, key_pos, q_pos0, scale, L)
    local_max = row_max.clone()
    _all_reduce(row_max, dist.ReduceOp.MAX, group, world)
    normaliser *= torch.exp(local_max - _finite(row_max)).double()
    _all_reduce(normaliser, dist.ReduceOp.SUM, group, world)

    # Pass 2: the normalised weights folded into the vertical statistic and the block masses.
    if backend == "triton":
        from .kernels.triton_approx import vs_masses
        vertical, block_mass = vs_masses(q_grouped, k, key_pos, q_pos0, scale, L, B, row_max,
                                         normaliser.reciprocal().float(), len(q_block_rows))
    else:
        vertical, block_mass = _torch_vs_masses(q_grouped, k, key_pos, q_pos0, scale, L, B, row_max, normaliser,
                                                q_block_rows)

    # Slash: each query block's masses go to offsets q_block - k_block. A local block is one
    # global block in every layout, so within one query block every scatter hits distinct bins:
    # no colliding float atomics, and activation recompute rebuilds the same index bit for bit.
    # Masked pairs (key block after the query block) carry exact zeros, clamped onto bin 0.
    slash = torch.zeros(b, hq, nb, dtype=torch.float64, device=q.device)
    k_blk = key_pos[::B] // B
    for j in range(len(q_block_rows)):
        offset = (first_qb + j - k_blk).clamp(0, nb - 1)
        slash.scatter_add_(2, offset.expand(b, hq, -1), block_mass[:, :, j].double())
    _all_reduce(slash, dist.ReduceOp.SUM, group, world)
    return vertical, slash, key_pos


def _top_by_value(values: torch.Tensor, take: int) -> torch.Tensor:
    """Indices of the ``take`` largest non-negative fp32 ``values`` along the last dim, largest
    first, ties by lower index: a stable descending sort's head, for the price of a top-k. The
    value's bits (monotone for non-negative floats) and the reversed index form one unique int64
    key, so the order cannot depend on the top-k implementation."""
    n = values.shape[-1]
    reversed_index = (n - 1) - torch.arange(n, device=values.device)
    key = (values.contiguous().view(torch.int32).to(torch.int64) << 32) | reversed_index
    return (n - 1) - (key.topk(take, dim=-1).values & 0xFFFFFFFF)


def approximate_vs_index(q, k, config: MTrainingConfig, group=None, layout: str = "striped",
                         softmax_scale=None, backend: str = "auto") -> VSIndex:
    world, _ = _world(group)
    vertical, slash, key_pos = vs_statistics(q, k, config, group, layout, softmax_scale, backend)
    b, hq, n_local = vertical.shape
    seq_len, B = n_local * world, config.block_size
    nb = seq_len // B
    total = torch.full((b, hq), float(config.last_q), dtype=torch.float64, device=q.device)

    # Slash: every offset is a candidate; offsets 0..local_window-1 are mandatory (0 always).
    offsets = torch.arange(nb, device=q.device).expand(b, hq, nb)
    mandatory_s = offsets < max(1, config.local_window)
    slash_idx, n_slash = _budget_select(slash, offsets, mandatory_s, total, config.top_p,
                                        config.min_slash, min(config.max_slash, nb), config.max_slash)

    # Vertical: each rank's top max_vertical columns are the only candidates that can win.
    cap_v = config.max_vertical
    if cap_v == 0:
        empty = torch.zeros(b, hq, 0, dtype=torch.int32, device=q.device)
        return VSIndex(slash_idx, n_slash, empty, torch.zeros(b, hq, dtype=torch.int32, device=q.device), B)
    sinks = (key_pos < config.sink_tokens).expand(b, hq, n_local)
    local_key = torch.where(sinks, torch.full_like(vertical, float("inf")), vertical)
    take = min(cap_v, n_local)
    top = _top_by_value(local_key, take)
    cand_values, cand_positions = vertical.gather(-1, top), key_pos[top]
    if world > 1:
        gathered_v = [torch.empty_like(cand_values) for _ in range(world)]
        gathered_p = [torch.empty_like(cand_positions) for _ in range(world)]
        dist.all_gather(gathered_v, cand_values, group=group)
        dist.all_gather(gathered_p, cand_positions, group=group)
        cand_values, cand_positions = torch.cat(gathered_v, -1), torch.cat(gathered_p, -1)
    by_position = torch.sort(cand_positions, dim=-1).indices  # ties then break by position
    cand_values, cand_positions = cand_values.gather(-1, by_position), cand_positions.gather(-1, by_position)
    vert_idx, n_vert = _budget_select(cand_values, cand_positions,
                                      cand_positions < config.sink_tokens, total, config.top_p,
                                      config.min_vertical, min(cap_v, seq_len), cap_v)
    return VSIndex(slash_idx, n_slash, vert_idx, n_vert, B)


def fixed_index(batch: int, heads: int, seq_len: int, config: MTrainingConfig, device=None) -> VSIndex:
    """Fixed budgets spread deterministically (benchmarks): the local window, then offsets spread
    geometrically up to ``max_slash``; the sinks, then columns spread evenly up to ``max_vertical``."""
    B = config.block_size
    nb = seq_len // B
    n_s = min(config.max_slash, nb)
    offsets = list(range(min(max(1, config.local_window), n_s)))
    geometric = torch.logspace(0, math.log10(max(nb - 1, 1)), steps=max(n_s, 1)).long().tolist()
    for o in geometric + list(range(nb)):  # spread first, then the nearest unused offsets
        if len(offsets) == n_s:
            break
        if o < nb and o not in offsets:
            offsets.append(o)
    offsets.sort()
    n_v = min(config.max_vertical, seq_len)
    sinks = list(range(min(config.sink_tokens, n_v)))
    rest = torch.linspace(config.sink_tokens, seq_len - 1, steps=max(n_v - len(sinks), 0)).long().tolist()
    columns = sorted(set(sinks) | set(rest))[:n_v]
    return VSIndex.from_lists([[offsets] * heads] * batch, [[columns] * heads] * batch, block_size=B,
                              device=device, max_slash=config.max_slash, max_vertical=config.max_vertical)


def approximate_index(q: torch.Tensor, k: torch.Tensor, config: MTrainingConfig, group=None,
                      layout: str = "striped", softmax_scale: Optional[float] = None,
                      backend: str = "auto") -> VSIndex:
    """The index for one layer: ``config.index`` picks "vs" (approximated from q and k), "dense"
    (all blocks) or "fixed" (fixed budgets). q ``[b, hq, n_local, d]``, k ``[b, hkv, n_local, d]``
    are this rank's post-RoPE tokens in ``layout`` order (``group=None``: the full sequence on
    one device). Returns the same ``VSIndex`` on every rank. ``backend`` computes the statistics:
    "auto" (fused Triton kernels on CUDA, PyTorch elsewhere), "triton" or "torch"."""
    world, _ = _world(group)
    resolve_backend(backend, q.device)  # a bad name fails here, whatever the index builder
    if q.dim() != 4 or k.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"approximate_index: q {tuple(q.shape)} and k {tuple(k.shape)} must be "
                         "[batch, heads, tokens, head_dim] with matching batch, tokens and head_dim")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"approximate_index: query heads ({q.shape[1]}) must be a multiple of key heads "
                         f"({k.shape[1]})")
    n_local = q.shape[2]
    seq_len = n_local * world
    check_layout(seq_len, layout, world, config.block_size)
    b, hq = q.shape[:2]
    if config.index == "dense":
        return VSIndex.dense(b, hq, seq_len, config.block_size, device=q.device)
    if config.index == "fixed":
        return fixed_index(b, hq, seq_len, config, device=q.device)
    if config.last_q > n_local:
        raise ValueError(f"approximate_index: last_q ({config.last_q}) exceeds the {n_local} tokens each rank "
                         "holds; lower --mtraining-last-q")
    return approximate_vs_index(q, k, config, group, layout, softmax_scale, backend)
