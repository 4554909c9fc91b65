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

Packed documents (``cu_seqlens``, docs/design.md §1): a query only sees its own document, so
the last queries of the sequence say nothing about the other documents. Instead, every document
longer than one block (``block_size`` tokens) is scored by ITS OWN last ``last_q`` queries (all
of them if it is shorter), against its own keys only, causal by global position:
  * rows: a fixed capacity of ``config.max_documents`` slots, each ``last_q`` rows (rounded up to
    the Triton row tile; the extra rows are unused). The longest eligible documents get the slots
    (ties: the later document first); the slot table is built on the device from ``cu_seqlens``
    with a top-k of host-known size, so there is no host synchronisation and every shape is
    fixed by the config and the shape of ``cu_seqlens``. Documents beyond the capacity contribute
    no statistics (they get what the others select, the diagonal and the window);
  * fairness: each row's softmax is its own (normalised across ranks as above); each scored
    document's rows are weighted ``last_q / rows`` so every document holds the same mass
    ``last_q`` whatever its length: a needle of a small document weighs as much, relative to
    its document, as one of a big document, and the mass of a big document cannot drown it.
    Vertical columns are then selected from the union exactly as without documents (top-p over
    the summed mass, ``last_q x scored documents``; the same clamps): the selection keeps the
    top-p share of the AVERAGE document, as the unpacked selection keeps the top-p share of the
    average last query. A document's columns are its own, so the vertical statistic needs no
    further care;
  * slash offsets, unlike columns, are shared by every document: an offset selected for one
    document costs pairs in all of them. So the slash statistic re-weights each scored
    document's masses by its share of the scored documents' tokens (``group_slash_weight``; the
    total stays ``last_q x scored documents``): top-p then keeps that share of the attention
    mass of the AVERAGE QUERY, as without documents. With equal weights a 1K-token document whose
    attention spreads over its 16 offsets demanded ~15 of them, each of which also costs ~2/Lb
    of the pairs of every long document of Lb blocks (the packed quality run: 0.28 of
    the document-causal pairs, mostly slashes);
  * documents of at most one block are not scored: all their pairs lie at block offset 0 or 1,
    so they are dense with the diagonal (always selected) and offset 1, which is made mandatory
    when one of them straddles a block boundary (at most one more block diagonal);
  * sinks: positions ``< sink_tokens`` as without documents, plus the first ``sink_tokens``
    columns of every scored document (Megatron restarts RoPE per document: each one has its own
    attention sink).
Without ``cu_seqlens``, or with a single document ``[0, N]``, the unpacked code runs, bit for bit.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist

from .collective import agreement
from .config import MTrainingConfig
from .block_approx import moba_index, xattn_index
from .block_index import BlockIndex
from .documents import Documents
from .index import VSIndex
from .kernels.dispatch import approx_kernel
from .layout import check_layout, layout_table, local_positions

KEY_CHUNK = 8192  # keys scored at a time (a multiple of every block size): memory O(last_q x chunk) per head



def _world(group) -> Tuple[int, int]:
    """(size, rank) of the CP group; ``group=None`` means one device holding the full sequence."""
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _layout(config: MTrainingConfig, world: int) -> str:
    """The token layout of q and k: ``config.layout`` over a CP group; on one device the sequence
    is in order, which both layouts are at CP size 1 (zigzag's two chunks would only add a
    divisibility rule)."""
    return config.layout if world > 1 else "striped"


def _layout_positions(device, seq_len, layout, world, rank, block_size, last_q):
    """(key positions, local rows holding last queries, their slots in Q_last), a ``layout_table``."""
    def build():
        pos = local_positions(seq_len, layout, world, rank, block_size)
        rows = torch.nonzero(pos >= seq_len - last_q).flatten()
        return pos, rows, pos[rows] - (seq_len - last_q)
    return layout_table("approximator positions", device, (seq_len, layout, world, rank, block_size, last_q), build)


def _layout_inverse(device, seq_len, layout, world, rank, block_size):
    """(local index of each global position, local block of each global block), -1 where another
    rank holds it; int64, a ``layout_table``."""
    def build():
        pos = local_positions(seq_len, layout, world, rank, block_size)
        local = torch.full((seq_len,), -1, dtype=torch.int64)
        local[pos] = torch.arange(pos.numel())
        blocks = pos[::block_size] // block_size
        local_block = torch.full((seq_len // block_size,), -1, dtype=torch.int64)
        local_block[blocks] = torch.arange(blocks.numel())
        return local, local_block
    return layout_table("approximator inverse", device, (seq_len, layout, world, rank, block_size), build)


def _row_tile(last_q: int) -> int:
    """Rows per tile of the Triton statistics kernels (``triton_approx._launch_shape``)."""
    return max(16, min(128, 1 << max(0, last_q - 1).bit_length()))


@dataclasses.dataclass
class _DocumentRows:
    """The scoring rows of packed documents: ``slots`` document slots of ``stride`` rows each
    (``R = slots * stride``); a slot's valid rows are its document's last ``min(last_q, length)``
    positions, at the end of the slot. Built on the device, fixed shapes."""

    slot_start: torch.Tensor  # int64 [slots]: first position of the slot's document (0 if unused)
    slot_valid: torch.Tensor  # bool [slots]
    row_pos: torch.Tensor     # int32 [R]: global position of the row's query, -1 on unused rows
    row_start: torch.Tensor   # int32 [R]: first position of the row's document (0 on unused rows)
    row_weight: torch.Tensor  # fp64 [R]: last_q / (the document's scored rows), 0 on unused rows
    row_group: torch.Tensor   # int32 [R]: the row's (slot, query block) group, 0 on unused rows
    group_qb: torch.Tensor    # int64 [groups]: global query block of each group, -1 if unused
    tile_lo: torch.Tensor     # int32 [R / block_m]: first key position any row of the tile sees
    tile_hi: torch.Tensor     # int32 [R / block_m]: last key position any row of the tile sees (-1: none)
    block_m: int              # rows per tile (the Triton kernels' BLOCK_M)
    group_slash_weight: torch.Tensor  # fp64 [groups]: the group's document's token share x scored documents
    total: torch.Tensor       # fp64 []: the mass of all rows, last_q x scored documents
    straddle: torch.Tensor    # bool []: a document of at most one block straddles a block boundary

    @property
    def rows(self) -> int:
        return self.row_pos.numel()


def _document_rows(documents: Documents, config: MTrainingConfig, device) -> _DocumentRows:
    """The scoring rows of ``documents`` (see the module docstring), built once per object."""
    key = ("approx rows", config.last_q, config.block_size, config.max_documents, torch.device(device))
    return documents.derived(key, lambda: _build_document_rows(documents, config, torch.device(device)))


def _build_document_rows(documents: Documents, config: MTrainingConfig, device) -> _DocumentRows:
    L, B, D = config.last_q, config.block_size, config.max_documents
    seq_len = documents.seq_len
    block_m = _row_tile(L)
    stride = -(-L // block_m) * block_m
    groups_per_slot = (L - 1) // B + 2  # query blocks that L consecutive positions can touch
    cu = documents.on(device).to(torch.int64)
    starts, ends = cu[:-1], cu[1:]
    lengths = ends - starts
    eligible = lengths > B
    # Longest first, then the later document; unique keys (starts differ), so top-k is exact and
    # the same on every rank. Documents of one block or less rank last and are never valid.
    priority = torch.where(eligible, lengths * (seq_len + 1) + starts, -1 - starts)
    take = min(D, lengths.numel())
    top = torch.topk(priority, take).indices
    pad = D - take
    zeros = torch.zeros(pad, dtype=torch.int64, device=device)
    slot_start = torch.cat([starts[top], zeros])
    slot_end = torch.cat([ends[top], zeros])
    slot_valid = torch.cat([eligible[top], zeros.bool()])
    n_rows = torch.where(slot_valid, (slot_end - slot_start).clamp(max=L), 0)
    i = torch.arange(stride, device=device)
    valid = slot_valid[:, None] & (i[None, :] >= stride - n_rows[:, None])           # [D, stride]
    pos = slot_end[:, None] - stride + i[None, :]
    row_pos = torch.where(valid, pos, -1)
    row_start = torch.where(valid, slot_start[:, None], 0)
    row_weight = torch.where(valid, L / n_rows.clamp(min=1).double()[:, None], 0.0)
    base_qb = (slot_end - n_rows) // B  # query block of the slot's first valid row
    slot_ids = torch.arange(D, device=device)[:, None]
    row_group = torch.where(valid, slot_ids * groups_per_slot + row_pos.clamp(min=0) // B - base_qb[:, None], 0)
    group_qb = base_qb[:, None] + torch.arange(groups_per_slot, device=device)[None, :]
    group_ok = slot_valid[:, None] & (group_qb <= (slot_end[:, None] - 1) // B)
    group_qb = torch.where(group_ok, group_qb, -1)
    tiles_lo = torch.where(valid, row_start, seq_len).reshape(-1, block_m).amin(-1)
    tiles_hi = row_pos.reshape(-1, block_m).amax(-1)
    short = ~eligible & (starts // B != (ends - 1) // B)
    slot_tokens = torch.where(slot_valid, slot_end - slot_start, 0).double()
    token_share = slot_valid.sum() * slot_tokens / slot_tokens.sum().clamp(min=1)
    group_slash_weight = token_share.repeat_interleave(groups_per_slot)
    return _DocumentRows(
        slot_start=slot_start, slot_valid=slot_valid, row_pos=row_pos.reshape(-1).to(torch.int32),
        row_start=row_start.reshape(-1).to(torch.int32), row_weight=row_weight.reshape(-1),
        row_group=row_group.reshape(-1).to(torch.int32), group_qb=group_qb.reshape(-1),
        tile_lo=tiles_lo.to(torch.int32), tile_hi=tiles_hi.to(torch.int32), block_m=block_m,
        group_slash_weight=group_slash_weight,
        total=L * slot_valid.sum().double(), straddle=short.any())


def _packed(documents: Optional[Documents]) -> Optional[Documents]:
    """``documents`` if it holds several documents; None for none or one (``[0, N]``, the only
    valid two-entry table): the unpacked code then runs. Decided by shape, no synchronisation."""
    return documents if documents is not None and documents.num_documents > 1 else None


def _document_sinks(positions: torch.Tensor, rows: _DocumentRows, sink_tokens: int) -> torch.Tensor:
    """bool like ``positions``: among the first ``sink_tokens`` of a scored document."""
    offset = positions[..., None] - rows.slot_start
    return ((offset >= 0) & (offset < sink_tokens) & rows.slot_valid).any(-1)


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
    # Never select zero-mass padding; a mandatory entry counts even at zero mass (a sink in a
    # short document): the truncated candidate list of one device and the longer gathered one of
    # several ranks then agree on the count.
    available = (mandatory | (values > 0)).sum(-1)
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


def _torch_row_partials(q_grouped, k, key_pos, q_pos0, scale, L, rows: Optional[_DocumentRows] = None):
    """PyTorch pass 1 (CPU): online row max and normaliser over the local keys, chunk by chunk.
    ``rows``: packed documents' scoring rows (``L`` of them; ``q_pos0`` unused)."""
    q_pos = torch.arange(q_pos0, q_pos0 + L, device=k.device) if rows is None else rows.row_pos
    b, hkv = q_grouped.shape[:2]
    hq = q_grouped.shape[2] // L * hkv
    row_max = torch.full((b, hq, L), float("-inf"), device=k.device)
    normaliser = torch.zeros(b, hq, L, dtype=torch.float64, device=k.device)
    for start in range(0, k.shape[2], KEY_CHUNK):
        s = _chunk_scores(q_grouped, k, key_pos, q_pos, scale, L, start, None if rows is None else rows.row_start)
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


def _chunk_scores(q_grouped, k, key_pos, q_pos, scale, L, start, q_start=None):
    """Scaled scores [b, hq, L, chunk] of the last queries against keys start.., -inf where masked
    (after the query, or, with ``q_start``, before the query's document).
    GQA without copying K per query head: the g query heads of one KV head are one matmul."""
    b = q_grouped.shape[0]
    kc = k[:, :, start:start + KEY_CHUNK].float()
    s = torch.matmul(q_grouped, kc.transpose(-1, -2)).view(b, -1, L, kc.shape[2]) * scale
    visible = key_pos[start:start + KEY_CHUNK][None, :] <= q_pos[:, None]
    if q_start is not None:
        visible = visible & (key_pos[start:start + KEY_CHUNK][None, :] >= q_start[:, None])
    return s.masked_fill(~visible, float("-inf"))


def _torch_document_masses(q_grouped, k, key_pos, scale, B, row_max, inv_norm, rows: _DocumentRows):
    """PyTorch pass 2 for packed documents: the weights ``exp(s - row_max) * inv_norm`` (the row
    weight folded into ``inv_norm``, fp64 ``[b, hq, R]``, 0 on unused rows) folded into the
    vertical statistic (fp32) and the block masses per (row group, local key block) (fp64)."""
    R = rows.rows
    b = q_grouped.shape[0]
    hq = row_max.shape[1]
    n_local = k.shape[2]
    groups = rows.group_qb.numel()
    # Row -> group as a one-hot matrix: the per-group sums are one matmul (a fixed order).
    one_hot = (rows.row_group[None, :].long() == torch.arange(groups, device=k.device)[:, None]).double()
    vertical = torch.zeros(b, hq, n_local, dtype=torch.float64, device=k.device)
    block_mass = torch.zeros(b, hq, groups, n_local // B, dtype=torch.float64, device=k.device)
    m = _finite(row_max)
    for start in range(0, n_local, KEY_CHUNK):
        s = _chunk_scores(q_grouped, k, key_pos, rows.row_pos, scale, R, start, rows.row_start)
        p = torch.exp(s - m[..., None]).double() * inv_norm[..., None]
        stop = start + p.shape[-1]
        vertical[..., start:stop] = p.sum(-2)
        block_mass[..., start // B:stop // B] = torch.matmul(one_hot, p.reshape(b, hq, R, -1, B).sum(-1))
    return vertical.float(), block_mass


def _finite(m):
    """A row with no visible key has max -inf: use 0 there, so exp(-inf - 0) gives exact zeros."""
    return torch.where(torch.isinf(m), torch.zeros_like(m), m)


def vs_statistics(q, k, config: MTrainingConfig, group=None, softmax_scale=None,
                  backend: str = "auto", cu_seqlens: Union[Documents, torch.Tensor, None] = None):
    """Vertical (per local column, fp32) and slash (per global block offset, fp64) attention mass
    of the last ``last_q`` queries, identical to a single device's up to summation order.
    Returns ``(vertical, slash, key_pos)``, ``key_pos`` the global position of each local key.

    ``backend``: "auto" (fused Triton kernels on CUDA, PyTorch passes elsewhere), "triton" or "torch".
    ``cu_seqlens``: packed documents (module docstring; a ``documents.Documents`` or its tensor):
    the masses of each scored document's last queries, weighted so every scored document holds
    ``last_q``.
    """
    packed = _packed(Documents.of(cu_seqlens, q.shape[2] * _world(group)[0], "vs_statistics: cu_seqlens",
                                   validate=config.settings.validate))
    if packed is not None:
        rows = _document_rows(packed, config, q.device)
        return _document_statistics(q, k, config, group, softmax_scale, backend, rows)
    world, rank = _world(group)
    layout = _layout(config, world)
    kernel = approx_kernel(backend, q.device)  # "triton": kernels/triton_approx.py
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
    if kernel == "triton":
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
    if kernel == "triton":
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


def _document_statistics(q, k, config: MTrainingConfig, group, softmax_scale,
                         backend: str, rows: _DocumentRows):
    """``vs_statistics`` for packed documents: the same two passes over the scoring ``rows``."""
    world, rank = _world(group)
    layout = _layout(config, world)
    kernel = approx_kernel(backend, q.device)  # "triton": kernels/triton_approx.py
    b, hq, n_local, d = q.shape
    hkv = k.shape[1]
    B = config.block_size
    seq_len = n_local * world
    nb = seq_len // B
    R = rows.rows
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    key_pos = _layout_positions(q.device, seq_len, layout, world, rank, B, config.last_q)[0]
    local_of, local_block_of = _layout_inverse(q.device, seq_len, layout, world, rank, B)

    # The scoring queries from whichever ranks hold them: gathered into zeros, summed across
    # ranks (exact: one nonzero term per entry). Data-dependent positions, fixed shapes. (The
    # clamps only keep a bad GPU cu_seqlens, whose values are not checked here, in bounds.)
    local = local_of[rows.row_pos.long().clamp(0, seq_len - 1)]
    mine = (rows.row_pos >= 0) & (local >= 0)
    q_rows = torch.where(mine[:, None], q.index_select(2, local.clamp(min=0)).float(), 0.0)
    _all_reduce(q_rows, dist.ReduceOp.SUM, group, world)
    q_grouped = q_rows.reshape(b, hkv, (hq // hkv) * R, d)

    # Pass 1: row max and normaliser (each row over its own document's keys), across ranks.
    if kernel == "triton":
        from .kernels.triton_approx import row_partials
        q_grouped = q_grouped.to(k.dtype).contiguous()
        k = k if k.stride(-1) == 1 else k.contiguous()
        part_max, part_sum = row_partials(q_grouped, k, key_pos, 0, scale, R, B, rows=rows)
        row_max = part_max.amax(-1)
        rescale = torch.exp(part_max - _finite(row_max)[..., None]).double()
        normaliser = (part_sum.double() * rescale).sum(-1)
    else:
        row_max, normaliser = _torch_row_partials(q_grouped, k, key_pos, 0, scale, R, rows)
    local_max = row_max.clone()
    _all_reduce(row_max, dist.ReduceOp.MAX, group, world)
    normaliser *= torch.exp(local_max - _finite(row_max)).double()
    _all_reduce(normaliser, dist.ReduceOp.SUM, group, world)
    # Each document's weight folds into the normaliser; unused rows (no visible key anywhere,
    # normaliser 0) get weight 0, not 0/0.
    inv_norm = torch.where(rows.row_weight > 0, rows.row_weight / normaliser, 0.0)

    # Pass 2: vertical statistic and block masses per (row group, local key block).
    if kernel == "triton":
        from .kernels.triton_approx import vs_masses
        vertical, block_mass = vs_masses(q_grouped, k, key_pos, 0, scale, R, B, _finite(row_max),
                                         inv_norm.float(), rows.group_qb.numel(), rows=rows)
    else:
        vertical, block_mass = _torch_document_masses(q_grouped, k, key_pos, scale, B, row_max, inv_norm, rows)

    # Slash: offset o of group j (query block qb_j) collects key block qb_j - o, weighted by its
    # document's token share (module docstring). A gather (pad column for blocks of other ranks
    # and before the sequence) then a sum over the groups in order: deterministic, no float
    # atomics. Groups in chunks to bound the temporary.
    n_kb = n_local // B
    weighted = block_mass.double() * rows.group_slash_weight[:, None]
    padded = torch.cat([weighted, weighted.new_zeros(b, hq, block_mass.shape[2], 1)], -1)
    offsets = torch.arange(nb, device=q.device)
    slash = torch.zeros(b, hq, nb, dtype=torch.float64, device=q.device)
    groups = rows.group_qb.numel()
    chunk = max(1, (1 << 24) // max(1, b * hq * nb))
    for g0 in range(0, groups, chunk):
        qb = rows.group_qb[g0:g0 + chunk, None]
        kb = qb - offsets[None, :]
        source = torch.where((qb >= 0) & (kb >= 0), local_block_of[kb.clamp(0, nb - 1)], -1)
        source = torch.where(source >= 0, source, n_kb)
        part = padded[:, :, g0:g0 + chunk].gather(-1, source.expand(b, hq, -1, -1))
        slash += part.sum(-2)
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


def approximate_vs_index(q, k, config: MTrainingConfig, group=None,
                         softmax_scale=None, backend: str = "auto",
                         cu_seqlens: Union[Documents, torch.Tensor, None] = None) -> VSIndex:
    world, _ = _world(group)
    packed = _packed(Documents.of(cu_seqlens, q.shape[2] * world, "approximate_vs_index: cu_seqlens",
                                   validate=config.settings.validate))
    rows = None if packed is None else _document_rows(packed, config, q.device)
    if rows is None:
        vertical, slash, key_pos = vs_statistics(q, k, config, group, softmax_scale, backend)
    else:
        vertical, slash, key_pos = _document_statistics(q, k, config, group, softmax_scale, backend, rows)
    # NaN mass (NaN or Inf in q or k, or scores that overflow) counts as none: sorted, NaN would
    # rank before the mandatory diagonal and sinks and push them out of the index.
    vertical, slash = torch.nan_to_num(vertical, nan=0.0), torch.nan_to_num(slash, nan=0.0)
    b, hq, n_local = vertical.shape
    seq_len, B = n_local * world, config.block_size
    nb = seq_len // B
    total = torch.full((b, hq), float(config.last_q), dtype=torch.float64, device=q.device)
    if rows is not None:  # last_q per scored document
        total = rows.total.expand(b, hq)

    # Slash: every offset is a candidate; offsets 0..local_window-1 are mandatory (0 always).
    offsets = torch.arange(nb, device=q.device).expand(b, hq, nb)
    mandatory_s = offsets < max(1, config.local_window)
    if rows is not None:  # documents of at most one block across a block boundary need offset 1
        mandatory_s = mandatory_s | ((offsets == 1) & rows.straddle)
    slash_idx, n_slash = _budget_select(slash, offsets, mandatory_s, total, config.top_p,
                                        config.min_slash, min(config.max_slash, nb), config.max_slash)

    # Vertical: each rank's top max_vertical columns are the only candidates that can win.
    cap_v = config.max_vertical
    if cap_v == 0:
        empty = torch.zeros(b, hq, 0, dtype=torch.int32, device=q.device)
        return VSIndex(slash_idx, n_slash, empty, torch.zeros(b, hq, dtype=torch.int32, device=q.device), B)
    sinks = key_pos < config.sink_tokens
    if rows is not None:  # and the first sink_tokens of every scored document
        sinks = sinks | _document_sinks(key_pos, rows, config.sink_tokens)
    sinks = sinks.expand(b, hq, n_local)
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
    mandatory_v = cand_positions < config.sink_tokens
    if rows is not None:
        mandatory_v = mandatory_v | _document_sinks(cand_positions, rows, config.sink_tokens)
    vert_idx, n_vert = _budget_select(cand_values, cand_positions, mandatory_v, total, config.top_p,
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


def _agree_on_shapes(q, k, config: MTrainingConfig, group, softmax_scale,
                     documents: Optional[Documents], local_error: Optional[BaseException]) -> None:
    """Before the first collective whose size depends on them: the CP ranks agree on the shapes
    and settings (``collective/agreement.py``; a rank whose own checks failed makes its peers fail too).
    Eager where that costs no device synchronisation (CPU / gloo, or ``Settings.validate``); on
    GPUs with NCCL the Megatron path checks them at its consistency iterations instead
    (``integration/consistency.py``), and nothing is added here."""
    if agreement.mode(q.device, group, config.settings) != "eager":
        if local_error is not None:
            raise local_error
        return
    items = []
    if local_error is None:
        given = documents is not None
        cu_seqlens = documents.cu_seqlens if given else None
        items = [("function", agreement.host_word("approximate_index"), "approximate_index"),
                 ("q shape [batch, heads, tokens per rank, head_dim]", agreement.host_word(tuple(q.shape)),
                  tuple(q.shape)),
                 ("k shape", agreement.host_word(tuple(k.shape)), tuple(k.shape)),
                 ("dtype", agreement.host_word(str(q.dtype)), q.dtype),
                 ("MTraining config", agreement.host_word(config), config),
                 ("softmax scale", agreement.host_word(softmax_scale), softmax_scale),
                 ("cu_seqlens given", given, given),
                 ("cu_seqlens length", int(cu_seqlens.numel()) if given else 0,
                  int(cu_seqlens.numel()) if given else 0),
                 ("cu_seqlens values", agreement.Checksum(cu_seqlens) if given else 0, None)]
    agreement.agree(group, "approximate_index", items, local_error, q.device, config.settings,
                    hint="(In Megatron: q is [--micro-batch-size, heads, --seq-length / CP, head_dim]: the CP ranks "
                         "got batches of different --seq-length or --micro-batch-size from the data path.) ")


def approximate_index(q: torch.Tensor, k: torch.Tensor, config: MTrainingConfig, group=None,
                      softmax_scale: Optional[float] = None, backend: str = "auto",
                      cu_seqlens: Union[Documents, torch.Tensor, None] = None) -> Union[VSIndex, BlockIndex]:
    """The index for one layer: ``config.index`` picks "vs" (approximated from q and k), "dense"
    (all blocks), "fixed" (fixed budgets), or a ``BlockIndex``: "moba" (MoBA's gate) or "xattn"
    (XAttention's antidiagonal scores), ``block_approx.py``; a sequence of at most ``config.dense_max_seq_length``
    tokens gets the dense index whatever the builder. q ``[b, hq, n_local, d]``, k ``[b, hkv, n_local, d]``
    are this rank's post-RoPE tokens in ``config.layout`` order (``group=None``: the full sequence
    on one device, in order). Returns the same ``VSIndex`` on every rank. ``backend`` computes the statistics:
    "auto" (fused Triton kernels on CUDA, PyTorch elsewhere), "triton" or "torch".

    ``cu_seqlens``: packed documents in GLOBAL positions, the same on every rank and batch element:
    a ``documents.Documents`` (built once per batch) or its int32 tensor ``[0, e1, ..., N]``
    (checked fully on CPU, by structure elsewhere: no host synchronisation). The "vs" builder
    then scores each document by its own last queries (up to
    ``config.max_documents`` documents, the longest first; see the module docstring); None or
    one document ``[0, N]`` gives exactly the unpacked index."""
    world, _ = _world(group)
    documents = None
    with agreement.OwnChecks(group if world > 1 else None, config.settings) as checks:  # with CP > 1 the peers hear of a failure
        approx_kernel(backend, q.device)  # a bad name fails here, whatever the index builder
        if q.dim() != 4 or k.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
            raise ValueError(f"approximate_index: q {tuple(q.shape)} and k {tuple(k.shape)} must be "
                             "[batch, heads, tokens, head_dim] with matching batch, tokens and head_dim")
        if q.shape[1] % k.shape[1]:
            raise ValueError(f"approximate_index: query heads ({q.shape[1]}) must be a multiple of key heads "
                             f"({k.shape[1]})")
        n_local = q.shape[2]
        seq_len = n_local * world
        if world == 1 and seq_len % config.block_size:
            raise ValueError(f"approximate_index: the sequence length {seq_len} is not a multiple of the block size "
                             f"{config.block_size}")
        check_layout(seq_len, _layout(config, world), world, config.block_size)
        documents = Documents.of(cu_seqlens, seq_len, "approximate_index: cu_seqlens",
                                 validate=config.settings.validate)
        builds_vs = config.index == "vs" and seq_len > config.dense_max_seq_length
        if builds_vs and config.last_q > n_local:
            raise ValueError(f"approximate_index: last_q ({config.last_q}) exceeds the {n_local} tokens each rank "
                             "holds; lower --mtraining-last-q")
    if world > 1:  # in the agreement below
        _agree_on_shapes(q, k, config, group, softmax_scale, documents, checks.error)
    b, hq = q.shape[:2]
    if config.index == "dense" or seq_len <= config.dense_max_seq_length:
        return VSIndex.dense(b, hq, seq_len, config.block_size, device=q.device)
    if config.index == "fixed":
        return fixed_index(b, hq, seq_len, config, device=q.device)
    if config.index == "moba":
        return moba_index(q, k, config, group, documents)
    if config.index == "xattn":
        return xattn_index(q, k, config, group, documents)
    return approximate_vs_index(q, k, config, group, softmax_scale, backend, documents)
