"""What the Hopper kernels (``hopper_fwd.py``, ``hopper_bwd.py``; Gluon, sm_90) share: their tile,
their layouts, and the key stream of the kernels that walk a query tile's keys.

They compute in warpgroups over 64-row tiles (wgmma's m64 atom across the 4 warps of each), with
tiles moved by cp.async in 16-byte pieces into wgmma-ready (swizzled) shared memory. Which calls
they cover (sm_90, dtypes, head dims, block sizes, alignment) is decided in ``dispatch.py``.

The key stream (``query_program`` .. ``mask_scores``): the key tiles that one query tile reads
(the forwards and dQ): first the slash key blocks of its query block (``BLOCK // KT`` tiles per
block), then the plan's columns in KT-column slots. KT, the keys per tile, is 64 (one column word
per column tile), or 128 for the ping-pong forward (a whole 128-token key block; two column words).

Every tile is one copy of KT K rows and KT V rows by ``cp.async``, from row indices: a slash
tile's are consecutive, a column tile's are gathered (TMA cannot gather on sm_90), so strided
views (Megatron's [s, b, h, d]) and columns take one path. The rows and the mask's scalars are
loaded a tile or more before they are needed, so that the dependent loads' latency hides behind
the tiles in flight (it cut the forward's time by about 40%: docs/performance.md).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from .common import HOPPER_TILE

TILE = gl.constexpr(HOPPER_TILE)  # rows per program tile (one warpgroup's m64 wgmma) and keys per tile


@gluon.jit
def wide(x, INT64: gl.constexpr):
    """``x`` in int64 when element offsets can pass 2^31 (``int64_offsets``)."""
    if INT64:
        x = x.to(gl.int64)
    return x


@gluon.constexpr_function
def copy_layout(head_dim, warps=4):
    """Registers of a [rows, head_dim] tile for cp.async: 16-byte pieces, a warp covers whole rows."""
    return gl.BlockedLayout([1, 8], [32 // (head_dim // 8), head_dim // 8], [warps, 1], [1, 0])


@gluon.constexpr_function
def mma_layout(n, warps=4):
    """The wgmma accumulator of a [16 * warps, n] tile: the m64 atom over each warpgroup, the
    warpgroups (``warps // 4``) over consecutive 64-row slices."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, n, 16])


@gluon.constexpr_function
def register_operand_layout(head_dim, warps=4):
    """A [16 * warps, 64] A operand in registers (P or dS) of a product into a [16 * warps,
    head_dim] accumulator."""
    return gl.DotOperandLayout(operand_index=0, parent=mma_layout(head_dim, warps), k_width=2)


def shared_layout(head_dim: int, dtype: torch.dtype):
    """The wgmma-ready (swizzled) shared-memory layout of a [rows, head_dim] tile (the swizzle
    depends on the row's bytes only)."""
    element = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return gl.NVMMASharedLayout.get_default_for([TILE.value, head_dim], element)


@gluon.jit
def query_program(pid_m, pid_bh, QBlk, KVCnt, ColLimit, Diag, ColStart, HQ, GROUP, NQB, MAX_S, MAX_V, N_WORDS,
                  BLOCK: gl.constexpr, ROWS: gl.constexpr, INT64: gl.constexpr, DOCS: gl.constexpr,
                  HAS_COLS: gl.constexpr, KT: gl.constexpr = TILE):
    """Where program (``pid_m``: ROWS query rows, ``pid_bh``: batch x query head) finds its keys:
    (b, h, kv head, global query block, its slash list's and its column slots' offsets in the plan,
    its column word row, then its tiles of KT keys: slash tiles, column limit, whether a column
    needs the token-level test, first column slot read, all tiles)."""
    b = wide(pid_bh // HQ, INT64)
    h = wide(pid_bh % HQ, INT64)
    q_local_blk = pid_m // (BLOCK // ROWS)
    q_blk = gl.load(QBlk + q_local_blk)
    bh = wide(pid_bh, INT64)  # times the plan's row lengths
    plan_row = bh * NQB + q_local_blk
    n_slash = gl.load(KVCnt + plan_row) * (BLOCK // KT)
    if HAS_COLS:
        n_cols = gl.load(ColLimit + plan_row)
        diag = gl.load(Diag + plan_row) != 0
        if DOCS:  # columns of earlier documents are skipped whole tiles at a time
            c_begin = (gl.load(ColStart + plan_row) // KT) * KT
        else:
            c_begin = n_cols * 0
        n_tiles = n_slash + (gl.maximum(n_cols - c_begin, 0) + KT - 1) // KT
    else:
        n_cols = n_slash * 0
        diag = n_cols != 0
        c_begin = n_cols
        n_tiles = n_slash
    return (b, h, h // GROUP, q_blk, plan_row * MAX_S, bh * MAX_V, plan_row * N_WORDS, n_slash, n_cols, diag,
            c_begin, n_tiles)


@gluon.jit
def query_positions(pid_m, q_blk, DocStart, DocLast, BLOCK: gl.constexpr, ROWS: gl.constexpr, DOCS: gl.constexpr,
                    rows_layout: gl.constexpr):
    """The positions of program ``pid_m``'s ROWS query rows, for the masks: (first position,
    positions, their documents' starts, the start of its block's last document; the last two are
    the positions and the block without documents)."""
    q_first = q_blk * BLOCK + (pid_m % (BLOCK // ROWS)) * ROWS
    q_pos = q_first + gl.arange(0, ROWS, layout=rows_layout)
    if DOCS:
        q_doc = gl.load(DocStart + q_pos)
        doc_mask_below = gl.load(DocLast + q_blk)
    else:
        q_doc = q_pos
        doc_mask_below = q_blk
    return q_first, q_pos, q_doc, doc_mask_below


@gluon.jit
def tile_rows(u, n_tiles, n_slash, KVIdx, Cols, list_row, col_row, c_begin, n_cols, BLOCK: gl.constexpr,
              INT64: gl.constexpr, rows_layout: gl.constexpr, KT: gl.constexpr = TILE, r0: gl.constexpr = 0,
              CH: gl.constexpr = TILE):
    """Local key rows ``r0 .. r0 + CH`` of tile ``u`` of KT keys (anything past the list: never
    copied). Loaded a while before the copy is issued, so that the gather's latency hides behind
    the tile in flight."""
    offs = r0 + gl.arange(0, CH, layout=rows_layout)
    j = gl.load(KVIdx + list_row + u // (BLOCK // KT), mask=u < n_slash, other=0)
    c = c_begin + (u - n_slash) * KT + offs
    # Column slots past the limit gather row 0; their bit in the column word is never read.
    col_rows = gl.load(Cols + col_row + c, mask=(u >= n_slash) & (u < n_tiles) & (c < n_cols), other=0)
    return wide(gl.where(u >= n_slash, col_rows, j * BLOCK + (u % (BLOCK // KT)) * KT + offs), INT64)


@gluon.jit
def issue_tile(u, n_tiles, rows, k_base, v_base, stride_kn, stride_vn, k_smem, v_smem, HEAD_DIM: gl.constexpr,
               STAGES: gl.constexpr, c_layout: gl.constexpr):
    """Start copying tile ``u``'s K and V rows into slot ``u % STAGES`` and close one cp.async group
    (an empty one past the list, so that the group count stays one per tile)."""
    if u < n_tiles:
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, c_layout))[None, :]
        slot = u % STAGES
        async_copy.async_copy_global_to_shared(k_smem.index(slot), k_base + rows[:, None] * stride_kn + offs_d)
        async_copy.async_copy_global_to_shared(v_smem.index(slot), v_base + rows[:, None] * stride_vn + offs_d)
    async_copy.commit_group()


@gluon.jit
def tile_scalars(t, n_tiles, n_slash, KVIdx, KBlk, Words, list_row, word_row, c_begin, BLOCK: gl.constexpr,
                 HAS_COLS: gl.constexpr, KT: gl.constexpr = TILE, n_cols=0):
    """What tile ``t``'s mask needs, as scalars: (position of its first key if a slash tile, its
    column word if a column tile; with KT = 128 its two words, (low, high), the high one only
    below ``n_cols``). Loaded one tile ahead: the two loads depend on each other."""
    j = gl.load(KVIdx + list_row + t // (BLOCK // KT), mask=t < n_slash, other=0)
    k_first = gl.load(KBlk + j) * BLOCK + (t % (BLOCK // KT)) * KT
    if HAS_COLS:
        c0 = c_begin + (t - n_slash) * KT
        is_col = (t >= n_slash) & (t < n_tiles)
        word = gl.load(Words + word_row + c0 // 64, mask=is_col, other=0)
        if KT == 128:
            word = (word, gl.load(Words + word_row + c0 // 64 + 1, mask=is_col & (c0 + 64 < n_cols), other=0))
    else:
        word = gl.to_tensor(0).to(gl.int64)
        if KT == 128:
            word = (word, word)
    return k_first, word


@gluon.jit
def mask_scores(s, t, k_first, word, n_slash, q_first, q_pos, q_doc, doc_mask_below, diag, ColPos, col_row, c_begin,
                n_cols, BLOCK: gl.constexpr, DOCS: gl.constexpr, HAS_COLS: gl.constexpr, cols_layout: gl.constexpr,
                KT: gl.constexpr = TILE):
    """Tile ``t``'s scores ``s`` [query rows, KT keys] with the pairs it must not count set to -inf.
    Masks only where needed, as the Triton kernels: a slash tile by position on the diagonal (and,
    with documents, where it starts before the block's last document); a column tile by its column
    word(s) (``tile_scalars``), and by position only where ``diag`` (column_words.py) says so."""
    offs = gl.arange(0, KT, layout=cols_layout)
    if t < n_slash:
        needs = k_first + KT > q_first
        if DOCS:
            needs = needs | (k_first < doc_mask_below)
        if needs:
            k_pos = k_first + offs
            keep = k_pos[None, :] <= q_pos[:, None]
            if DOCS:
                keep = keep & (k_pos[None, :] >= q_doc[:, None])
            s = gl.where(keep, s, float("-inf"))
    else:
        if HAS_COLS:
            c0 = c_begin + (t - n_slash) * KT  # a multiple of KT: the tile is KT // 64 column words
            if KT == 64:
                live = ((word >> offs.to(gl.int64)) & 1) != 0
            else:
                bit = (offs % 64).to(gl.int64)
                live = (gl.where(offs < 64, word[0] >> bit, word[1] >> bit) & 1) != 0
            live = live & (c0 + offs < n_cols)
            s = gl.where(live[None, :], s, float("-inf"))
            if diag:
                c_pos = gl.load(ColPos + col_row + c0 + offs, mask=c0 + offs < n_cols, other=0).to(gl.int32)
                keep = c_pos[None, :] <= q_pos[:, None]
                if DOCS:
                    keep = keep & (c_pos[None, :] >= q_doc[:, None])
                s = gl.where(keep, s, float("-inf"))
    return s
