"""Triton kernels for the approximator's statistics (``approx.vs_statistics`` on CUDA).

The last ``L`` queries of the sequence are scored against this rank's keys twice, never storing
the ``L x n_local`` scores:

* ``row_partials``: per query row and run of ``BLOCKS_PER_PROG`` key blocks, the running max
  and sum of exp (the softmax normaliser's pieces; combined in fp64 by the caller, then across
  ranks);
* ``vs_masses``: with the global row max and normaliser, the softmax weights folded into the
  vertical statistic (per key column, summed over the ``L`` rows of a head) and the slash
  statistic's block masses (per key block and query block).

One program per (run of key blocks, batch x KV head). The query heads of one KV head are looped
inside the program, so their re-reads of a K tile hit the cache instead of memory (GQA). Every sum has
a fixed order, so repeated calls give the same bits (activation recompute rebuilds the index).

Packed documents (``rows=``, the approximator's ``_DocumentRows``; compiled as a separate
``DOCS`` variant, the unpacked kernels are unchanged): the rows are the last queries of several
documents, each with its own position and document start (keys before it are masked), and a
group id for the block masses. Each row tile lies within one document slot, so whole key blocks
outside the tile's key range ``[tile_lo, tile_hi]`` are skipped: the scored work is about
``last_q`` rows per key of the scored documents, as without documents.

Cost at 128K local keys, 16/2 heads, d 128, L 64 (per pass): QK^T 2 x 1024 x 128K x 128 = 34 GFLOP,
134M exps, 64 MB of K, and no score leaves the chip; the PyTorch version writes and re-reads the
fp32/fp64 score chunks several times, and is several times slower (docs/performance.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import kernel_flags

BLOCKS_PER_PROG = 8  # key blocks per program: enough work per program, few partials per row


@triton.jit
def _masked_scores(q, K, KPOS, k_base, cols, n_local, offs_d, D, qpos, qstart, row_ok, scale, stride_kn,
                   UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, DOCS: tl.constexpr):
    """Scaled scores of a query tile against one key block; invisible pairs (after the query, or,
    with DOCS, before its document start ``qstart``) are -inf."""
    col_ok = cols < n_local
    # int64 offsets: k may be a strided view of Megatron's [s, b, heads, d], over 2^31 elements.
    k = tl.load(K + k_base + cols[:, None].to(tl.int64) * stride_kn + offs_d[None, :],
                mask=col_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
    kpos = tl.load(KPOS + cols, mask=col_ok, other=0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
    visible = (kpos[None, :] <= qpos[:, None]) & row_ok[:, None] & col_ok[None, :]
    if DOCS:
        visible = visible & (kpos[None, :] >= qstart[:, None])
    return tl.where(visible, s, float("-inf")), visible


@triton.jit
def _tile_rows(QPOS, QSTART, TILE_LO, TILE_HI, rows, row_ok, m0, q_pos0, BLOCK_M: tl.constexpr,
               DOCS: tl.constexpr):
    """(query positions, document starts, first and last key position) of a row tile; without
    DOCS the last queries of the sequence, and placeholders never read."""
    if DOCS:
        qpos = tl.load(QPOS + rows, mask=row_ok, other=-1)
        qstart = tl.load(QSTART + rows, mask=row_ok, other=0)
        tile = m0 // BLOCK_M
        return qpos, qstart, tl.load(TILE_LO + tile), tl.load(TILE_HI + tile)
    else:
        qpos = q_pos0 + rows
        return qpos, qpos, m0, m0


@triton.jit
def _tile_sees_block(KPOS, blk, tile_lo, tile_hi, BLOCK_N: tl.constexpr):
    """Whether a row tile (DOCS) sees any key of local block ``blk`` (a local block is one global
    block: contiguous positions)."""
    kpos0 = tl.load(KPOS + blk * BLOCK_N)
    return (kpos0 + BLOCK_N > tile_lo) & (kpos0 <= tile_hi)


@triton.jit
def _load_query_tile(Q, q_base, rows, row_ok, offs_d, D, stride_qm, UPCAST: tl.constexpr):
    q = tl.load(Q + q_base + rows[:, None] * stride_qm + offs_d[None, :],
                mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    return q


@triton.jit
def _program_coords(n_blocks, stride_kb, stride_kh, HKV: tl.constexpr, BLOCKS_PER_PROG: tl.constexpr):
    """(run index, batch, KV head, K offset, first and end key block) of this program."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HKV
    kvh = pid_bh % HKV
    blk0 = pid_n * BLOCKS_PER_PROG
    k_base = b.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh
    return pid_n, b, kvh, k_base, blk0, tl.minimum(blk0 + BLOCKS_PER_PROG, n_blocks)


@triton.jit
def _partials_step(q, K, KPOS, k_base, blk, n_local, offs_d, D, qpos, qstart, row_ok, scale, stride_kn, m_i, l_i,
                   BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, DOCS: tl.constexpr):
    """The running (max, sum of exp) of a row tile after key block ``blk``."""
    cols = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    s, _ = _masked_scores(q, K, KPOS, k_base, cols, n_local, offs_d, D, qpos, qstart, row_ok, scale, stride_kn,
                          UPCAST, DOT_PRECISION, DOCS)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no visible key yet: sums stay 0
    l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(s - m_safe[:, None]), 1)
    return m_new, l_i


@triton.jit
def _row_partials_kernel(Q, K, KPOS, MAX_OUT, SUM_OUT, QPOS, QSTART, TILE_LO, TILE_HI,
                         n_local, n_blocks, q_pos0, scale, L, G, D,
                         stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                         stride_ob, stride_oh, stride_om,
                         HKV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCKS_PER_PROG: tl.constexpr,
                         UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, DOCS: tl.constexpr):
    pid_n, b, kvh, k_base, blk0, blk1 = _program_coords(n_blocks, stride_kb, stride_kh, HKV, BLOCKS_PER_PROG)
    offs_d = tl.arange(0, BLOCK_D)
    for g in range(G):
        h = kvh * G + g
        for m0 in range(0, L, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            row_ok = rows < L
            q_base = b * stride_qb + kvh * stride_qh + g * L * stride_qm
            qpos, qstart, tile_lo, tile_hi = _tile_rows(QPOS, QSTART, TILE_LO, TILE_HI, rows, row_ok, m0, q_pos0,
                                                        BLOCK_M, DOCS)
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            if DOCS:
                # Local positions ascend (both layouts), so the run's keys lie in [first, last]:
                # a tile whose documents miss the run loads nothing; inside, blocks are skipped.
                run_lo = tl.load(KPOS + blk0 * BLOCK_N)
                run_hi = tl.load(KPOS + blk1 * BLOCK_N - 1)
                if (run_hi >= tile_lo) & (run_lo <= tile_hi):
                    q = _load_query_tile(Q, q_base, rows, row_ok, offs_d, D, stride_qm, UPCAST)
                    for blk in range(blk0, blk1):
                        if _tile_sees_block(KPOS, blk, tile_lo, tile_hi, BLOCK_N):
                            m_i, l_i = _partials_step(q, K, KPOS, k_base, blk, n_local, offs_d, D, qpos, qstart,
                                                      row_ok, scale, stride_kn, m_i, l_i, BLOCK_N, UPCAST,
                                                      DOT_PRECISION, DOCS)
            else:
                q = _load_query_tile(Q, q_base, rows, row_ok, offs_d, D, stride_qm, UPCAST)
                for blk in range(blk0, blk1):
                    m_i, l_i = _partials_step(q, K, KPOS, k_base, blk, n_local, offs_d, D, qpos, qstart, row_ok,
                                              scale, stride_kn, m_i, l_i, BLOCK_N, UPCAST, DOT_PRECISION, DOCS)
            out = b * stride_ob + h * stride_oh + rows * stride_om + pid_n
            tl.store(MAX_OUT + out, m_i, mask=row_ok)
            tl.store(SUM_OUT + out, l_i, mask=row_ok)


@triton.jit
def _masses_step(Q, K, KPOS, ROW_MAX, INV_NORM, QGROUP, q_base, k_base, stat_base, cols, rows, row_ok, qb_ids,
                 n_local, offs_d, D, qpos, qstart, first_qb, scale, stride_qm, stride_kn, column_mass, block_mass,
                 BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, DOCS: tl.constexpr):
    """Column and block masses after one row tile against one key block."""
    q = _load_query_tile(Q, q_base, rows, row_ok, offs_d, D, stride_qm, UPCAST)
    s, visible = _masked_scores(q, K, KPOS, k_base, cols, n_local, offs_d, D, qpos, qstart, row_ok, scale,
                                stride_kn, UPCAST, DOT_PRECISION, DOCS)
    stat = stat_base + rows
    row_max = tl.load(ROW_MAX + stat, mask=row_ok, other=0.0)
    inv_norm = tl.load(INV_NORM + stat, mask=row_ok, other=0.0)
    p = tl.where(visible, tl.exp(s - row_max[:, None]) * inv_norm[:, None], 0.0)
    column_mass += tl.sum(p, 0)
    # Rows of one query block share their block offset to this key block (DOCS: the row's
    # (document slot, query block) group).
    if DOCS:
        row_qb = tl.load(QGROUP + rows, mask=row_ok, other=0)
    else:
        row_qb = qpos // BLOCK_N - first_qb
    row_mass = tl.sum(p, 1)
    block_mass += tl.sum(tl.where(row_qb[:, None] == qb_ids[None, :], row_mass[:, None], 0.0), 0)
    return column_mass, block_mass


@triton.jit
def _vs_masses_kernel(Q, K, KPOS, ROW_MAX, INV_NORM, VERTICAL, BLOCK_MASS, QPOS, QSTART, QGROUP, TILE_LO, TILE_HI,
                      n_local, n_blocks, q_pos0, first_qb, scale, L, G, D,
                      stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                      stride_rb, stride_rh, stride_vb, stride_vh, stride_mb, stride_mh, stride_mq,
                      HKV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                      BLOCKS_PER_PROG: tl.constexpr, NQB: tl.constexpr, NQB_PAD: tl.constexpr,
                      UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, DOCS: tl.constexpr):
    _, b, kvh, k_base, blk0, blk1 = _program_coords(n_blocks, stride_kb, stride_kh, HKV, BLOCKS_PER_PROG)
    offs_d = tl.arange(0, BLOCK_D)
    qb_ids = tl.arange(0, NQB_PAD)
    for blk in range(blk0, blk1):  # key blocks outside: one column sum per block, stored once
        cols = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        for g in range(G):
            h = kvh * G + g
            column_mass = tl.zeros([BLOCK_N], tl.float32)
            block_mass = tl.zeros([NQB_PAD], tl.float32)
            q_base = b * stride_qb + kvh * stride_qh + g * L * stride_qm
            stat_base = b * stride_rb + h * stride_rh
            for m0 in range(0, L, BLOCK_M):
                rows = m0 + tl.arange(0, BLOCK_M)
                row_ok = rows < L
                qpos, qstart, tile_lo, tile_hi = _tile_rows(QPOS, QSTART, TILE_LO, TILE_HI, rows, row_ok, m0, q_pos0,
                                                            BLOCK_M, DOCS)
                if DOCS:  # row tiles whose documents miss this key block are skipped
                    if _tile_sees_block(KPOS, blk, tile_lo, tile_hi, BLOCK_N):
                        column_mass, block_mass = _masses_step(
                            Q, K, KPOS, ROW_MAX, INV_NORM, QGROUP, q_base, k_base, stat_base, cols, rows, row_ok,
                            qb_ids, n_local, offs_d, D, qpos, qstart, first_qb, scale, stride_qm, stride_kn,
                            column_mass, block_mass, BLOCK_N, UPCAST, DOT_PRECISION, DOCS)
                else:
                    column_mass, block_mass = _masses_step(
                        Q, K, KPOS, ROW_MAX, INV_NORM, QGROUP, q_base, k_base, stat_base, cols, rows, row_ok,
                        qb_ids, n_local, offs_d, D, qpos, qstart, first_qb, scale, stride_qm, stride_kn,
                        column_mass, block_mass, BLOCK_N, UPCAST, DOT_PRECISION, DOCS)
            tl.store(VERTICAL + b * stride_vb + h * stride_vh + cols, column_mass, mask=cols < n_local)
            tl.store(BLOCK_MASS + b * stride_mb + h * stride_mh + qb_ids * stride_mq + blk, block_mass,
                     mask=qb_ids < NQB)


def _launch_shape(q_grouped: torch.Tensor, k: torch.Tensor, last_q: int, block_size: int, rows=None):
    if q_grouped.dtype != k.dtype or q_grouped.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("triton_approx: q_grouped and k must share a dtype and have a contiguous last dim, got "
                         f"{q_grouped.dtype} / {k.dtype}, strides {q_grouped.stride()} / {k.stride()}")
    b, hkv, gl, d = q_grouped.shape
    n_local = k.shape[2]
    n_blocks = n_local // block_size
    n_prog = triton.cdiv(n_blocks, BLOCKS_PER_PROG)
    flags = kernel_flags(k.dtype)
    block_m = max(16, min(128, triton.next_power_of_2(last_q))) if rows is None else rows.block_m
    if rows is not None and (rows.rows != last_q or last_q % block_m):
        raise ValueError(f"triton_approx: {last_q} rows do not match the row table ({rows.rows} rows, tiles of "
                         f"{block_m})")
    meta = dict(HKV=hkv, BLOCK_M=block_m, BLOCK_N=block_size,
                BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCKS_PER_PROG=BLOCKS_PER_PROG, **flags,
                DOCS=rows is not None, num_warps=4, num_stages=1)
    return (n_prog, b * hkv), n_local, n_blocks, meta


def _row_tables(rows, key_pos):
    """(QPOS, QSTART, QGROUP, TILE_LO, TILE_HI) for the kernels: the row table's, or placeholders
    (never read without DOCS)."""
    if rows is None:
        return (key_pos,) * 5
    return rows.row_pos, rows.row_start, rows.row_group, rows.tile_lo, rows.tile_hi


def row_partials(q_grouped: torch.Tensor, k: torch.Tensor, key_pos: torch.Tensor, q_pos0: int, scale: float,
                 last_q: int, block_size: int, rows=None):
    """Per-row (max, sum of exp) of the scaled scores over each run of ``BLOCKS_PER_PROG`` key
    blocks: two fp32 ``[b, hq, last_q, runs]`` tensors (max -inf and sum 0 where nothing is visible).

    ``q_grouped`` ``[b, hkv, G * last_q, d]`` in ``k``'s dtype (query heads of one KV head stacked),
    ``k`` ``[b, hkv, n_local, d]``, ``key_pos`` the global position of each local key.
    ``rows``: packed documents' row table (``approx._DocumentRows``, ``last_q`` = its row count;
    ``q_pos0`` unused): the rows' positions and document starts replace ``q_pos0 + row``.
    """
    grid, n_local, n_blocks, meta = _launch_shape(q_grouped, k, last_q, block_size, rows)
    qpos, qstart, _, tile_lo, tile_hi = _row_tables(rows, key_pos)
    b, hkv, gl, d = q_grouped.shape
    g = gl // last_q
    max_out = torch.empty(b, hkv * g, last_q, grid[0], dtype=torch.float32, device=k.device)
    sum_out = torch.empty_like(max_out)
    _row_partials_kernel[grid](
        q_grouped, k, key_pos, max_out, sum_out, qpos, qstart, tile_lo, tile_hi, n_local, n_blocks, q_pos0, scale,
        last_q, g, d,
        q_grouped.stride(0), q_grouped.stride(1), q_grouped.stride(2), k.stride(0), k.stride(1), k.stride(2),
        max_out.stride(0), max_out.stride(1), max_out.stride(2), **meta)
    return max_out, sum_out


def vs_masses(q_grouped: torch.Tensor, k: torch.Tensor, key_pos: torch.Tensor, q_pos0: int, scale: float,
              last_q: int, block_size: int, row_max: torch.Tensor, inv_norm: torch.Tensor, num_query_blocks: int,
              rows=None):
    """Softmax weights ``exp(s - row_max) * inv_norm`` folded two ways: the vertical statistic
    ``[b, hq, n_local]`` (sum over the ``last_q`` rows per key) and the block masses
    ``[b, hq, n_query_blocks, n_local / block_size]`` (sum per key block and query block, the
    query blocks being those the last ``last_q`` positions fall in, in order), both fp32.
    ``row_max`` and ``inv_norm`` are fp32 ``[b, hq, last_q]`` (global over all ranks);
    ``num_query_blocks`` is how many query blocks the last ``last_q`` positions fall in.
    ``rows`` (packed documents, see ``row_partials``): the block masses are per row group
    (``rows.row_group``, ``num_query_blocks`` groups) instead of per query block."""
    grid, n_local, n_blocks, meta = _launch_shape(q_grouped, k, last_q, block_size, rows)
    qpos, qstart, qgroup, tile_lo, tile_hi = _row_tables(rows, key_pos)
    b, hkv, gl, d = q_grouped.shape
    g = gl // last_q
    first_qb, nqb = q_pos0 // block_size, num_query_blocks
    row_max, inv_norm = row_max.contiguous(), inv_norm.contiguous()
    vertical = torch.empty(b, hkv * g, n_local, dtype=torch.float32, device=k.device)
    block_mass = torch.empty(b, hkv * g, nqb, n_blocks, dtype=torch.float32, device=k.device)
    _vs_masses_kernel[grid](
        q_grouped, k, key_pos, row_max, inv_norm, vertical, block_mass, qpos, qstart, qgroup, tile_lo, tile_hi,
        n_local, n_blocks, q_pos0, first_qb, scale, last_q, g, d,
        q_grouped.stride(0), q_grouped.stride(1), q_grouped.stride(2), k.stride(0), k.stride(1), k.stride(2),
        row_max.stride(0), row_max.stride(1), vertical.stride(0), vertical.stride(1),
        block_mass.stride(0), block_mass.stride(1), block_mass.stride(2),
        NQB=nqb, NQB_PAD=max(2, triton.next_power_of_2(nqb)), **meta)
    return vertical, block_mass
