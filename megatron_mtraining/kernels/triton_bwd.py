"""Triton backward of vertical-slash attention for one (query chunk, key chunk) pair.

Gradients are recomputed from the saved (final) log-sum-exp and ``delta = rowsum(dO * O)``,
and added into fp32 accumulators, so a ring can call this once per step:
  * ``_dq_kernel``   one program per (query block, head): the forward's key blocks and columns.
  * ``_dkdv_kernel`` one program per (key block, kv head): the transposed slash lists of every
    query head of the GQA group. Slash sets are closed under transposition (query block
    ``kb + delta`` reads key block ``kb``), so each key block has exactly one writer: no atomics.
  * ``_dkdv_col_kernel`` columns are read by every later query block: a split reduction over
    the query blocks from the first that can see the column tile (``first_query_blocks``)
    writes fp32 partials, summed in a fixed order afterwards (deterministic).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import triton_fwd
from .plan import first_query_blocks, query_block_ends
from .triton_fwd import (LOG2E, _causal_columns, _column_begin, _column_tile, _document_starts, _head_offset,
                         _needs_token_mask, _query_documents, _tile_ptrs, _token_mask, _token_mask_t, _wide,
                         _word_bits, document_arguments, kernel_flags)


# The index block size at which dQ and the key-block dK/dV run on the Hopper kernels
# (``kernels="hopper"``): their programs hold a whole 128-token block, two warpgroups sharing
# every streamed tile. (The column gradients run on them at any block size.)
HOPPER_SLASH_BLOCK = 128


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
    q = tl.load(_tile_ptrs(Q + _head_offset(b, h, stride_qb, stride_qh, INT64), rows, stride_qn, offs_d, INT64))
    do = tl.load(_tile_ptrs(DO + _head_offset(b, h, stride_ob, stride_oh, INT64), rows, stride_on, offs_d, INT64))
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    stat = _head_offset(b, h, stride_lb, stride_lh, INT64) + rows
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
        k, v, live = _column_tile(Cols, Words, k_base, v_base, col_row, word_row, c0, n_cols,
                                  stride_kn, stride_vn, offs_d, BLOCK_COL, INT64, UPCAST)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        p = tl.where(live[None, :], tl.math.exp2(s * qk_scale - lse2[:, None]), 0.0)
        if CAUSAL:
            p = _causal_columns(p, 0.0, ColPos, col_row, c0, n_cols, q_pos, q_doc, BLOCK_COL, DOCS)
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
    q_doc, doc_mask_below = _query_documents(DocStart, DocLast, q_pos, q_blk, DOCS)
    q, do, lse2, di = _load_query_side(Q, DO, Lse, Delta, b, h, rows, offs_d,
                                       stride_qb, stride_qh, stride_qn, stride_ob, stride_oh, stride_on,
                                       stride_lb, stride_lh, INT64, UPCAST)
    k_base = K + _head_offset(b, kvh, stride_kb, stride_kh, INT64)
    v_base = V + _head_offset(b, kvh, stride_vb, stride_vh, INT64)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    bh = _wide(pid_bh, INT64)  # times the plan's row lengths
    plan_row = bh * NQB + q_local_blk
    n_blocks = tl.load(KVCnt + plan_row)
    for t in range(0, n_blocks):
        j = tl.load(KVIdx + plan_row * MAX_S + t)
        k_blk = tl.load(KBlk + j)
        for sub in tl.static_range(0, BLOCK, BLOCK_N):
            k_rows = j * BLOCK + sub + offs_n
            k = tl.load(_tile_ptrs(k_base, k_rows, stride_kn, offs_d, INT64))
            v = tl.load(_tile_ptrs(v_base, k_rows, stride_vn, offs_d, INT64))
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            p = tl.math.exp2(s - lse2[:, None])
            # As in the forward: the diagonal block, and (DOCS) blocks before the last query's document.
            if MASK_EVERY_TILE or _needs_token_mask(k_blk, q_blk, doc_mask_below, BLOCK, DOCS):
                k_pos = k_blk * BLOCK + sub + offs_n
                p = tl.where(_token_mask(k_pos, q_pos, q_doc, DOCS), p, 0.0)
            dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
            ds = p * (dp - di[:, None])
            dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)

    # The columns after the limit are after all of this block's queries. Two copies of the loop,
    # so that neither branches inside (diag: never for a valid index).
    n_cols = tl.load(ColLimit + plan_row)
    c_begin = _column_begin(ColStart, plan_row, BLOCK_COL, DOCS)
    col_row, word_row = bh * MAX_V, plan_row * N_WORDS
    if tl.load(Diag + plan_row) != 0:
        dq = _dq_columns(dq, q, do, lse2, di, q_pos, q_doc, qk_scale, Cols, ColPos, Words, k_base, v_base,
                         col_row, word_row, c_begin, n_cols, stride_kn, stride_vn, offs_d, BLOCK_COL, INT64, UPCAST,
                         DOT_PRECISION, True, DOCS)
    else:
        dq = _dq_columns(dq, q, do, lse2, di, q_pos, q_doc, qk_scale, Cols, ColPos, Words, k_base, v_base,
                         col_row, word_row, c_begin, n_cols, stride_kn, stride_vn, offs_d, BLOCK_COL, INT64, UPCAST,
                         DOT_PRECISION, False, DOCS)

    dq_ptrs = _tile_ptrs(DQ + _head_offset(b, h, stride_gb, stride_gh, INT64), rows, stride_gn, offs_d, INT64)
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
    k = tl.load(_tile_ptrs(K + _head_offset(b, kvh, stride_kb, stride_kh, INT64), k_rows, stride_kn, offs_d, INT64))
    v = tl.load(_tile_ptrs(V + _head_offset(b, kvh, stride_vb, stride_vh, INT64), k_rows, stride_vn, offs_d, INT64))
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for g in range(0, GROUP):
        h = kvh * GROUP + g
        plan_row = _wide(b * HQ + h, INT64) * NKB + k_local_blk
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
                # diagonal) made this kernel twice as slow on an H200, and a branch around the mask
                # alone 9% slower (more spills; docs/performance.md).
                # (DOCS: the key must also lie in the query's document.)
                q_doc = _document_starts(DocStart, q_pos, DOCS)
                p_t = tl.where(_token_mask_t(k_pos, q_pos, q_doc, DOCS), _probs_t(k, q, lse2, qk_scale, DOT_PRECISION),
                               0.0)
                dk, dv = _grads_t(dk, dv, p_t, v, q, do, di, DOT_PRECISION)
    g_head = _head_offset(b, kvh, stride_gb, stride_gh, INT64)
    dk_ptrs = _tile_ptrs(DK + g_head, k_rows, stride_gn, offs_d, INT64)
    dv_ptrs = _tile_ptrs(DV + g_head, k_rows, stride_gn, offs_d, INT64)
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
        live = _word_bits(tl.load(words + i * N_WORDS), first_bit, BLOCK_COL)  # this block's live columns
        q_blk = tl.load(QBlk + i)
        for sub in tl.static_range(0, BLOCK, BLOCK_M):
            q, do, lse2, di = _load_query_side(Q, DO, Lse, Delta, b, h, i * BLOCK + sub + offs_m, offs_d,
                                               stride_qb, stride_qh, stride_qn, stride_ob, stride_oh,
                                               stride_on, stride_lb, stride_lh, INT64, UPCAST)
            q_pos = q_blk * BLOCK + sub + offs_m
            q_doc = _document_starts(DocStart, q_pos, DOCS)
            keep = live[:, None] & (_token_mask_t(c_pos, q_pos, q_doc, DOCS) | (not any_diag))
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
    HQ, GROUP, NQB, MAX_V, MAX_V_PAD, N_WORDS, SPLITS, BH,
    BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_COL: tl.constexpr, HEAD_DIM: tl.constexpr,
    INT64: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, DOCS: tl.constexpr,
):
    tl.static_assert(64 % BLOCK_COL == 0, "a column tile must lie within one 64-bit word")
    pid_c = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = pid_bh // HQ
    h = pid_bh % HQ
    kvh = h // GROUP
    bh = _wide(pid_bh, INT64)  # times the plan's row lengths
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_c = pid_c * BLOCK_COL + tl.arange(0, BLOCK_COL)
    n_cols = tl.load(ColCnt + pid_bh)
    c_ok = offs_c < n_cols
    col = tl.load(Cols + bh * MAX_V + offs_c, mask=c_ok, other=0)
    c_pos = tl.load(ColPos + bh * MAX_V + offs_c, mask=c_ok, other=0)
    # Empty slots read row 0 and are never live (their partials are zeroed at the store).
    k = tl.load(_tile_ptrs(K + _head_offset(b, kvh, stride_kb, stride_kh, INT64), col, stride_kn, offs_d, INT64))
    v = tl.load(_tile_ptrs(V + _head_offset(b, kvh, stride_vb, stride_vh, INT64), col, stride_vn, offs_d, INT64))
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_COL, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_COL, HEAD_DIM], tl.float32)
    # The query blocks before q_first end before the tile's first column, those from q_end on (DOCS)
    # start their documents after its last column: the splits share the rest.
    tile = pid_bh * tl.num_programs(0) + pid_c
    q_first = tl.load(QFirst + tile)
    if DOCS:
        q_end = tl.load(QEnd + tile)
    else:
        q_end = NQB
    per_split = tl.cdiv(tl.maximum(q_end - q_first, 0), SPLITS)
    i_start = q_first + pid_s * per_split
    i_end = tl.minimum(i_start + per_split, q_end)  # empty tiles (q_first = NQB) write zero partials
    words = Words + bh * NQB * N_WORDS + (pid_c * BLOCK_COL) // 64  # this tile's word, per query block
    # A live column inside some query block of this head (never for a valid index) needs the
    # token-level test; folded into the mask without a branch (a branch, or two copies of the
    # loop, made ptxas serialise the loop's wgmma instructions).
    any_diag = tl.load(HeadDiag + pid_bh) != 0
    dk, dv = _column_gradients(dk, dv, k, v, c_pos, (pid_c * BLOCK_COL) % 64, words, i_start, i_end, any_diag,
                               Q, DO, Lse, Delta, QBlk, DocStart, b, h, offs_m, offs_d, qk_scale, stride_qb,
                               stride_qh, stride_qn, stride_ob, stride_oh, stride_on, stride_lb, stride_lh, N_WORDS,
                               BLOCK, BLOCK_M, BLOCK_COL, INT64, UPCAST, DOT_PRECISION, DOCS)
    # Partials [splits * b * hq, MAX_V_PAD, HEAD_DIM] can pass 2^31 elements too; one store, so int64.
    part = (pid_s * BH + pid_bh).to(tl.int64) * MAX_V_PAD * HEAD_DIM
    # Empty slots (they gathered row 0) store exact zeros, whatever row 0 holds: they are scattered
    # onto row 0 afterwards.
    tl.store(_tile_ptrs(DKP + part, offs_c, HEAD_DIM, offs_d, True), tl.where(c_ok[:, None], dk * sm_scale, 0.0))
    tl.store(_tile_ptrs(DVP + part, offs_c, HEAD_DIM, offs_d, True), tl.where(c_ok[:, None], dv, 0.0))


def _column_splits(nqb: int, programs_per_split: int, target: int) -> int:
    """Query-range splits of the column reduction: about ``target`` programs, to fill a large GPU
    (more splits: shorter programs, more fp32 partials to sum)."""
    return max(1, min(nqb, -(-target // max(1, programs_per_split))))


def vs_attention_bwd_triton(q, k, v, do, lse, delta, plan, dq, dk, dv, softmax_scale: float,
                            accumulate_dq: bool = True, kernels: str = "triton") -> None:
    """Add this plan's gradients into fp32 ``dq`` ``[b,hq,nq,d]`` and ``dk``/``dv`` ``[b,hkv,nk,d]``.
    ``accumulate_dq=False`` (a single step) writes ``dq`` in its own dtype instead of adding.
    ``kernels="hopper"`` runs the Hopper kernels of ``hopper_bwd`` instead (sm_90; the caller
    checks ``step.backward_kernel``): the same work split, partials and reduction. dQ and the
    key-block dK/dV go to them only at B = 128 (``HOPPER_SLASH_BLOCK``), where a program holds
    a whole index block; at B = 64 Triton's are as fast or faster (docs/performance.md).

    ``lse`` and ``delta`` (fp32 ``[b, hq, nq]``, same strides) belong to the FINAL output.
    """
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    group = hq // hkv
    B = plan.block_size
    nqb, nkb = nq // B, nk // B
    max_s, max_v = plan.kv_blocks.shape[-1], plan.cols.shape[-1]
    cfg = triton_fwd.tile_config(B, q.dtype, "bwd")
    launch = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **kernel_flags(q.dtype))
    block_m, block_n, block_col = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_COL"]
    qk_scale = softmax_scale * LOG2E
    if delta.stride() != lse.stride():
        delta = delta.contiguous()
        lse = lse.contiguous()
    launch["INT64"] = triton_fwd.int64_offsets(q, k, v, do, lse, delta, dq, dk, dv, *triton_fwd.plan_tensors(plan))
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
               v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2),
               lse.stride(0), lse.stride(1))
    cols, col_pos, words, diag, n_words = triton_fwd.column_arguments(plan)
    doc_start, doc_last, col_start, docs = document_arguments(plan)

    if kernels == "hopper" and B == HOPPER_SLASH_BLOCK:
        from .hopper_bwd import block_gradients_hopper, query_gradients_hopper
        query_gradients_hopper(q, k, v, do, lse, delta, dq, plan, accumulate_dq, launch["INT64"], strides, qk_scale,
                               softmax_scale)
        block_gradients_hopper(q, k, v, do, lse, delta, dk, dv, plan, doc_start, doc_last, docs, launch["INT64"],
                               strides, qk_scale, softmax_scale)
    else:
        _dq_kernel[(nq // block_m, b * hq)](
            q, k, v, do, lse, delta, dq,
            plan.q_block_ids, plan.k_block_ids, plan.kv_count, plan.kv_blocks, plan.col_limit, cols, col_pos,
            words, diag, doc_start, doc_last, col_start, *strides, dq.stride(0), dq.stride(1), dq.stride(2),
            qk_scale, softmax_scale, hq, group, nqb, max_s, max_v, n_words,
            BLOCK=B, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_COL=block_col, HEAD_DIM=d,
            MASK_EVERY_TILE=cfg["MASK_EVERY_TILE"], DQ_ACCUMULATE=accumulate_dq, DOCS=docs, **launch)
        _dkdv_kernel[(nk // block_n, b * hkv)](
            q, k, v, do, lse, delta, dk, dv,
            plan.q_block_ids, plan.k_block_ids, plan.q_count, plan.q_blocks, doc_start,
            *strides, dk.stride(0), dk.stride(1), dk.stride(2),
            qk_scale, softmax_scale, hq, hkv, group, nkb, max_s,
            BLOCK=B, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=d, DOCS=docs, **launch)

    if max_v == 0:
        return
    if kernels == "hopper":
        block_col = 64  # the Hopper kernel's column tiles
    n_tiles = -(-max_v // block_col)
    max_v_pad = n_tiles * block_col
    splits = _column_splits(nqb, n_tiles * b * hq, cfg["COLUMN_PROGRAMS"])
    q_first = first_query_blocks(plan, block_col)
    q_end = query_block_ends(plan, block_col) if docs else q_first  # read only with DOCS
    dk_part = torch.empty(splits, b * hq, max_v_pad, d, dtype=torch.float32, device=q.device)
    dv_part = torch.empty_like(dk_part)
    head_diag = diag.amax(-1).contiguous()
    if kernels == "hopper":
        from .hopper_bwd import column_gradients_hopper
        column_gradients_hopper(q, k, v, do, lse, delta, dk_part, dv_part, plan, cols, col_pos, words, head_diag,
                                q_first, q_end, doc_start, docs, launch["INT64"], strides, qk_scale, softmax_scale,
                                splits)
    else:
        _dkdv_col_kernel[(n_tiles, b * hq, splits)](
            q, k, v, do, lse, delta, dk_part, dv_part,
            plan.q_block_ids, plan.col_count, cols, col_pos, words, head_diag, q_first, q_end, doc_start,
            *strides, qk_scale, softmax_scale,
            hq, group, nqb, max_v, max_v_pad, n_words, splits, b * hq,
            BLOCK=B, BLOCK_M=block_m, BLOCK_COL=block_col, HEAD_DIM=d, DOCS=docs, **launch)
    # Fixed-order reduction over splits, then one scatter per GQA position: within one
    # index_add_ every real target row is distinct (padding slots add exact zeros), so the
    # result does not depend on the order of the adds.
    dk_cols = dk_part.sum(0)[:, :max_v].view(b, hkv, group, max_v, d)
    dv_cols = dv_part.sum(0)[:, :max_v].view(b, hkv, group, max_v, d)
    slot_ok = torch.arange(max_v, device=q.device) < plan.col_count[..., None]
    target = torch.where(slot_ok, plan.cols.long(), 0).view(b, hkv, group, max_v)
    row_base = (torch.arange(b * hkv, device=q.device) * nk).view(b, hkv, 1)
    dk_flat = dk.view(-1, d) if dk.is_contiguous() else None
    dv_flat = dv.view(-1, d) if dv.is_contiguous() else None
    if dk_flat is None or dv_flat is None:
        raise ValueError("vs_attention_bwd_triton: dk and dv accumulators must be contiguous")
    for g in range(group):
        rows = (row_base + target[:, :, g]).reshape(-1)
        dk_flat.index_add_(0, rows, dk_cols[:, :, g].reshape(-1, d))
        dv_flat.index_add_(0, rows, dv_cols[:, :, g].reshape(-1, d))
