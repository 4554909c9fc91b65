"""Triton backward of vertical-slash attention for one (query chunk, key chunk) pair.

Gradients are recomputed from the saved (final) log-sum-exp and ``delta = rowsum(dO * O)``,
and added into fp32 accumulators, so a ring can call this once per step:
  * ``_dq_kernel``   one program per (query block, head): the forward's key blocks and columns.
  * ``_dkdv_kernel`` one program per (key block, kv head): the transposed slash lists of every
    query head of the GQA group. Slash sets are closed under transposition (query block
    ``kb + delta`` reads key block ``kb``), so each key block has exactly one writer: no atomics.
  * ``_dkdv_col_kernel`` columns are read by every later query block: a split reduction over
    the query blocks from the first that can see the column tile (``first_query_blocks``)
    writes fp32 partials, summed in a fixed order afterwards (deterministic; ``column_partials``).

Each kernel has a launcher with the same arguments as its Hopper twin in ``hopper_bwd.py``
(``query_gradients_*``, ``block_gradients_*``, ``column_gradients_*``). ``step.py`` runs the
backward of a step: it launches each part on the kernels ``dispatch.backward_parts`` picks,
and allocates and reduces the column partials.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .column_partials import column_program
from .common import column_arguments, document_arguments
from .triton_common import (causal_columns, column_begin, column_tile, document_starts, head_offset, kernel_flags,
                            needs_token_mask, query_documents, tile_config, tile_ptrs, token_mask, token_mask_t, wide,
                            word_bits)


@triton.jit
def _probs_t(k, q, lse2, qk_scale, DOT_PRECISION: tl.constexpr):
    """Key-major probabilities of one tile, recomputed from the saved log-sum-exp (base 2)."""
    s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
    return tl.math.exp2(s_t * qk_scale - lse2[None, :])


@triton.jit
def _grads_t(dk, dv, p_t, v, q, do, di, DOT_PRECISION: tl.constexpr):
    """Add one tile's (dk, dv) contributions (dk without softmax scale) from its masked
    probabilities; the products accumulate in place."""
    dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
    ds_t = p_t * (dp_t - di[None, :])
    dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def _load_query_side(Q, DO, Lse, Delta, b, h, rows, offs_d,
                     stride_qb, stride_qh, stride_qn, stride_ob, stride_oh, stride_on,
                     stride_lb, stride_lh, INT64: tl.constexpr, UPCAST: tl.constexpr):
    q = tl.load(tile_ptrs(Q + head_offset(b, h, stride_qb, stride_qh, INT64), rows, stride_qn, offs_d, INT64))
    do = tl.load(tile_ptrs(DO + head_offset(b, h, stride_ob, stride_oh, INT64), rows, stride_on, offs_d, INT64))
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    stat = head_offset(b, h, stride_lb, stride_lh, INT64) + rows
    lse = tl.load(Lse + stat)
    # A row without any key (lse = -inf) has p = 0 everywhere: exp2(s - inf).
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    di = tl.load(Delta + stat)
    return q, do, lse2, di


@triton.jit
def _dq_columns(dq, q, do, lse2, di, q_pos, q_doc, qk_scale, Cols, ColPos, Words, k_base, v_base, col_row,
                word_row, c_begin, n_cols, stride_kn, stride_vn, offs_d, BLOCK_COL: tl.constexpr,
                INT64: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, CAUSAL: tl.constexpr,
                DOCS: tl.constexpr):
    """dQ's column part: add the live columns of slots [c_begin, n_cols) into ``dq``."""
    for c0 in range(c_begin, n_cols, BLOCK_COL):
        k, v, live = column_tile(Cols, Words, k_base, v_base, col_row, word_row, c0, n_cols,
                                 stride_kn, stride_vn, offs_d, BLOCK_COL, INT64, UPCAST)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        p = tl.where(live[None, :], tl.math.exp2(s * qk_scale - lse2[:, None]), 0.0)
        if CAUSAL:
            p = causal_columns(p, 0.0, ColPos, col_row, c0, n_cols, q_pos, q_doc, BLOCK_COL, DOCS)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - di[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def _dq_kernel(
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
    BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_COL: tl.constexpr,
    HEAD_DIM: tl.constexpr, INT64: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    MASK_EVERY_TILE: tl.constexpr, DQ_ACCUMULATE: tl.constexpr, DOCS: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HQ
    h = pid_bh % HQ
    kvh = h // GROUP
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q_local_blk = pid_m // (BLOCK // BLOCK_M)
    q_blk = tl.load(QBlk + q_local_blk)
    q_pos = q_blk * BLOCK + (pid_m % (BLOCK // BLOCK_M)) * BLOCK_M + offs_m
    rows = pid_m * BLOCK_M + offs_m
    q_doc, doc_mask_below = query_documents(DocStart, DocLast, q_pos, q_blk, DOCS)
    q, do, lse2, di = _load_query_side(Q, DO, Lse, Delta, b, h, rows, offs_d,
                                       stride_qb, stride_qh, stride_qn, stride_ob, stride_oh, stride_on,
                                       stride_lb, stride_lh, INT64, UPCAST)
    k_base = K + head_offset(b, kvh, stride_kb, stride_kh, INT64)
    v_base = V + head_offset(b, kvh, stride_vb, stride_vh, INT64)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    bh = wide(pid_bh, INT64)  # times the plan's row lengths
    plan_row = bh * NQB + q_local_blk
    n_blocks = tl.load(KVCnt + plan_row)
    for t in range(0, n_blocks):
        j = tl.load(KVIdx + plan_row * MAX_S + t)
        k_blk = tl.load(KBlk + j)
        for sub in tl.static_range(0, BLOCK, BLOCK_N):
            k_rows = j * BLOCK + sub + offs_n
            k = tl.load(tile_ptrs(k_base, k_rows, stride_kn, offs_d, INT64))
            v = tl.load(tile_ptrs(v_base, k_rows, stride_vn, offs_d, INT64))
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            p = tl.math.exp2(s - lse2[:, None])
            # As in the forward: the diagonal block, and (DOCS) blocks before the last query's document.
            if MASK_EVERY_TILE or needs_token_mask(k_blk, q_blk, doc_mask_below, BLOCK, DOCS):
                k_pos = k_blk * BLOCK + sub + offs_n
                p = tl.where(token_mask(k_pos, q_pos, q_doc, DOCS), p, 0.0)
            dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
            ds = p * (dp - di[:, None])
            dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)

    # The columns after the limit are after all of this block's queries. Two copies of the loop,
    # so that neither branches inside (diag: never for a valid index).
    n_cols = tl.load(ColLimit + plan_row)
    c_begin = column_begin(ColStart, plan_row, BLOCK_COL, DOCS)
    col_row, word_row = bh * MAX_V, plan_row * N_WORDS
    if tl.load(Diag + plan_row) != 0:
        dq = _dq_columns(dq, q, do, lse2, di, q_pos, q_doc, qk_scale, Cols, ColPos, Words, k_base, v_base,
                         col_row, word_row, c_begin, n_cols, stride_kn, stride_vn, offs_d, BLOCK_COL, INT64, UPCAST,
                         DOT_PRECISION, True, DOCS)
    else:
        dq = _dq_columns(dq, q, do, lse2, di, q_pos, q_doc, qk_scale, Cols, ColPos, Words, k_base, v_base,
                         col_row, word_row, c_begin, n_cols, stride_kn, stride_vn, offs_d, BLOCK_COL, INT64, UPCAST,
                         DOT_PRECISION, False, DOCS)

    dq_ptrs = tile_ptrs(DQ + head_offset(b, h, stride_gb, stride_gh, INT64), rows, stride_gn, offs_d, INT64)
    if DQ_ACCUMULATE:
        tl.store(dq_ptrs, tl.load(dq_ptrs) + dq * sm_scale)
    else:  # this program is the rows' only writer: store in DQ's dtype
        tl.store(dq_ptrs, (dq * sm_scale).to(DQ.dtype.element_ty))


@triton.jit
def _dkdv_kernel(
    Q, K, V, DO, Lse, Delta, DK, DV,
    QBlk, KBlk, QCnt, QIdx, DocStart,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on,
    stride_lb, stride_lh,
    stride_gb, stride_gh, stride_gn,
    qk_scale, sm_scale,
    HQ, HKV, GROUP, NKB, MAX_S,
    BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    INT64: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, DOCS: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bkv = tl.program_id(1)
    b = pid_bkv // HKV
    kvh = pid_bkv % HKV
    offs_n = tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    k_local_blk = pid_n // (BLOCK // BLOCK_N)
    k_blk = tl.load(KBlk + k_local_blk)
    k_pos = k_blk * BLOCK + (pid_n % (BLOCK // BLOCK_N)) * BLOCK_N + offs_n
    k_rows = pid_n * BLOCK_N + offs_n
    k = tl.load(tile_ptrs(K + head_offset(b, kvh, stride_kb, stride_kh, INT64), k_rows, stride_kn, offs_d, INT64))
    v = tl.load(tile_ptrs(V + head_offset(b, kvh, stride_vb, stride_vh, INT64), k_rows, stride_vn, offs_d, INT64))
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for g in range(0, GROUP):
        h = kvh * GROUP + g
        plan_row = wide(b * HQ + h, INT64) * NKB + k_local_blk
        n_blocks = tl.load(QCnt + plan_row)
        for t in range(0, n_blocks):
            i = tl.load(QIdx + plan_row * MAX_S + t)
            q_blk = tl.load(QBlk + i)
            for sub in tl.static_range(0, BLOCK, BLOCK_M):
                q_pos = q_blk * BLOCK + sub + offs_m
                q, do, lse2, di = _load_query_side(Q, DO, Lse, Delta, b, h, i * BLOCK + sub + offs_m, offs_d,
                                                   stride_qb, stride_qh, stride_qn, stride_ob, stride_oh,
                                                   stride_on, stride_lb, stride_lh, INT64, UPCAST)
                # Masked on every tile: a branch to two copies of the tile's code (unmasked off the
                # diagonal) made this kernel twice as slow, and a branch around the mask alone
                # slower too (more spills).
                # (DOCS: the key must also lie in the query's document.)
                q_doc = document_starts(DocStart, q_pos, DOCS)
                p_t = tl.where(token_mask_t(k_pos, q_pos, q_doc, DOCS), _probs_t(k, q, lse2, qk_scale, DOT_PRECISION),
                               0.0)
                dk, dv = _grads_t(dk, dv, p_t, v, q, do, di, DOT_PRECISION)
    g_head = head_offset(b, kvh, stride_gb, stride_gh, INT64)
    dk_ptrs = tile_ptrs(DK + g_head, k_rows, stride_gn, offs_d, INT64)
    dv_ptrs = tile_ptrs(DV + g_head, k_rows, stride_gn, offs_d, INT64)
    tl.store(dk_ptrs, tl.load(dk_ptrs) + dk * sm_scale)
    tl.store(dv_ptrs, tl.load(dv_ptrs) + dv)


@triton.jit
def _column_gradients(dk, dv, k, v, c_pos, first_bit, words, i_start, i_end, any_diag, Q, DO, Lse, Delta, QBlk,
                      DocStart, b, h, offs_m, offs_d, qk_scale, stride_qb, stride_qh, stride_qn, stride_ob,
                      stride_oh, stride_on, stride_lb, stride_lh, N_WORDS, BLOCK: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_COL: tl.constexpr, INT64: tl.constexpr, UPCAST: tl.constexpr,
                      DOT_PRECISION: tl.constexpr, DOCS: tl.constexpr):
    """Add the gradients of one column tile over query blocks [i_start, i_end) into (dk, dv)."""
    for i in range(i_start, i_end):
        live = word_bits(tl.load(words + i * N_WORDS), first_bit, BLOCK_COL)  # this block's live columns
        q_blk = tl.load(QBlk + i)
        for sub in tl.static_range(0, BLOCK, BLOCK_M):
            q, do, lse2, di = _load_query_side(Q, DO, Lse, Delta, b, h, i * BLOCK + sub + offs_m, offs_d,
                                               stride_qb, stride_qh, stride_qn, stride_ob, stride_oh,
                                               stride_on, stride_lb, stride_lh, INT64, UPCAST)
            q_pos = q_blk * BLOCK + sub + offs_m
            q_doc = document_starts(DocStart, q_pos, DOCS)
            keep = live[:, None] & (token_mask_t(c_pos, q_pos, q_doc, DOCS) | (not any_diag))
            p_t = tl.where(keep, _probs_t(k, q, lse2, qk_scale, DOT_PRECISION), 0.0)
            dk, dv = _grads_t(dk, dv, p_t, v, q, do, di, DOT_PRECISION)
    return dk, dv


@triton.jit
def _dkdv_col_kernel(
    Q, K, V, DO, Lse, Delta, DKP, DVP,
    QBlk, ColCnt, Cols, ColPos, Words, HeadDiag, QFirst, QEnd, DocStart,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on,
    stride_lb, stride_lh,
    qk_scale, sm_scale,
    HQ, GROUP, NQB, MAX_V, N_TILES, N_WORDS, SPLITS,
    BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_COL: tl.constexpr, HEAD_DIM: tl.constexpr,
    INT64: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, DOCS: tl.constexpr,
):
    """N_TILES x SPLITS programs per (batch x query head), shared by the head's live column tiles:
    one program per (live tile, query-range split) (``column_partials.column_program``)."""
    tl.static_assert(64 % BLOCK_COL == 0, "a column tile must lie within one 64-bit word")
    pid_bh = tl.program_id(1)
    b = pid_bh // HQ
    h = pid_bh % HQ
    kvh = h // GROUP
    bh = wide(pid_bh, INT64)  # times the plan's row lengths
    n_cols = tl.load(ColCnt + pid_bh)
    program = tl.program_id(2) * N_TILES + tl.program_id(0)
    pid_c, pid_s, n_splits = column_program(program, n_cols, N_TILES * SPLITS, BLOCK_COL)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_c = pid_c * BLOCK_COL + tl.arange(0, BLOCK_COL)
    c_ok = offs_c < n_cols
    col = tl.load(Cols + bh * MAX_V + offs_c, mask=c_ok, other=0)
    c_pos = tl.load(ColPos + bh * MAX_V + offs_c, mask=c_ok, other=0)
    # Empty slots read row 0 and are never live (their partials are zeroed at the store).
    k = tl.load(tile_ptrs(K + head_offset(b, kvh, stride_kb, stride_kh, INT64), col, stride_kn, offs_d, INT64))
    v = tl.load(tile_ptrs(V + head_offset(b, kvh, stride_vb, stride_vh, INT64), col, stride_vn, offs_d, INT64))
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_COL, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_COL, HEAD_DIM], tl.float32)
    # The query blocks before q_first end before the tile's first column, those from q_end on (DOCS)
    # start their documents after its last column: the splits share the rest.
    # pid_c < N_TILES always (column_partials); a program past the head's live tiles
    # (pid_c * BLOCK_COL >= n_cols) walks nothing: its query range is empty.
    tile = pid_bh * N_TILES + pid_c
    q_first = tl.load(QFirst + tile)
    if DOCS:
        q_end = tl.load(QEnd + tile)
    else:
        q_end = NQB
    per_split = tl.cdiv(tl.maximum(q_end - q_first, 0), n_splits)
    i_start = q_first + pid_s * per_split
    i_end = tl.where(pid_c * BLOCK_COL < n_cols, tl.minimum(i_start + per_split, q_end), i_start)
    words = Words + bh * NQB * N_WORDS + (pid_c * BLOCK_COL) // 64  # this tile's word, per query block
    # A live column inside some query block of this head (never for a valid index) needs the
    # token-level test; folded into the mask without a branch (a branch, or two copies of the
    # loop, made ptxas serialise the loop's wgmma instructions).
    any_diag = tl.load(HeadDiag + pid_bh) != 0
    dk, dv = _column_gradients(dk, dv, k, v, c_pos, (pid_c * BLOCK_COL) % 64, words, i_start, i_end, any_diag,
                               Q, DO, Lse, Delta, QBlk, DocStart, b, h, offs_m, offs_d, qk_scale, stride_qb,
                               stride_qh, stride_qn, stride_ob, stride_oh, stride_on, stride_lb, stride_lh, N_WORDS,
                               BLOCK, BLOCK_M, BLOCK_COL, INT64, UPCAST, DOT_PRECISION, DOCS)
    # The partial of program p of head bh is at [bh, p]: [b * hq, programs, BLOCK_COL, HEAD_DIM] can
    # pass 2^31 elements too; one store, so int64. Empty slots (they gathered row 0) store zeros.
    part = (bh.to(tl.int64) * (N_TILES * SPLITS) + program) * BLOCK_COL * HEAD_DIM
    rows = tl.arange(0, BLOCK_COL)
    tl.store(tile_ptrs(DKP + part, rows, HEAD_DIM, offs_d, True), tl.where(c_ok[:, None], dk * sm_scale, 0.0))
    tl.store(tile_ptrs(DVP + part, rows, HEAD_DIM, offs_d, True), tl.where(c_ok[:, None], dv, 0.0))


def _launch(q, block_size: int, int64: bool, kernel_launch: tuple) -> tuple:
    """(tile config, launch keywords) of the backward's Triton kernels for ``q``'s dtype
    (``kernel_launch``: ``Settings.kernel_launch``)."""
    cfg = tile_config(block_size, q.dtype, "bwd", kernel_launch)
    launch = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], INT64=int64, **kernel_flags(q.dtype))
    return cfg, launch


def query_gradients_triton(q, k, v, do, lse, delta, dq, plan, accumulate: bool, int64: bool, strides,
                           qk_scale: float, softmax_scale: float, kernel_launch: tuple = ()) -> None:
    """dQ of every query tile over its slash blocks and columns, added into fp32 ``dq`` (or, with
    ``accumulate=False``, written in ``dq``'s dtype: the program is the rows' only writer)."""
    b, hq, nq, d = q.shape
    B = plan.block_size
    cfg, launch = _launch(q, B, int64, kernel_launch)
    cols, col_pos, words, diag, n_words = column_arguments(plan)
    doc_start, doc_last, col_start, docs = document_arguments(plan)
    _dq_kernel[(nq // cfg["BLOCK_M"], b * hq)](
        q, k, v, do, lse, delta, dq,
        plan.q_block_ids, plan.k_block_ids, plan.kv_count, plan.kv_blocks, plan.col_limit, cols, col_pos,
        words, diag, doc_start, doc_last, col_start, *strides, dq.stride(0), dq.stride(1), dq.stride(2),
        qk_scale, softmax_scale, hq, hq // k.shape[1], nq // B, plan.kv_blocks.shape[-1], plan.cols.shape[-1],
        n_words, BLOCK=B, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_COL=cfg["BLOCK_COL"], HEAD_DIM=d,
        MASK_EVERY_TILE=cfg["MASK_EVERY_TILE"], DQ_ACCUMULATE=accumulate, DOCS=docs, **launch)


def block_gradients_triton(q, k, v, do, lse, delta, dk, dv, plan, doc_start, doc_last, docs: bool, int64: bool,
                           strides, qk_scale: float, softmax_scale: float, kernel_launch: tuple = ()) -> None:
    """dK, dV of every key tile through the transposed slash lists, added into fp32 ``dk``/``dv``
    (``doc_last``: unused here, the Hopper kernel's argument)."""
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    B = plan.block_size
    cfg, launch = _launch(q, B, int64, kernel_launch)
    _dkdv_kernel[(nk // cfg["BLOCK_N"], b * hkv)](
        q, k, v, do, lse, delta, dk, dv,
        plan.q_block_ids, plan.k_block_ids, plan.q_count, plan.q_blocks, doc_start,
        *strides, dk.stride(0), dk.stride(1), dk.stride(2),
        qk_scale, softmax_scale, hq, hkv, hq // hkv, nk // B, plan.kv_blocks.shape[-1],
        BLOCK=B, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], HEAD_DIM=d, DOCS=docs, **launch)


def column_gradients_triton(q, k, v, do, lse, delta, dk_part, dv_part, plan, cols, col_pos, words, head_diag,
                            q_first, q_end, doc_start, docs: bool, int64: bool, strides, qk_scale: float,
                            softmax_scale: float, splits: int, kernel_launch: tuple = ()) -> None:
    """fp32 partials of dK (scaled) and dV of ``tile_config``'s BLOCK_COL-column tiles, one per column
    program (``column_partials``: ``dk_part`` ``[b * hq, n_tiles * splits, BLOCK_COL, d]``)."""
    b, hq, nq, d = q.shape
    B = plan.block_size
    cfg, launch = _launch(q, B, int64, kernel_launch)
    n_tiles = dk_part.shape[1] // splits
    _dkdv_col_kernel[(n_tiles, b * hq, splits)](
        q, k, v, do, lse, delta, dk_part, dv_part,
        plan.q_block_ids, plan.col_count, cols, col_pos, words, head_diag, q_first, q_end, doc_start,
        *strides, qk_scale, softmax_scale,
        hq, hq // k.shape[1], nq // B, plan.cols.shape[-1], n_tiles, words.shape[-1], splits,
        BLOCK=B, BLOCK_M=cfg["BLOCK_M"], BLOCK_COL=cfg["BLOCK_COL"], HEAD_DIM=d, DOCS=docs, **launch)
