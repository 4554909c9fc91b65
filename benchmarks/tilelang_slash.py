"""Issue 17 spike, TileLang candidate: the slash part of our attention as TileLang kernels.

Not part of the package: this is the measured candidate of `spike_tilelang.py`. The problem is
the one `spike_fa4.py` gave FlashAttention-4: per query block, the key blocks ``q - o`` for the
head's selected offsets ``o`` (the slash part of a VSIndex, columns dropped), causal on the
diagonal block. Four kernels, written for Hopper through TileLang's lowering (TMA loads, WGMMA,
its automatic producer/consumer warp specialisation of ``T.Pipelined``):

  forward   one program per (query block, query head): the block's key-block list, online
            softmax in base 2; writes O (bf16) and the base-2 log-sum-exp (fp32)
  delta     rowsum(O * dO) in fp32
  dkdv      one program per (key block, KV head): every (query head of the group, 64-row query
            tile) that attends it, from the transposed lists; dK and dV summed over the group in
            registers, so GQA needs no atomics and no second pass
  dq        one program per (query block, query head): the forward's lists again, dQ in registers

The backward is deterministic by construction (no atomics: each output tile has one program,
which adds its terms in list order). It is the structure of our Triton backward (a dK/dV kernel
and a dQ kernel, 7 GEMMs per tile pair), so the comparison is of code generation, not of
algorithm.

Layouts are ours: q [b, hq, n, d], k/v [b, hk, n, d], bf16, d = 128 or 64. (No ``from __future__
import annotations`` here: TileLang evaluates the kernels' tensor annotations in their closures.)
"""

import functools
import math
from typing import NamedTuple

import torch

QUERY_TILE = 64  # rows of the query tile in dkdv
COLUMN_TILE = 64  # gathered key columns per tile (forward and dq)


def slash_block_lists(slash_bitmap: torch.Tensor, num_blocks: int, kv_heads: int, block_size: int):
    """The slash mask as block lists: ``(fwd_idx, fwd_cnt, bwd_idx, bwd_cnt)``.

    ``slash_bitmap``: int8 [b, hq, num_blocks], 1 where a block offset is selected (offset 0, the
    diagonal, must be). Forward: per (b, hq, query block) its key blocks ascending (diagonal last),
    ``fwd_idx`` [b, hq, nb, max] int32 padded with 0, ``fwd_cnt`` [b, hq, nb]. Backward: per
    (b, hk, key block), entries ``head_in_group * n_tiles + query_tile`` for every 64-row query
    tile of the group's heads that attends it, head-major, tiles ascending (the diagonal first),
    ``bwd_idx`` [b, hk, nb, max], ``bwd_cnt`` [b, hk, nb].
    """
    b, hq, _ = slash_bitmap.shape
    groups = hq // kv_heads
    dev = slash_bitmap.device
    blk = torch.arange(num_blocks, device=dev)
    offset = blk[:, None] - blk[None, :]  # [query block, key block]
    sel = slash_bitmap.bool()
    active = sel[:, :, offset.clamp(min=0)] & (offset >= 0)  # [b, hq, qb, kb]

    def pack(mask):  # mask [..., n]: indices of the True entries first, ascending
        count = mask.sum(-1, dtype=torch.int32)
        order = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        width = max(int(count.max()), 1)
        idx = torch.where(torch.arange(width, device=dev) < count[..., None], order[..., :width], 0)
        return idx.contiguous(), count.contiguous()

    fwd_idx, fwd_cnt = pack(active)
    # Backward: per key block, the query tiles of each head of the group.
    sub = block_size // QUERY_TILE
    per_key = active.transpose(-1, -2)  # [b, hq, kb, qb]
    per_key = per_key.repeat_interleave(sub, dim=-1)  # query blocks -> 64-row tiles
    per_key = per_key.reshape(b, kv_heads, groups, num_blocks, num_blocks * sub)
    per_key = per_key.permute(0, 1, 3, 2, 4).reshape(b, kv_heads, num_blocks, groups * num_blocks * sub)
    bwd_idx, bwd_cnt = pack(per_key)
    return fwd_idx, fwd_cnt, bwd_idx, bwd_cnt


def column_lists(vertical: torch.Tensor, n_vertical: torch.Tensor, seq_len: int, block_size: int):
    """The column part for the kernels: ``(col_pos, col_tiles, col_limit)``.

    ``col_pos`` int32 [b, hq, max_cols]: each head's columns ascending, padded with 0 to a
    multiple of the block (max_cols = 0 when no head has columns); ``col_limit`` int32
    [b, hq, nb]: how many of them lie before the query block's end (the ones it may attend; those
    inside a selected slash block are masked in the kernels); ``col_tiles`` = ceil(limit / B).
    """
    b, hq, width = vertical.shape
    nb = seq_len // block_size
    valid = torch.arange(width, device=vertical.device) < n_vertical[..., None]
    pos = torch.where(valid, vertical.long(), seq_len).sort(-1).values
    max_cols = -(-int(n_vertical.max()) // block_size) * block_size if width else 0
    pos = torch.nn.functional.pad(pos, (0, max(max_cols - width, 0)), value=seq_len)[..., :max_cols].contiguous()
    ends = ((torch.arange(nb, device=vertical.device) + 1) * block_size).expand(b, hq, nb).contiguous()
    limit = torch.searchsorted(pos, ends).to(torch.int32)
    tiles = ((limit + block_size - 1) // block_size).to(torch.int32)
    col_pos = torch.where(pos < seq_len, pos, 0).to(torch.int32)
    if max_cols == 0:
        col_pos = torch.zeros(b, hq, 1, dtype=torch.int32, device=vertical.device)
    return col_pos.contiguous(), tiles.contiguous(), limit.contiguous()


def with_columns(x: torch.Tensor, col_pos: torch.Tensor, max_cols: int) -> torch.Tensor:
    """K or V [b, hk, n, d] with each query head's gathered column rows after the sequence:
    [b, hk, n + groups * max_cols, d] (the group's heads in order), so one TMA copy in the kernels
    reads a slash block or a column tile alike. Costs one copy of K or V per call."""
    if max_cols == 0:
        return x
    b, hk, n, d = x.shape
    idx = col_pos.reshape(b, hk, -1).long()
    return torch.cat([x, torch.gather(x, 2, idx[..., None].expand(-1, -1, -1, d))], 2)


def _tl():
    import tilelang
    import tilelang.language as T
    return tilelang, T


def _pass_configs():
    tilelang, _ = _tl()
    return {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True}


PRODUCER_REGISTERS = 24  # the loading warpgroup's registers after its setmaxnreg.dec


def consumer_registers(programs: int, consumer_threads: int) -> int:
    """Registers per consumer thread with ``programs`` programs per SM: what the SM's 64K leave
    after the producer warpgroup's (TileLang's default, 240, would make a second program's
    consumers wait in setmaxnreg for registers that never come)."""
    per_program = 65536 // programs - 128 * PRODUCER_REGISTERS
    return min(240, per_program // consumer_threads // 8 * 8)


def _occupancy(T, programs_per_sm, threads):
    @T.macro
    def fit_programs_per_sm():
        """``programs_per_sm`` programs per SM: ``__launch_bounds__(threads, n)`` and the
        consumers' setmaxnreg lowered to what n programs leave (``consumer_registers``)."""
        if programs_per_sm > 1:
            T.annotate_min_blocks_per_sm(programs_per_sm)
            T.annotate_producer_reg_dealloc(PRODUCER_REGISTERS)
            T.annotate_consumer_reg_alloc(consumer_registers(programs_per_sm, threads))

    return fit_programs_per_sm


def _tile_mask(T, block, acc):
    @T.macro
    def mask_tile(s, col_ok, slash_s, ColPos, ColLimit, bz, h, qb, t, n_slash, kb, tc):
        """-inf on the scores of pairs a tile must not attend: the causal half of the diagonal
        block; a column tile's slots past the block's limit or inside a selected slash block.
        Every other slash tile (most tiles) does no mask work."""
        if t >= n_slash:
            for j in T.Parallel(block):
                col_ok[j] = T.if_then_else(
                    (tc * block + j < ColLimit[bz, h, qb])
                    & (slash_s[T.max(qb - ColPos[bz, h, tc * block + j] // block, 0)] == 0), 1, 0)
            for i, j in T.Parallel(block, block):
                s[i, j] = T.if_then_else(col_ok[j] != 0, s[i, j], -T.infinity(acc))
        elif kb == qb:
            for i, j in T.Parallel(block, block):
                s[i, j] = T.if_then_else(j > i, -T.infinity(acc), s[i, j])

    return mask_tile


@functools.lru_cache(maxsize=None)
def forward_kernel(batch, heads, kv_heads, seq, dim, block, max_cnt, max_cols, sm_scale, num_stages=2,
                   programs_per_sm=1):
    tilelang, T = _tl()
    nb = seq // block
    groups = heads // kv_heads
    scale = sm_scale * 1.44269504  # scores in base 2
    threads = 128 * (block // 64)
    rows = seq + groups * max_cols  # K and V with their heads' gathered columns after the sequence
    dtype, acc = T.bfloat16, T.float32
    fit_programs_per_sm = _occupancy(T, programs_per_sm, threads)
    mask_tile = _tile_mask(T, block, acc)

    @T.macro
    def online_softmax(scores, probs, o, m, m_prev, corr, row_sum, l):
        """Fold one tile's scores into the running max, sum and output (base 2); probs <- P."""
        T.copy(m, m_prev)
        T.reduce_max(scores, m, dim=1, clear=False)
        for i in T.Parallel(block):
            corr[i] = T.exp2(m_prev[i] * scale - m[i] * scale)
        for i, j in T.Parallel(block, scores.shape[1]):
            scores[i, j] = T.exp2(scores[i, j] * scale - m[i] * scale)
        T.reduce_sum(scores, row_sum, dim=1)
        for i in T.Parallel(block):
            l[i] = l[i] * corr[i] + row_sum[i]
        T.copy(scores, probs)
        for i, j in T.Parallel(block, dim):
            o[i, j] *= corr[i]

    @T.prim_func
    def fwd(Q: T.Tensor([batch, heads, seq, dim], dtype), K: T.Tensor([batch, kv_heads, rows, dim], dtype),
            V: T.Tensor([batch, kv_heads, rows, dim], dtype), Idx: T.Tensor([batch, heads, nb, max_cnt], T.int32),
            Cnt: T.Tensor([batch, heads, nb], T.int32), ColPos: T.Tensor([batch, heads, max(max_cols, 1)], T.int32),
            ColTiles: T.Tensor([batch, heads, nb], T.int32), ColLimit: T.Tensor([batch, heads, nb], T.int32),
            Slash: T.Tensor([batch, heads, nb], T.int8),
            O: T.Tensor([batch, heads, seq, dim], dtype), LSE: T.Tensor([batch, heads, seq], acc)):
        with T.Kernel(nb, heads, batch, threads=threads) as (qb, h, bz):
            fit_programs_per_sm()
            q_s = T.alloc_shared([block, dim], dtype)
            k_s = T.alloc_shared([block, dim], dtype)
            v_s = T.alloc_shared([block, dim], dtype)
            o_s = T.alloc_shared([block, dim], dtype)
            slash_s = T.alloc_shared([nb], T.int8)
            col_ok = T.alloc_shared([block], T.int32)
            s = T.alloc_fragment([block, block], acc)
            p = T.alloc_fragment([block, block], dtype)
            o = T.alloc_fragment([block, dim], acc)
            m = T.alloc_fragment([block], acc)
            m_prev = T.alloc_fragment([block], acc)
            corr = T.alloc_fragment([block], acc)
            row_sum = T.alloc_fragment([block], acc)
            l = T.alloc_fragment([block], acc)
            hk = h // groups
            T.copy(Q[bz, h, qb * block:(qb + 1) * block, :], q_s)
            T.fill(o, 0)
            T.fill(l, 0)
            T.fill(m, -T.infinity(acc))
            # One loop over the slash blocks (ascending, the diagonal last: the running max is
            # finite from then on) and then the column tiles: the head's columns before this
            # block's end, ``block`` at a time, from the rows of its pre-gathered columns after the
            # sequence in K and V (``with_columns``), so one TMA copy serves both. A column inside
            # a selected slash block is the slash part's (DESIGN.md: the union). One loop with
            # one copy, because TileLang's automatic warp specialisation pipelines one loop per
            # kernel and no copy under a branch.
            T.copy(Slash[bz, h, :], slash_s)
            n_slash = Cnt[bz, h, qb]
            col_base = seq + (h % groups) * max_cols
            for t in T.Pipelined(n_slash + ColTiles[bz, h, qb], num_stages=num_stages):
                kb = Idx[bz, h, qb, T.min(t, max_cnt - 1)]
                tc = t - n_slash
                row = T.if_then_else(t < n_slash, kb * block, col_base + tc * block)
                T.copy(K[bz, hk, row:row + block, :], k_s)
                T.clear(s)
                T.gemm(q_s, k_s, s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                mask_tile(s, col_ok, slash_s, ColPos, ColLimit, bz, h, qb, t, n_slash, kb, tc)
                online_softmax(s, p, o, m, m_prev, corr, row_sum, l)
                T.copy(V[bz, hk, row:row + block, :], v_s)
                T.gemm(p, v_s, o, policy=T.GemmWarpPolicy.FullRow)
            for i, j in T.Parallel(block, dim):
                o[i, j] /= l[i]
            T.copy(o, o_s)
            T.copy(o_s, O[bz, h, qb * block:(qb + 1) * block, :])
            for i in T.Parallel(block):
                l[i] = T.log2(l[i]) + m[i] * scale
            T.copy(l, LSE[bz, h, qb * block:(qb + 1) * block])

    return tilelang.compile(fwd, pass_configs=_pass_configs())


@functools.lru_cache(maxsize=None)
def delta_kernel(batch, heads, seq, dim):
    tilelang, T = _tl()
    rows = 64

    @T.prim_func
    def delta(O: T.Tensor([batch, heads, seq, dim], T.bfloat16), dO: T.Tensor([batch, heads, seq, dim], T.bfloat16),
              D: T.Tensor([batch, heads, seq], T.float32)):
        with T.Kernel(seq // rows, heads, batch, threads=128) as (rb, h, bz):
            o = T.alloc_fragment([rows, dim], T.float32)
            do = T.alloc_fragment([rows, dim], T.float32)
            d = T.alloc_fragment([rows], T.float32)
            T.copy(O[bz, h, rb * rows:(rb + 1) * rows, :], o)
            T.copy(dO[bz, h, rb * rows:(rb + 1) * rows, :], do)
            for i, j in T.Parallel(rows, dim):
                o[i, j] *= do[i, j]
            T.reduce_sum(o, d, dim=1)
            T.copy(d, D[bz, h, rb * rows:(rb + 1) * rows])

    return tilelang.compile(delta, pass_configs=_pass_configs())


@functools.lru_cache(maxsize=None)
def dkdv_kernel(batch, heads, kv_heads, seq, dim, block, max_cnt, sm_scale, num_stages=2, programs_per_sm=1):
    tilelang, T = _tl()
    nb = seq // block
    n_tiles = seq // QUERY_TILE
    groups = heads // kv_heads
    scale = sm_scale * 1.44269504
    rows = QUERY_TILE
    threads = 128 * (block // 64)
    dtype, acc = T.bfloat16, T.float32
    fit_programs_per_sm = _occupancy(T, programs_per_sm, threads)

    @T.prim_func
    def dkdv(Q: T.Tensor([batch, heads, seq, dim], dtype), K: T.Tensor([batch, kv_heads, seq, dim], dtype),
             V: T.Tensor([batch, kv_heads, seq, dim], dtype), dO: T.Tensor([batch, heads, seq, dim], dtype),
             LSE: T.Tensor([batch, heads, seq], acc), D: T.Tensor([batch, heads, seq], acc),
             Idx: T.Tensor([batch, kv_heads, nb, max_cnt], T.int32), Cnt: T.Tensor([batch, kv_heads, nb], T.int32),
             dK: T.Tensor([batch, kv_heads, seq, dim], dtype), dV: T.Tensor([batch, kv_heads, seq, dim], dtype)):
        with T.Kernel(nb, kv_heads, batch, threads=threads) as (kb, hk, bz):
            fit_programs_per_sm()
            k_s = T.alloc_shared([block, dim], dtype)
            v_s = T.alloc_shared([block, dim], dtype)
            q_s = T.alloc_shared([rows, dim], dtype)
            do_s = T.alloc_shared([rows, dim], dtype)
            lse_s = T.alloc_shared([rows], acc)
            d_s = T.alloc_shared([rows], acc)
            ds_s = T.alloc_shared([block, rows], dtype)
            out_s = T.alloc_shared([block, dim], dtype)
            pt = T.alloc_fragment([block, rows], acc)
            dpt = T.alloc_fragment([block, rows], acc)
            pt_cast = T.alloc_fragment([block, rows], dtype)
            dk = T.alloc_fragment([block, dim], acc)
            dv = T.alloc_fragment([block, dim], acc)
            T.copy(K[bz, hk, kb * block:(kb + 1) * block, :], k_s)
            T.copy(V[bz, hk, kb * block:(kb + 1) * block, :], v_s)
            T.clear(dk)
            T.clear(dv)
            for t in T.Pipelined(Cnt[bz, hk, kb], num_stages=num_stages):
                entry = Idx[bz, hk, kb, t]
                h = hk * groups + entry // n_tiles
                qt = entry % n_tiles
                T.copy(Q[bz, h, qt * rows:(qt + 1) * rows, :], q_s)
                T.copy(dO[bz, h, qt * rows:(qt + 1) * rows, :], do_s)
                T.copy(LSE[bz, h, qt * rows:(qt + 1) * rows], lse_s)
                T.copy(D[bz, h, qt * rows:(qt + 1) * rows], d_s)
                T.clear(pt)
                T.gemm(k_s, q_s, pt, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                for i, j in T.Parallel(block, rows):  # P^T, zero where the key comes after the query
                    pt[i, j] = T.if_then_else(kb * block + i <= qt * rows + j,
                                              T.exp2(pt[i, j] * scale - lse_s[j]), 0)
                T.clear(dpt)
                T.gemm(v_s, do_s, dpt, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                T.copy(pt, pt_cast)
                T.gemm(pt_cast, do_s, dv, policy=T.GemmWarpPolicy.FullRow)
                for i, j in T.Parallel(block, rows):
                    pt_cast[i, j] = pt[i, j] * (dpt[i, j] - d_s[j]) * sm_scale
                T.copy(pt_cast, ds_s)
                T.gemm(ds_s, q_s, dk, policy=T.GemmWarpPolicy.FullRow)
            T.copy(dv, out_s)
            T.copy(out_s, dV[bz, hk, kb * block:(kb + 1) * block, :])
            T.copy(dk, out_s)
            T.copy(out_s, dK[bz, hk, kb * block:(kb + 1) * block, :])

    return tilelang.compile(dkdv, pass_configs=_pass_configs())


@functools.lru_cache(maxsize=None)
def dq_kernel(batch, heads, kv_heads, seq, dim, block, max_cnt, max_cols, sm_scale, num_stages=2,
              programs_per_sm=1):
    tilelang, T = _tl()
    nb = seq // block
    groups = heads // kv_heads
    scale = sm_scale * 1.44269504
    threads = 128 * (block // 64)
    rows = seq + groups * max_cols  # as the forward's
    dtype, acc = T.bfloat16, T.float32
    fit_programs_per_sm = _occupancy(T, programs_per_sm, threads)
    mask_tile = _tile_mask(T, block, acc)

    @T.prim_func
    def dq(Q: T.Tensor([batch, heads, seq, dim], dtype), K: T.Tensor([batch, kv_heads, rows, dim], dtype),
           V: T.Tensor([batch, kv_heads, rows, dim], dtype), dO: T.Tensor([batch, heads, seq, dim], dtype),
           LSE: T.Tensor([batch, heads, seq], acc), D: T.Tensor([batch, heads, seq], acc),
           Idx: T.Tensor([batch, heads, nb, max_cnt], T.int32), Cnt: T.Tensor([batch, heads, nb], T.int32),
           ColPos: T.Tensor([batch, heads, max(max_cols, 1)], T.int32), ColTiles: T.Tensor([batch, heads, nb], T.int32),
           ColLimit: T.Tensor([batch, heads, nb], T.int32), Slash: T.Tensor([batch, heads, nb], T.int8),
           dQ: T.Tensor([batch, heads, seq, dim], dtype)):
        with T.Kernel(nb, heads, batch, threads=threads) as (qb, h, bz):
            fit_programs_per_sm()
            q_s = T.alloc_shared([block, dim], dtype)
            do_s = T.alloc_shared([block, dim], dtype)
            k_s = T.alloc_shared([block, dim], dtype)
            v_s = T.alloc_shared([block, dim], dtype)
            ds_s = T.alloc_shared([block, block], dtype)
            out_s = T.alloc_shared([block, dim], dtype)
            slash_s = T.alloc_shared([nb], T.int8)
            col_ok = T.alloc_shared([block], T.int32)
            lse = T.alloc_fragment([block], acc)
            dd = T.alloc_fragment([block], acc)
            s = T.alloc_fragment([block, block], acc)
            dp = T.alloc_fragment([block, block], acc)
            dq_acc = T.alloc_fragment([block, dim], acc)
            hk = h // groups
            T.copy(Q[bz, h, qb * block:(qb + 1) * block, :], q_s)
            T.copy(dO[bz, h, qb * block:(qb + 1) * block, :], do_s)
            T.copy(LSE[bz, h, qb * block:(qb + 1) * block], lse)
            T.copy(D[bz, h, qb * block:(qb + 1) * block], dd)
            T.copy(Slash[bz, h, :], slash_s)
            T.clear(dq_acc)
            n_slash = Cnt[bz, h, qb]
            col_base = seq + (h % groups) * max_cols
            for t in T.Pipelined(n_slash + ColTiles[bz, h, qb], num_stages=num_stages):  # as the forward's
                kb = Idx[bz, h, qb, T.min(t, max_cnt - 1)]
                tc = t - n_slash
                row = T.if_then_else(t < n_slash, kb * block, col_base + tc * block)
                T.copy(K[bz, hk, row:row + block, :], k_s)
                T.copy(V[bz, hk, row:row + block, :], v_s)
                T.clear(s)
                T.gemm(q_s, k_s, s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                mask_tile(s, col_ok, slash_s, ColPos, ColLimit, bz, h, qb, t, n_slash, kb, tc)
                T.clear(dp)
                T.gemm(do_s, v_s, dp, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                for i, j in T.Parallel(block, block):  # dS (0 where masked: exp2(-inf) = 0)
                    s[i, j] = T.exp2(s[i, j] * scale - lse[i]) * (dp[i, j] - dd[i])
                T.copy(s, ds_s)
                T.gemm(ds_s, k_s, dq_acc, policy=T.GemmWarpPolicy.FullRow)
            for i, j in T.Parallel(block, dim):
                dq_acc[i, j] *= sm_scale
            T.copy(dq_acc, out_s)
            T.copy(out_s, dQ[bz, h, qb * block:(qb + 1) * block, :])

    return tilelang.compile(dq, pass_configs=_pass_configs())


class Plan(NamedTuple):
    """Everything the kernels walk: the slash lists (``slash_block_lists``), the column part
    (``column_lists``; ``max_cols`` = 0 without columns) and the slash bitmap [b, hq, nb] int8."""
    block: int
    fwd_idx: torch.Tensor
    fwd_cnt: torch.Tensor
    bwd_idx: torch.Tensor
    bwd_cnt: torch.Tensor
    col_pos: torch.Tensor
    col_tiles: torch.Tensor
    col_limit: torch.Tensor
    slash: torch.Tensor
    max_cols: int


def make_plan(index, seq_len: int, kv_heads: int, columns: bool = True) -> Plan:
    """The plan of a VSIndex (``columns=False``: its slash part only)."""
    B = index.block_size
    nb = seq_len // B
    slash = index.slash_bitmap(nb)
    lists = slash_block_lists(slash, nb, kv_heads, B)
    n_vertical = index.n_vertical if columns else torch.zeros_like(index.n_vertical)
    col_pos, col_tiles, col_limit = column_lists(index.vertical, n_vertical, seq_len, B)
    max_cols = -(-int(n_vertical.max()) // B) * B
    return Plan(B, *lists, col_pos, col_tiles, col_limit, slash, max_cols)


def kernel_args(plan: Plan, q_shape, kv_heads: int, sm_scale: float) -> dict:
    """Each kernel factory's arguments for one problem (its shapes and list widths)."""
    b, hq, n, d = q_shape
    common = (b, hq, kv_heads, n, d, plan.block)
    return dict(forward=common + (plan.fwd_idx.shape[-1], plan.max_cols, sm_scale),
                delta=(b, hq, n, d),
                dkdv=common + (plan.bwd_idx.shape[-1], sm_scale),
                dq=common + (plan.fwd_idx.shape[-1], plan.max_cols, sm_scale))


FACTORIES = dict(forward=forward_kernel, delta=delta_kernel, dkdv=dkdv_kernel, dq=dq_kernel)


def compile_kernels(plan: Plan, q_shape, kv_heads: int, sm_scale: float, variants=((2, 1),)) -> dict:
    """Build the kernels of one problem at once, each (num_stages, programs per SM) variant of
    the attention kernels (nvcc runs in parallel; shapes and list widths are compile-time
    constants, so a new problem is a new build). Returns {(name, variant): kernel}."""
    from concurrent.futures import ThreadPoolExecutor

    args = kernel_args(plan, q_shape, kv_heads, sm_scale)
    jobs = [("delta", ())] + [(name, v) for name in ("forward", "dkdv", "dq") for v in variants]
    with ThreadPoolExecutor(8) as pool:
        futures = {job: pool.submit(FACTORIES[job[0]], *args[job[0]], *job[1]) for job in jobs}
    return {job: f.result() for job, f in futures.items()}


def forward_pass(q, k_rows, v_rows, plan: Plan, sm_scale: float, variant=(2, 1)):
    """(out, lse base 2) with ``k_rows``/``v_rows`` from ``with_columns``."""
    b, hq, n, d = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(b, hq, n, dtype=torch.float32, device=q.device)
    kernel = forward_kernel(*kernel_args(plan, q.shape, k_rows.shape[1], sm_scale)["forward"], *variant)
    kernel(q, k_rows, v_rows, plan.fwd_idx, plan.fwd_cnt, plan.col_pos, plan.col_tiles, plan.col_limit,
           plan.slash, out, lse)
    return out, lse


def forward_and_dq(q, k, v, dout, plan: Plan, sm_scale: float, variant=(2, 1)):
    """(out, dq) of a plan with columns (no column dK/dV kernel in the spike): the forward, delta
    and dQ kernels on the column rows from ``with_columns``. q, k, v, dout detached."""
    k_rows, v_rows = with_columns(k, plan.col_pos, plan.max_cols), with_columns(v, plan.col_pos, plan.max_cols)
    out, lse = forward_pass(q, k_rows, v_rows, plan, sm_scale, variant)
    args = kernel_args(plan, q.shape, k.shape[1], sm_scale)
    delta = torch.empty_like(lse)
    delta_kernel(*args["delta"])(out, dout, delta)
    dq = torch.empty_like(q)
    dq_kernel(*args["dq"], *variant)(q, k_rows, v_rows, dout, lse, delta, plan.fwd_idx, plan.fwd_cnt, plan.col_pos,
                                     plan.col_tiles, plan.col_limit, plan.slash, dq)
    return out, dq


class SlashAttention(torch.autograd.Function):
    """Forward and backward of a slash-only plan through the four TileLang kernels (the column
    part's dK/dV has no TileLang kernel in this spike: plans with columns are forward/dQ only)."""

    @staticmethod
    def forward(ctx, q, k, v, plan, sm_scale, variant):
        if plan.max_cols:
            raise NotImplementedError("the spike has no column dK/dV kernel: use a plan without columns")
        out, lse = forward_pass(q, k, v, plan, sm_scale, variant)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.sm_scale, ctx.variant = plan, sm_scale, variant
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        plan = ctx.plan
        b, hq, n, d = q.shape
        args = kernel_args(plan, q.shape, k.shape[1], ctx.sm_scale)
        dout = dout.contiguous()
        delta = torch.empty(b, hq, n, dtype=torch.float32, device=q.device)
        delta_kernel(*args["delta"])(out, dout, delta)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dkdv_kernel(*args["dkdv"], *ctx.variant)(q, k, v, dout, lse, delta, plan.bwd_idx, plan.bwd_cnt, dk, dv)
        dq_kernel(*args["dq"], *ctx.variant)(q, k, v, dout, lse, delta, plan.fwd_idx, plan.fwd_cnt, plan.col_pos,
                                             plan.col_tiles, plan.col_limit, plan.slash, dq)
        return dq, dk, dv, None, None, None


def slash_attention(q, k, v, plan: Plan, sm_scale=None, variant=(2, 1)):
    """Attention over a slash-only plan; q [b, hq, n, d] bf16. ``variant``: (num_stages,
    programs per SM) of the attention kernels."""
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q.shape[-1])
    return SlashAttention.apply(q, k, v, plan, float(sm_scale), tuple(variant))
