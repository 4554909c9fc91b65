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

import math
import os

import torch
import triton
import triton.language as tl

LN2 = math.log(2.0)
LOG2E = 1.0 / LN2


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def kernel_flags(dtype: torch.dtype) -> dict:
    """Compile-time flags shared by all kernels for an input dtype."""
    return dict(
        # Triton's CPU interpreter multiplies bf16 tiles wrongly: compute in fp32 there.
        UPCAST=interpreting() and dtype == torch.bfloat16,
        # fp32 inputs get full-precision products (tf32 would cost ~3e-4 relative error).
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
    )


# Launch settings (num_warps, num_stages) per kernel family, "fwd" or "bwd", that replace the
# defaults below: benchmarks/kernel.py --launch sets them to compare settings; empty otherwise.
LAUNCH_OVERRIDES: dict = {}


def max_element_offset(x: torch.Tensor) -> int:
    """Offset of the last element from the first: the largest offset a kernel computes into ``x``."""
    return sum((size - 1) * stride for size, stride in zip(x.shape, x.stride()) if size > 0)


def int64_offsets(*tensors: torch.Tensor) -> bool:
    """The kernels' INT64 flag: whether an element offset into one of these tensors can pass
    2^31 - 1 (a [b, heads, s, d] view of Megatron's [s, b, heads, d] spans the whole tensor). Only
    then are offsets computed in int64: that costs the forward ~26% and the backward ~13% at
    64-token blocks (~2% at 128; H100), and int32 ones provably suffice everywhere else."""
    return any(max_element_offset(x) >= 2 ** 31 for x in tensors)


def plan_tensors(plan) -> tuple:
    """The plan's tensors that the kernels index per (batch, head) row, for ``int64_offsets``."""
    return plan.kv_blocks, plan.q_blocks, plan.cols, plan.col_pos, plan.col_limit, plan.col_start, *plan.column_words


def document_arguments(plan) -> tuple:
    """(doc_start, block_last_start, col_start, DOCS) for the kernels' packed-document masks.
    Without documents the kernels never read the first two (compiled out), but Triton wants
    storage behind every pointer."""
    docs = plan.documents
    if docs is None:
        return plan.q_block_ids, plan.q_block_ids, plan.col_start, False
    return docs.doc_start, docs.block_last_start, plan.col_start, True


def column_arguments(plan) -> tuple:
    """(cols, col_pos, words, diag, words per query block) for the kernels' column part. With no
    column capacity the kernels never read the tensors, but Triton wants storage behind every
    pointer."""
    words, diag = plan.column_words
    n_words = words.shape[-1]
    if plan.cols.shape[-1] == 0:
        return plan.col_count, plan.col_count, diag, diag, n_words
    return plan.cols, plan.col_pos, words, diag, n_words


def tile_config(block: int, dtype: torch.dtype, family: str = "fwd") -> dict:
    """Tile shapes and launch settings. Tiles divide the index block: a 128-block runs as 64-row
    tiles where 128-row fp32 tiles would not fit in shared memory."""
    tile = min(block, 64) if dtype == torch.float32 else min(block, 128)
    cfg = dict(BLOCK_M=tile, BLOCK_N=tile, BLOCK_COL=min(tile, 64),
               num_warps=8 if tile >= 128 else 4,
               num_stages=1 if (tile >= 128 or dtype == torch.float32) else 2,
               MASK_EVERY_TILE=False,
               COLUMN_PROGRAMS=1024)  # backward's column-gradient kernel: programs to aim for
    cfg.update(LAUNCH_OVERRIDES.get(family, {}))
    if 64 % cfg["BLOCK_COL"]:
        raise ValueError(f"tile_config: BLOCK_COL {cfg['BLOCK_COL']} must divide 64 (a column tile reads one "
                         "64-bit column word)")
    return cfg


def forward_launch_config(block: int, dtype: torch.dtype) -> dict:
    """The forward's share of ``tile_config``: every key is a keyword of ``_vs_attn_fwd_kernel``
    or a launch setting (the compiled kernel refuses unknown keywords; the interpreter does not)."""
    cfg = tile_config(block, dtype)
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
def _wide(x, INT64: tl.constexpr):
    """``x`` (an index that multiplies a stride) in int64 when offsets can pass 2^31 (``int64_offsets``)."""
    if INT64:
        x = tl.cast(x, tl.int64)  # tl.cast: the interpreter's loop indices are Python ints
    return x


@triton.jit
def _head_offset(b, h, stride_b, stride_h, INT64: tl.constexpr):
    """Offset of (batch ``b``, head ``h``)."""
    return _wide(b, INT64) * stride_b + _wide(h, INT64) * stride_h


@triton.jit
def _tile_ptrs(base, rows, stride, offs_d, INT64: tl.constexpr):
    """Pointers of the [rows, d] tile of the (batch, head) at ``base``."""
    return base + _wide(rows, INT64)[:, None] * stride + offs_d[None, :]


@triton.jit
def _word_bits(word, first, COUNT: tl.constexpr):
    """Bits ``first .. first + COUNT - 1`` of a 64-bit column word, as booleans."""
    return ((word >> (tl.arange(0, COUNT) + first).to(tl.int64)) & 1) != 0


@triton.jit
def _column_tile(Cols, Words, k_base, v_base, col_row, word_row, c0, n_cols, stride_kn, stride_vn, offs_d,
                 BLOCK_COL: tl.constexpr, INT64: tl.constexpr, UPCAST: tl.constexpr):
    """Gather one tile of the plan's columns: K, V and which columns are live for the query block
    (one word of the step's column words, instead of a gather chain per column)."""
    tl.static_assert(64 % BLOCK_COL == 0, "a column tile must lie within one 64-bit word")
    offs_c = c0 + tl.arange(0, BLOCK_COL)
    # Past the limit: row 0, never live (its p is 0; only a non-finite row 0 would leak, as any
    # gathered non-live column would).
    col = tl.load(Cols + col_row + offs_c, mask=offs_c < n_cols, other=0)
    live = _word_bits(tl.load(Words + word_row + c0 // 64), c0 % 64, BLOCK_COL)
    k = tl.load(_tile_ptrs(k_base, col, stride_kn, offs_d, INT64))
    v = tl.load(_tile_ptrs(v_base, col, stride_vn, offs_d, INT64))
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v, live


@triton.jit
def _causal_columns(x, fill, ColPos, col_row, c0, n_cols, q_pos, q_doc, BLOCK_COL: tl.constexpr,
                    DOCS: tl.constexpr):
    """``x`` with ``fill`` where a column is after the query (or, with DOCS, before the query's
    document ``q_doc``): needed only where a live column shares the query block or the block
    straddles a document boundary (``column_words``' diag), so the kernels run a separate copy of
    their column loop there."""
    offs_c = c0 + tl.arange(0, BLOCK_COL)
    c_pos = tl.load(ColPos + col_row + offs_c, mask=offs_c < n_cols, other=0)
    keep = c_pos[None, :] <= q_pos[:, None]
    if DOCS:
        keep = keep & (c_pos[None, :] >= q_doc[:, None])
    return tl.where(keep, x, fill)


@triton.jit
def _token_mask(k_pos, q_pos, q_doc, DOCS: tl.constexpr):
    """[queries, keys] pairs that are causal (and, with DOCS, in the query's document)."""
    keep = k_pos[None, :] <= q_pos[:, None]
    if DOCS:
        keep = keep & (k_pos[None, :] >= q_doc[:, None])
    return keep


@triton.jit
def _needs_token_mask(k_blk, q_blk, doc_mask_below, BLOCK: tl.constexpr, DOCS: tl.constexpr):
    """Whether a key block needs the token-level mask for this query block: the diagonal block,
    and, with DOCS, key blocks that start before the document of the block's last query."""
    needs = k_blk == q_blk
    if DOCS:
        needs = needs | (k_blk * BLOCK < doc_mask_below)
    return needs


@triton.jit
def _token_mask_t(k_pos, q_pos, q_doc, DOCS: tl.constexpr):
    """``_token_mask`` key-major ([keys, queries]), for the backward's key-side kernels."""
    keep = k_pos[:, None] <= q_pos[None, :]
    if DOCS:
        keep = keep & (k_pos[:, None] >= q_doc[None, :])
    return keep


@triton.jit
def _document_starts(DocStart, q_pos, DOCS: tl.constexpr):
    """The document start of each query row (DOCS); without documents, a placeholder never read."""
    if DOCS:
        return tl.load(DocStart + q_pos)
    else:
        return q_pos


@triton.jit
def _query_documents(DocStart, DocLast, q_pos, q_blk, DOCS: tl.constexpr):
    """(document start per query row, the block's token-mask bound); unused without DOCS."""
    if DOCS:
        return tl.load(DocStart + q_pos), tl.load(DocLast + q_blk)
    else:
        return q_pos, q_blk


@triton.jit
def _column_begin(ColStart, plan_row, BLOCK_COL: tl.constexpr, DOCS: tl.constexpr):
    """First column slot a query block walks, on a tile boundary (DOCS: past earlier documents)."""
    if DOCS:
        return (tl.load(ColStart + plan_row) // BLOCK_COL) * BLOCK_COL
    else:
        return 0


@triton.jit
def _forward_columns(q, q_pos, q_doc, m_i, l_i, acc, qk_scale, Cols, ColPos, Words, k_base, v_base, col_row,
                     word_row, c_begin, n_cols, stride_kn, stride_vn, offs_d, BLOCK_COL: tl.constexpr,
                     INT64: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, CAUSAL: tl.constexpr,
                     DOCS: tl.constexpr):
    """The forward's column part: fold the live columns of slots [c_begin, n_cols) into (m, l, acc)."""
    for c0 in range(c_begin, n_cols, BLOCK_COL):
        k, v, live = _column_tile(Cols, Words, k_base, v_base, col_row, word_row, c0, n_cols,
                                  stride_kn, stride_vn, offs_d, BLOCK_COL, INT64, UPCAST)
        s = tl.where(live[None, :], tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION), float("-inf"))
        if CAUSAL:
            s = _causal_columns(s, float("-inf"), ColPos, col_row, c0, n_cols, q_pos, q_doc, BLOCK_COL, DOCS)
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
    q_doc, doc_mask_below = _query_documents(DocStart, DocLast, q_pos, q_blk, DOCS)
    q = tl.load(_tile_ptrs(Q + _head_offset(b, h, stride_qb, stride_qh, INT64), rows, stride_qn, offs_d, INT64))
    if UPCAST:
        q = q.to(tl.float32)
    k_base = K + _head_offset(b, kvh, stride_kb, stride_kh, INT64)
    v_base = V + _head_offset(b, kvh, stride_vb, stride_vh, INT64)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    # Slash part: whole key blocks. Only the diagonal block can hold keys after a query.
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
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            # Earlier key blocks hold no key after a query (nor, past the documents' bound, a key of
            # another document).
            if MASK_EVERY_TILE or _needs_token_mask(k_blk, q_blk, doc_mask_below, BLOCK, DOCS):
                k_pos = k_blk * BLOCK + sub + offs_n
                s = tl.where(_token_mask(k_pos, q_pos, q_doc, DOCS), s, float("-inf"))
            m_i, l_i, acc = _online_softmax_step(s, qk_scale, v, m_i, l_i, acc, DOT_PRECISION)

    # Vertical part: gathered columns not covered by a selected slash block of this query block,
    # up to the last one that is not after all of its queries.
    # Two copies of the loop, so that neither branches inside (diag: never for a valid index).
    n_cols = tl.load(ColLimit + plan_row)
    c_begin = _column_begin(ColStart, plan_row, BLOCK_COL, DOCS)
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

    o_ptrs = _tile_ptrs(Out + _head_offset(b, h, stride_ob, stride_oh, INT64), rows, stride_on, offs_d, INT64)
    l_ptrs = Lse + _head_offset(b, h, stride_lb, stride_lh, INT64) + rows
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


def vs_attention_fwd_triton(q, k, v, plan, out, lse, softmax_scale: float, accumulate: bool) -> None:
    """Run the forward for one plan; writes (or, with ``accumulate``, merges into) ``out`` and ``lse``.

    q ``[b, hq, nq, d]``, k/v ``[b, hkv, nk, d]`` (last dim contiguous); out ``[b, hq, nq, d]``
    (fp32 when accumulating); lse fp32 ``[b, hq, nq]`` contiguous in the last dim.
    """
    if not softmax_scale > 0:
        raise ValueError(f"vs_attention_fwd_triton: softmax_scale must be positive, got {softmax_scale}")
    b, hq, nq, d = q.shape
    B = plan.block_size
    nqb = nq // B
    max_v = plan.cols.shape[-1]
    cols, col_pos, words, diag, n_words = column_arguments(plan)
    doc_start, doc_last, col_start, docs = document_arguments(plan)
    cfg = forward_launch_config(B, q.dtype)
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
