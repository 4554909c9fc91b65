"""The column gradients' programs and partials: which program takes which (column tile, query
range), and the fixed-order sum of their fp32 partials into dK/dV.

A step's plan has room for every column of the index (``max_v`` slots per head), but a ring step
fills only the columns its key chunk holds: about 1/W of them. The column kernels
(``_dkdv_col_kernel``, ``_dkdv_col_sm90_kernel``) are launched with a fixed number of programs per
(batch x query head), ``programs = n_tiles x splits`` (``n_tiles`` tiles cover the capacity), and
the programs are dealt out to the head's LIVE tiles (those holding a column) at run time:

  live      = ceil(col_count / tile)               tiles holding a column
  n_splits  = programs // max(live, 1)             query-range splits per live tile (>= splits)
  program p -> tile p // n_splits, split p % n_splits; tiles from ``live`` on walk nothing

A head whose columns fill the capacity gets ``splits`` per tile, as a plain (tile, split) grid
would; at W = 4 a step's heads hold about a quarter of it, and the same programs split each live
tile about 4 ways instead of idling on empty tiles (dealt as a plain grid, a quarter of the
programs had work, the long ones, and the column kernel took 1.4x the one-GPU time / 4:
docs/performance.md). A split past a tile's query range walks nothing and writes zeros (with few
live tiles there can be more splits than query blocks; capping them in the kernel moved its
register allocation, doubling the spill reloads in its loop in one build).

Program p of head bh writes its fp32 partial (dK scaled, dV) at ``[bh, p]`` of
``[b * hq, programs, tile, d]``; ``add_column_partials`` sums each live tile's ``n_splits``
partials in split order and adds them into the rows of its columns: deterministic, with one
launch per position in the GQA group (within one head every column is a distinct row; two heads
of a group may share rows, so they add one after the other).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def column_program(program, n_cols, PROGRAMS, TILE_COLS: tl.constexpr):
    """(tile, split, splits of that tile) of ``program`` among a head's ``PROGRAMS`` column
    programs, for a head with ``n_cols`` columns (the module's mapping)."""
    n_splits = column_splits(n_cols, PROGRAMS, TILE_COLS)
    return program // n_splits, program % n_splits, n_splits


@triton.jit
def column_splits(n_cols, PROGRAMS, TILE_COLS: tl.constexpr):
    """Query-range splits of each live tile of a head with ``n_cols`` columns."""
    return PROGRAMS // tl.maximum(tl.cdiv(n_cols, TILE_COLS), 1)


@triton.jit
def _add_column_partials_kernel(DKP, DVP, DK, DV, ColCnt, Cols, g, HQ, GROUP, HKV, NK, MAX_V, PROGRAMS,
                                TILE_COLS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """One program per (column tile, batch x kv head) for query head ``g`` of the kv head's group."""
    tile = tl.program_id(0)
    bkv = tl.program_id(1)
    b = bkv // HKV
    bh = (b * HQ + (bkv % HKV) * GROUP + g).to(tl.int64)
    n_cols = tl.load(ColCnt + bh)
    live = tl.cdiv(n_cols, TILE_COLS)
    if tile < live:
        n_splits = column_splits(n_cols, PROGRAMS, TILE_COLS)
        rows = tl.arange(0, TILE_COLS)
        offs_d = tl.arange(0, HEAD_DIM)
        tile_offs = rows[:, None] * HEAD_DIM + offs_d[None, :]
        first = (bh * PROGRAMS + tile * n_splits) * (TILE_COLS * HEAD_DIM)
        dk = tl.zeros([TILE_COLS, HEAD_DIM], tl.float32)
        dv = tl.zeros([TILE_COLS, HEAD_DIM], tl.float32)
        for split in range(0, n_splits):  # in split order: the sum does not depend on the schedule
            at = first + tl.cast(split, tl.int64) * (TILE_COLS * HEAD_DIM) + tile_offs
            dk += tl.load(DKP + at)
            dv += tl.load(DVP + at)
        slot = tile * TILE_COLS + rows
        ok = slot < n_cols
        col = tl.load(Cols + bh * MAX_V + slot, mask=ok, other=0)
        dst = (bkv.to(tl.int64) * NK + col)[:, None] * HEAD_DIM + offs_d[None, :]
        mask = ok[:, None]
        tl.store(DK + dst, tl.load(DK + dst, mask=mask, other=0.0) + dk, mask=mask)
        tl.store(DV + dst, tl.load(DV + dst, mask=mask, other=0.0) + dv, mask=mask)


def empty_column_partials(b: int, hq: int, n_tiles: int, splits: int, tile_cols: int, head_dim: int,
                          device: torch.device) -> tuple:
    """Uninitialised fp32 (dK, dV) partials ``[b * hq, n_tiles * splits, tile_cols, head_dim]``: one
    ``[tile_cols, head_dim]`` tile per column program (every program of a live tile writes its tile,
    zeros for an empty query range; those past the live tiles are never read)."""
    shape = (b * hq, n_tiles * splits, tile_cols, head_dim)
    return (torch.empty(shape, dtype=torch.float32, device=device),
            torch.empty(shape, dtype=torch.float32, device=device))


def add_column_partials(dk_part: torch.Tensor, dv_part: torch.Tensor, col_count: torch.Tensor,
                        cols: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> None:
    """Add the column programs' partials (``empty_column_partials``) into fp32 ``dk``/``dv``
    ``[b, hkv, nk, d]`` (contiguous) at the plan's columns (``col_count`` ``[b, hq]``, ``cols``
    ``[b, hq, max_v]``, local key rows)."""
    b, hkv, nk, d = dk.shape
    hq, max_v = cols.shape[1], cols.shape[-1]
    programs, tile_cols = dk_part.shape[1], dk_part.shape[2]
    n_tiles = -(-max_v // tile_cols)
    if not all(x.is_contiguous() for x in (dk, dv, dk_part, dv_part, cols, col_count)):
        raise ValueError("add_column_partials: dk, dv, the partials, cols and col_count must be contiguous")
    if dk.dtype != torch.float32 or dv.dtype != torch.float32 or dv.shape != dk.shape:
        raise ValueError(f"add_column_partials: dk and dv must be fp32 accumulators of one shape, got "
                         f"{dk.dtype} {tuple(dk.shape)} and {dv.dtype} {tuple(dv.shape)}")
    if (dk_part.shape != dv_part.shape or dk_part.shape[0] != b * hq or dk_part.shape[3] != d
            or n_tiles == 0 or programs % n_tiles):
        raise ValueError(f"add_column_partials: partials {tuple(dk_part.shape)} do not fit {b * hq} heads, "
                         f"{n_tiles} tiles of {tile_cols} columns and head dim {d}")
    for g in range(hq // hkv):  # one after the other: heads of a group may share rows
        _add_column_partials_kernel[(n_tiles, b * hkv)](
            dk_part, dv_part, dk, dv, col_count, cols, g, hq, hq // hkv, hkv, nk, max_v, programs,
            TILE_COLS=tile_cols, HEAD_DIM=d, num_warps=4)
