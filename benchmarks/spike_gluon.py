"""Spike M10 (issue 17): the slash-only forward as an explicit Hopper kernel in Gluon.

benchmarks/spike_hopper_kernels.md section 7 (M10) and NOTES.md (session 10, M1): our forward is not
bound by moving K/V (the tiles stream in 0.51-0.68 of its time), so what is left is the overlap of
QK^T, softmax and PV that Triton's compiler does not give one 4-warp program. Gluon (Triton 3.6's
layout-explicit dialect) lets the kernel say it:

  * K/V tiles arrive by TMA into a ring of STAGES shared-memory slots, one mbarrier per slot;
  * per key tile t, the kernel issues S_t = Q K_t^T and then O += P_{t-1} V_{t-1} as asynchronous
    wgmma groups, waits for the scores only (``warpgroup_mma_wait(1)``), and runs tile t's softmax
    on the warpgroup while the tensor cores run tile t-1's PV product (FA3's intra-warpgroup
    pipelining); the output is rescaled once that product retires. No instruction reads an
    in-flight accumulator, so ptxas keeps the wgmma groups asynchronous (an earlier schedule,
    S_{t+1} in flight over softmax(t) in the same registers, was serialised: ptxas C7514);
  * P goes from the score accumulator's registers to the PV product's A operand in registers;
  * a slot is refilled once the PV product that read it has retired (tile t-1's, at iteration t):
    STAGES >= 2, and each extra slot gives the copy one more iteration.

The function is the spike's problem (spike_autows.py): the `fixed` index with its columns
emptied, one program per (query block, batch x query head), every tile through the causal
``where`` (only the diagonal tile, listed last, is actually masked), out and natural-log lse like
production. Gluon has no CPU interpreter: the CPU checks are a cross-compile for sm_90a
(``--compile-sm90``: does it compile, how much shared memory, wgmma in the PTX); the GPU run checks
every variant against the fp32 reference and production's kernel (spike_autows's harness) and
times them at 128K beside production:

    python benchmarks/spike_gluon.py --out $OUT/spike_gluon_nvidia-h200.json   # GPU (H200)
    python benchmarks/spike_gluon.py --compile-sm90 [--out compile.json]        # CPU
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Dict, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import spike_autows as harness  # noqa: E402  (sets TRITON_INTERPRET on a GPU-less run; --compile-sm90 keeps it off)
from common import ptxas_report  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,  # noqa: E402
                                                              warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402

from megatron_mtraining.kernels.triton_fwd import LOG2E  # noqa: E402


@gluon.jit
def _fold_scores(s, q_pos, k_first, m_i, l_i, qk_scale, BLOCK: gl.constexpr, col_layout: gl.constexpr):
    """Online softmax of one score tile (raw q.k, fp32), base 2: (p, alpha, m, l). Every tile of a
    slash list holds a key for every row (the diagonal one the query itself), so m is finite from
    the first tile on."""
    k_pos = k_first + gl.arange(0, BLOCK, layout=col_layout)
    s = gl.where(k_pos[None, :] <= q_pos[:, None], s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    p = gl.exp2(s * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def _barriers(COUNT: gl.constexpr, N: gl.constexpr):
    """N mbarriers, each completing a phase after COUNT arrivals."""
    bars = gl.allocate_shared_memory(gl.int64, [N, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(N):
        mbarrier.init(bars.index(i), count=COUNT)
    return bars


@gluon.jit
def _load_tile(k_desc, v_desc, k_smem, v_smem, ready, slot, row, pred):
    """K and V of one key block into ``slot``, completing on ``ready[slot]``."""
    bar = ready.index(slot)
    mbarrier.expect(bar, 2 * k_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(k_desc, [row, 0], bar, k_smem.index(slot), pred=pred)
    tma.async_copy_global_to_shared(v_desc, [row, 0], bar, v_smem.index(slot), pred=pred)


@gluon.jit
def _attend_query_tile(q_desc, k_desc, v_desc, o_desc, Lse, q_smem, k_smem, v_smem, ready, empty, q_bar, blocks,
                       n_tiles, kv_row0, q_row, q_first, lse_row, qk_scale, turn_mine, turn_other, paired,
                       HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                       SELF_LOAD: gl.constexpr, PINGPONG: gl.constexpr, FIRST: gl.constexpr,
                       Q_IN_REGS: gl.constexpr):
    """One 64-row query tile (BLOCK_M rows from position ``q_first``) on one warpgroup: its slash
    key blocks (``blocks[:n_tiles]``, BLOCK_N keys each, K/V in the ``STAGES`` slots of
    ``k_smem``/``v_smem``, each slot's arrival on ``ready``), then out and lse. SELF_LOAD: this warpgroup also refills a slot once its PV product retires; else it
    arrives on ``empty`` and a producer warp refills it.

    PINGPONG (two consumer warpgroups, FA3's schedule): the two take turns to issue their wgmma
    groups, so one's softmax runs while the other's products occupy the tensor cores. Iteration
    k's issue waits on ``turn_mine`` and then arrives on ``turn_other``, for the first ``paired``
    iterations only (the shorter list's count: the longer one then runs alone). FIRST: this
    warpgroup issues first (a fresh mbarrier's wait on parity 1 passes).

    Q_IN_REGS: the scores' A operand (Q) comes from registers, loaded once: a 64x64 score tile
    with both operands in shared memory reads ~32 FLOP per byte, about the tensor cores' rate
    against 128 B/clock of shared memory; from registers only K is read (64 FLOP/byte)."""
    # One warpgroup: the m64 wgmma atom over 4 warps, scores [BLOCK_M, BLOCK_N], output [BLOCK_M, HEAD_DIM].
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    cols_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    q_pos = q_first + gl.arange(0, BLOCK_M, layout=rows_s)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=rows_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=rows_s)

    # Tile 0's scores and softmax (alpha is 0 there: the empty accumulator stays 0).
    mbarrier.wait(q_bar, 0)
    if Q_IN_REGS:
        q_op = q_smem.load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))
    else:
        q_op = q_smem
    mbarrier.wait(ready.index(0), 0)
    s = warpgroup_mma(q_op, k_smem.index(0).permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout),
                      use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    p, alpha, m_i, l_i = _fold_scores(s, q_pos, gl.load(blocks) * BLOCK_N, m_i, l_i, qk_scale, BLOCK_N, cols_s)
    p_op = gl.convert_layout(p.to(q_desc.dtype), p_layout)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
    for t in range(1, n_tiles):
        slot = t % STAGES
        prev = (t - 1) % STAGES
        mbarrier.wait(ready.index(slot), (t // STAGES) & 1)
        if PINGPONG:
            k = t - 1
            mbarrier.wait(turn_mine, (k & 1) ^ (1 if FIRST else 0), pred=k < paired)
        # Tile t's scores, then tile t-1's PV product, both in flight.
        s = warpgroup_mma(q_op, k_smem.index(slot).permute((1, 0)),
                          gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout), use_acc=False, is_async=True)
        acc = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn_other, count=1, pred=t - 1 < paired)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))  # the scores (issued first) only
        # Tile t's softmax on this warpgroup while the tensor cores run tile t-1's PV product.
        p, alpha, m_i, l_i = _fold_scores(s, q_pos, gl.load(blocks + t) * BLOCK_N, m_i, l_i, qk_scale, BLOCK_N, cols_s)
        p_op = gl.convert_layout(p.to(q_desc.dtype), p_layout)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        acc = acc * gl.convert_layout(alpha, rows_o)[:, None]
        # Tile t-1's K and V are read: its slot takes tile t-1+STAGES.
        if SELF_LOAD:
            refill = t - 1 + STAGES
            j_refill = gl.load(blocks + refill, mask=refill < n_tiles, other=0)
            _load_tile(k_desc, v_desc, k_smem, v_smem, ready, prev, kv_row0 + j_refill * BLOCK_N, refill < n_tiles)
        else:
            mbarrier.arrive(empty.index(prev), count=1)
    acc = warpgroup_mma(p_op, v_smem.index((n_tiles - 1) % STAGES), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))

    out = acc / gl.convert_layout(l_i, rows_o)[:, None]
    q_smem.store(out.to(q_desc.dtype))  # Q is no longer read: its slot stages the output
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [q_row, 0], q_smem)
    gl.store(Lse + lse_row + q_pos, (m_i + gl.log2(l_i)) * 0.6931471805599453)
    tma.store_wait(pendings=0)


@gluon.jit
def _slash_fwd_gluon_kernel(q_desc, k_desc, v_desc, o_desc, Lse, KVCnt, KVIdx, HQ, GROUP, N, NQB, MAX_S, qk_scale,
                            HEAD_DIM: gl.constexpr, BLOCK: gl.constexpr, STAGES: gl.constexpr,
                            Q_IN_REGS: gl.constexpr):
    """One 4-warp program per (query block, batch x query head): it loads and computes."""
    gl.static_assert(STAGES >= 2, "a slot is refilled once its PV product retires: 2 slots or more")
    pid_m = gl.program_id(0)
    pid_bh = gl.program_id(1)
    b = pid_bh // HQ
    h = pid_bh % HQ
    kv_row0 = (b * (HQ // GROUP) + h // GROUP) * N  # Q/O are [b*hq*N, d], K/V [b*hkv*N, d]
    q_row = pid_bh * N + pid_m * BLOCK

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK, HEAD_DIM], v_desc.layout)
    ready = _barriers(1, STAGES)
    q_bar = _barriers(1, 1).index(0)

    plan_row = pid_bh * NQB + pid_m
    n_tiles = gl.load(KVCnt + plan_row)
    blocks = KVIdx + plan_row * MAX_S
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, 0], q_bar, q_smem)
    for i in gl.static_range(STAGES):  # every slot starts filling at once
        j = gl.load(blocks + i, mask=i < n_tiles, other=0)
        _load_tile(k_desc, v_desc, k_smem, v_smem, ready, i, kv_row0 + j * BLOCK, i < n_tiles)
    _attend_query_tile(q_desc, k_desc, v_desc, o_desc, Lse, q_smem, k_smem, v_smem, ready, ready, q_bar, blocks,
                       n_tiles, kv_row0, q_row, pid_m * BLOCK, pid_bh * N, qk_scale, q_bar, q_bar, 0, HEAD_DIM, BLOCK,
                       BLOCK, STAGES, True, False, True, Q_IN_REGS)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
    mbarrier.invalidate(q_bar)


@gluon.jit
def _producer(k_desc, v_desc, k_smem, v_smem, ready, empty, blocks, n_tiles, kv_row0, BLOCK: gl.constexpr,
              STAGES: gl.constexpr):
    """The producer warp: both consumers' K/V tiles, each into its own ring, in their order."""
    n_max = gl.maximum(n_tiles[0], n_tiles[1])
    for t in range(n_max):
        slot = t % STAGES
        phase = (t // STAGES) & 1
        for c in gl.static_range(2):
            if t < n_tiles[c]:
                # A fresh mbarrier counts as having completed the phase before 0: the first
                # STAGES waits pass.
                mbarrier.wait(empty[c].index(slot), phase ^ 1)
                j = gl.load(blocks[c] + t)
                _load_tile(k_desc, v_desc, k_smem[c], v_smem[c], ready[c], slot, kv_row0 + j * BLOCK, True)


@gluon.jit
def _slash_fwd_gluon_ws_kernel(q_desc, k_desc, v_desc, o_desc, Lse, KVCnt, KVIdx, HQ, GROUP, N, NQB, MAX_S, qk_scale,
                               HEAD_DIM: gl.constexpr, BLOCK: gl.constexpr, STAGES: gl.constexpr,
                               PINGPONG: gl.constexpr, Q_IN_REGS: gl.constexpr):
    """Warp-specialised: one program per (two query blocks, batch x query head). Two consumer
    warpgroups each attend one query block (the default partition and a 4-warp worker), a 1-warp
    producer keeps both K/V rings full (gl.warp_specialize); PINGPONG: the consumers take turns
    to issue their products (``_attend_query_tile``)."""
    pid_m = gl.program_id(0)
    pid_bh = gl.program_id(1)
    b = pid_bh // HQ
    h = pid_bh % HQ
    kv_row0 = (b * (HQ // GROUP) + h // GROUP) * N

    q_smem0 = gl.allocate_shared_memory(q_desc.dtype, [BLOCK, HEAD_DIM], q_desc.layout)
    q_smem1 = gl.allocate_shared_memory(q_desc.dtype, [BLOCK, HEAD_DIM], q_desc.layout)
    k_smem0 = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK, HEAD_DIM], k_desc.layout)
    k_smem1 = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK, HEAD_DIM], k_desc.layout)
    v_smem0 = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK, HEAD_DIM], v_desc.layout)
    v_smem1 = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK, HEAD_DIM], v_desc.layout)
    ready0 = _barriers(1, STAGES)
    ready1 = _barriers(1, STAGES)
    empty0 = _barriers(1, STAGES)
    empty1 = _barriers(1, STAGES)
    q_bars = _barriers(1, 2)
    turns = _barriers(1, 2)

    q_blk0 = 2 * pid_m
    rows0 = pid_bh * NQB + q_blk0
    n0 = gl.load(KVCnt + rows0)
    n1 = gl.load(KVCnt + rows0 + 1)
    blocks0 = KVIdx + rows0 * MAX_S
    blocks1 = blocks0 + MAX_S
    q_row0 = pid_bh * N + q_blk0 * BLOCK
    for c in gl.static_range(2):
        mbarrier.expect(q_bars.index(c), q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row0, 0], q_bars.index(0), q_smem0)
    tma.async_copy_global_to_shared(q_desc, [q_row0 + BLOCK, 0], q_bars.index(1), q_smem1)

    lse_row = pid_bh * N
    paired = gl.minimum(n0, n1) - 1  # loop iterations both consumers have
    gl.warp_specialize([
        (_attend_query_tile, (q_desc, k_desc, v_desc, o_desc, Lse, q_smem0, k_smem0, v_smem0, ready0, empty0,
                              q_bars.index(0), blocks0, n0, kv_row0, q_row0, q_blk0 * BLOCK, lse_row, qk_scale,
                              turns.index(0), turns.index(1), paired, HEAD_DIM, BLOCK, BLOCK, STAGES, False, PINGPONG,
                              True, Q_IN_REGS)),
        (_attend_query_tile, (q_desc, k_desc, v_desc, o_desc, Lse, q_smem1, k_smem1, v_smem1, ready1, empty1,
                              q_bars.index(1), blocks1, n1, kv_row0, q_row0 + BLOCK, (q_blk0 + 1) * BLOCK, lse_row,
                              qk_scale, turns.index(1), turns.index(0), paired, HEAD_DIM, BLOCK, BLOCK, STAGES, False,
                              PINGPONG, False, Q_IN_REGS)),
        (_producer, (k_desc, v_desc, (k_smem0, k_smem1), (v_smem0, v_smem1), (ready0, ready1), (empty0, empty1),
                     (blocks0, blocks1), (n0, n1), kv_row0, BLOCK, STAGES)),
    ], [4, 1], [168, 24])


def tile_layout(block: int, head_dim: int):
    return gl.NVMMASharedLayout.get_default_for([block, head_dim], gl.bfloat16)


@gluon.jit
def _ring_producer(k_desc, v_desc, k_smem, v_smem, ready, empty, blocks, n_tiles, kv_row0, BLOCK_N: gl.constexpr,
                   STAGES: gl.constexpr):
    """The producer warp of one shared ring: every K/V tile of the list, once its slot is empty."""
    for t in range(n_tiles):
        slot = t % STAGES
        mbarrier.wait(empty.index(slot), ((t // STAGES) & 1) ^ 1)  # a fresh mbarrier passes parity 1
        _load_tile(k_desc, v_desc, k_smem, v_smem, ready, slot, kv_row0 + gl.load(blocks + t) * BLOCK_N, True)


@gluon.jit
def _slash_fwd_gluon_shared_kv_kernel(q_desc, k_desc, v_desc, o_desc, Lse, KVCnt, KVIdx, HQ, GROUP, N, NQB, MAX_S,
                                      qk_scale, HEAD_DIM: gl.constexpr, BLOCK: gl.constexpr, STAGES: gl.constexpr,
                                      PINGPONG: gl.constexpr, Q_IN_REGS: gl.constexpr, SHARE_HEADS: gl.constexpr):
    """Two consumer warpgroups share every K/V tile of one key-block list, so each tile is read
    once for 128 query rows (half the bytes per pair of the 64-row kernels); a producer warp fills
    the ring, and a slot is empty once both consumers release it.

    SHARE_HEADS False (128-token index blocks, FA3's tile shape): one program per (query block,
    batch x query head); the consumers take 64 of its query rows each. SHARE_HEADS True (64-token
    blocks): one program per (query block, two query heads of one GQA group); each consumer takes
    one head. Valid only where the two heads' key-block lists are equal (the fixed index; the host
    checks): an upper bound for sharing K/V across heads."""
    ROWS: gl.constexpr = BLOCK if SHARE_HEADS else BLOCK // 2
    pid_m = gl.program_id(0)
    if SHARE_HEADS:
        bh0 = 2 * gl.program_id(1)
        bh1 = bh0 + 1
        first1 = pid_m * BLOCK
    else:
        bh0 = gl.program_id(1)
        bh1 = bh0
        first1 = pid_m * BLOCK + ROWS
    b = bh0 // HQ
    h = bh0 % HQ
    kv_row0 = (b * (HQ // GROUP) + h // GROUP) * N
    first0 = pid_m * BLOCK
    q_row0 = bh0 * N + first0
    q_row1 = bh1 * N + first1

    q_smem0 = gl.allocate_shared_memory(q_desc.dtype, [ROWS, HEAD_DIM], q_desc.layout)
    q_smem1 = gl.allocate_shared_memory(q_desc.dtype, [ROWS, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK, HEAD_DIM], v_desc.layout)
    ready = _barriers(1, STAGES)
    empty = _barriers(2, STAGES)  # both consumers release a slot
    q_bars = _barriers(1, 2)
    turns = _barriers(1, 2)

    plan_row = bh0 * NQB + pid_m
    n_tiles = gl.load(KVCnt + plan_row)
    blocks = KVIdx + plan_row * MAX_S
    for c in gl.static_range(2):
        mbarrier.expect(q_bars.index(c), q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row0, 0], q_bars.index(0), q_smem0)
    tma.async_copy_global_to_shared(q_desc, [q_row1, 0], q_bars.index(1), q_smem1)

    gl.warp_specialize([
        (_attend_query_tile, (q_desc, k_desc, v_desc, o_desc, Lse, q_smem0, k_smem, v_smem, ready, empty,
                              q_bars.index(0), blocks, n_tiles, kv_row0, q_row0, first0, bh0 * N, qk_scale,
                              turns.index(0), turns.index(1), n_tiles - 1, HEAD_DIM, ROWS, BLOCK, STAGES, False,
                              PINGPONG, True, Q_IN_REGS)),
        (_attend_query_tile, (q_desc, k_desc, v_desc, o_desc, Lse, q_smem1, k_smem, v_smem, ready, empty,
                              q_bars.index(1), blocks, n_tiles, kv_row0, q_row1, first1, bh1 * N, qk_scale,
                              turns.index(1), turns.index(0), n_tiles - 1, HEAD_DIM, ROWS, BLOCK, STAGES, False,
                              PINGPONG, False, Q_IN_REGS)),
        (_ring_producer, (k_desc, v_desc, k_smem, v_smem, ready, empty, blocks, n_tiles, kv_row0, BLOCK, STAGES)),
    ], [4, 1], [232, 24])


@dataclasses.dataclass(frozen=True)
class GluonVariant(harness.Variant):
    kernel: str = "gluon"
    warp_specialized: bool = False  # two consumer warpgroups and a producer warp per program
    maxnreg: Optional[int] = None   # registers per thread the warp-specialised kernel divides
    pingpong: bool = False          # the two consumers take turns to issue their products
    q_in_regs: bool = False         # the scores' Q operand from registers (else shared memory)
    wide: bool = False              # 128-token index blocks: two consumers share each 128-key tile
    share_heads: bool = False       # 64-token blocks: two GQA heads (equal lists) share each K/V tile


def gluon_kernel(var: GluonVariant):
    if var.wide or var.share_heads:
        return _slash_fwd_gluon_shared_kv_kernel
    return _slash_fwd_gluon_ws_kernel if var.warp_specialized else _slash_fwd_gluon_kernel


def launch_gluon(var: GluonVariant, q, k, v, plan, out, lse, scale):
    """The Gluon kernel on contiguous [b, h, n, d] bf16 tensors (as the harness makes them)."""
    b, hq, n, d = q.shape
    hkv, B = k.shape[1], plan.block_size
    if (B == 128) != var.wide:
        raise ValueError(f"variant for {'128' if var.wide else '64'}-token blocks run on a plan of {B}-token "
                         "blocks (spike_autows.py --block)")
    if var.share_heads:
        rows = plan.kv_count.reshape(b, hq, -1)
        lists = plan.kv_blocks.reshape(b, hq, rows.shape[-1], -1)
        if (hq // hkv) % 2 or not (torch.equal(rows[:, 0::2], rows[:, 1::2])
                                   and torch.equal(lists[:, 0::2], lists[:, 1::2])):
            raise ValueError("share_heads needs head pairs of one GQA group with equal key-block lists")
    q_rows = B // 2 if var.wide else B
    q_layout, kv_layout = tile_layout(q_rows, d), tile_layout(B, d)
    q_desc, o_desc = (TensorDescriptor.from_tensor(x.view(-1, d), [q_rows, d], q_layout) for x in (q, out))
    k_desc, v_desc = (TensorDescriptor.from_tensor(x.view(-1, d), [B, d], kv_layout) for x in (k, v))
    options = {"maxnreg": var.maxnreg} if var.maxnreg else {}
    options["Q_IN_REGS"] = var.q_in_regs
    if var.warp_specialized:
        options["PINGPONG"] = var.pingpong
    if var.wide or var.share_heads:
        options["SHARE_HEADS"] = var.share_heads
        grid = (n // B, b * hq // (2 if var.share_heads else 1))
    elif var.warp_specialized:  # two query blocks per program
        if (n // B) % 2:
            raise ValueError(f"{n // B} query blocks do not pair up for the warp-specialised kernel")
        grid = (n // B // 2, b * hq)
    else:
        grid = (n // B, b * hq)
    return gluon_kernel(var)[grid](
        q_desc, k_desc, v_desc, o_desc, lse, plan.kv_count, plan.kv_blocks, hq, hq // hkv, n, n // B,
        plan.kv_blocks.shape[-1], scale * LOG2E, HEAD_DIM=d, BLOCK=B, STAGES=var.num_stages,
        num_warps=var.num_warps, **options)


GLUON_VARIANTS: Dict[str, GluonVariant] = {
    "g_s2": GluonVariant("Gluon: TMA ring of 2, async wgmma, softmax(t) over PV(t-1) (80 KB)", num_stages=2),
    "g_s3": GluonVariant("Gluon: as g_s2 with a ring of 3 (112 KB: still two programs per SM)", num_stages=3),
    "g_ws_s2": GluonVariant("Gluon, warp-specialised: two consumer warpgroups (one query block each) and a TMA "
                            "producer warp, rings of 2 (160 KB: one program per SM)", num_stages=2,
                            warp_specialized=True, maxnreg=168),
    "g_ws_s3": GluonVariant("Gluon, warp-specialised as g_ws_s2, rings of 3 (224 KB)", num_stages=3,
                            warp_specialized=True, maxnreg=168),
    "g_pp_s3": GluonVariant("Gluon, warp-specialised as g_ws_s3, the consumers ping-pong (take turns to issue "
                            "their products)", num_stages=3, warp_specialized=True, maxnreg=168, pingpong=True),
    "g_s3_qreg": GluonVariant("Gluon: as g_s3 with Q in registers for the scores", num_stages=3, q_in_regs=True),
    # --block 128 only (the fixed index and the plan at 128-token blocks)
    "g128_s2": GluonVariant("Gluon, B = 128: two consumer warpgroups (64 query rows each) share every 128-key "
                            "tile, producer warp, ring of 2 (160 KB)", num_stages=2, warp_specialized=True,
                            maxnreg=168, wide=True),
    "g128_pp_s2": GluonVariant("Gluon, B = 128 as g128_s2, the consumers ping-pong", num_stages=2,
                               warp_specialized=True, maxnreg=168, wide=True, pingpong=True),
    "g128_pp_s3": GluonVariant("Gluon, B = 128 as g128_pp_s2 with a ring of 3 (224 KB)", num_stages=3,
                               warp_specialized=True, maxnreg=168, wide=True, pingpong=True),
    # --block 64, the fixed index only (equal lists within a GQA group): the bound for sharing K/V across heads
    "g_heads_pp_s3": GluonVariant("Gluon, B = 64: two query heads of one GQA group share every K/V tile "
                                  "(ping-pong consumers, producer warp, ring of 3)", num_stages=3,
                                  warp_specialized=True, maxnreg=168, pingpong=True, share_heads=True),
}


def compile_sm90(names, head_dim: int = 128, block: int = 64) -> Dict:
    """Cross-compile the Gluon variants for sm_90a (no GPU): shared memory, and whether the PTX
    holds wgmma and TMA (cp.async.bulk.tensor) instructions."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    def desc(rows):
        return f"tensordesc<bf16[{rows},{head_dim}],{tile_layout(rows, head_dim)!r}>"

    scalars = {"Lse": "*fp32", "KVCnt": "*i32", "KVIdx": "*i32", **{p: "i32" for p in ("HQ", "GROUP", "N", "NQB", "MAX_S")},
               "qk_scale": "fp32", **{p: "constexpr" for p in ("HEAD_DIM", "BLOCK", "STAGES")}}
    out: Dict = {}
    for name in names:
        var = GLUON_VARIANTS[name]
        entry = out[name] = {}
        kv_rows = 128 if var.wide else block
        q_rows = kv_rows // 2 if var.wide else kv_rows
        constexprs = {"HEAD_DIM": head_dim, "BLOCK": kv_rows, "STAGES": var.num_stages, "Q_IN_REGS": var.q_in_regs}
        kernel_sig = {"q_desc": desc(q_rows), "k_desc": desc(kv_rows), "v_desc": desc(kv_rows),
                      "o_desc": desc(q_rows), **scalars, "Q_IN_REGS": "constexpr"}
        if var.warp_specialized:
            constexprs["PINGPONG"] = var.pingpong
            kernel_sig["PINGPONG"] = "constexpr"
        if var.wide or var.share_heads:
            constexprs["SHARE_HEADS"] = var.share_heads
            kernel_sig["SHARE_HEADS"] = "constexpr"
        src = GluonASTSource(gluon_kernel(var), kernel_sig, constexprs)
        options = {"num_warps": var.num_warps, **({"maxnreg": var.maxnreg} if var.maxnreg else {})}
        kernel = harness.attempt(entry, "compile", lambda: triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                                                          options=options))
        if kernel is not None:
            ptx = kernel.asm["ptx"]
            entry.update(shared_bytes=kernel.metadata.shared, num_warps=kernel.metadata.num_warps,
                         wgmma=ptx.count("wgmma.mma_async"), tma_loads=ptx.count("cp.async.bulk.tensor"),
                         **ptxas_report(ptx))
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    harness.register_variants(GLUON_VARIANTS, launch_gluon)
    if "--compile-sm90" in argv:
        compiled = compile_sm90(list(GLUON_VARIANTS))
        for name, e in compiled.items():
            print(f"sm_90a {name}: {e}")
        if "--out" in argv:
            harness.write_json(argv[argv.index("--out") + 1], {"benchmark": "spike_gluon_compile_sm90",
                                                               "triton": triton.__version__, "variants": compiled})
        return 0 if all("errors" not in e for e in compiled.values()) else 1
    if not ("--variants" in argv or any(a.startswith("--variants=") for a in argv)):
        argv = [*argv, "--variants", ",".join(["a", *GLUON_VARIANTS])]
    if not ("--out" in argv or any(a.startswith("--out=") for a in argv)):
        argv = [*argv, "--out", os.path.join(harness.RESULTS_DIR, "spike_gluon_local.json")]
    return harness.main(argv)


if __name__ == "__main__":
    sys.exit(main())
