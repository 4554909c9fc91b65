"""The Hopper (sm_90) forward at 128-token index blocks with FA3's schedule, in Gluon, for B = 128
only (``vs_attention_fwd_hopper``'s contract, the default at B = 128).

Why a second Hopper forward (benchmarks/NOTES.md, spike M10 and session 12): the 64-row forward
(``hopper_fwd.py``) moves 8 bytes of K/V per pair and sits at that stream's time. At B = 128 one
program can hold the whole query block, so that two consumer warpgroups (64 query rows each) share
every streamed K/V tile: half the bytes per pair. In lockstep the two softmaxes collide (the
128-row variant of ``hopper_fwd.py``: 2% slower), so here they take turns to issue their wgmma
groups (ping-pong): one's softmax runs while the other's products use the tensor cores. M10's
slash-only version of this shape ran 1.63x our B = 128 forward.

One program per (query block, batch x query head), three partitions (``gl.warp_specialize``):
  * a producer warpgroup copies Q once, then every key tile (128 keys: one slash key block, or
    128 column slots) into a ring of STAGES slots by ``cp.async`` from row indices (TMA cannot
    gather on sm_90, and cp.async takes Megatron's strided views as they are), in CHUNK-row pieces
    (few registers); each thread's copies arrive on the slot's ``ready`` mbarrier when they land;
  * two consumer warpgroups each run ``hopper_fwd.py``'s loop on 64 query rows: S_t and
    PV_{t-1} as two async wgmma groups, tile t's softmax over PV_{t-1}; the masks are the same
    (``hopper_keys.py`` with KT = 128); a slot is released on ``empty`` once both consumers'
    PV products that read it retired.

(The backward's dQ and key-block kernels in this schedule were measured ~23% slower than the
lockstep ones of ``hopper_bwd.py`` on an H200, benchmarks/NOTES.md session 16, and were removed.)

Covered: sm_90, bf16/fp16, head_dim 64 or 128, B = 128, the accumulate mode of ring steps, strided
views, packed documents. Gluon has no CPU interpreter: cross-compiled in CI, tested on the GPU.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait

from .hopper_common import TILE, _wide, copy_layout, mma_layout, register_operand_layout, shared_layout
from .hopper_fwd import _fold_tile, _write_output
from .hopper_keys import _mask_scores, _query_positions, _query_program, _tile_rows, _tile_scalars
from .triton_fwd import LOG2E, column_arguments, document_arguments, int64_offsets, plan_tensors

BLOCK_SIZE = 128  # the only index block size this kernel runs (a program = a query block)
STAGES = 3  # forward K/V ring: 32 KB (Q) + 3 x 64 KB at d 128 = 224 KB, one program per SM
CHUNK = 16  # rows per producer copy: [16, d] over 128 threads, a few registers of addresses
PRODUCER_WARPS = gl.constexpr(4)
# Registers per thread after the split (setmaxnreg): 2 x 128 x 240 + 128 x 24 <= 64K.
CONSUMER_REGS = gl.constexpr(240)
PRODUCER_REGS = gl.constexpr(24)


@gluon.jit
def _produce(Q, DO, K, V, q_smem, do_smem, k_smem, v_smem, q_ready, ready, empty, b, h, kvh, pid_m,
             stride_qb, stride_qh, stride_qn, stride_ob, stride_oh, stride_on, stride_kb, stride_kh, stride_kn,
             stride_vb, stride_vh, stride_vn, KVIdx, Cols, list_row, col_row, c_begin, n_cols, n_slash, n_tiles,
             BLOCK: gl.constexpr, KT: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
             CHUNK: gl.constexpr, HAS_DO: gl.constexpr, INT64: gl.constexpr):
    """The producer warpgroup: the block's Q (and dO when HAS_DO) rows, then every key tile of KT
    keys once its slot is empty (a fresh mbarrier passes the wait on parity 1, so the first STAGES
    tiles go at once). Every thread's copies arrive on the barrier when they land."""
    c_layout: gl.constexpr = copy_layout(HEAD_DIM, PRODUCER_WARPS)
    rows_c: gl.constexpr = gl.SliceLayout(1, c_layout)
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, c_layout))[None, :]
    q_base = Q + b * stride_qb + h * stride_qh
    do_base = DO + b * stride_ob + h * stride_oh
    for r in gl.static_range(0, BLOCK, CHUNK):
        q_rows = _wide(pid_m * BLOCK + r + gl.arange(0, CHUNK, layout=rows_c), INT64)[:, None]
        async_copy.async_copy_global_to_shared(q_smem.slice(r, CHUNK), q_base + q_rows * stride_qn + offs_d)
        if HAS_DO:
            async_copy.async_copy_global_to_shared(do_smem.slice(r, CHUNK), do_base + q_rows * stride_on + offs_d)
    async_copy.mbarrier_arrive(q_ready, increment_count=False)

    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh
    for u in range(n_tiles):
        slot = u % STAGES
        mbarrier.wait(empty.index(slot), ((u // STAGES) & 1) ^ 1)
        for r in gl.static_range(0, KT, CHUNK):
            rows = _tile_rows(u, n_tiles, n_slash, KVIdx, Cols, list_row, col_row, c_begin, n_cols, BLOCK, INT64,
                              rows_c, KT, r, CHUNK)
            async_copy.async_copy_global_to_shared(k_smem.index(slot).slice(r, CHUNK),
                                                   k_base + rows[:, None] * stride_kn + offs_d)
            async_copy.async_copy_global_to_shared(v_smem.index(slot).slice(r, CHUNK),
                                                   v_base + rows[:, None] * stride_vn + offs_d)
        async_copy.mbarrier_arrive(ready.index(slot), increment_count=False)
    async_copy.commit_group()
    async_copy.wait_group(0)  # no copy outlives the program


@gluon.jit
def _ring_barriers(STAGES: gl.constexpr):
    """The schedule's mbarriers, initialised: (ready, empty: one per slot; q_ready; the consumers'
    two turn barriers)."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout()).index(0)
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=PRODUCER_WARPS * 32)  # every producer thread's copies
        mbarrier.init(empty.index(i), count=2)  # both consumers
    mbarrier.init(q_ready, count=PRODUCER_WARPS * 32)
    for i in gl.static_range(2):
        mbarrier.init(turns.index(i), count=1)
    return ready, empty, q_ready, turns


@gluon.jit
def _invalidate(ready, empty, q_ready, turns, STAGES: gl.constexpr):
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))
    mbarrier.invalidate(q_ready)
    for i in gl.static_range(2):
        mbarrier.invalidate(turns.index(i))


@gluon.jit
def _consume_fwd(Out, Lse, q_smem, k_smem, v_smem, q_ready, ready, empty, turn_mine, turn_other, b, h, pid_m, q_blk,
             KVIdx, KBlk, Words, ColPos, DocStart, DocLast, list_row, col_row, word_row, c_begin, n_cols, diag,
             n_slash, n_tiles, stride_ob, stride_oh, stride_on, stride_lb, stride_lh, qk_scale,
             HALF: gl.constexpr, BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
             ACCUMULATE: gl.constexpr, INT64: gl.constexpr, DOCS: gl.constexpr, HAS_COLS: gl.constexpr):
    """One consumer warpgroup: query rows ``HALF * 64 ..`` of the block over every key tile, then
    their output. Its issues alternate with the other consumer's: iteration t's wgmma groups wait
    on ``turn_mine`` and then arrive on ``turn_other``; HALF 0 goes first."""
    s_layout: gl.constexpr = mma_layout(BLOCK, 4)  # scores [64, 128 keys]
    o_layout: gl.constexpr = mma_layout(HEAD_DIM, 4)
    p_layout: gl.constexpr = register_operand_layout(HEAD_DIM, 4)
    rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    cols_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    q_first, q_pos, q_doc, doc_mask_below = _query_positions(2 * pid_m + HALF, q_blk, DocStart, DocLast, BLOCK,
                                                             TILE, DOCS, rows_s)
    q_op = q_smem.slice(HALF * TILE, TILE)
    m_i = gl.full([TILE], float("-inf"), gl.float32, layout=rows_s)
    l_i = gl.zeros([TILE], gl.float32, layout=rows_s)
    acc = gl.zeros([TILE, HEAD_DIM], gl.float32, layout=o_layout)
    if n_tiles > 0:
        k_first, word = _tile_scalars(0, n_tiles, n_slash, KVIdx, KBlk, Words, list_row, word_row, c_begin, BLOCK,
                                      HAS_COLS, BLOCK, n_cols)
        mbarrier.wait(q_ready, 0)
        mbarrier.wait(ready.index(0), 0)
        fence_async_shared()  # the producer's cp.async writes (generic proxy) before wgmma reads them
        s = warpgroup_mma(q_op, k_smem.index(0).permute((1, 0)), gl.zeros([TILE, BLOCK], gl.float32, s_layout),
                          use_acc=False, is_async=True)
        next_first, next_word = _tile_scalars(1, n_tiles, n_slash, KVIdx, KBlk, Words, list_row, word_row, c_begin,
                                              BLOCK, HAS_COLS, BLOCK, n_cols)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        p, alpha, m_i, l_i = _fold_tile(s, 0, k_first, word, n_slash, q_first, q_pos, q_doc, doc_mask_below, diag,
                                        m_i, l_i, qk_scale, ColPos, col_row, c_begin, n_cols, BLOCK, DOCS, HAS_COLS,
                                        cols_s, BLOCK)
        p_op = gl.convert_layout(p.to(q_smem.dtype), p_layout)
        for t in range(1, n_tiles):
            k_first = next_first
            word = next_word
            next_first, next_word = _tile_scalars(t + 1, n_tiles, n_slash, KVIdx, KBlk, Words, list_row, word_row,
                                                  c_begin, BLOCK, HAS_COLS, BLOCK, n_cols)
            slot = t % STAGES
            prev = (t - 1) % STAGES
            mbarrier.wait(ready.index(slot), (t // STAGES) & 1)
            fence_async_shared()
            mbarrier.wait(turn_mine, ((t - 1) & 1) ^ (1 - HALF))  # HALF 0's first wait passes
            s = warpgroup_mma(q_op, k_smem.index(slot).permute((1, 0)), gl.zeros([TILE, BLOCK], gl.float32, s_layout),
                              use_acc=False, is_async=True)
            acc = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
            mbarrier.arrive(turn_other, count=1)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))  # the scores (issued first) only
            p, alpha, m_i, l_i = _fold_tile(s, t, k_first, word, n_slash, q_first, q_pos, q_doc, doc_mask_below,
                                            diag, m_i, l_i, qk_scale, ColPos, col_row, c_begin, n_cols, BLOCK, DOCS,
                                            HAS_COLS, cols_s, BLOCK)
            p_op = gl.convert_layout(p.to(q_smem.dtype), p_layout)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            acc = acc * gl.convert_layout(alpha, rows_o)[:, None]
            mbarrier.arrive(empty.index(prev), count=1)  # this consumer is done with tile t-1
        acc = warpgroup_mma(p_op, v_smem.index((n_tiles - 1) % STAGES), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    # Stored from the accumulator's own layout: a coalescing conversion would need 32 KB of scratch,
    # more than the 224 KB of Q and the ring leave.
    rows = pid_m * BLOCK + HALF * TILE + gl.arange(0, TILE, layout=rows_o)
    _write_output(acc, m_i, l_i, Out, Lse, b, h, rows, stride_ob, stride_oh, stride_on, stride_lb, stride_lh,
                  INT64, ACCUMULATE, rows_o, o_layout)


@gluon.jit
def _vs_attn_fwd_pingpong_kernel(
    Q, K, V, Out, Lse,
    QBlk, KBlk, KVCnt, KVIdx, ColLimit, Cols, ColPos, Words, Diag, DocStart, DocLast, ColStart,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on,
    stride_lb, stride_lh,
    qk_scale,
    HQ, GROUP, NQB, MAX_S, MAX_V, N_WORDS,
    BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CHUNK: gl.constexpr,
    ACCUMULATE: gl.constexpr, INT64: gl.constexpr, DOCS: gl.constexpr, HAS_COLS: gl.constexpr,
    SMEM_LAYOUT: gl.constexpr,
):
    gl.static_assert(BLOCK == 2 * TILE, "a program is one 128-token query block: two 64-row consumers")
    gl.static_assert(STAGES >= 2, "a slot is refilled once both consumers' PV products on it retired")
    pid_m = gl.program_id(0)
    pid_bh = gl.program_id(1)
    b, h, kvh, q_blk, list_row, col_row, word_row, n_slash, n_cols, diag, c_begin, n_tiles = _query_program(
        pid_m, pid_bh, QBlk, KVCnt, ColLimit, Diag, ColStart, HQ, GROUP, NQB, MAX_S, MAX_V, N_WORDS, BLOCK, BLOCK,
        INT64, DOCS, HAS_COLS, BLOCK)

    q_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [BLOCK, HEAD_DIM], SMEM_LAYOUT)
    k_smem = gl.allocate_shared_memory(K.dtype.element_ty, [STAGES, BLOCK, HEAD_DIM], SMEM_LAYOUT)
    v_smem = gl.allocate_shared_memory(V.dtype.element_ty, [STAGES, BLOCK, HEAD_DIM], SMEM_LAYOUT)
    ready, empty, q_ready, turns = _ring_barriers(STAGES)
    # The two consumers' arguments differ in their turn barriers and their HALF only.
    gl.warp_specialize([
        (_consume_fwd, (Out, Lse, q_smem, k_smem, v_smem, q_ready, ready, empty, turns.index(0), turns.index(1), b, h,
                    pid_m, q_blk, KVIdx, KBlk, Words, ColPos, DocStart, DocLast, list_row, col_row, word_row,
                    c_begin, n_cols, diag, n_slash, n_tiles, stride_ob, stride_oh, stride_on, stride_lb, stride_lh,
                    qk_scale, 0, BLOCK, HEAD_DIM, STAGES, ACCUMULATE, INT64, DOCS, HAS_COLS)),
        (_consume_fwd, (Out, Lse, q_smem, k_smem, v_smem, q_ready, ready, empty, turns.index(1), turns.index(0), b, h,
                    pid_m, q_blk, KVIdx, KBlk, Words, ColPos, DocStart, DocLast, list_row, col_row, word_row,
                    c_begin, n_cols, diag, n_slash, n_tiles, stride_ob, stride_oh, stride_on, stride_lb, stride_lh,
                    qk_scale, 1, BLOCK, HEAD_DIM, STAGES, ACCUMULATE, INT64, DOCS, HAS_COLS)),
        (_produce, (Q, Q, K, V, q_smem, q_smem, k_smem, v_smem, q_ready, ready, empty, b, h, kvh, pid_m,
                    stride_qb, stride_qh, stride_qn, stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                    stride_vb, stride_vh, stride_vn, KVIdx, Cols, list_row, col_row, c_begin, n_cols, n_slash,
                    n_tiles, BLOCK, BLOCK, HEAD_DIM, STAGES, CHUNK, False, INT64)),
    ], [4, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])
    _invalidate(ready, empty, q_ready, turns, STAGES)

def vs_attention_fwd_pingpong(q, k, v, plan, out, lse, softmax_scale: float, accumulate: bool) -> None:
    """``vs_attention_fwd_hopper``'s contract at B = 128 (``unsupported_reason`` must be '')."""
    if not softmax_scale > 0:
        raise ValueError(f"vs_attention_fwd_pingpong: softmax_scale must be positive, got {softmax_scale}")
    if plan.block_size != BLOCK_SIZE:
        raise ValueError(f"vs_attention_fwd_pingpong: block size {plan.block_size} (runs {BLOCK_SIZE} only)")
    b, hq, nq, d = q.shape
    B = plan.block_size
    cols, col_pos, words, diag, n_words = column_arguments(plan)
    doc_start, doc_last, col_start, docs = document_arguments(plan)
    _vs_attn_fwd_pingpong_kernel[(nq // B, b * hq)](
        q, k, v, out, lse,
        plan.q_block_ids, plan.k_block_ids, plan.kv_count, plan.kv_blocks, plan.col_limit, cols, col_pos, words,
        diag, doc_start, doc_last, col_start,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1),
        softmax_scale * LOG2E,
        hq, hq // k.shape[1], nq // B, plan.kv_blocks.shape[-1], plan.cols.shape[-1], n_words,
        BLOCK=B, HEAD_DIM=d, STAGES=STAGES, CHUNK=CHUNK, ACCUMULATE=accumulate,
        INT64=int64_offsets(q, k, v, out, lse, *plan_tensors(plan)), DOCS=docs, HAS_COLS=plan.cols.shape[-1] > 0,
        SMEM_LAYOUT=shared_layout(d, q.dtype), num_warps=4, maxnreg=168,
    )
