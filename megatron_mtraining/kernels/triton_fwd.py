"""Triton forward of vertical-slash attention for one (query chunk, key chunk) pair.

One program per (query tile of BLOCK_M rows, batch x query head); tiles divide the index block
B. It walks the key blocks that the plan lists for its query block (slash part, diagonal last,
each in tiles of BLOCK_N keys), then the plan's columns in tiles of BLOCK_COL up to the plan's
column limit (later columns are after every query of the block), keeping the columns that the
step's column words mark live for the block (not already read through a selected slash block),
with an online softmax in fp32 (base 2). The result is written as (out, fp32 lse), or merged
through log-sum-exp into existing accumulators (ring attention calls it once per step).

Cost per (query block, head): 4*B*d FLOPs per active key (QK^T and PV) over B*d*2 bytes of K/V
per key block: the work is the active pairs, nothing proportional to the sequence.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import LOG2E, column_arguments, document_arguments, int64_offsets, plan_tensors
from .triton_common import (column_begin, column_tile, causal_columns, head_offset, kernel_flags, needs_token_mask,
                            query_documents, tile_config, tile_ptrs, token_mask, wide)


def forward_launch_config(block: int, dtype: torch.dtype, kernel_launch: tuple = ()) -> dict:
    """The forward's share of ``tile_config``: every key is a keyword of ``_vs_attn_fwd_kernel``
    or a launch setting (the compiled kernel refuses unknown keywords; the interpreter does not).
    ``kernel_launch``: ``Settings.kernel_launch``."""
    cfg = tile_config(block, dtype, "fwd", kernel_launch)
    cfg.pop("COLUMN_PROGRAMS")  # the backward's column-gradient kernel
    return cfg


@triton.jit
def _online_softmax_step(s, qk_scale, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """Fold one tile of raw scores ``s`` = q.k (masked entries -inf) into (m, l, acc), base 2.
    The scale (> 0, so the row maximum commutes with it) is applied inside exp2's argument: one
    fused multiply-add per score instead of a multiply and a subtract."""
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet stay exact zeros
    p = tl.math.exp2(s * qk_scale - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _forward_columns(q, q_pos, q_doc, m_i, l_i, acc, qk_scale, Cols, ColPos, Words, k_base, v_base, col_row,
                     word_row, c_begin, n_cols, stride_kn, stride_vn, offs_d, BLOCK_COL: tl.constexpr,
                     INT64: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, CAUSAL: tl.constexpr,
                     DOCS: tl.constexpr):
    """The forward's column part: fold the live columns of slots [c_begin, n_cols) into (m, l, acc)."""
    for c0 in range(c_begin, n_cols, BLOCK_COL):
        k, v, live = column_tile(Cols, Words, k_base, v_base, col_row, word_row, c0, n_cols,
                                 stride_kn, stride_vn, offs_d, BLOCK_COL, INT64, UPCAST)
        s = tl.where(live[None, :], tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION), float("-inf"))
        if CAUSAL:
            s = causal_columns(s, float("-inf"), ColPos, col_row, c0, n_cols, q_pos, q_doc, BLOCK_COL, DOCS)
        m_i, l_i, acc = _online_softmax_step(s, qk_scale, v, m_i, l_i, acc, DOT_PRECISION)
    return m_i, l_i, acc


@triton.jit
def _vs_attn_fwd_kernel(
    Q, K, V, Out, Lse,
    QBlk, KBlk, KVCnt, KVIdx, ColLimit, Cols, ColPos, Words, Diag, DocStart, DocLast, ColStart,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on,
    stride_lb, stride_lh,
    qk_scale,
    HQ, GROUP, NQB, MAX_S, MAX_V, N_WORDS,
    BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_COL: tl.constexpr,
    HEAD_DIM: tl.constexpr, ACCUMULATE: tl.constexpr, INT64: tl.constexpr, UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr, MASK_EVERY_TILE: tl.constexpr, DOCS: tl.constexpr,
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
    q = tl.load(tile_ptrs(Q + head_offset(b, h, stride_qb, stride_qh, INT64), rows, stride_qn, offs_d, INT64))
    if UPCAST:
        q = q.to(tl.float32)
    k_base = K + head_offset(b, kvh, stride_kb, stride_kh, INT64)
    v_base = V + head_offset(b, kvh, stride_vb, stride_vh, INT64)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    # Slash part: whole key blocks. Only the diagonal block can hold keys after a query.
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
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            # Earlier key blocks hold no key after a query (nor, past the documents' bound, a key of
            # another document).
            if MASK_EVERY_TILE or needs_token_mask(k_blk, q_blk, doc_mask_below, BLOCK, DOCS):
                k_pos = k_blk * BLOCK + sub + offs_n
                s = tl.where(token_mask(k_pos, q_pos, q_doc, DOCS), s, float("-inf"))
            m_i, l_i, acc = _online_softmax_step(s, qk_scale, v, m_i, l_i, acc, DOT_PRECISION)

    # Vertical part: gathered columns not covered by a selected slash block of this query block,
    # up to the last one that is not after all of its queries.
    # Two copies of the loop, so that neither branches inside (diag: never for a valid index).
    n_cols = tl.load(ColLimit + plan_row)
    c_begin = column_begin(ColStart, plan_row, BLOCK_COL, DOCS)
    col_row, word_row = bh * MAX_V, plan_row * N_WORDS
    if tl.load(Diag + plan_row) != 0:
        m_i, l_i, acc = _forward_columns(q, q_pos, q_doc, m_i, l_i, acc, qk_scale, Cols, ColPos, Words, k_base,
                                         v_base, col_row, word_row, c_begin, n_cols, stride_kn, stride_vn, offs_d,
                                         BLOCK_COL, INT64, UPCAST, DOT_PRECISION, True, DOCS)
    else:
        m_i, l_i, acc = _forward_columns(q, q_pos, q_doc, m_i, l_i, acc, qk_scale, Cols, ColPos, Words, k_base,
                                         v_base, col_row, word_row, c_begin, n_cols, stride_kn, stride_vn, offs_d,
                                         BLOCK_COL, INT64, UPCAST, DOT_PRECISION, False, DOCS)

    has_key = l_i > 0
    l_safe = tl.where(has_key, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(has_key, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))

    o_ptrs = tile_ptrs(Out + head_offset(b, h, stride_ob, stride_oh, INT64), rows, stride_on, offs_d, INT64)
    l_ptrs = Lse + head_offset(b, h, stride_lb, stride_lh, INT64) + rows
    if ACCUMULATE:
        # Merge with the previous steps' partial result through log-sum-exp, in fp32.
        old_lse = tl.load(l_ptrs)
        old_out = tl.load(o_ptrs).to(tl.float32)
        mx = tl.maximum(old_lse, lse)
        mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
        w_old = tl.exp(old_lse - mx_safe)
        w_new = tl.exp(lse - mx_safe)
        total = w_old + w_new
        has_any = total > 0
        total_safe = tl.where(has_any, total, 1.0)
        out = (old_out * w_old[:, None] + out * w_new[:, None]) / total_safe[:, None]
        lse = tl.where(has_any, mx_safe + tl.log(total_safe), float("-inf"))
    tl.store(o_ptrs, out.to(Out.dtype.element_ty))
    tl.store(l_ptrs, lse)


def vs_attention_fwd_triton(q, k, v, plan, out, lse, softmax_scale: float, accumulate: bool,
                            kernel_launch: tuple = ()) -> None:
    """Run the forward for one plan; writes (or, with ``accumulate``, merges into) ``out`` and ``lse``.

    q ``[b, hq, nq, d]``, k/v ``[b, hkv, nk, d]`` (last dim contiguous); out ``[b, hq, nq, d]``
    (fp32 when accumulating); lse fp32 ``[b, hq, nq]`` contiguous in the last dim.
    ``kernel_launch``: ``Settings.kernel_launch`` (launch settings instead of the defaults).
    """
    if not softmax_scale > 0:
        raise ValueError(f"vs_attention_fwd_triton: softmax_scale must be positive, got {softmax_scale}")
    b, hq, nq, d = q.shape
    B = plan.block_size
    nqb = nq // B
    max_v = plan.cols.shape[-1]
    cols, col_pos, words, diag, n_words = column_arguments(plan)
    doc_start, doc_last, col_start, docs = document_arguments(plan)
    cfg = forward_launch_config(B, q.dtype, kernel_launch)
    grid = (nq // cfg["BLOCK_M"], b * hq)
    _vs_attn_fwd_kernel[grid](
        q, k, v, out, lse,
        plan.q_block_ids, plan.k_block_ids, plan.kv_count, plan.kv_blocks, plan.col_limit, cols, col_pos,
        words, diag, doc_start, doc_last, col_start,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1),
        softmax_scale * LOG2E,
        hq, hq // k.shape[1], nqb, plan.kv_blocks.shape[-1], max_v, n_words,
        BLOCK=B, HEAD_DIM=d, ACCUMULATE=accumulate, INT64=int64_offsets(q, k, v, out, lse, *plan_tensors(plan)),
        DOCS=docs, **kernel_flags(q.dtype), **cfg,
    )
