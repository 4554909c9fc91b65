"""Hopper (sm_90) backward of vertical-slash attention, in Gluon: the work of ``triton_bwd``'s three
kernels with the same grids' split of the work, the same partial outputs and the same fixed-order
reduction, so the backward stays deterministic.

  * ``_dq_sm90_kernel``   dQ of one query block's rows over its slash tiles and columns (the key
    tiles stream through two shared-memory slots, as in the forward: ``hopper_common.py``'s key stream).
  * ``_dkdv_sm90_kernel`` dK, dV of one key block over the transposed slash lists of every query
    head of its GQA group (Q/dO tiles stream through two slots; each key row has one writer).
  * ``_dkdv_col_sm90_kernel`` dK, dV of 64 gathered columns over a range of query blocks: fp32
    partials per range, summed in a fixed order afterwards (``column_partials``).

Per streamed tile, one warpgroup per 64 rows of the program runs, as asynchronous wgmma, the two
score products (S, dP; or S^T, dP^T in the key-major kernels, where each key's mask scalars are a
register per thread), the masked P = exp2(S * scale - lse) and dS = P * (dP - delta) while dP's
product finishes, then the gradient products, which retire at the next tile's top while its copies
land; one bar.sync per tile (a thread's copies visible to all, a slot refilled only once every
warp's products that read it retired).

Program shapes (docs/performance.md, "The whole backward in Gluon", has the timings): a dQ /
key-block program holds a whole index block of 128, two warpgroups sharing every streamed tile
(half the bytes per pair); at B = 128 all three kernels beat Triton's, the key blocks and the
columns by far. At B = 64 the same kernels with one warpgroup per program were no faster than
Triton's, so B = 64 runs Triton's dQ and key-block kernels (``dispatch.backward_parts``) and this
module's columns, which are faster at both block sizes.

(The ping-pong schedule of the B = 128 forward, a producer warpgroup and two consumer warpgroups
taking turns on the tensor cores, was tried for dQ and the key-block dK/dV: about a quarter slower
than these lockstep kernels (``docs/performance.md``), and removed.)
"""

from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma, warpgroup_mma_init,
                                                              warpgroup_mma_wait)

from .common import column_arguments, document_arguments
from .hopper_common import (TILE, copy_layout, issue_tile, mask_scores, mma_layout, query_positions, query_program,
                            register_operand_layout, shared_layout, tile_rows, tile_scalars, wide)


@gluon.jit
def _query_base(X, b, h, stride_b, stride_h, INT64: gl.constexpr):
    """Query head ``h`` of batch ``b`` in Q or dO."""
    return X + wide(b, INT64) * stride_b + wide(h, INT64) * stride_h


@gluon.jit
def _issue_query_tile(u, n_q, first_row, q_base, do_base, stride_qn, stride_on, q_smem, do_smem,
                      HEAD_DIM: gl.constexpr, INT64: gl.constexpr, c_layout: gl.constexpr):
    """Start copying query tile ``u``'s Q and dO rows (local rows ``first_row ...`` of
    ``q_base``/``do_base``) into slot ``u % 2`` and close one cp.async group (an empty one past the
    range)."""
    if u < n_q:
        rows = wide(first_row + gl.arange(0, TILE, layout=gl.SliceLayout(1, c_layout)), INT64)[:, None]
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, c_layout))[None, :]
        async_copy.async_copy_global_to_shared(q_smem.index(u % 2), q_base + rows * stride_qn + offs_d)
        async_copy.async_copy_global_to_shared(do_smem.index(u % 2), do_base + rows * stride_on + offs_d)
    async_copy.commit_group()


@gluon.jit
def _start_scores_t(k_tile, v_tile, q_tile, do_tile, s_layout: gl.constexpr):
    """One tile's S^T = K Q^T and dP^T = V dO^T as two asynchronous wgmma groups, both in flight."""
    shape: gl.constexpr = [k_tile.shape[0], q_tile.shape[0]]
    s_t = warpgroup_mma(k_tile, q_tile.permute((1, 0)), gl.zeros(shape, gl.float32, s_layout), use_acc=False,
                        is_async=True)
    dp_t = warpgroup_mma(v_tile, do_tile.permute((1, 0)), gl.zeros(shape, gl.float32, s_layout), use_acc=False,
                         is_async=True)
    return s_t, dp_t


@gluon.jit
def _issue_scores_t(k_tile, v_tile, q_tile, do_tile, s_layout: gl.constexpr):
    """``_start_scores_t``, then S^T waited for; dP^T still in flight (it finishes under the exp2
    of P^T)."""
    s_t, dp_t = _start_scores_t(k_tile, v_tile, q_tile, do_tile, s_layout)
    s_t = warpgroup_mma_wait(num_outstanding=1, deps=(s_t,))
    return s_t, dp_t


@gluon.jit
def _issue_gradients_t(dk, dv, p_t, dp_t, di, q_tile, do_tile, a_layout: gl.constexpr):
    """Start dV += P^T dO and dK += dS^T Q from the tile's masked P^T (dK unscaled). dV's product
    starts before dS is computed (P^T as its A operand from registers); both stay in flight and
    retire at the next tile's top."""
    dv = warpgroup_mma(gl.convert_layout(p_t.to(do_tile.dtype), a_layout), do_tile, dv, is_async=True)
    dp_t = warpgroup_mma_wait(num_outstanding=1, deps=(dp_t,))  # issued before dV's product
    ds_t = p_t * (dp_t - di[None, :])
    dk = warpgroup_mma(gl.convert_layout(ds_t.to(q_tile.dtype), a_layout), q_tile, dk, is_async=True)
    return dk, dv


@gluon.jit
def _column_program(program, n_cols, PROGRAMS, TILE_COLS: gl.constexpr):
    """``column_partials.column_program`` in Gluon: (tile, split, splits of that tile)."""
    live = (n_cols + TILE_COLS - 1) // TILE_COLS
    n_splits = PROGRAMS // gl.maximum(live, 1)
    return program // n_splits, program % n_splits, n_splits


@gluon.jit
def _dkdv_col_sm90_kernel(
    Q, K, V, DO, Lse, Delta, DKP, DVP,
    QBlk, ColCnt, Cols, ColPos, Words, HeadDiag, QFirst, QEnd, DocStart,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on,
    stride_lb, stride_lh,
    qk_scale, sm_scale,
    HQ, GROUP, NQB, MAX_V, N_TILES, N_WORDS, SPLITS,
    BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr, INT64: gl.constexpr, DOCS: gl.constexpr,
    SMEM_LAYOUT: gl.constexpr,
):
    """N_TILES x SPLITS programs per (batch x query head), shared by the head's live 64-column
    tiles (``column_partials``): one program per (live tile, query-range split). The gathered K and
    V rows sit in shared memory as wgmma operands for the whole loop (Triton's column kernel holds
    them in registers, spills and waits on memory, and takes about 1.3x as long)."""
    gl.static_assert(BLOCK % TILE == 0, "index blocks are whole 64-row tiles")
    c_layout: gl.constexpr = copy_layout(HEAD_DIM)
    s_layout: gl.constexpr = mma_layout(TILE)  # S^T and dP^T
    g_layout: gl.constexpr = mma_layout(HEAD_DIM)  # dK and dV
    a_layout: gl.constexpr = register_operand_layout(HEAD_DIM)
    cols_of_s: gl.constexpr = gl.SliceLayout(1, s_layout)  # one entry per column (row of S^T)
    queries_of_s: gl.constexpr = gl.SliceLayout(0, s_layout)  # one entry per query (column of S^T)
    rows_c: gl.constexpr = gl.SliceLayout(1, c_layout)

    pid_bh = gl.program_id(1)
    b = wide(pid_bh // HQ, INT64)
    h = wide(pid_bh % HQ, INT64)
    kvh = h // GROUP
    bh = wide(pid_bh, INT64)  # times the plan's row lengths
    n_cols = gl.load(ColCnt + pid_bh)
    program = gl.program_id(2) * N_TILES + gl.program_id(0)
    pid_c, pid_s, n_splits = _column_program(program, n_cols, N_TILES * SPLITS, TILE)
    rows_left = n_cols - pid_c * TILE  # this tile's slots that hold a column (none: <= 0)

    kc_smem = gl.allocate_shared_memory(K.dtype.element_ty, [TILE, HEAD_DIM], SMEM_LAYOUT)
    vc_smem = gl.allocate_shared_memory(V.dtype.element_ty, [TILE, HEAD_DIM], SMEM_LAYOUT)
    # Two Q/dO slots: 32 KB (K_c, V_c) + 2 x 32 KB = 96 KB, two programs per SM.
    q_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [2, TILE, HEAD_DIM], SMEM_LAYOUT)
    do_smem = gl.allocate_shared_memory(DO.dtype.element_ty, [2, TILE, HEAD_DIM], SMEM_LAYOUT)

    # The tile's columns: gathered once (empty slots read row 0 and are never live; their partials
    # are zeroed at the store).
    slots_c = pid_c * TILE + gl.arange(0, TILE, layout=rows_c)
    col = wide(gl.load(Cols + bh * MAX_V + slots_c, mask=slots_c < n_cols, other=0), INT64)[:, None]
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, c_layout))[None, :]
    async_copy.async_copy_global_to_shared(kc_smem, K + b * stride_kb + kvh * stride_kh + col * stride_kn + offs_d)
    async_copy.async_copy_global_to_shared(vc_smem, V + b * stride_vb + kvh * stride_vh + col * stride_vn + offs_d)

    # The query blocks before q_first end before the tile's first column, those from q_end on (DOCS)
    # start their documents after its last column: the splits share the rest.
    # A program past the head's live tiles (pid_c * TILE >= n_cols) walks nothing (n_q = 0 below).
    # pid_c < N_TILES always (column_partials); the clamp is kept for the register allocation: without
    # it the INT64 build's loop reloads 16 spilled values per tile, with it 8.
    tile = pid_bh * N_TILES + gl.minimum(pid_c, N_TILES - 1)
    q_first = gl.load(QFirst + tile)
    if DOCS:
        q_end = gl.load(QEnd + tile)
    else:
        q_end = q_first * 0 + NQB
    per_split = (gl.maximum(q_end - q_first, 0) + n_splits - 1) // n_splits
    i_start = q_first + pid_s * per_split
    i_end = gl.minimum(i_start + per_split, q_end)
    n_q = gl.where(pid_c * TILE < n_cols, gl.maximum(i_end - i_start, 0) * (BLOCK // TILE), 0)  # 64-row tiles
    row0 = i_start * BLOCK
    q_base = Q + b * stride_qb + h * stride_qh
    do_base = DO + b * stride_ob + h * stride_oh
    stat_base = b * stride_lb + h * stride_lh
    words = Words + bh * NQB * N_WORDS + (pid_c * TILE) // 64  # this tile's word, per query block
    any_diag = gl.load(HeadDiag + pid_bh) != 0
    _issue_query_tile(0, n_q, row0, q_base, do_base, stride_qn, stride_on, q_smem, do_smem, HEAD_DIM, INT64,
                      c_layout)  # with K_c and V_c: group 0

    c_bit = gl.arange(0, TILE, layout=cols_of_s)
    c_slot = pid_c * TILE + c_bit
    c_pos = gl.load(ColPos + bh * MAX_V + c_slot, mask=c_slot < n_cols, other=0).to(gl.int32)
    q_offs = gl.arange(0, TILE, layout=queries_of_s)
    # dK and dV are carried through the loop as in-flight wgmma accumulators.
    dk = warpgroup_mma_init(gl.zeros([TILE, HEAD_DIM], gl.float32, layout=g_layout))
    dv = warpgroup_mma_init(gl.zeros([TILE, HEAD_DIM], gl.float32, layout=g_layout))
    # Tile 0's scalars: its query block's column word and global block id (then one tile ahead).
    word = gl.load(words + i_start * N_WORDS, mask=n_q > 0, other=0)
    q_blk = gl.load(QBlk + i_start, mask=n_q > 0, other=0)
    for u in range(0, n_q):
        i_next = i_start + (u + 1) // (BLOCK // TILE)
        word_next = gl.load(words + i_next * N_WORDS, mask=u + 1 < n_q, other=0)
        q_blk_next = gl.load(QBlk + i_next, mask=u + 1 < n_q, other=0)
        # The tile's statistics load first: L2's latency hides behind tile u-1's dV/dK products and
        # tile u's S^T/dP^T (loaded later, the products waited on them: docs/performance.md).
        stat = stat_base + row0 + u * TILE + q_offs
        lse = gl.load(Lse + stat)
        di = gl.load(Delta + stat)
        # A row without any key (lse = -inf) has p = 0 everywhere: exp2(s - inf).
        lse2 = gl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
        # Tile u-1's dV/dK products have retired (every warp, after the barrier) and tile u has
        # landed: tile u+1 takes the slot they read.
        dk = warpgroup_mma_wait(num_outstanding=0, deps=(dk,))
        dv = warpgroup_mma_wait(num_outstanding=0, deps=(dv,))
        async_copy.wait_group(0)
        gl.thread_barrier()
        _issue_query_tile(u + 1, n_q, row0 + (u + 1) * TILE, q_base, do_base, stride_qn, stride_on, q_smem, do_smem,
                          HEAD_DIM, INT64, c_layout)
        fence_async_shared()
        slot = u % 2
        s_t, dp_t = _issue_scores_t(kc_smem, vc_smem, q_smem.index(slot), do_smem.index(slot), s_layout)
        live = ((word >> c_bit.to(gl.int64)) & 1) != 0
        p_t = gl.where(live[:, None], gl.exp2(s_t * qk_scale - lse2[None, :]), 0.0)
        if any_diag:  # a live column inside some query block (never for a valid index)
            q_pos = q_blk * BLOCK + (u % (BLOCK // TILE)) * TILE + q_offs
            causal = c_pos[:, None] <= q_pos[None, :]
            if DOCS:
                causal = causal & (c_pos[:, None] >= gl.load(DocStart + q_pos)[None, :])
            p_t = gl.where(causal, p_t, 0.0)
        dk, dv = _issue_gradients_t(dk, dv, p_t, dp_t, di, q_smem.index(slot), do_smem.index(slot), a_layout)
        word = word_next
        q_blk = q_blk_next
    dk = warpgroup_mma_wait(num_outstanding=0, deps=(dk,))
    dv = warpgroup_mma_wait(num_outstanding=0, deps=(dv,))
    async_copy.wait_group(0)  # no copy outlives the program (the K/V gather when n_q = 0)

    # The partial of program p of head bh is at [bh, p] (``column_partials``); [b * hq, programs,
    # 64, HEAD_DIM] can pass 2^31 elements: int64. Empty slots (they gathered row 0) store zeros.
    # Only rows_left and the program ids are live across the loop: at 255 registers, values kept
    # through it are spilled and reloaded per tile (keeping the program's tile there cost 60%).
    program = gl.program_id(2) * N_TILES + gl.program_id(0)
    part = (gl.program_id(1).to(gl.int64) * (N_TILES * SPLITS) + program) * TILE * HEAD_DIM
    ok = (gl.arange(0, TILE, layout=rows_c) < rows_left)[:, None]
    offs = gl.arange(0, TILE, layout=rows_c).to(gl.int64)[:, None] * HEAD_DIM + offs_d
    gl.store(DKP + part + offs, gl.where(ok, gl.convert_layout(dk * sm_scale, c_layout), 0.0))
    gl.store(DVP + part + offs, gl.where(ok, gl.convert_layout(dv, c_layout), 0.0))


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _store_gradient(ptrs, value, ACCUMULATE: gl.constexpr):
    """A program's gradient rows: added to the fp32 sums already there (ring steps, or dK/dV's
    column part), else stored in the tensor's dtype (the program is the rows' only writer)."""
    if ACCUMULATE:
        gl.store(ptrs, gl.load(ptrs) + value)
    else:
        gl.store(ptrs, value.to(ptrs.dtype.element_ty))


@gluon.jit
def _locate_query_tile(u, n_pass, ends, tiles, heads, g0, b, kvh, k_local, QCnt, QIdx, HQ, GROUP, NKB, MAX_S,
                       BLOCK: gl.constexpr, INT64: gl.constexpr):
    """Query tile ``u`` of a pass over heads g0.. of the GQA group (each head's transposed list in
    turn, ``BLOCK // 64`` tiles per listed query block): (query head, local query block, 64-row
    sub-tile). ``ends``/``tiles``: per head of the pass, its last tile + 1 and its tile count, held
    whole by every thread, so this is a few register operations (no loop over heads)."""
    g = gl.sum((ends <= u).to(gl.int32), axis=0)  # the head whose tiles hold u
    start = gl.sum(gl.where(heads == g, ends - tiles, 0), axis=0)
    h = kvh * GROUP + g0 + g
    plan_row = (wide(b * HQ + h, INT64)) * NKB + k_local
    e = u - start
    i = gl.load(QIdx + plan_row * MAX_S + e // (BLOCK // TILE), mask=u < n_pass, other=0)
    return h, i, e % (BLOCK // TILE)


@gluon.jit
def _dkdv_sm90_kernel(
    Q, K, V, DO, Lse, Delta, DK, DV,
    QBlk, KBlk, QCnt, QIdx, DocStart, DocLast,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on,
    stride_lb, stride_lh,
    stride_gb, stride_gh, stride_gn,
    qk_scale, sm_scale,
    HQ, HKV, GROUP, NKB, MAX_S,
    BLOCK: gl.constexpr, KEYS: gl.constexpr, HEAD_DIM: gl.constexpr, HEADS: gl.constexpr, INT64: gl.constexpr,
    DOCS: gl.constexpr, SMEM_LAYOUT: gl.constexpr,
):
    """One program per (KEYS keys of an index block, batch x kv head); the GQA group's heads in
    passes of up to HEADS, each pass one pipeline over its heads' transposed lists in turn."""
    gl.static_assert(BLOCK % KEYS == 0 and KEYS % TILE == 0, "a program's keys lie in one index block")
    WARPS: gl.constexpr = KEYS // 16  # a warpgroup per 64 keys
    c_layout: gl.constexpr = copy_layout(HEAD_DIM, WARPS)
    s_layout: gl.constexpr = mma_layout(TILE, WARPS)  # S^T and dP^T
    g_layout: gl.constexpr = mma_layout(HEAD_DIM, WARPS)  # dK and dV
    a_layout: gl.constexpr = register_operand_layout(HEAD_DIM, WARPS)
    keys_of_s: gl.constexpr = gl.SliceLayout(1, s_layout)  # one entry per key (row of S^T)
    queries_of_s: gl.constexpr = gl.SliceLayout(0, s_layout)  # one entry per query (column of S^T)
    rows_c: gl.constexpr = gl.SliceLayout(1, c_layout)
    heads_layout: gl.constexpr = gl.BlockedLayout([HEADS], [32], [WARPS], [0])  # every thread holds all

    pid_n = gl.program_id(0)
    pid_bkv = gl.program_id(1)
    b = pid_bkv // HKV
    kvh = pid_bkv % HKV
    k_local = pid_n // (BLOCK // KEYS)
    k_first = gl.load(KBlk + k_local) * BLOCK + (pid_n % (BLOCK // KEYS)) * KEYS
    k_pos = k_first + gl.arange(0, KEYS, layout=keys_of_s)
    q_offs = gl.arange(0, TILE, layout=queries_of_s)
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, c_layout))[None, :]

    k_smem = gl.allocate_shared_memory(K.dtype.element_ty, [KEYS, HEAD_DIM], SMEM_LAYOUT)
    v_smem = gl.allocate_shared_memory(V.dtype.element_ty, [KEYS, HEAD_DIM], SMEM_LAYOUT)
    # Two Q/dO slots, shared by the warpgroups: 32 KB (K, V) + 2 x 32 KB = 96 KB at 64 keys, two
    # programs per SM; 128 KB at 128 keys, one.
    q_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [2, TILE, HEAD_DIM], SMEM_LAYOUT)
    do_smem = gl.allocate_shared_memory(DO.dtype.element_ty, [2, TILE, HEAD_DIM], SMEM_LAYOUT)
    k_rows = wide(pid_n * KEYS + gl.arange(0, KEYS, layout=rows_c), INT64)[:, None]
    async_copy.async_copy_global_to_shared(
        k_smem, K + wide(b, INT64) * stride_kb + wide(kvh, INT64) * stride_kh + k_rows * stride_kn + offs_d)
    async_copy.async_copy_global_to_shared(
        v_smem, V + wide(b, INT64) * stride_vb + wide(kvh, INT64) * stride_vh + k_rows * stride_vn + offs_d)

    dk = warpgroup_mma_init(gl.zeros([KEYS, HEAD_DIM], gl.float32, layout=g_layout))
    dv = warpgroup_mma_init(gl.zeros([KEYS, HEAD_DIM], gl.float32, layout=g_layout))
    heads = gl.arange(0, HEADS, layout=heads_layout)
    # The group's heads in passes of HEADS: one pipeline per pass over the heads' lists in turn.
    for g0 in range(0, GROUP, HEADS):
        head_rows = (wide(b * HQ + kvh * GROUP + g0 + heads, INT64)) * NKB + k_local
        tiles = gl.load(QCnt + head_rows, mask=g0 + heads < GROUP, other=0) * (BLOCK // TILE)
        ends = gl.associative_scan(tiles, 0, _add)
        n_pass = gl.sum(tiles, axis=0)
        h, i, sub = _locate_query_tile(0, n_pass, ends, tiles, heads, g0, b, kvh, k_local, QCnt, QIdx, HQ, GROUP,
                                       NKB, MAX_S, BLOCK, INT64)
        row = i * BLOCK + sub * TILE
        _issue_query_tile(0, n_pass, row, _query_base(Q, b, h, stride_qb, stride_qh, INT64),
                          _query_base(DO, b, h, stride_ob, stride_oh, INT64), stride_qn, stride_on, q_smem, do_smem,
                          HEAD_DIM, INT64, c_layout)
        q_first = gl.load(QBlk + i, mask=n_pass > 0, other=0) * BLOCK + sub * TILE
        h_next, i_next, sub_next = _locate_query_tile(1, n_pass, ends, tiles, heads, g0, b, kvh, k_local, QCnt,
                                                      QIdx, HQ, GROUP, NKB, MAX_S, BLOCK, INT64)
        for u in range(0, n_pass):
            stat = wide(b, INT64) * stride_lb + wide(h, INT64) * stride_lh + row + q_offs
            lse = gl.load(Lse + stat)
            di = gl.load(Delta + stat)
            lse2 = gl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
            # Loads for later: tile u+2's list entry (its copy is issued in the next tile: a
            # dependent load waited on there would stall every tile), tile u+1's position.
            h_after, i_after, sub_after = _locate_query_tile(u + 2, n_pass, ends, tiles, heads, g0, b, kvh, k_local,
                                                             QCnt, QIdx, HQ, GROUP, NKB, MAX_S, BLOCK, INT64)
            q_first_next = gl.load(QBlk + i_next, mask=u + 1 < n_pass, other=0) * BLOCK + sub_next * TILE
            if DOCS:
                doc_below = gl.load(DocLast + q_first // BLOCK)  # the start of the block's last document
            # Tile u-1's dV/dK products have retired (every warp, after the barrier) and tile u has
            # landed: tile u+1 takes the slot they read.
            dk = warpgroup_mma_wait(num_outstanding=0, deps=(dk,))
            dv = warpgroup_mma_wait(num_outstanding=0, deps=(dv,))
            async_copy.wait_group(0)
            gl.thread_barrier()
            row_next = i_next * BLOCK + sub_next * TILE
            _issue_query_tile(u + 1, n_pass, row_next, _query_base(Q, b, h_next, stride_qb, stride_qh, INT64),
                              _query_base(DO, b, h_next, stride_ob, stride_oh, INT64), stride_qn, stride_on, q_smem,
                              do_smem, HEAD_DIM, INT64, c_layout)
            fence_async_shared()
            slot = u % 2
            s_t, dp_t = _issue_scores_t(k_smem, v_smem, q_smem.index(slot), do_smem.index(slot), s_layout)
            p_t = gl.exp2(s_t * qk_scale - lse2[None, :])
            # Masked by position only where some pair is not causal (the diagonal) or (documents)
            # some query's document starts after the tile's first key.
            needs = k_first + KEYS > q_first
            if DOCS:
                needs = needs | (k_first < doc_below)
            if needs:
                q_pos = q_first + q_offs
                keep = k_pos[:, None] <= q_pos[None, :]
                if DOCS:
                    keep = keep & (k_pos[:, None] >= gl.load(DocStart + q_pos)[None, :])
                p_t = gl.where(keep, p_t, 0.0)
            dk, dv = _issue_gradients_t(dk, dv, p_t, dp_t, di, q_smem.index(slot), do_smem.index(slot), a_layout)
            h, row, q_first = h_next, row_next, q_first_next
            h_next, i_next, sub_next = h_after, i_after, sub_after
        # Retired; carried into the next pass as accumulators again.
        dk = warpgroup_mma_init(warpgroup_mma_wait(num_outstanding=0, deps=(dk,)))
        dv = warpgroup_mma_init(warpgroup_mma_wait(num_outstanding=0, deps=(dv,)))
        async_copy.wait_group(0)  # no copy outlives the pass (the K/V copy when it is empty)
        gl.thread_barrier()  # the next pass's first tile refills slot 0
    dk = warpgroup_mma_wait(num_outstanding=0, deps=(dk,))
    dv = warpgroup_mma_wait(num_outstanding=0, deps=(dv,))

    # This program is the only writer of its key rows (slash sets are closed under transposition).
    out_rows = wide(pid_n * KEYS + gl.arange(0, KEYS, layout=rows_c), INT64)[:, None]
    g_offs = wide(b, INT64) * stride_gb + wide(kvh, INT64) * stride_gh + out_rows * stride_gn + offs_d
    gl.store(DK + g_offs, gl.load(DK + g_offs) + gl.convert_layout(dk * sm_scale, c_layout))
    gl.store(DV + g_offs, gl.load(DV + g_offs) + gl.convert_layout(dv, c_layout))


@gluon.jit
def _dq_sm90_kernel(
    Q, K, V, DO, Lse, Delta, DQ,
    QBlk, KBlk, KVCnt, KVIdx, ColLimit, Cols, ColPos, Words, Diag, DocStart, DocLast, ColStart,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on,
    stride_lb, stride_lh,
    stride_gb, stride_gh, stride_gn,
    qk_scale, sm_scale,
    HQ, GROUP, NQB, MAX_S, MAX_V, N_WORDS,
    BLOCK: gl.constexpr, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr, ACCUMULATE: gl.constexpr,
    INT64: gl.constexpr, DOCS: gl.constexpr, HAS_COLS: gl.constexpr, SMEM_LAYOUT: gl.constexpr,
):
    """One program per (ROWS query rows of an index block, batch x query head); its only writer,
    so the one-step backward stores dQ in the inputs' dtype (ACCUMULATE off)."""
    gl.static_assert(BLOCK % ROWS == 0 and ROWS % TILE == 0, "a program's rows lie in one index block")
    WARPS: gl.constexpr = ROWS // 16  # a warpgroup per 64 rows
    c_layout: gl.constexpr = copy_layout(HEAD_DIM, WARPS)
    s_layout: gl.constexpr = mma_layout(TILE, WARPS)  # S and dP
    g_layout: gl.constexpr = mma_layout(HEAD_DIM, WARPS)  # dQ
    a_layout: gl.constexpr = register_operand_layout(HEAD_DIM, WARPS)
    rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    cols_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    rows_c: gl.constexpr = gl.SliceLayout(1, c_layout)

    pid_m = gl.program_id(0)
    pid_bh = gl.program_id(1)
    b, h, kvh, q_blk, list_row, col_row, word_row, n_slash, n_cols, diag, c_begin, n_tiles = query_program(
        pid_m, pid_bh, QBlk, KVCnt, ColLimit, Diag, ColStart, HQ, GROUP, NQB, MAX_S, MAX_V, N_WORDS, BLOCK, ROWS,
        INT64, DOCS, HAS_COLS)
    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh

    # Q and dO stay; K/V tiles in two slots, shared by the warpgroups: 2 x 16 KB + 2 x 32 KB = 96 KB
    # at 64 rows, two programs per SM; 128 KB at 128 rows, one.
    q_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [ROWS, HEAD_DIM], SMEM_LAYOUT)
    do_smem = gl.allocate_shared_memory(DO.dtype.element_ty, [ROWS, HEAD_DIM], SMEM_LAYOUT)
    k_smem = gl.allocate_shared_memory(K.dtype.element_ty, [2, TILE, HEAD_DIM], SMEM_LAYOUT)
    v_smem = gl.allocate_shared_memory(V.dtype.element_ty, [2, TILE, HEAD_DIM], SMEM_LAYOUT)
    rows = wide(pid_m * ROWS + gl.arange(0, ROWS, layout=rows_c), INT64)[:, None]
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, c_layout))[None, :]
    async_copy.async_copy_global_to_shared(q_smem, Q + b * stride_qb + h * stride_qh + rows * stride_qn + offs_d)
    async_copy.async_copy_global_to_shared(do_smem, DO + b * stride_ob + h * stride_oh + rows * stride_on + offs_d)
    kv_rows = tile_rows(0, n_tiles, n_slash, KVIdx, Cols, list_row, col_row, c_begin, n_cols, BLOCK, INT64, rows_c)
    issue_tile(0, n_tiles, kv_rows, k_base, v_base, stride_kn, stride_vn, k_smem, v_smem, HEAD_DIM, 2,
               c_layout)  # with Q and dO: group 0
    kv_rows = tile_rows(1, n_tiles, n_slash, KVIdx, Cols, list_row, col_row, c_begin, n_cols, BLOCK, INT64, rows_c)

    q_first, q_pos, q_doc, doc_mask_below = query_positions(pid_m, q_blk, DocStart, DocLast, BLOCK, ROWS, DOCS,
                                                            rows_s)
    stat = b * stride_lb + h * stride_lh + pid_m * ROWS + gl.arange(0, ROWS, layout=rows_s)
    lse = gl.load(Lse + stat)
    di = gl.load(Delta + stat)
    # A row without any key (lse = -inf) has p = 0 everywhere: exp2(s - inf).
    lse2 = gl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    dq = warpgroup_mma_init(gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=g_layout))
    k_first, word = tile_scalars(0, n_tiles, n_slash, KVIdx, KBlk, Words, list_row, word_row, c_begin, BLOCK,
                                 HAS_COLS)
    for t in range(0, n_tiles):
        next_first, next_word = tile_scalars(t + 1, n_tiles, n_slash, KVIdx, KBlk, Words, list_row, word_row,
                                             c_begin, BLOCK, HAS_COLS)
        # Tile t-1's dQ product has retired (every warp, after the barrier) and tile t has landed:
        # tile t+1 takes the slot tile t-1 used.
        dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))
        async_copy.wait_group(0)
        gl.thread_barrier()
        issue_tile(t + 1, n_tiles, kv_rows, k_base, v_base, stride_kn, stride_vn, k_smem, v_smem, HEAD_DIM, 2,
                   c_layout)
        kv_rows = tile_rows(t + 2, n_tiles, n_slash, KVIdx, Cols, list_row, col_row, c_begin, n_cols, BLOCK, INT64,
                            rows_c)
        fence_async_shared()
        slot = t % 2
        s = warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)), gl.zeros([ROWS, TILE], gl.float32, s_layout),
                          use_acc=False, is_async=True)
        dp = warpgroup_mma(do_smem, v_smem.index(slot).permute((1, 0)), gl.zeros([ROWS, TILE], gl.float32, s_layout),
                           use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
        s = mask_scores(s, t, k_first, word, n_slash, q_first, q_pos, q_doc, doc_mask_below, diag, ColPos, col_row,
                        c_begin, n_cols, BLOCK, DOCS, HAS_COLS, cols_s)
        p = gl.exp2(s * qk_scale - lse2[:, None])
        dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp,))
        ds = p * (dp - di[:, None])
        dq = warpgroup_mma(gl.convert_layout(ds.to(K.dtype.element_ty), a_layout), k_smem.index(slot), dq,
                           is_async=True)
        k_first = next_first
        word = next_word
    dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))
    async_copy.wait_group(0)  # no copy outlives the program

    out = gl.convert_layout(dq * sm_scale, c_layout)
    _store_gradient(DQ + b * stride_gb + h * stride_gh + rows * stride_gn + offs_d, out, ACCUMULATE)


def column_gradients_hopper(q, k, v, do, lse, delta, dk_part, dv_part, plan, cols, col_pos, words, head_diag,
                            q_first, q_end, doc_start, docs: bool, int64: bool, strides, qk_scale: float,
                            softmax_scale: float, splits: int) -> None:
    """``_dkdv_col_kernel``'s launch with the same arguments (64-column tiles): fp32 partials of
    dK (scaled) and dV, one per column program (``column_partials``)."""
    b, hq, nq, d = q.shape
    B = plan.block_size
    n_tiles = dk_part.shape[1] // splits
    _dkdv_col_sm90_kernel[(n_tiles, b * hq, splits)](
        q, k, v, do, lse, delta, dk_part, dv_part,
        plan.q_block_ids, plan.col_count, cols, col_pos, words, head_diag, q_first, q_end, doc_start,
        *strides, qk_scale, softmax_scale,
        hq, hq // k.shape[1], nq // B, plan.cols.shape[-1], n_tiles, words.shape[-1], splits,
        BLOCK=B, HEAD_DIM=d, INT64=int64, DOCS=docs, SMEM_LAYOUT=shared_layout(d, q.dtype), num_warps=4,
    )


def block_gradients_hopper(q, k, v, do, lse, delta, dk, dv, plan, doc_start, doc_last, docs: bool, int64: bool,
                           strides, qk_scale: float, softmax_scale: float) -> None:
    """``_dkdv_kernel``'s work (dK, dV of the key blocks through the transposed slash lists, added
    into fp32 ``dk``/``dv``) with one program per (index block, batch x kv head): a warpgroup per
    64 keys, sharing every Q/dO tile."""
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    group = hq // hkv
    keys = plan.block_size
    if keys != 128:
        raise ValueError(f"block_gradients_hopper: index blocks of 128 only (got {keys}; B = 64 runs Triton's)")
    _dkdv_sm90_kernel[(nk // keys, b * hkv)](
        q, k, v, do, lse, delta, dk, dv,
        plan.q_block_ids, plan.k_block_ids, plan.q_count, plan.q_blocks, doc_start, doc_last,
        *strides, dk.stride(0), dk.stride(1), dk.stride(2), qk_scale, softmax_scale,
        hq, hkv, group, nk // plan.block_size, plan.q_blocks.shape[-1],
        BLOCK=plan.block_size, KEYS=keys, HEAD_DIM=d, HEADS=min(8, triton.next_power_of_2(group)), INT64=int64,
        DOCS=docs, SMEM_LAYOUT=shared_layout(d, q.dtype), num_warps=keys // 16,
    )


def query_gradients_hopper(q, k, v, do, lse, delta, dq, plan, accumulate: bool, int64: bool, strides, qk_scale: float,
                           softmax_scale: float) -> None:
    """``_dq_kernel``'s work (dQ of a query tile over its slash blocks and columns; added into fp32
    ``dq``, or with ``accumulate=False`` written in ``dq``'s dtype) with one program per (64 query
    rows, batch x query head); at B = 128 a program holds a whole query block, a warpgroup per 64 rows
    sharing every K/V tile."""
    b, hq, nq, d = q.shape
    rows = plan.block_size
    if rows != 128:
        raise ValueError(f"query_gradients_hopper: index blocks of 128 only (got {rows}; B = 64 runs Triton's)")
    cols, col_pos, words, diag, n_words = column_arguments(plan)
    doc_start, doc_last, col_start, docs = document_arguments(plan)
    _dq_sm90_kernel[(nq // rows, b * hq)](
        q, k, v, do, lse, delta, dq,
        plan.q_block_ids, plan.k_block_ids, plan.kv_count, plan.kv_blocks, plan.col_limit, cols, col_pos, words,
        diag, doc_start, doc_last, col_start,
        *strides, dq.stride(0), dq.stride(1), dq.stride(2), qk_scale, softmax_scale,
        hq, hq // k.shape[1], nq // plan.block_size, plan.kv_blocks.shape[-1], plan.cols.shape[-1], n_words,
        BLOCK=plan.block_size, ROWS=rows, HEAD_DIM=d, ACCUMULATE=accumulate, INT64=int64, DOCS=docs,
        HAS_COLS=plan.cols.shape[-1] > 0, SMEM_LAYOUT=shared_layout(d, q.dtype), num_warps=rows // 16,
    )
