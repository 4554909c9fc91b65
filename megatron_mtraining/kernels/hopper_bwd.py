"""Hopper (sm_90) column gradients of vertical-slash attention, in Gluon: dK and dV of the plan's
gathered columns, the work of ``triton_bwd._dkdv_col_kernel`` with the same grid, partial outputs
and fixed-order reduction (so the backward stays deterministic).

Why (benchmarks/NOTES.md, session 11): at 128K the Triton column kernel runs its four products at
~310 TFLOP/s against ~510 for the other backward kernels: it holds the gathered K and V in
registers for the whole loop, spills, and waits on memory. Here one 4-warp program per (64-column
tile, batch x query head, query-range split) gathers its K and V rows once into shared memory
(cp.async), then walks its query tiles (64 rows; Q and dO by cp.async into two slots, one tile
ahead) with, per tile, in the transposed orientation (one row per column, so the column's live
bit and position are two registers per thread):

    S^T = K_c Q^T,  dP^T = V_c dO^T        (asynchronous wgmma)
    P^T = exp2(S^T * scale - lse) masked,  dS^T = P^T * (dP^T - delta)
    dV += P^T dO,   dK += dS^T Q            (asynchronous wgmma, retired at the next tile's top)

The dV/dK products of tile u run on the tensor cores while tile u+1's copies land and tile u+1's
lse and delta load; one bar.sync per tile (a thread's copies visible to all, and a slot refilled
only once every warp's products that read it retired). Registers and shared memory allow two
programs per SM. At 128K on an H200: 4.56 ms against the Triton kernel's 5.69 ms.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma, warpgroup_mma_init,
                                                              warpgroup_mma_wait)

from .hopper_common import TILE, _wide, copy_layout, mma_layout, register_operand_layout, shared_layout



@gluon.jit
def _issue_query_tile(u, n_q, row0, q_base, do_base, stride_qn, stride_on, q_smem, do_smem, HEAD_DIM: gl.constexpr,
                      INT64: gl.constexpr, c_layout: gl.constexpr):
    """Start copying query tile ``u``'s Q and dO rows (local rows ``row0 + 64 u ...``) into slot
    ``u % 2`` and close one cp.async group (an empty one past the range)."""
    if u < n_q:
        rows = _wide(row0 + u * TILE + gl.arange(0, TILE, layout=gl.SliceLayout(1, c_layout)), INT64)[:, None]
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, c_layout))[None, :]
        async_copy.async_copy_global_to_shared(q_smem.index(u % 2), q_base + rows * stride_qn + offs_d)
        async_copy.async_copy_global_to_shared(do_smem.index(u % 2), do_base + rows * stride_on + offs_d)
    async_copy.commit_group()


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
    HQ, GROUP, NQB, MAX_V, MAX_V_PAD, N_WORDS, SPLITS, BH,
    BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr, INT64: gl.constexpr, DOCS: gl.constexpr,
    SMEM_LAYOUT: gl.constexpr,
):
    gl.static_assert(BLOCK % TILE == 0, "index blocks are whole 64-row tiles")
    c_layout: gl.constexpr = copy_layout(HEAD_DIM)
    s_layout: gl.constexpr = mma_layout(TILE)  # S^T and dP^T
    g_layout: gl.constexpr = mma_layout(HEAD_DIM)  # dK and dV
    a_layout: gl.constexpr = register_operand_layout(HEAD_DIM)
    cols_of_s: gl.constexpr = gl.SliceLayout(1, s_layout)  # one entry per column (row of S^T)
    queries_of_s: gl.constexpr = gl.SliceLayout(0, s_layout)  # one entry per query (column of S^T)
    rows_c: gl.constexpr = gl.SliceLayout(1, c_layout)

    pid_c = gl.program_id(0)
    pid_bh = gl.program_id(1)
    pid_s = gl.program_id(2)
    b = _wide(pid_bh // HQ, INT64)
    h = _wide(pid_bh % HQ, INT64)
    kvh = h // GROUP
    bh = _wide(pid_bh, INT64)  # times the plan's row lengths
    n_cols = gl.load(ColCnt + pid_bh)

    kc_smem = gl.allocate_shared_memory(K.dtype.element_ty, [TILE, HEAD_DIM], SMEM_LAYOUT)
    vc_smem = gl.allocate_shared_memory(V.dtype.element_ty, [TILE, HEAD_DIM], SMEM_LAYOUT)
    # Two Q/dO slots: 32 KB (K_c, V_c) + 2 x 32 KB = 96 KB, two programs per SM.
    q_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [2, TILE, HEAD_DIM], SMEM_LAYOUT)
    do_smem = gl.allocate_shared_memory(DO.dtype.element_ty, [2, TILE, HEAD_DIM], SMEM_LAYOUT)

    # The tile's columns: gathered once (empty slots read row 0 and are never live; their partials
    # are zeroed at the store).
    slots_c = pid_c * TILE + gl.arange(0, TILE, layout=rows_c)
    col = _wide(gl.load(Cols + bh * MAX_V + slots_c, mask=slots_c < n_cols, other=0), INT64)[:, None]
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, c_layout))[None, :]
    async_copy.async_copy_global_to_shared(kc_smem, K + b * stride_kb + kvh * stride_kh + col * stride_kn + offs_d)
    async_copy.async_copy_global_to_shared(vc_smem, V + b * stride_vb + kvh * stride_vh + col * stride_vn + offs_d)

    # The query blocks before q_first end before the tile's first column, those from q_end on (DOCS)
    # start their documents after its last column: the splits share the rest.
    tile = pid_bh * gl.num_programs(0) + pid_c
    q_first = gl.load(QFirst + tile)
    if DOCS:
        q_end = gl.load(QEnd + tile)
    else:
        q_end = q_first * 0 + NQB
    per_split = (gl.maximum(q_end - q_first, 0) + SPLITS - 1) // SPLITS
    i_start = q_first + pid_s * per_split
    i_end = gl.minimum(i_start + per_split, q_end)
    n_q = gl.maximum(i_end - i_start, 0) * (BLOCK // TILE)  # 64-row query tiles
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
        # tile u's S^T/dP^T (loaded later, the products waited on them: profile, NOTES).
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
        _issue_query_tile(u + 1, n_q, row0, q_base, do_base, stride_qn, stride_on, q_smem, do_smem, HEAD_DIM,
                          INT64, c_layout)
        fence_async_shared()
        slot = u % 2
        s_t = warpgroup_mma(kc_smem, q_smem.index(slot).permute((1, 0)), gl.zeros([TILE, TILE], gl.float32, s_layout),
                            use_acc=False, is_async=True)
        dp_t = warpgroup_mma(vc_smem, do_smem.index(slot).permute((1, 0)),
                             gl.zeros([TILE, TILE], gl.float32, s_layout), use_acc=False, is_async=True)
        s_t = warpgroup_mma_wait(num_outstanding=1, deps=(s_t,))
        live = ((word >> c_bit.to(gl.int64)) & 1) != 0
        p_t = gl.where(live[:, None], gl.exp2(s_t * qk_scale - lse2[None, :]), 0.0)
        if any_diag:  # a live column inside some query block (never for a valid index)
            q_pos = q_blk * BLOCK + (u % (BLOCK // TILE)) * TILE + q_offs
            causal = c_pos[:, None] <= q_pos[None, :]
            if DOCS:
                causal = causal & (c_pos[:, None] >= gl.load(DocStart + q_pos)[None, :])
            p_t = gl.where(causal, p_t, 0.0)
        # dV's product starts before dS is computed (P^T as its A operand from registers).
        dv = warpgroup_mma(gl.convert_layout(p_t.to(DO.dtype.element_ty), a_layout), do_smem.index(slot), dv,
                           is_async=True)
        dp_t = warpgroup_mma_wait(num_outstanding=1, deps=(dp_t,))  # issued before dV's product
        ds_t = p_t * (dp_t - di[None, :])
        dk = warpgroup_mma(gl.convert_layout(ds_t.to(Q.dtype.element_ty), a_layout), q_smem.index(slot), dk,
                           is_async=True)
        word = word_next
        q_blk = q_blk_next
    dk = warpgroup_mma_wait(num_outstanding=0, deps=(dk,))
    dv = warpgroup_mma_wait(num_outstanding=0, deps=(dv,))
    async_copy.wait_group(0)  # no copy outlives the program (the K/V gather when n_q = 0)

    # Partials [splits * b * hq, MAX_V_PAD, HEAD_DIM] can pass 2^31 elements: int64. Empty slots
    # (they gathered row 0) store exact zeros, whatever row 0 holds: they are scattered onto row 0.
    part = (pid_s * BH + pid_bh).to(gl.int64) * MAX_V_PAD * HEAD_DIM
    out_rows = pid_c * TILE + gl.arange(0, TILE, layout=rows_c)
    ok = (out_rows < n_cols)[:, None]
    offs = out_rows.to(gl.int64)[:, None] * HEAD_DIM + offs_d
    gl.store(DKP + part + offs, gl.where(ok, gl.convert_layout(dk * sm_scale, c_layout), 0.0))
    gl.store(DVP + part + offs, gl.where(ok, gl.convert_layout(dv, c_layout), 0.0))


def column_gradients_hopper(q, k, v, do, lse, delta, dk_part, dv_part, plan, cols, col_pos, words, head_diag,
                            q_first, q_end, doc_start, docs: bool, int64: bool, strides, qk_scale: float,
                            softmax_scale: float, splits: int) -> None:
    """``_dkdv_col_kernel``'s launch with the same arguments (64-column tiles): fp32 partials of
    dK (scaled) and dV per (split, batch x query head, column slot)."""
    b, hq, nq, d = q.shape
    B = plan.block_size
    n_tiles = dk_part.shape[2] // TILE.value
    _dkdv_col_sm90_kernel[(n_tiles, b * hq, splits)](
        q, k, v, do, lse, delta, dk_part, dv_part,
        plan.q_block_ids, plan.col_count, cols, col_pos, words, head_diag, q_first, q_end, doc_start,
        *strides, qk_scale, softmax_scale,
        hq, hq // k.shape[1], nq // B, plan.cols.shape[-1], dk_part.shape[2], words.shape[-1], splits, b * hq,
        BLOCK=B, HEAD_DIM=d, INT64=int64, DOCS=docs, SMEM_LAYOUT=shared_layout(d, q.dtype), num_warps=4,
    )
