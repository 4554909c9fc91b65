"""Hopper (sm_90) forward of vertical-slash attention, in Gluon: the Triton forward's function,
plan and interface (``vs_attention_fwd_triton``), with the tensor cores kept busy.

Why a second kernel (docs/performance.md, "Is the forward bound by moving K/V?"): Triton's forward runs
QK^T -> softmax -> PV one after the other in its single warpgroup, so the tensor cores idle while
exp2 runs. Here one warpgroup issues S_t = Q K_t^T and O += P_{t-1} V_{t-1} as two asynchronous
wgmma groups, waits for the scores only, and runs tile t's softmax while the tensor cores run
tile t-1's PV product (FA3's intra-warpgroup pipelining); K/V tiles stream into a ring of
STAGES shared-memory slots two tiles ahead. On the slash loop this runs 1.1x Triton's rate or
better, bit for bit the same result (docs/performance.md).

One 4-warp program per (64 query rows, batch x query head). Its tiles are 64 keys each: first
the slash key blocks of its query block (``BLOCK // 64`` tiles per block), then the plan's columns
in 64-column slots. Every tile is one copy of 64 K rows and 64 V rows by ``cp.async``, from row
indices: a slash tile's are consecutive, a column tile's are gathered (TMA cannot gather on
sm_90), so strided views (Megatron's [s, b, h, d]) and columns take the same path. Every tile goes
through one exact, branch-free mask: causal (and, with documents, same-document) by position, and
for column tiles the step's column word (live: not read through a selected slash block). Rows
with no key yet keep m = -inf and contribute nothing, so empty lists, ring steps and document
edges need no special case.

Covered: sm_90 GPUs, bf16/fp16, head_dim 64 or 128, index blocks of 64 or 128 tokens, the merge
mode of ring attention. Everything else runs the Triton forward (``dispatch.forward_kernel`` decides).
Gluon has no CPU interpreter: on the CPU this kernel is cross-compiled for sm_90a in the tests
(no spills, no serialised wgmma); its numbers are tested on the GPU against the reference and the
Triton forward.

At B = 128 the default is the ping-pong forward (below: one program per query block, two
ping-ponging warpgroups sharing every K/V tile); ``dispatch.hopper_forward_rows`` picks the
program's rows, 64 or 128.

The ping-pong forward, B = 128 only (docs/performance.md, "The ping-pong forward at B = 128"):
the 64-row forward moves 8 bytes of K/V per pair and sits at that stream's time. At B = 128 one
program can hold the whole query block, so that two consumer warpgroups (64 query rows each)
share every streamed K/V tile: half the bytes per pair. In lockstep the two softmaxes collide (a
128-row variant of the kernel above was slower), so here they take turns to issue their wgmma
groups (ping-pong): one's softmax runs while the other's products use the tensor cores. One
program per (query block,
batch x query head), three partitions (``gl.warp_specialize``):
  * a producer warpgroup copies Q once, then every key tile (128 keys: one slash key block, or
    128 column slots) into a ring of PINGPONG_STAGES slots by ``cp.async`` from row indices (TMA
    cannot gather on sm_90, and cp.async takes Megatron's strided views as they are), in
    CHUNK-row pieces (few registers); each thread's copies arrive on the slot's ``ready``
    mbarrier when they land;
  * two consumer warpgroups each run the loop above on 64 query rows: S_t and PV_{t-1} as two
    async wgmma groups, tile t's softmax over PV_{t-1}; the masks are the same
    (``hopper_common``'s key stream with KT = 128); a slot is released on ``empty`` once both
    consumers' PV products that read it retired.
(The backward's dQ and key-block kernels in this schedule ran about a quarter slower than the
lockstep ones of ``hopper_bwd.py``, docs/performance.md, and were removed.)
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .common import LOG2E, column_arguments, document_arguments, int64_offsets, plan_tensors
from .hopper_common import (TILE, copy_layout, issue_tile, mask_scores, mma_layout, query_positions, query_program,
                            register_operand_layout, shared_layout, tile_rows, tile_scalars, wide)

STAGES = 3  # K/V ring slots: 16 KB (Q) + 3 x 32 KB = 112 KB, two programs per SM


@gluon.jit
def _fold_tile(s, t, k_first, word, n_slash, q_first, q_pos, q_doc, doc_mask_below, diag, m_i, l_i, qk_scale, ColPos,
               col_row, c_begin, n_cols, BLOCK: gl.constexpr, DOCS: gl.constexpr, HAS_COLS: gl.constexpr,
               cols_layout: gl.constexpr, KT: gl.constexpr = TILE):
    """Mask tile ``t``'s raw scores ``s`` (KT keys) and fold them into the online softmax (base 2):
    (p, alpha, m, l). The scale (> 0) goes inside exp2's argument."""
    s = mask_scores(s, t, k_first, word, n_slash, q_first, q_pos, q_doc, doc_mask_below, diag, ColPos, col_row,
                    c_begin, n_cols, BLOCK, DOCS, HAS_COLS, cols_layout, KT)
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet stay exact zeros
    p = gl.exp2(s * qk_scale - m_safe[:, None])
    alpha = gl.exp2(m_i - m_safe)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def _write_output(acc, m_i, l_i, Out, Lse, b, h, rows, stride_ob, stride_oh, stride_on, stride_lb, stride_lh,
                  INT64: gl.constexpr, ACCUMULATE: gl.constexpr, rows_c: gl.constexpr, c_layout: gl.constexpr):
    """Normalise and store ``rows``' output and natural-log lse; in the accumulate mode (ring
    steps) merge them with the previous steps' partial result through log-sum-exp, in fp32."""
    o_layout: gl.constexpr = acc.type.layout
    has_key = l_i > 0
    l_safe = gl.where(has_key, l_i, 1.0)
    lse = gl.convert_layout(gl.where(has_key, (m_i + gl.log2(l_safe)) * 0.6931471805599453, float("-inf")), rows_c)
    out = gl.convert_layout(acc / gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout))[:, None], c_layout)
    offs_d = gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, c_layout))
    o_ptrs = Out + b * stride_ob + h * stride_oh + wide(rows, INT64)[:, None] * stride_on + offs_d[None, :]
    l_ptrs = Lse + b * stride_lb + h * stride_lh + rows
    if ACCUMULATE:
        # Merge with the previous steps' partial result through log-sum-exp, in fp32.
        old_lse = gl.load(l_ptrs)
        old_out = gl.load(o_ptrs).to(gl.float32)
        mx = gl.maximum(old_lse, lse)
        mx_safe = gl.where(mx == float("-inf"), 0.0, mx)
        w_old = gl.exp(old_lse - mx_safe)
        w_new = gl.exp(lse - mx_safe)
        total = w_old + w_new
        has_any = total > 0
        total_safe = gl.where(has_any, total, 1.0)
        out = (old_out * w_old[:, None] + out * w_new[:, None]) / total_safe[:, None]
        lse = gl.where(has_any, mx_safe + gl.log(total_safe), float("-inf"))
    gl.store(o_ptrs, out.to(Out.dtype.element_ty))
    gl.store(l_ptrs, lse)


@gluon.jit
def _vs_attn_fwd_sm90_kernel(
    Q, K, V, Out, Lse,
    QBlk, KBlk, KVCnt, KVIdx, ColLimit, Cols, ColPos, Words, Diag, DocStart, DocLast, ColStart,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on,
    stride_lb, stride_lh,
    qk_scale,
    HQ, GROUP, NQB, MAX_S, MAX_V, N_WORDS,
    BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
    ACCUMULATE: gl.constexpr, INT64: gl.constexpr, DOCS: gl.constexpr, HAS_COLS: gl.constexpr,
    SMEM_LAYOUT: gl.constexpr,
):
    gl.static_assert(STAGES >= 2, "a slot is refilled once its PV product retires: 2 slots or more")
    ROWS: gl.constexpr = TILE  # one warpgroup's m64 rows per program
    WARPS: gl.constexpr = 4
    c_layout: gl.constexpr = copy_layout(HEAD_DIM, WARPS)
    s_layout: gl.constexpr = mma_layout(TILE, WARPS)  # scores
    o_layout: gl.constexpr = mma_layout(HEAD_DIM, WARPS)  # output
    p_layout: gl.constexpr = register_operand_layout(HEAD_DIM, WARPS)
    rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    cols_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    rows_c: gl.constexpr = gl.SliceLayout(1, c_layout)

    pid_m = gl.program_id(0)
    pid_bh = gl.program_id(1)
    b, h, kvh, q_blk, list_row, col_row, word_row, n_slash, n_cols, diag, c_begin, n_tiles = query_program(
        pid_m, pid_bh, QBlk, KVCnt, ColLimit, Diag, ColStart, HQ, GROUP, NQB, MAX_S, MAX_V, N_WORDS, BLOCK, ROWS,
        INT64, DOCS, HAS_COLS)
    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh

    q_smem = gl.allocate_shared_memory(Q.dtype.element_ty, [ROWS, HEAD_DIM], SMEM_LAYOUT)
    k_smem = gl.allocate_shared_memory(K.dtype.element_ty, [STAGES, TILE, HEAD_DIM], SMEM_LAYOUT)
    v_smem = gl.allocate_shared_memory(V.dtype.element_ty, [STAGES, TILE, HEAD_DIM], SMEM_LAYOUT)

    # Q joins tile 0's copy group; every slot starts filling at once.
    rows = pid_m * ROWS + gl.arange(0, ROWS, layout=rows_c)
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, c_layout))
    async_copy.async_copy_global_to_shared(
        q_smem, Q + b * stride_qb + h * stride_qh + wide(rows, INT64)[:, None] * stride_qn + offs_d[None, :])
    for i in gl.static_range(STAGES):
        kv_rows = tile_rows(i, n_tiles, n_slash, KVIdx, Cols, list_row, col_row, c_begin, n_cols, BLOCK, INT64,
                            rows_c)
        issue_tile(i, n_tiles, kv_rows, k_base, v_base, stride_kn, stride_vn, k_smem, v_smem, HEAD_DIM, STAGES,
                   c_layout)

    q_first, q_pos, q_doc, doc_mask_below = query_positions(pid_m, q_blk, DocStart, DocLast, BLOCK, ROWS, DOCS, rows_s)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=rows_s)
    l_i = gl.zeros([ROWS], gl.float32, layout=rows_s)
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
    if n_tiles > 0:
        # Tile 0 alone (the accumulator is still empty), then per tile t: S_t and PV_{t-1} in flight.
        k_first, word = tile_scalars(0, n_tiles, n_slash, KVIdx, KBlk, Words, list_row, word_row, c_begin, BLOCK,
                                     HAS_COLS)
        async_copy.wait_group(STAGES - 1)
        gl.thread_barrier()  # every thread's copies have landed
        fence_async_shared()  # cp.async writes (generic proxy) before wgmma reads (async proxy)
        s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), gl.zeros([ROWS, TILE], gl.float32, s_layout),
                          use_acc=False, is_async=True)
        next_first, next_word = tile_scalars(1, n_tiles, n_slash, KVIdx, KBlk, Words, list_row, word_row, c_begin,
                                             BLOCK, HAS_COLS)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        p, alpha, m_i, l_i = _fold_tile(s, 0, k_first, word, n_slash, q_first, q_pos, q_doc, doc_mask_below, diag,
                                        m_i, l_i, qk_scale, ColPos, col_row, c_begin, n_cols, BLOCK, DOCS, HAS_COLS,
                                        cols_s)
        p_op = gl.convert_layout(p.to(Q.dtype.element_ty), p_layout)
        for t in range(1, n_tiles):
            k_first = next_first
            word = next_word
            # Loads for later: the next tile's mask scalars, and the rows of the tile this
            # iteration starts copying.
            next_first, next_word = tile_scalars(t + 1, n_tiles, n_slash, KVIdx, KBlk, Words, list_row, word_row,
                                                 c_begin, BLOCK, HAS_COLS)
            refill = t - 1 + STAGES
            kv_rows = tile_rows(refill, n_tiles, n_slash, KVIdx, Cols, list_row, col_row, c_begin, n_cols, BLOCK,
                                INT64, rows_c)
            async_copy.wait_group(STAGES - 2)  # tile t (groups complete in order)
            gl.thread_barrier()
            fence_async_shared()
            s = warpgroup_mma(q_smem, k_smem.index(t % STAGES).permute((1, 0)),
                              gl.zeros([ROWS, TILE], gl.float32, s_layout), use_acc=False, is_async=True)
            acc = warpgroup_mma(p_op, v_smem.index((t - 1) % STAGES), acc, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))  # the scores (issued first) only
            p, alpha, m_i, l_i = _fold_tile(s, t, k_first, word, n_slash, q_first, q_pos, q_doc, doc_mask_below,
                                            diag, m_i, l_i, qk_scale, ColPos, col_row, c_begin, n_cols, BLOCK, DOCS,
                                            HAS_COLS, cols_s)
            p_op = gl.convert_layout(p.to(Q.dtype.element_ty), p_layout)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            acc = acc * gl.convert_layout(alpha, rows_o)[:, None]
            # Every warp's share of PV_{t-1} has retired: tile t-1's slot takes tile t-1+STAGES.
            gl.thread_barrier()
            issue_tile(refill, n_tiles, kv_rows, k_base, v_base, stride_kn, stride_vn, k_smem, v_smem, HEAD_DIM,
                       STAGES, c_layout)
        acc = warpgroup_mma(p_op, v_smem.index((n_tiles - 1) % STAGES), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    async_copy.wait_group(0)  # no copy outlives the program

    _write_output(acc, m_i, l_i, Out, Lse, b, h, rows, stride_ob, stride_oh, stride_on, stride_lb, stride_lh,
                  INT64, ACCUMULATE, rows_c, c_layout)


# ----------------------------------------------------------------------------------------------
# The ping-pong forward (B = 128)
# ----------------------------------------------------------------------------------------------

PINGPONG_BLOCK = 128  # the only index block size it runs (a program = a query block)
PINGPONG_STAGES = 3  # its K/V ring: 32 KB (Q) + 3 x 64 KB at d 128 = 224 KB, one program per SM
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
        q_rows = wide(pid_m * BLOCK + r + gl.arange(0, CHUNK, layout=rows_c), INT64)[:, None]
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
            rows = tile_rows(u, n_tiles, n_slash, KVIdx, Cols, list_row, col_row, c_begin, n_cols, BLOCK, INT64,
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

    q_first, q_pos, q_doc, doc_mask_below = query_positions(2 * pid_m + HALF, q_blk, DocStart, DocLast, BLOCK,
                                                            TILE, DOCS, rows_s)
    q_op = q_smem.slice(HALF * TILE, TILE)
    m_i = gl.full([TILE], float("-inf"), gl.float32, layout=rows_s)
    l_i = gl.zeros([TILE], gl.float32, layout=rows_s)
    acc = gl.zeros([TILE, HEAD_DIM], gl.float32, layout=o_layout)
    if n_tiles > 0:
        k_first, word = tile_scalars(0, n_tiles, n_slash, KVIdx, KBlk, Words, list_row, word_row, c_begin, BLOCK,
                                     HAS_COLS, BLOCK, n_cols)
        mbarrier.wait(q_ready, 0)
        mbarrier.wait(ready.index(0), 0)
        fence_async_shared()  # the producer's cp.async writes (generic proxy) before wgmma reads them
        s = warpgroup_mma(q_op, k_smem.index(0).permute((1, 0)), gl.zeros([TILE, BLOCK], gl.float32, s_layout),
                          use_acc=False, is_async=True)
        next_first, next_word = tile_scalars(1, n_tiles, n_slash, KVIdx, KBlk, Words, list_row, word_row, c_begin,
                                             BLOCK, HAS_COLS, BLOCK, n_cols)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        p, alpha, m_i, l_i = _fold_tile(s, 0, k_first, word, n_slash, q_first, q_pos, q_doc, doc_mask_below, diag,
                                        m_i, l_i, qk_scale, ColPos, col_row, c_begin, n_cols, BLOCK, DOCS, HAS_COLS,
                                        cols_s, BLOCK)
        p_op = gl.convert_layout(p.to(q_smem.dtype), p_layout)
        for t in range(1, n_tiles):
            k_first = next_first
            word = next_word
            next_first, next_word = tile_scalars(t + 1, n_tiles, n_slash, KVIdx, KBlk, Words, list_row, word_row,
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
    b, h, kvh, q_blk, list_row, col_row, word_row, n_slash, n_cols, diag, c_begin, n_tiles = query_program(
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


def vs_attention_fwd_hopper(q, k, v, plan, out, lse, softmax_scale: float, accumulate: bool, rows: int) -> None:
    """``vs_attention_fwd_triton``'s contract on an sm_90 GPU, for the calls ``dispatch`` gives the
    Hopper forward: programs of ``rows`` query rows, 64 (``_vs_attn_fwd_sm90_kernel``) or, with
    128-token blocks, 128 (``_vs_attn_fwd_pingpong_kernel``); ``dispatch.hopper_forward_rows``
    picks."""
    if not softmax_scale > 0:
        raise ValueError(f"vs_attention_fwd_hopper: softmax_scale must be positive, got {softmax_scale}")
    b, hq, nq, d = q.shape
    B = plan.block_size
    if rows == 128 and B == PINGPONG_BLOCK:
        kernel, grid_rows, options = _vs_attn_fwd_pingpong_kernel, B, dict(STAGES=PINGPONG_STAGES, CHUNK=CHUNK,
                                                                           maxnreg=168)
    elif rows == 64:
        kernel, grid_rows, options = _vs_attn_fwd_sm90_kernel, 64, dict(STAGES=STAGES)
    else:
        raise ValueError(f"vs_attention_fwd_hopper: rows must be 64, or 128 with 128-token blocks; got {rows} "
                         f"with {B}-token blocks")
    cols, col_pos, words, diag, n_words = column_arguments(plan)
    doc_start, doc_last, col_start, docs = document_arguments(plan)
    kernel[(nq // grid_rows, b * hq)](
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
        BLOCK=B, HEAD_DIM=d, ACCUMULATE=accumulate,
        INT64=int64_offsets(q, k, v, out, lse, *plan_tensors(plan)), DOCS=docs, HAS_COLS=plan.cols.shape[-1] > 0,
        SMEM_LAYOUT=shared_layout(d, q.dtype), num_warps=4, **options,
    )
