"""Hopper (sm_90) kernels at 128-token index blocks with FA3's schedule, in Gluon, for B = 128 only:
the forward (``vs_attention_fwd_hopper``'s contract, the default at B = 128), dQ and the key-block
dK/dV (``query_gradients_hopper``'s and ``block_gradients_hopper``'s contracts; opt-in, below).

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

The backward's two slash kernels take the same schedule with 64-row streamed tiles (S, dP and the
gradient accumulators of 128-wide tiles would not fit 240 registers):
  * dQ: the producer copies the block's Q and dO once, then the key tiles (64 keys) into a ring of
    DQ_STAGES; each consumer issues S_t and dP_t (in turn with the other), computes
    dS_t = P_t (dP_t - delta), then dQ += dS_t K_t;
  * key-block dK/dV: the producer copies the block's K and V once, then the Q and dO rows of every
    64-row query tile of the transposed lists (the GQA group's heads in passes, as
    ``hopper_bwd._dkdv_sm90_kernel``) into a ring of DKDV_STAGES; each consumer (64 keys) issues
    S^T and dP^T in turn, then dV += P^T dO and dK += dS^T Q.
A slot goes back once both consumers' products that read it retired. Both pass their GPU tests
(``test_pingpong_backward_matches_the_lockstep_one``; ``scripts/gpu_hopper.sh`` stage pp_ab runs
them and the A/B) but run ~23% slower than the lockstep kernels on an H200 (``benchmarks/NOTES.md``,
session 16), so nothing calls them unless ``MTRAINING_BACKWARD_SCHEDULE=pingpong`` is set
(``hopper_bwd.backward_schedule``).

Covered: sm_90, bf16/fp16, head_dim 64 or 128, B = 128, the accumulate mode of ring steps, strided
views, packed documents. Gluon has no CPU interpreter: cross-compiled in CI, tested on the GPU.
"""

from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_init, warpgroup_mma_wait)

from .hopper_bwd import (_add, _issue_gradients_t, _locate_query_tile, _query_base, _start_scores_t,
                         _store_gradient)
from .hopper_common import TILE, _wide, copy_layout, mma_layout, register_operand_layout, shared_layout
from .hopper_fwd import _fold_tile, _write_output
from .hopper_keys import _mask_scores, _query_positions, _query_program, _tile_rows, _tile_scalars
from .triton_fwd import LOG2E, column_arguments, document_arguments, int64_offsets, plan_tensors

BLOCK_SIZE = 128  # the only index block size this kernel runs (a program = a query block)
STAGES = 3  # forward K/V ring: 32 KB (Q) + 3 x 64 KB at d 128 = 224 KB, one program per SM
DQ_STAGES = 4  # dQ's K/V ring of 64-key tiles: 2 x 32 KB (Q, dO) + 4 x 32 KB = 192 KB
DKDV_STAGES = 4  # the key-block kernel's Q/dO ring of 64-row tiles: 2 x 32 KB (K, V) + 4 x 32 KB = 192 KB
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


@gluon.jit
def _consume_dq(DQ, Lse, Delta, q_smem, do_smem, k_smem, v_smem, q_ready, ready, empty, turn_mine, turn_other, b, h,
                pid_m, q_blk, KVIdx, KBlk, Words, ColPos, DocStart, DocLast, list_row, col_row, word_row, c_begin,
                n_cols, diag, n_slash, n_tiles, stride_lb, stride_lh, stride_gb, stride_gh, stride_gn, qk_scale,
                sm_scale, HALF: gl.constexpr, BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                ACCUMULATE: gl.constexpr, INT64: gl.constexpr, DOCS: gl.constexpr, HAS_COLS: gl.constexpr):
    """One dQ consumer: query rows ``HALF * 64 ..`` of the block over every 64-key tile. Per tile
    S and dP go out together (in turn with the other consumer), then dS = P (dP - delta) and
    dQ += dS K; tile t-1's dQ product is waited for at the top of iteration t, which then releases
    its slot."""
    s_layout: gl.constexpr = mma_layout(TILE, 4)  # S and dP
    g_layout: gl.constexpr = mma_layout(HEAD_DIM, 4)  # dQ
    a_layout: gl.constexpr = register_operand_layout(HEAD_DIM, 4)
    rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    cols_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    rows_g: gl.constexpr = gl.SliceLayout(1, g_layout)

    q_first, q_pos, q_doc, doc_mask_below = _query_positions(2 * pid_m + HALF, q_blk, DocStart, DocLast, BLOCK,
                                                             TILE, DOCS, rows_s)
    stat = b * stride_lb + h * stride_lh + pid_m * BLOCK + HALF * TILE + gl.arange(0, TILE, layout=rows_s)
    lse = gl.load(Lse + stat)
    di = gl.load(Delta + stat)
    # A row without any key (lse = -inf) has p = 0 everywhere: exp2(s - inf).
    lse2 = gl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    q_op = q_smem.slice(HALF * TILE, TILE)
    do_op = do_smem.slice(HALF * TILE, TILE)
    dq = warpgroup_mma_init(gl.zeros([TILE, HEAD_DIM], gl.float32, layout=g_layout))
    k_first, word = _tile_scalars(0, n_tiles, n_slash, KVIdx, KBlk, Words, list_row, word_row, c_begin, BLOCK,
                                  HAS_COLS)
    mbarrier.wait(q_ready, 0)
    for t in range(n_tiles):
        next_first, next_word = _tile_scalars(t + 1, n_tiles, n_slash, KVIdx, KBlk, Words, list_row, word_row,
                                              c_begin, BLOCK, HAS_COLS)
        slot = t % STAGES
        dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))
        mbarrier.arrive(empty.index((t + STAGES - 1) % STAGES), count=1, pred=t > 0)  # tile t-1 is read
        mbarrier.wait(ready.index(slot), (t // STAGES) & 1)
        fence_async_shared()  # the producer's cp.async writes (generic proxy) before wgmma reads them
        mbarrier.wait(turn_mine, (t & 1) ^ (1 - HALF))  # HALF 0's first wait passes
        s = warpgroup_mma(q_op, k_smem.index(slot).permute((1, 0)), gl.zeros([TILE, TILE], gl.float32, s_layout),
                          use_acc=False, is_async=True)
        dp = warpgroup_mma(do_op, v_smem.index(slot).permute((1, 0)), gl.zeros([TILE, TILE], gl.float32, s_layout),
                           use_acc=False, is_async=True)
        mbarrier.arrive(turn_other, count=1)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
        s = _mask_scores(s, t, k_first, word, n_slash, q_first, q_pos, q_doc, doc_mask_below, diag, ColPos, col_row,
                         c_begin, n_cols, BLOCK, DOCS, HAS_COLS, cols_s)
        p = gl.exp2(s * qk_scale - lse2[:, None])
        dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp,))
        ds = p * (dp - di[:, None])
        dq = warpgroup_mma(gl.convert_layout(ds.to(k_smem.dtype), a_layout), k_smem.index(slot), dq, is_async=True)
        k_first = next_first
        word = next_word
    dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))

    # Stored from the accumulator's layout (no conversion scratch: see the forward's epilogue).
    rows = _wide(pid_m * BLOCK + HALF * TILE + gl.arange(0, TILE, layout=rows_g), INT64)[:, None]
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, g_layout))[None, :]
    _store_gradient(DQ + b * stride_gb + h * stride_gh + rows * stride_gn + offs_d, dq * sm_scale, ACCUMULATE)


@gluon.jit
def _dq_pingpong_kernel(
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
    BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CHUNK: gl.constexpr,
    ACCUMULATE: gl.constexpr, INT64: gl.constexpr, DOCS: gl.constexpr, HAS_COLS: gl.constexpr,
    SMEM_LAYOUT: gl.constexpr,
):
    gl.static_assert(BLOCK == 2 * TILE, "a program is one 128-token query block: two 64-row consumers")
    gl.static_assert(STAGES >= 2, "a slot is refilled once both consumers' dQ products on it retired")
    pid_m = gl.program_id(0)
    pid_bh = gl.program_id(1)
    b, h, kvh, q_blk, list_row, col_row, word_row, n_slash, n_cols, diag, c_begin, n_tiles = _query_program(
        pid_m, pid_bh, QBlk, KVCnt, ColLimit, Diag, ColStart, HQ, GROUP, NQB, MAX_S, MAX_V, N_WORDS, BLOCK, BLOCK,
        INT64, DOCS, HAS_COLS)

    q_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [BLOCK, HEAD_DIM], SMEM_LAYOUT)
    do_smem = gl.allocate_shared_memory(DO.dtype.element_ty, [BLOCK, HEAD_DIM], SMEM_LAYOUT)
    k_smem = gl.allocate_shared_memory(K.dtype.element_ty, [STAGES, TILE, HEAD_DIM], SMEM_LAYOUT)
    v_smem = gl.allocate_shared_memory(V.dtype.element_ty, [STAGES, TILE, HEAD_DIM], SMEM_LAYOUT)
    ready, empty, q_ready, turns = _ring_barriers(STAGES)
    # The two consumers' arguments differ in their turn barriers and their HALF only.
    gl.warp_specialize([
        (_consume_dq, (DQ, Lse, Delta, q_smem, do_smem, k_smem, v_smem, q_ready, ready, empty, turns.index(0),
                       turns.index(1), b, h, pid_m, q_blk, KVIdx, KBlk, Words, ColPos, DocStart, DocLast, list_row,
                       col_row, word_row, c_begin, n_cols, diag, n_slash, n_tiles, stride_lb, stride_lh, stride_gb,
                       stride_gh, stride_gn, qk_scale, sm_scale, 0, BLOCK, HEAD_DIM, STAGES, ACCUMULATE, INT64,
                       DOCS, HAS_COLS)),
        (_consume_dq, (DQ, Lse, Delta, q_smem, do_smem, k_smem, v_smem, q_ready, ready, empty, turns.index(1),
                       turns.index(0), b, h, pid_m, q_blk, KVIdx, KBlk, Words, ColPos, DocStart, DocLast, list_row,
                       col_row, word_row, c_begin, n_cols, diag, n_slash, n_tiles, stride_lb, stride_lh, stride_gb,
                       stride_gh, stride_gn, qk_scale, sm_scale, 1, BLOCK, HEAD_DIM, STAGES, ACCUMULATE, INT64,
                       DOCS, HAS_COLS)),
        (_produce, (Q, DO, K, V, q_smem, do_smem, k_smem, v_smem, q_ready, ready, empty, b, h, kvh, pid_m,
                    stride_qb, stride_qh, stride_qn, stride_ob, stride_oh, stride_on, stride_kb, stride_kh, stride_kn,
                    stride_vb, stride_vh, stride_vn, KVIdx, Cols, list_row, col_row, c_begin, n_cols, n_slash,
                    n_tiles, BLOCK, TILE, HEAD_DIM, STAGES, CHUNK, True, INT64)),
    ], [4, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])
    _invalidate(ready, empty, q_ready, turns, STAGES)


def query_gradients_pingpong(q, k, v, do, lse, delta, dq, plan, accumulate: bool, int64: bool, strides,
                             qk_scale: float, softmax_scale: float) -> None:
    """``query_gradients_hopper``'s contract at B = 128 with this module's schedule."""
    b, hq, nq, d = q.shape
    B = plan.block_size
    if B != BLOCK_SIZE:
        raise ValueError(f"query_gradients_pingpong: block size {B} (runs {BLOCK_SIZE} only)")
    cols, col_pos, words, diag, n_words = column_arguments(plan)
    doc_start, doc_last, col_start, docs = document_arguments(plan)
    _dq_pingpong_kernel[(nq // B, b * hq)](
        q, k, v, do, lse, delta, dq,
        plan.q_block_ids, plan.k_block_ids, plan.kv_count, plan.kv_blocks, plan.col_limit, cols, col_pos, words,
        diag, doc_start, doc_last, col_start,
        *strides, dq.stride(0), dq.stride(1), dq.stride(2), qk_scale, softmax_scale,
        hq, hq // k.shape[1], nq // B, plan.kv_blocks.shape[-1], plan.cols.shape[-1], n_words,
        BLOCK=B, HEAD_DIM=d, STAGES=DQ_STAGES, CHUNK=CHUNK, ACCUMULATE=accumulate, INT64=int64, DOCS=docs,
        HAS_COLS=plan.cols.shape[-1] > 0, SMEM_LAYOUT=shared_layout(d, q.dtype), num_warps=4, maxnreg=168,
    )


@gluon.jit
def _pass_tiles(g0, b, kvh, k_local, QCnt, HQ, GROUP, NKB, HEADS: gl.constexpr, BLOCK: gl.constexpr,
                INT64: gl.constexpr, heads_layout: gl.constexpr):
    """A pass over heads g0 .. g0 + HEADS of the GQA group: (heads, per head its query tiles and
    their running end, the pass's tile count), held whole by every thread (``_locate_query_tile``)."""
    heads = gl.arange(0, HEADS, layout=heads_layout)
    head_rows = (_wide(b * HQ + kvh * GROUP + g0 + heads, INT64)) * NKB + k_local
    tiles = gl.load(QCnt + head_rows, mask=g0 + heads < GROUP, other=0) * (BLOCK // TILE)
    ends = gl.associative_scan(tiles, 0, _add)
    return heads, tiles, ends, gl.sum(tiles, axis=0)


@gluon.jit
def _produce_query_tiles(Q, DO, K, V, q_smem, do_smem, k_smem, v_smem, kv_ready, ready, empty, b, kvh, pid_n,
                         k_local, QCnt, QIdx, stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                         stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_on, HQ, GROUP, NKB, MAX_S,
                         BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr, HEADS: gl.constexpr, STAGES: gl.constexpr,
                         CHUNK: gl.constexpr, INT64: gl.constexpr):
    """The key-block kernel's producer warpgroup: the block's K and V rows, then the Q and dO rows
    of every 64-row query tile of the transposed lists (the GQA group's heads in passes of HEADS,
    each head's list in turn), each into the ring once its slot is empty."""
    c_layout: gl.constexpr = copy_layout(HEAD_DIM, PRODUCER_WARPS)
    rows_c: gl.constexpr = gl.SliceLayout(1, c_layout)
    heads_layout: gl.constexpr = gl.BlockedLayout([HEADS], [32], [PRODUCER_WARPS], [0])
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, c_layout))[None, :]
    k_base = K + _wide(b, INT64) * stride_kb + _wide(kvh, INT64) * stride_kh
    v_base = V + _wide(b, INT64) * stride_vb + _wide(kvh, INT64) * stride_vh
    for r in gl.static_range(0, BLOCK, CHUNK):
        k_rows = _wide(pid_n * BLOCK + r + gl.arange(0, CHUNK, layout=rows_c), INT64)[:, None]
        async_copy.async_copy_global_to_shared(k_smem.slice(r, CHUNK), k_base + k_rows * stride_kn + offs_d)
        async_copy.async_copy_global_to_shared(v_smem.slice(r, CHUNK), v_base + k_rows * stride_vn + offs_d)
    async_copy.mbarrier_arrive(kv_ready, increment_count=False)

    base = 0  # tiles of the earlier passes: the ring's position carries across passes
    for g0 in range(0, GROUP, HEADS):
        heads, tiles, ends, n_pass = _pass_tiles(g0, b, kvh, k_local, QCnt, HQ, GROUP, NKB, HEADS, BLOCK, INT64,
                                                 heads_layout)
        for u in range(n_pass):
            t = base + u
            slot = t % STAGES
            h, i, sub = _locate_query_tile(u, n_pass, ends, tiles, heads, g0, b, kvh, k_local, QCnt, QIdx, HQ,
                                           GROUP, NKB, MAX_S, BLOCK, INT64)
            q_base = _query_base(Q, b, h, stride_qb, stride_qh, INT64)
            do_base = _query_base(DO, b, h, stride_ob, stride_oh, INT64)
            mbarrier.wait(empty.index(slot), ((t // STAGES) & 1) ^ 1)
            for r in gl.static_range(0, TILE, CHUNK):
                q_rows = _wide(i * BLOCK + sub * TILE + r + gl.arange(0, CHUNK, layout=rows_c), INT64)[:, None]
                async_copy.async_copy_global_to_shared(q_smem.index(slot).slice(r, CHUNK),
                                                       q_base + q_rows * stride_qn + offs_d)
                async_copy.async_copy_global_to_shared(do_smem.index(slot).slice(r, CHUNK),
                                                       do_base + q_rows * stride_on + offs_d)
            async_copy.mbarrier_arrive(ready.index(slot), increment_count=False)
        base += n_pass
    async_copy.commit_group()
    async_copy.wait_group(0)  # no copy outlives the program


@gluon.jit
def _consume_dkdv(DK, DV, Lse, Delta, q_smem, do_smem, k_smem, v_smem, kv_ready, ready, empty, turn_mine, turn_other,
                  b, kvh, pid_n, k_local, QBlk, KBlk, QCnt, QIdx, DocStart, DocLast, stride_lb, stride_lh, stride_gb,
                  stride_gh, stride_gn, qk_scale, sm_scale, HQ, GROUP, NKB, MAX_S, HALF: gl.constexpr,
                  BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr, HEADS: gl.constexpr, STAGES: gl.constexpr,
                  INT64: gl.constexpr, DOCS: gl.constexpr):
    """One key-block consumer: keys ``HALF * 64 ..`` of the block over every query tile of the
    transposed lists. Per tile S^T and dP^T go out together (in turn with the other consumer), then
    P^T, dV += P^T dO and dK += dS^T Q (``hopper_bwd._issue_gradients_t``); tile t-1's products are
    waited for at the top of iteration t, which then releases its slot."""
    s_layout: gl.constexpr = mma_layout(TILE, 4)  # S^T and dP^T
    g_layout: gl.constexpr = mma_layout(HEAD_DIM, 4)  # dK and dV
    a_layout: gl.constexpr = register_operand_layout(HEAD_DIM, 4)
    keys_of_s: gl.constexpr = gl.SliceLayout(1, s_layout)  # one entry per key (row of S^T)
    queries_of_s: gl.constexpr = gl.SliceLayout(0, s_layout)  # one entry per query (column of S^T)
    heads_layout: gl.constexpr = gl.BlockedLayout([HEADS], [32], [4], [0])

    k_first = gl.load(KBlk + k_local) * BLOCK + HALF * TILE
    k_pos = k_first + gl.arange(0, TILE, layout=keys_of_s)
    q_offs = gl.arange(0, TILE, layout=queries_of_s)
    k_op = k_smem.slice(HALF * TILE, TILE)
    v_op = v_smem.slice(HALF * TILE, TILE)
    dk = warpgroup_mma_init(gl.zeros([TILE, HEAD_DIM], gl.float32, layout=g_layout))
    dv = warpgroup_mma_init(gl.zeros([TILE, HEAD_DIM], gl.float32, layout=g_layout))
    mbarrier.wait(kv_ready, 0)
    base = 0
    for g0 in range(0, GROUP, HEADS):
        heads, tiles, ends, n_pass = _pass_tiles(g0, b, kvh, k_local, QCnt, HQ, GROUP, NKB, HEADS, BLOCK, INT64,
                                                 heads_layout)
        h, i, sub = _locate_query_tile(0, n_pass, ends, tiles, heads, g0, b, kvh, k_local, QCnt, QIdx, HQ, GROUP,
                                       NKB, MAX_S, BLOCK, INT64)
        for u in range(n_pass):
            t = base + u
            slot = t % STAGES
            # Loads for later: the next tile's list entry; this tile's statistics and position.
            h_next, i_next, sub_next = _locate_query_tile(u + 1, n_pass, ends, tiles, heads, g0, b, kvh, k_local,
                                                          QCnt, QIdx, HQ, GROUP, NKB, MAX_S, BLOCK, INT64)
            row = i * BLOCK + sub * TILE
            stat = _wide(b, INT64) * stride_lb + _wide(h, INT64) * stride_lh + row + q_offs
            lse = gl.load(Lse + stat)
            di = gl.load(Delta + stat)
            lse2 = gl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
            q_first = gl.load(QBlk + i) * BLOCK + sub * TILE
            if DOCS:
                doc_below = gl.load(DocLast + q_first // BLOCK)  # the start of the block's last document
            dk = warpgroup_mma_wait(num_outstanding=0, deps=(dk,))
            dv = warpgroup_mma_wait(num_outstanding=0, deps=(dv,))
            mbarrier.arrive(empty.index((t + STAGES - 1) % STAGES), count=1, pred=t > 0)  # tile t-1 is read
            mbarrier.wait(ready.index(slot), (t // STAGES) & 1)
            fence_async_shared()  # the producer's cp.async writes (generic proxy) before wgmma reads them
            mbarrier.wait(turn_mine, (t & 1) ^ (1 - HALF))  # HALF 0's first wait passes
            s_t, dp_t = _start_scores_t(k_op, v_op, q_smem.index(slot), do_smem.index(slot), s_layout)
            mbarrier.arrive(turn_other, count=1)  # issued: the other consumer's products may go
            s_t = warpgroup_mma_wait(num_outstanding=1, deps=(s_t,))
            p_t = gl.exp2(s_t * qk_scale - lse2[None, :])
            # Masked by position only where some pair is not causal (the diagonal) or (documents)
            # some query's document starts after the tile's first key.
            needs = k_first + TILE > q_first
            if DOCS:
                needs = needs | (k_first < doc_below)
            if needs:
                q_pos = q_first + q_offs
                keep = k_pos[:, None] <= q_pos[None, :]
                if DOCS:
                    keep = keep & (k_pos[:, None] >= gl.load(DocStart + q_pos)[None, :])
                p_t = gl.where(keep, p_t, 0.0)
            dk, dv = _issue_gradients_t(dk, dv, p_t, dp_t, di, q_smem.index(slot), do_smem.index(slot), a_layout)
            h, i, sub = h_next, i_next, sub_next
        # Retired; carried into the next pass as accumulators again (as in the lockstep kernel).
        dk = warpgroup_mma_init(warpgroup_mma_wait(num_outstanding=0, deps=(dk,)))
        dv = warpgroup_mma_init(warpgroup_mma_wait(num_outstanding=0, deps=(dv,)))
        base += n_pass
    dk = warpgroup_mma_wait(num_outstanding=0, deps=(dk,))
    dv = warpgroup_mma_wait(num_outstanding=0, deps=(dv,))

    # This program is the only writer of its key rows (slash sets are closed under transposition).
    # Stored from the accumulators' layout (no conversion scratch: see the forward's epilogue).
    rows = _wide(pid_n * BLOCK + HALF * TILE + gl.arange(0, TILE, layout=gl.SliceLayout(1, g_layout)), INT64)
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, g_layout))[None, :]
    g_offs = _wide(b, INT64) * stride_gb + _wide(kvh, INT64) * stride_gh + rows[:, None] * stride_gn + offs_d
    _store_gradient(DK + g_offs, dk * sm_scale, True)
    _store_gradient(DV + g_offs, dv, True)


@gluon.jit
def _dkdv_pingpong_kernel(
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
    BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr, HEADS: gl.constexpr, STAGES: gl.constexpr, CHUNK: gl.constexpr,
    INT64: gl.constexpr, DOCS: gl.constexpr, SMEM_LAYOUT: gl.constexpr,
):
    """One program per (key block, batch x kv head): two consumers of 64 keys each share every
    Q/dO tile of the GQA group's transposed lists."""
    gl.static_assert(BLOCK == 2 * TILE, "a program is one 128-token key block: two 64-key consumers")
    gl.static_assert(STAGES >= 2, "a slot is refilled once both consumers' products on it retired")
    pid_n = gl.program_id(0)
    pid_bkv = gl.program_id(1)
    b = pid_bkv // HKV
    kvh = pid_bkv % HKV
    k_local = pid_n

    k_smem = gl.allocate_shared_memory(K.dtype.element_ty, [BLOCK, HEAD_DIM], SMEM_LAYOUT)
    v_smem = gl.allocate_shared_memory(V.dtype.element_ty, [BLOCK, HEAD_DIM], SMEM_LAYOUT)
    q_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [STAGES, TILE, HEAD_DIM], SMEM_LAYOUT)
    do_smem = gl.allocate_shared_memory(DO.dtype.element_ty, [STAGES, TILE, HEAD_DIM], SMEM_LAYOUT)
    ready, empty, kv_ready, turns = _ring_barriers(STAGES)
    gl.warp_specialize([
        (_consume_dkdv, (DK, DV, Lse, Delta, q_smem, do_smem, k_smem, v_smem, kv_ready, ready, empty, turns.index(0),
                         turns.index(1), b, kvh, pid_n, k_local, QBlk, KBlk, QCnt, QIdx, DocStart, DocLast, stride_lb,
                         stride_lh, stride_gb, stride_gh, stride_gn, qk_scale, sm_scale, HQ, GROUP, NKB, MAX_S, 0,
                         BLOCK, HEAD_DIM, HEADS, STAGES, INT64, DOCS)),
        (_consume_dkdv, (DK, DV, Lse, Delta, q_smem, do_smem, k_smem, v_smem, kv_ready, ready, empty, turns.index(1),
                         turns.index(0), b, kvh, pid_n, k_local, QBlk, KBlk, QCnt, QIdx, DocStart, DocLast, stride_lb,
                         stride_lh, stride_gb, stride_gh, stride_gn, qk_scale, sm_scale, HQ, GROUP, NKB, MAX_S, 1,
                         BLOCK, HEAD_DIM, HEADS, STAGES, INT64, DOCS)),
        (_produce_query_tiles, (Q, DO, K, V, q_smem, do_smem, k_smem, v_smem, kv_ready, ready, empty, b, kvh, pid_n,
                                k_local, QCnt, QIdx, stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                                stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_on, HQ, GROUP, NKB,
                                MAX_S, BLOCK, HEAD_DIM, HEADS, STAGES, CHUNK, INT64)),
    ], [4, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])
    _invalidate(ready, empty, kv_ready, turns, STAGES)


def block_gradients_pingpong(q, k, v, do, lse, delta, dk, dv, plan, doc_start, doc_last, docs: bool, int64: bool,
                             strides, qk_scale: float, softmax_scale: float) -> None:
    """``block_gradients_hopper``'s contract at B = 128 with this module's schedule."""
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    group = hq // hkv
    B = plan.block_size
    if B != BLOCK_SIZE:
        raise ValueError(f"block_gradients_pingpong: block size {B} (runs {BLOCK_SIZE} only)")
    _dkdv_pingpong_kernel[(nk // B, b * hkv)](
        q, k, v, do, lse, delta, dk, dv,
        plan.q_block_ids, plan.k_block_ids, plan.q_count, plan.q_blocks, doc_start, doc_last,
        *strides, dk.stride(0), dk.stride(1), dk.stride(2), qk_scale, softmax_scale,
        hq, hkv, group, nk // B, plan.q_blocks.shape[-1],
        BLOCK=B, HEAD_DIM=d, HEADS=min(8, triton.next_power_of_2(group)), STAGES=DKDV_STAGES, CHUNK=CHUNK,
        INT64=int64, DOCS=docs, SMEM_LAYOUT=shared_layout(d, q.dtype), num_warps=4, maxnreg=168,
    )
