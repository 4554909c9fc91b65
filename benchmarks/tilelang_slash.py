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

import torch

QUERY_TILE = 64  # rows of the query tile in dkdv; also the forward's rows per consumer warpgroup


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


@functools.lru_cache(maxsize=None)
def forward_kernel(batch, heads, kv_heads, seq, dim, block, max_cnt, sm_scale, num_stages=2, programs_per_sm=1):
    tilelang, T = _tl()
    nb = seq // block
    groups = heads // kv_heads
    scale = sm_scale * 1.44269504  # scores in base 2
    threads = 128 * (block // 64)
    dtype, acc = T.bfloat16, T.float32

    @T.prim_func
    def fwd(Q: T.Tensor([batch, heads, seq, dim], dtype), K: T.Tensor([batch, kv_heads, seq, dim], dtype),
            V: T.Tensor([batch, kv_heads, seq, dim], dtype), Idx: T.Tensor([batch, heads, nb, max_cnt], T.int32),
            Cnt: T.Tensor([batch, heads, nb], T.int32), O: T.Tensor([batch, heads, seq, dim], dtype),
            LSE: T.Tensor([batch, heads, seq], acc)):
        with T.Kernel(nb, heads, batch, threads=threads) as (qb, h, bz):
            if programs_per_sm > 1:  # TileLang's parser needs these statements in the body itself
                T.annotate_min_blocks_per_sm(programs_per_sm)
                T.annotate_producer_reg_dealloc(PRODUCER_REGISTERS)
                T.annotate_consumer_reg_alloc(consumer_registers(programs_per_sm, threads))
            q_s = T.alloc_shared([block, dim], dtype)
            k_s = T.alloc_shared([block, dim], dtype)
            v_s = T.alloc_shared([block, dim], dtype)
            o_s = T.alloc_shared([block, dim], dtype)
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
            for t in T.Pipelined(Cnt[bz, h, qb], num_stages=num_stages):
                kb = Idx[bz, h, qb, t]
                T.copy(K[bz, hk, kb * block:(kb + 1) * block, :], k_s)
                for i, j in T.Parallel(block, block):  # causal only on the diagonal block
                    s[i, j] = T.if_then_else((kb == qb) & (j > i), -T.infinity(acc), 0)
                T.gemm(q_s, k_s, s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                T.copy(m, m_prev)
                T.reduce_max(s, m, dim=1, clear=False)
                for i in T.Parallel(block):
                    corr[i] = T.exp2(m_prev[i] * scale - m[i] * scale)
                for i, j in T.Parallel(block, block):
                    s[i, j] = T.exp2(s[i, j] * scale - m[i] * scale)
                T.reduce_sum(s, row_sum, dim=1)
                for i in T.Parallel(block):
                    l[i] = l[i] * corr[i] + row_sum[i]
                T.copy(s, p)
                for i, j in T.Parallel(block, dim):
                    o[i, j] *= corr[i]
                T.copy(V[bz, hk, kb * block:(kb + 1) * block, :], v_s)
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

    @T.prim_func
    def dkdv(Q: T.Tensor([batch, heads, seq, dim], dtype), K: T.Tensor([batch, kv_heads, seq, dim], dtype),
             V: T.Tensor([batch, kv_heads, seq, dim], dtype), dO: T.Tensor([batch, heads, seq, dim], dtype),
             LSE: T.Tensor([batch, heads, seq], acc), D: T.Tensor([batch, heads, seq], acc),
             Idx: T.Tensor([batch, kv_heads, nb, max_cnt], T.int32), Cnt: T.Tensor([batch, kv_heads, nb], T.int32),
             dK: T.Tensor([batch, kv_heads, seq, dim], dtype), dV: T.Tensor([batch, kv_heads, seq, dim], dtype)):
        with T.Kernel(nb, kv_heads, batch, threads=threads) as (kb, hk, bz):
            if programs_per_sm > 1:  # TileLang's parser needs these statements in the body itself
                T.annotate_min_blocks_per_sm(programs_per_sm)
                T.annotate_producer_reg_dealloc(PRODUCER_REGISTERS)
                T.annotate_consumer_reg_alloc(consumer_registers(programs_per_sm, threads))
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
def dq_kernel(batch, heads, kv_heads, seq, dim, block, max_cnt, sm_scale, num_stages=2, programs_per_sm=1):
    tilelang, T = _tl()
    nb = seq // block
    groups = heads // kv_heads
    scale = sm_scale * 1.44269504
    threads = 128 * (block // 64)
    dtype, acc = T.bfloat16, T.float32

    @T.prim_func
    def dq(Q: T.Tensor([batch, heads, seq, dim], dtype), K: T.Tensor([batch, kv_heads, seq, dim], dtype),
           V: T.Tensor([batch, kv_heads, seq, dim], dtype), dO: T.Tensor([batch, heads, seq, dim], dtype),
           LSE: T.Tensor([batch, heads, seq], acc), D: T.Tensor([batch, heads, seq], acc),
           Idx: T.Tensor([batch, heads, nb, max_cnt], T.int32), Cnt: T.Tensor([batch, heads, nb], T.int32),
           dQ: T.Tensor([batch, heads, seq, dim], dtype)):
        with T.Kernel(nb, heads, batch, threads=threads) as (qb, h, bz):
            if programs_per_sm > 1:  # TileLang's parser needs these statements in the body itself
                T.annotate_min_blocks_per_sm(programs_per_sm)
                T.annotate_producer_reg_dealloc(PRODUCER_REGISTERS)
                T.annotate_consumer_reg_alloc(consumer_registers(programs_per_sm, threads))
            q_s = T.alloc_shared([block, dim], dtype)
            do_s = T.alloc_shared([block, dim], dtype)
            k_s = T.alloc_shared([block, dim], dtype)
            v_s = T.alloc_shared([block, dim], dtype)
            ds_s = T.alloc_shared([block, block], dtype)
            out_s = T.alloc_shared([block, dim], dtype)
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
            T.clear(dq_acc)
            for t in T.Pipelined(Cnt[bz, h, qb], num_stages=num_stages):
                kb = Idx[bz, h, qb, t]
                T.copy(K[bz, hk, kb * block:(kb + 1) * block, :], k_s)
                T.copy(V[bz, hk, kb * block:(kb + 1) * block, :], v_s)
                T.clear(s)
                T.gemm(q_s, k_s, s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                T.clear(dp)
                T.gemm(do_s, v_s, dp, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                for i, j in T.Parallel(block, block):  # dS, zero above the diagonal
                    s[i, j] = T.if_then_else((kb < qb) | (j <= i),
                                             T.exp2(s[i, j] * scale - lse[i]) * (dp[i, j] - dd[i]), 0)
                T.copy(s, ds_s)
                T.gemm(ds_s, k_s, dq_acc, policy=T.GemmWarpPolicy.FullRow)
            for i, j in T.Parallel(block, dim):
                dq_acc[i, j] *= sm_scale
            T.copy(dq_acc, out_s)
            T.copy(out_s, dQ[bz, h, qb * block:(qb + 1) * block, :])

    return tilelang.compile(dq, pass_configs=_pass_configs())


class SlashAttention(torch.autograd.Function):
    """Forward and backward of the slash part through the four TileLang kernels."""

    @staticmethod
    def forward(ctx, q, k, v, lists, block, sm_scale):
        fwd_idx, fwd_cnt, bwd_idx, bwd_cnt = lists
        b, hq, n, d = q.shape
        hk = k.shape[1]
        out = torch.empty_like(q)
        lse = torch.empty(b, hq, n, dtype=torch.float32, device=q.device)
        forward_kernel(b, hq, hk, n, d, block, fwd_idx.shape[-1], sm_scale)(q, k, v, fwd_idx, fwd_cnt, out, lse)
        ctx.save_for_backward(q, k, v, out, lse, fwd_idx, fwd_cnt, bwd_idx, bwd_cnt)
        ctx.block, ctx.sm_scale = block, sm_scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, fwd_idx, fwd_cnt, bwd_idx, bwd_cnt = ctx.saved_tensors
        b, hq, n, d = q.shape
        hk = k.shape[1]
        dout = dout.contiguous()
        delta = torch.empty(b, hq, n, dtype=torch.float32, device=q.device)
        delta_kernel(b, hq, n, d)(out, dout, delta)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dkdv_kernel(b, hq, hk, n, d, ctx.block, bwd_idx.shape[-1], ctx.sm_scale)(
            q, k, v, dout, lse, delta, bwd_idx, bwd_cnt, dk, dv)
        dq_kernel(b, hq, hk, n, d, ctx.block, fwd_idx.shape[-1], ctx.sm_scale)(
            q, k, v, dout, lse, delta, fwd_idx, fwd_cnt, dq)
        return dq, dk, dv, None, None, None


def compile_kernels(q_shape, kv_heads, lists, block, sm_scale) -> None:
    """Build the four kernels of one problem at once (nvcc runs in parallel; each kernel's shapes,
    list widths included, are compile-time constants, so a new shape is a new build)."""
    from concurrent.futures import ThreadPoolExecutor

    b, hq, n, d = q_shape
    fwd_width, bwd_width = lists[0].shape[-1], lists[2].shape[-1]
    jobs = [(forward_kernel, (b, hq, kv_heads, n, d, block, fwd_width, sm_scale)),
            (delta_kernel, (b, hq, n, d)),
            (dkdv_kernel, (b, hq, kv_heads, n, d, block, bwd_width, sm_scale)),
            (dq_kernel, (b, hq, kv_heads, n, d, block, fwd_width, sm_scale))]
    with ThreadPoolExecutor(len(jobs)) as pool:
        for future in [pool.submit(fn, *args) for fn, args in jobs]:
            future.result()


def slash_attention(q, k, v, lists, block, sm_scale=None):
    """Attention over the slash block lists (``slash_block_lists``); q [b, hq, n, d] bf16."""
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q.shape[-1])
    return SlashAttention.apply(q, k, v, lists, block, float(sm_scale))
