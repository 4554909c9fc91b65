"""Spike M1 (issue 17): is our forward bound by moving K/V tiles to the SMs?

benchmarks/spike_hopper_kernels.md, sections 0.2, 1 and 7 (M1). The forward moves ~56.6 GB of K/V
tiles at 128K (fixed index, 5%, 64-token blocks) in 10.18 ms: 5.56 TB/s. This script runs the
forward's exact data movement with the math removed and asks how fast that movement alone can go:

  * the same grid as ``_vs_attn_fwd_kernel`` (one program per (query tile, batch x query head),
    query tiles fastest) and its launch settings (``triton_fwd.forward_launch_config``);
  * the same walk: the Q tile, then the plan's slash key blocks of the query block (``kv_count``
    / ``kv_blocks``, diagonal last), then the plan's gathered columns in tiles of BLOCK_COL up to
    ``col_limit`` (padding slots of the last tile load row 0, as production does);
  * the same pointer loads (``_tile_ptrs`` / ``_head_offset`` / ``_wide`` of triton_fwd);
  * instead of softmax and matrix products, every loaded tile is added into a register tile.

The tiles are read as int32 words (a bf16 [rows, d] tile is the same bytes as an int32
[rows, d/2] tile, and the same 16-byte vector loads) and summed with wrap-around: one integer add
per 4 bytes, so the checksum costs the SM almost nothing, and it is exact for any data. The host
recomputes it in PyTorch (int64, mod 2^32) from the plan's lists, per program, and the run
asserts equality: nothing can be optimised away or read from the wrong place unnoticed. Per
program three sums are written: slash tiles, column tiles, Q tile(s).

Variants (--variants, comma list):
  a       pointer loads, 64-token blocks (production's loads and pipeline depth: the loops are
          ``tl.range(num_stages=...)`` so that Triton turns the loads into cp.async copies as it
          does for production's, whose loads feed matrix products);
  a_reg   as a, not pipelined: plain loads into registers, latency hidden by occupancy alone;
  b       as a, but the slash K/V tiles through TMA (``tl.make_tensor_descriptor(...).load``);
          columns stay pointer loads (TMA gather is sm_100 only);
  c       as a with 128-token blocks: the fixed index built at B = 128 and production's B = 128
          launch settings (128-row tiles, 8 warps);
  d       as a, with --heads-per-program (default 2) query heads of one GQA group per program:
          each slash K/V tile is loaded once for all of them (valid because their slash lists are
          equal in the fixed index: asserted); Q tiles and columns stay per head;
  c_tma, c_hpp, d_tma: the combinations (B = 128 with TMA, B = 128 with shared heads, TMA with
          shared heads).

Per variant: median ms, bytes moved (counted exactly from the plan's lists on the host: whole
tiles, K and V, padding slots of the last column tile included), TB/s, and the ratio to the
production forward's time at the same block size, which is timed here too (``step_forward``,
plan built beforehand: the kernel alone, as in section 1's 10.18 ms). Not moved here, so not
counted: the forward's output and lse writes (~1% of the bytes) and the small index loads that
no address depends on (column words and positions, global key-block ids).

Reading it (section 0.2): if the stream alone takes >= 8-9 ms at B = 64 (<= 6.3-7 TB/s), the
10.2-ms forward is data-movement bound and only fewer bytes per pair help (c, d); if it streams
much faster, the forward has headroom for better overlap (warp specialisation).

    # GPU (H200; about a minute, most of it building the two 128K indices and compiling):
    python benchmarks/spike_kv_stream.py --out $OUT/spike_kv_stream_nvidia-h200.json
    # CPU check (automatic without CUDA): Triton's interpreter, S = 1024, 4/2 heads, d 64
    python benchmarks/spike_kv_stream.py --cpu-check
    # CPU: cross-compile the stream kernel variants for sm_90 (no GPU; catches compile errors)
    python benchmarks/spike_kv_stream.py --compile-sm90
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import math
import os
import sys
import tempfile
from typing import Dict, List

import torch

# Without a GPU the kernels run in Triton's CPU interpreter, which must be chosen before any kernel
# is decorated. The sm_90 cross-compile needs real (not interpreted) kernels, so it keeps it off.
if not torch.cuda.is_available() and "--compile-sm90" not in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import describe_index, device_slug, fixed_vs_index, median, run_metadata, time_ms, write_json  # noqa: E402

from megatron_mtraining.kernels import single_device_plan, step_forward  # noqa: E402
from megatron_mtraining.kernels.triton_fwd import (_head_offset, _tile_ptrs, _vs_attn_fwd_kernel, _wide,  # noqa: E402
                                                   column_arguments, forward_launch_config, int64_offsets,
                                                   interpreting, plan_tensors)

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
MASK32 = (1 << 32) - 1
PARTS = ("slash", "columns", "q")  # the three sums each program writes, in this order


# ----------------------------------------------------------------------------------------------
# The stream kernel: production's walk and loads, tiles summed instead of attended
# ----------------------------------------------------------------------------------------------


@triton.jit
def _word_sum(x):
    """Sum of an int32 tile, as int64: its low 32 bits are the wrapping int32 sum. (An int32
    ``tl.sum`` would do on the GPU, but the interpreter widens it and then refuses the overflow;
    a wrapping ``tl.reduce`` runs in Python there, ~0.2 s a tile.) Once per program: free."""
    return tl.sum(x.to(tl.int64))


@triton.jit
def _slash_stream_ptr(k_base, v_base, KVCnt, KVIdx, plan_row, MAX_S, stride_kn, stride_vn, offs_n, offs_w,
                      BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, WORDS: tl.constexpr, INT64: tl.constexpr,
                      STAGES: tl.constexpr):
    """Production's slash loop (``_vs_attn_fwd_kernel``): the listed key blocks, in BLOCK_N tiles."""
    acc = tl.zeros([BLOCK_N, WORDS], tl.int32)
    n_blocks = tl.load(KVCnt + plan_row)
    for t in tl.range(0, n_blocks, num_stages=STAGES):
        j = tl.load(KVIdx + plan_row * MAX_S + t)
        for sub in tl.static_range(0, BLOCK, BLOCK_N):
            k_rows = j * BLOCK + sub + offs_n
            k = tl.load(_tile_ptrs(k_base, k_rows, stride_kn, offs_w, INT64))
            v = tl.load(_tile_ptrs(v_base, k_rows, stride_vn, offs_w, INT64))
            acc += k + v
    return _word_sum(acc)


@triton.jit
def _slash_stream_tma(K, V, KVCnt, KVIdx, plan_row, MAX_S, kv_row0, KV_ROWS, BLOCK: tl.constexpr,
                      BLOCK_N: tl.constexpr, WORDS: tl.constexpr, STAGES: tl.constexpr):
    """The same loop with K/V tiles through TMA: K and V seen as [KV_ROWS, WORDS] row-major, a tile
    is one descriptor box at a row coordinate. The descriptors are built in the kernel (that needs
    ``triton.set_allocator``), as section 7 proposes for the warp-specialised forward."""
    k_desc = tl.make_tensor_descriptor(K, shape=[KV_ROWS, WORDS], strides=[WORDS, 1], block_shape=[BLOCK_N, WORDS])
    v_desc = tl.make_tensor_descriptor(V, shape=[KV_ROWS, WORDS], strides=[WORDS, 1], block_shape=[BLOCK_N, WORDS])
    acc = tl.zeros([BLOCK_N, WORDS], tl.int32)
    n_blocks = tl.load(KVCnt + plan_row)
    for t in tl.range(0, n_blocks, num_stages=STAGES):
        j = tl.load(KVIdx + plan_row * MAX_S + t)
        for sub in tl.static_range(0, BLOCK, BLOCK_N):
            row = kv_row0 + j * BLOCK + sub
            acc += k_desc.load([row, 0]) + v_desc.load([row, 0])
    return _word_sum(acc)


@triton.jit
def _kv_stream_kernel(
    Q, K, V, Sums, KVCnt, KVIdx, ColLimit, Cols,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    HQ, HKV, GROUP, N, NQB, MAX_S, MAX_V, N_PROG_M, KV_ROWS,
    BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_COL: tl.constexpr,
    WORDS: tl.constexpr, HPP: tl.constexpr, TMA: tl.constexpr, INT64: tl.constexpr, STAGES: tl.constexpr,
):
    """One program per (query tile, batch x group of HPP query heads); Q/K/V are int32 views
    ([b, h, n, d/2]). Writes Sums[(bh, pid_m), part] for each of its heads: slash, columns, q.
    STAGES: the loops' software pipeline. Production's loads feed matrix products, so Triton
    pipelines them (cp.async into shared memory, num_stages deep); loads that feed only adds are
    pipelined only when the loop asks for it (``tl.range(num_stages=...)``; checked on the sm_90
    compile), and STAGES = 1 leaves them as plain loads into registers."""
    pid_m = tl.program_id(0)
    pid_g = tl.program_id(1)
    bh0 = pid_g * HPP  # first (batch x query head) row of the program; HPP divides GROUP
    b = bh0 // HQ
    h0 = bh0 % HQ
    kvh = h0 // GROUP

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_c = tl.arange(0, BLOCK_COL)
    offs_w = tl.arange(0, WORDS)
    q_local_blk = pid_m // (BLOCK // BLOCK_M)
    rows = pid_m * BLOCK_M + offs_m
    k_base = K + _head_offset(b, kvh, stride_kb, stride_kh, INT64)
    v_base = V + _head_offset(b, kvh, stride_vb, stride_vh, INT64)

    # The Q tile(s) first, as production loads its Q tile before the loops.
    for hh in tl.static_range(HPP):
        q = tl.load(_tile_ptrs(Q + _head_offset(b, h0 + hh, stride_qb, stride_qh, INT64), rows, stride_qn, offs_w,
                               INT64))
        tl.store(Sums + ((bh0 + hh) * N_PROG_M + pid_m) * 3 + 2, _word_sum(q))

    # Slash part, once for the program's heads (their lists are equal: checked on the host).
    plan_row0 = _wide(bh0, INT64) * NQB + q_local_blk
    if TMA:
        kv_row0 = (b * HKV + kvh) * N  # first row of this KV head in the [b*hkv*n, d/2] view
        slash = _slash_stream_tma(K, V, KVCnt, KVIdx, plan_row0, MAX_S, kv_row0, KV_ROWS, BLOCK, BLOCK_N, WORDS, STAGES)
    else:
        slash = _slash_stream_ptr(k_base, v_base, KVCnt, KVIdx, plan_row0, MAX_S, stride_kn, stride_vn, offs_n,
                                  offs_w, BLOCK, BLOCK_N, WORDS, INT64, STAGES)
    for hh in tl.static_range(HPP):
        tl.store(Sums + ((bh0 + hh) * N_PROG_M + pid_m) * 3, slash)

    # Column part, per head: production's `_column_tile` loads (slot index, then the K and V rows;
    # slots past the limit read row 0), without the live-word and position loads.
    for hh in tl.static_range(HPP):
        bh = _wide(bh0 + hh, INT64)
        plan_row = bh * NQB + q_local_blk
        n_cols = tl.load(ColLimit + plan_row)
        col_row = bh * MAX_V
        acc_c = tl.zeros([BLOCK_COL, WORDS], tl.int32)
        for c0 in tl.range(0, n_cols, BLOCK_COL, num_stages=STAGES):
            slots = c0 + offs_c
            col = tl.load(Cols + col_row + slots, mask=slots < n_cols, other=0)
            k = tl.load(_tile_ptrs(k_base, col, stride_kn, offs_w, INT64))
            v = tl.load(_tile_ptrs(v_base, col, stride_vn, offs_w, INT64))
            acc_c += k + v
        tl.store(Sums + ((bh0 + hh) * N_PROG_M + pid_m) * 3 + 1, _word_sum(acc_c))


# ----------------------------------------------------------------------------------------------
# Variants
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Variant:
    about: str
    block: int = 64
    tma: bool = False
    shared_heads: bool = False  # --heads-per-program query heads per program (else 1)
    unpipelined: bool = False   # STAGES = 1: plain loads into registers (else production's num_stages)


VARIANTS: Dict[str, Variant] = {
    "a": Variant("pointer loads, B = 64 (production's loads and pipeline depth)"),
    "a_reg": Variant("pointer loads, B = 64, not pipelined (plain loads into registers)", unpipelined=True),
    "b": Variant("slash K/V through TMA descriptors, B = 64", tma=True),
    "c": Variant("pointer loads, B = 128 (index built at 128)", block=128),
    "d": Variant("pointer loads, B = 64, GQA heads share slash tiles", shared_heads=True),
    "c_tma": Variant("slash K/V through TMA, B = 128", block=128, tma=True),
    "c_hpp": Variant("pointer loads, B = 128, GQA heads share slash tiles", block=128, shared_heads=True),
    "d_tma": Variant("slash K/V through TMA, B = 64, GQA heads share slash tiles", tma=True, shared_heads=True),
}


def heads_per_program(var: Variant, cfg) -> int:
    return cfg.heads_per_program if var.shared_heads else 1


def stream_launch_config(block: int) -> Dict:
    """Production's bf16 forward tiles and launch settings at this block size."""
    full = forward_launch_config(block, torch.bfloat16)
    return {k: full[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_COL", "num_warps", "num_stages")}


def stages(var: Variant, launch: Dict) -> int:
    return 1 if var.unpipelined else launch["num_stages"]


def int32_view(x: torch.Tensor) -> torch.Tensor:
    """The bf16 [b, h, n, d] tensor as int32 [b, h, n, d/2]: the same bytes, read in 4-byte words."""
    return x.view(torch.int32)


def launch_stream(var: Variant, problem: Dict, hpp: int, q, k, v, sums):
    """Run the stream kernel; returns the compiled kernel (None in the interpreter)."""
    plan, launch = problem["plan"], problem["launch"]
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    qw, kw, vw = int32_view(q), int32_view(k), int32_view(v)
    cols = column_arguments(plan)[0]  # production's: a placeholder when the plan has no column capacity
    return _kv_stream_kernel[(n // launch["BLOCK_M"], b * hq // hpp)](
        qw, kw, vw, sums, plan.kv_count, plan.kv_blocks, plan.col_limit, cols,
        qw.stride(0), qw.stride(1), qw.stride(2),
        kw.stride(0), kw.stride(1), kw.stride(2),
        vw.stride(0), vw.stride(1), vw.stride(2),
        hq, hkv, hq // hkv, n, n // plan.block_size, plan.kv_blocks.shape[-1], plan.cols.shape[-1],
        n // launch["BLOCK_M"], b * hkv * n,
        BLOCK=plan.block_size, BLOCK_M=launch["BLOCK_M"], BLOCK_N=launch["BLOCK_N"], BLOCK_COL=launch["BLOCK_COL"],
        WORDS=d // 2, HPP=hpp, TMA=var.tma, INT64=problem["int64"], STAGES=stages(var, launch),
        num_warps=launch["num_warps"], num_stages=launch["num_stages"])


def sums_buffer(q, block_m: int) -> torch.Tensor:
    b, hq, n, _ = q.shape
    return torch.zeros(b * hq, n // block_m, len(PARTS), dtype=torch.int64, device=q.device)


# ----------------------------------------------------------------------------------------------
# Host side: the expected sums and the bytes, both from the plan's lists
# ----------------------------------------------------------------------------------------------


def expected_sums(q, k, v, plan, launch: Dict) -> torch.Tensor:
    """int64 [b*hq, programs along the sequence, 3]: what every program must write (mod 2^32),
    computed from the plan's lists in PyTorch; each head with its own lists."""
    B, BM, BC = plan.block_size, launch["BLOCK_M"], launch["BLOCK_COL"]
    b, hq, n, _ = q.shape
    hkv = k.shape[1]
    nqb, n_prog_m = n // B, n // BM
    kv_head = torch.arange(hq, device=q.device) // (hq // hkv)
    qw, kw, vw = (int32_view(x).long() for x in (q, k, v))
    row_sums = (kw + vw).sum(-1)[:, kv_head]                          # [b, hq, n]: K+V words per key row
    block_sums = row_sums.view(b, hq, nqb, B).sum(-1)                 # [b, hq, nqb]: per key block

    max_s = plan.kv_blocks.shape[-1]
    listed = block_sums.gather(2, plan.kv_blocks.long().view(b, hq, -1)).view(b, hq, nqb, max_s)
    in_list = torch.arange(max_s, device=q.device) < plan.kv_count.long()[..., None]
    slash = (listed * in_list).sum(-1)                                 # [b, hq, nqb]

    # Columns: slots [0, n_cols) hold their key rows; the last tile's slots past n_cols read row 0.
    n_cols = plan.col_limit.long()                                     # [b, hq, nqb]
    col_rows = row_sums.gather(2, plan.cols.long()) if plan.cols.shape[-1] else row_sums[..., :0]
    prefix = torch.nn.functional.pad(col_rows.cumsum(-1), (1, 0))     # [b, hq, max_v + 1]
    padding = (n_cols + BC - 1) // BC * BC - n_cols
    columns = prefix.gather(2, n_cols) + padding * row_sums[..., :1]  # [b, hq, nqb]

    q_sums = qw.sum(-1).view(b, hq, n_prog_m, BM).sum(-1)             # [b, hq, n_prog_m]
    block_of_prog = torch.arange(n_prog_m, device=q.device) // (B // BM)
    out = torch.stack([slash[..., block_of_prog], columns[..., block_of_prog], q_sums], -1)
    return out.view(b * hq, n_prog_m, len(PARTS))


def check_shared_lists(plan, hpp: int) -> None:
    """Heads sharing a program read the first head's slash list: the lists must be equal."""
    if hpp == 1:
        return
    b, hq, nqb = plan.kv_count.shape
    cnt = plan.kv_count.view(b, hq // hpp, hpp, nqb)
    blocks = plan.kv_blocks.view(b, hq // hpp, hpp, nqb, -1)
    assert torch.equal(cnt, cnt[:, :, :1].expand_as(cnt)), "heads sharing a program have different slash counts"
    assert torch.equal(blocks, blocks[:, :, :1].expand_as(blocks)), \
        "heads sharing a program have different slash lists"


def traffic(plan, launch: Dict, shape: tuple, hpp: int, elem_bytes: int = 2) -> Dict:
    """Bytes the kernel loads, counted from the plan's lists: whole tiles of K and V (per
    program: every listed slash block, and ceil(col_limit / BLOCK_COL) column tiles), the Q tiles,
    and the index words the addresses depend on. With hpp heads per program the slash tiles are
    counted once per head group (the lists are equal, ``check_shared_lists``)."""
    b, hq, n, d = shape
    B, BM, BN, BC = plan.block_size, launch["BLOCK_M"], launch["BLOCK_N"], launch["BLOCK_COL"]
    progs_per_block = B // BM  # programs sharing one query block's lists
    slash_blocks = int(plan.kv_count[:, ::hpp].long().sum()) * progs_per_block
    col_tiles = int(((plan.col_limit.long() + BC - 1) // BC).sum()) * progs_per_block
    slash_bytes = slash_blocks * B * d * elem_bytes * 2
    column_bytes = col_tiles * BC * d * elem_bytes * 2
    q_bytes = b * hq * n * d * elem_bytes
    index_bytes = 4 * (slash_blocks + col_tiles * BC)  # kv_blocks entries and column slots
    q_block_heads = b * hq * (n // B)
    return {"slash_tile_loads": slash_blocks * (B // BN), "column_tile_loads": col_tiles,
            "slash_blocks_per_query_block_head": slash_blocks / progs_per_block * hpp / q_block_heads,
            "column_tiles_per_query_block_head": col_tiles / progs_per_block / q_block_heads,
            "slash_bytes": slash_bytes, "column_bytes": column_bytes, "kv_bytes": slash_bytes + column_bytes,
            "q_bytes": q_bytes, "index_bytes": index_bytes,
            "total_bytes": slash_bytes + column_bytes + q_bytes + index_bytes}


def tb_per_s(nbytes: float, ms) -> float:
    return nbytes / (ms * 1e-3) / 1e12 if ms else None


# ----------------------------------------------------------------------------------------------
# Problems (one per block size), checks and timing
# ----------------------------------------------------------------------------------------------


def make_inputs(cfg, device, n_sets: int, seed: int) -> List[tuple]:
    """(q, k, v) sets of standard normal bf16, the benchmark's layout [b, h, s, d], contiguous.
    Normal data rather than patterns: power and clocks are what the real forward sees."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(heads):
        return torch.randn(1, heads, cfg.seq_len, cfg.head_dim, generator=gen, device=device, dtype=torch.bfloat16)

    return [(rand(cfg.heads), rand(cfg.kv_heads), rand(cfg.kv_heads)) for _ in range(n_sets)]


def build_problem(cfg, block: int, inputs, device) -> Dict:
    index = fixed_vs_index(1, cfg.heads, cfg.seq_len, block, cfg.density, device, cfg.seed)
    # The PyTorch conversion (identical tensors to the extension's: tests/test_convert.py): the
    # plan is input here, not measured, and this needs no compiled extension.
    plan = single_device_plan(index, cfg.seq_len, impl="torch")
    assert plan.documents is None and torch.equal(plan.q_block_ids.cpu(), torch.arange(cfg.seq_len // block,
                                                                                         dtype=torch.int32))
    plan.column_words  # made once here (production's forward reads it), not inside a timing
    launch = stream_launch_config(block)
    q, k, v = inputs[0]
    out, lse = torch.empty_like(q), torch.empty(q.shape[:3], dtype=torch.float32, device=device)
    described = describe_index(index, cfg.seq_len)
    int64 = int64_offsets(q, k, v, out, lse, *plan_tensors(plan))  # production's offset width
    return {"plan": plan, "launch": launch, "inputs": inputs, "int64": int64,
            "expected": expected_sums(q, k, v, plan, launch),
            "describe": {"block_size": block, "n_slash": described["n_slash"], "n_vertical": described["n_vertical"],
                         "density_mean": described["density_mean"], "active_pairs": described["active_pairs"],
                         "max_s": plan.kv_blocks.shape[-1], "max_v": plan.cols.shape[-1], "launch": launch,
                         "int64_offsets": int64}}


def compiled_info(kernel) -> Dict:
    """Registers, shared memory and whether the tile loads became async copies (cp.async / TMA)."""
    if kernel is None:
        return {"note": "interpreter: no compiled kernel"}
    info = {"num_warps": kernel.metadata.num_warps, "shared_bytes": kernel.metadata.shared}
    ttgir = kernel.asm.get("ttgir")
    if ttgir is not None:
        info["async_copy"] = "async_copy_global_to_local" in ttgir
        info["tma_copy"] = "async_tma_copy_global_to_local" in ttgir or "tma_load" in ttgir
    try:
        kernel._init_handles()
        info.update(n_regs=kernel.n_regs, n_spills=kernel.n_spills)
    except Exception as exc:  # noqa: BLE001  (diagnostics only)
        info["n_regs_error"] = f"{type(exc).__name__}: {exc}"[:200]
    return info


def check_variant(var: Variant, problem: Dict, hpp: int) -> tuple:
    """One launch on the first input set; every program's three sums against the host's."""
    q, k, v = problem["inputs"][0]
    sums = sums_buffer(q, problem["launch"]["BLOCK_M"])
    kernel = launch_stream(var, problem, hpp, q, k, v, sums)
    if q.is_cuda:
        torch.cuda.synchronize()
    got = sums.long() & MASK32
    want = problem["expected"] & MASK32
    wrong = got != want
    result = {"programs": got.shape[0] * got.shape[1],
              "wrong": {part: int(wrong[..., i].sum()) for i, part in enumerate(PARTS)}}
    result["pass"] = not bool(wrong.any())
    if not result["pass"]:
        bh, m, part = (int(x) for x in wrong.nonzero()[0])
        result["first_wrong"] = {"bh": bh, "pid_m": m, "part": PARTS[part], "got": int(got[bh, m, part]),
                                 "want": int(want[bh, m, part])}
    return result, kernel


def time_stream(var: Variant, problem: Dict, hpp: int, cfg, device) -> List[float]:
    q0 = problem["inputs"][0][0]
    sums = sums_buffer(q0, problem["launch"]["BLOCK_M"])
    return time_ms(lambda q, k, v: launch_stream(var, problem, hpp, q, k, v, sums), problem["inputs"], device,
                   cfg.warmup, cfg.reps)


def time_forward(problem: Dict, cfg, device) -> List[float]:
    """The production forward on the same plan and inputs: ``step_forward`` (the kernel alone)."""
    plan = problem["plan"]
    q0 = problem["inputs"][0][0]
    out, lse = torch.empty_like(q0), torch.empty(q0.shape[:3], dtype=torch.float32, device=device)
    scale = 1.0 / math.sqrt(cfg.head_dim)
    return time_ms(lambda q, k, v: step_forward("triton", q, k, v, plan, out, lse, scale, False),
                   problem["inputs"], device, cfg.warmup, cfg.reps)


def production_compiled():
    """The production forward's last compiled kernel (None in the interpreter)."""
    caches = getattr(_vs_attn_fwd_kernel, "device_caches", {})
    kernels = [kern for cache, *_ in caches.values() for kern in cache.values()]
    return kernels[-1] if kernels else None


def attempt(entry: Dict, key: str, fn):
    """fn(); a failure is kept as entry['errors'][key] and returns None (the other items still run)."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001  (compile errors, CUDA errors: record, go on)
        entry.setdefault("errors", {})[key] = f"{type(exc).__name__}: {exc}"[:1500]
        return None


def run_variant(name: str, problems: Dict, result: Dict, save, cfg, device) -> None:
    var = VARIANTS[name]
    hpp = heads_per_program(var, cfg)
    problem = problems[var.block]
    entry = result["variants"][name] = {"about": var.about, "block": var.block, "tma": var.tma,
                                        "heads_per_program": hpp, "stages": stages(var, problem["launch"]),
                                        "status": "checking"}
    save()
    if cfg.variant_timeout > 0:  # a hung kernel must not eat the device call: end, leaving the JSON
        faulthandler.dump_traceback_later(cfg.variant_timeout, exit=True)
    try:
        attempt(entry, "shared_lists", lambda: check_shared_lists(problem["plan"], hpp))
        if entry.get("errors"):
            entry["status"] = "failed"
            return
        shape = tuple(problem["inputs"][0][0].shape)
        entry["bytes"] = traffic(problem["plan"], problem["launch"], shape, hpp)
        checked = attempt(entry, "check", lambda: check_variant(var, problem, hpp))
        if checked is None:
            if var.tma and interpreting():
                # The interpreter may lack tensor descriptors: skip (b) there, do not fail the run.
                entry["status"] = "skipped"
                entry["skipped"] = ("TRITON_INTERPRET: tensor descriptors failed in the interpreter; TMA variants "
                                    "run only on the GPU. " + entry.pop("errors")["check"][:300])
            else:
                entry["status"] = "failed"
            return
        entry["check"], kernel = checked
        entry["compiled"] = attempt(entry, "compiled", lambda: compiled_info(kernel))
        entry["status"] = "timing"
        save()
        samples = attempt(entry, "timing", lambda: time_stream(var, problem, hpp, cfg, device))
        if samples:
            ms = median(samples)
            b = entry["bytes"]
            entry.update(ms=ms, samples_ms=samples, kv_tb_s=tb_per_s(b["kv_bytes"], ms),
                         total_tb_s=tb_per_s(b["total_bytes"], ms))
            fwd = result["forward"].get(str(var.block), {})
            if fwd.get("ms"):
                entry["forward_ms"] = fwd["ms"]
                entry["stream_over_forward"] = ms / fwd["ms"]
        entry["status"] = "done"
    finally:
        if cfg.variant_timeout > 0:
            faulthandler.cancel_dump_traceback_later()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        save()


def run_forward(block: int, problem: Dict, result: Dict, cfg, device) -> None:
    entry = result["forward"][str(block)] = {"about": "production _vs_attn_fwd_kernel via step_forward"}
    samples = attempt(entry, "timing", lambda: time_forward(problem, cfg, device))
    if samples:
        ms = median(samples)
        shape = tuple(problem["inputs"][0][0].shape)
        moved = traffic(problem["plan"], problem["launch"], shape, 1)
        entry.update(ms=ms, samples_ms=samples, kv_bytes=moved["kv_bytes"], kv_tb_s=tb_per_s(moved["kv_bytes"], ms))
        entry["compiled"] = attempt(entry, "compiled", lambda: compiled_info(production_compiled()))


# ----------------------------------------------------------------------------------------------
# sm_90 cross-compile (no GPU needed)
# ----------------------------------------------------------------------------------------------


def compile_sm90(names: List[str], hpp: int, head_dim: int = 128) -> Dict:
    """Compile each variant's stream kernel for sm_90 with production's launch settings: it must
    compile, and whether the tile loads became cp.async / TMA copies is recorded."""
    if interpreting():
        return {"skipped": "TRITON_INTERPRET=1 is set: the interpreter has no compiler; unset it"}
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ints = ("stride_qb", "stride_qh", "stride_qn", "stride_kb", "stride_kh", "stride_kn", "stride_vb", "stride_vh",
            "stride_vn", "HQ", "HKV", "GROUP", "N", "NQB", "MAX_S", "MAX_V", "N_PROG_M", "KV_ROWS")
    sig = {"Q": "*i32", "K": "*i32", "V": "*i32", "Sums": "*i64", "KVCnt": "*i32", "KVIdx": "*i32",
           "ColLimit": "*i32", "Cols": "*i32", **{p: "i32" for p in ints},
           **{p: "constexpr" for p in ("BLOCK", "BLOCK_M", "BLOCK_N", "BLOCK_COL", "WORDS", "HPP", "TMA", "INT64",
                                      "STAGES")}}
    out: Dict = {}
    for name in names:
        var = VARIANTS[name]
        launch = stream_launch_config(var.block)
        constexprs = {"BLOCK": var.block, "BLOCK_M": launch["BLOCK_M"], "BLOCK_N": launch["BLOCK_N"],
                      "BLOCK_COL": launch["BLOCK_COL"], "WORDS": head_dim // 2,
                      "HPP": hpp if var.shared_heads else 1, "TMA": var.tma, "INT64": False,
                      "STAGES": stages(var, launch)}
        entry = out[name] = {}
        kernel = attempt(entry, "compile", lambda: triton.compile(
            ASTSource(_kv_stream_kernel, sig, constexprs), target=GPUTarget("cuda", 90, 32),
            options={"num_warps": launch["num_warps"], "num_stages": launch["num_stages"]}))
        if kernel is not None:
            ttgir = kernel.asm["ttgir"]
            entry.update(num_warps=kernel.metadata.num_warps, shared_bytes=kernel.metadata.shared,
                         async_copy="async_copy_global_to_local" in ttgir,
                         tma_copy="async_tma_copy_global_to_local" in ttgir or "tma_load" in ttgir)
    return out


# ----------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------


def fmt(x, spec=".2f", width=8) -> str:
    return f"{x:{width}{spec}}" if isinstance(x, (int, float)) and not isinstance(x, bool) else f"{'-':>{width}}"


def print_table(result: Dict) -> None:
    cfg = result["config"]
    print(f"\n{result['meta']['device']} | K/V stream (forward's walk, math removed) | S {cfg['seq_len']}, "
          f"{cfg['heads']}/{cfg['kv_heads']} heads, d {cfg['head_dim']}, bf16, fixed index {cfg['density']}")
    for block, f in result["forward"].items():
        print(f"production forward B={block}: {fmt(f.get('ms'), '.3f')} ms, K/V {fmt(f.get('kv_bytes', 0) / 1e9)} GB, "
              f"{fmt(f.get('kv_tb_s'))} TB/s" + (f"  errors: {f['errors']}" if f.get("errors") else ""))
    header = (f"{'variant':>7} {'B':>4} {'TMA':>3} {'hpp':>3} {'stg':>3} {'check':>5} | {'ms':>8} {'K/V GB':>8} {'K/V TB/s':>8} "
              f"{'all TB/s':>8} | {'fwd ms':>8} {'str/fwd':>7}")
    print(header)
    print("-" * len(header))
    for name, e in result["variants"].items():
        c, by = e.get("check") or {}, e.get("bytes") or {}
        check = {True: "pass", False: "FAIL"}.get(c.get("pass"), e.get("status", "-")[:5])
        kv_gb = by["kv_bytes"] / 1e9 if by else None
        print(f"{name:>7} {e['block']:>4} {'yes' if e['tma'] else 'no':>3} {e['heads_per_program']:>3} {e['stages']:>3} {check:>5} | "
              f"{fmt(e.get('ms'), '.3f')} {fmt(kv_gb)} {fmt(e.get('kv_tb_s'))} {fmt(e.get('total_tb_s'))} | "
              f"{fmt(e.get('forward_ms'), '.3f')} {fmt(e.get('stream_over_forward'), '.2f', 7)}")
    print("(ms median; K/V GB = whole K and V tiles loaded, from the plan's lists; all = + Q tiles and index words;"
          "\n str/fwd = stream time over the production forward's at the same block size)")
    for name, e in result["variants"].items():
        for key, msg in (e.get("errors") or {}).items():
            print(f"error {name} {key}: {msg[:300]}")
        if e.get("skipped"):
            print(f"skipped {name}: {e['skipped'][:300]}")
    print(f"all checks pass: {'yes' if result.get('all_checks_pass') else 'NO'}")


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------

GPU_DEFAULTS = dict(seq_len=131072, heads=16, kv_heads=2, head_dim=128, density=0.05, warmup=3, reps=20,
                    input_sets=3, variant_timeout=90)
# The interpreter is slow: 4 query heads over 2 KV heads (a GQA pair for d), d 64, 16 / 8 blocks, and
# a density that gives off-diagonal slash offsets and column tiles at both block sizes.
CPU_DEFAULTS = dict(seq_len=1024, heads=4, kv_heads=2, head_dim=64, density=0.5, warmup=0, reps=1, input_sets=1,
                    variant_timeout=0)


@dataclasses.dataclass
class Config:
    seq_len: int
    heads: int
    kv_heads: int
    head_dim: int
    density: float
    warmup: int
    reps: int
    input_sets: int
    variant_timeout: float
    variants: List[str]
    heads_per_program: int
    cpu_check: bool
    seed: int = 0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, help="sequence length (default 131072; CPU check 1024)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {', '.join(VARIANTS)}")
    p.add_argument("--heads-per-program", type=int, default=2,
                   help="query heads per program in the shared-head variants (d, c_hpp, d_tma); divides the GQA group")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/spike_kv_stream_<device>.json)")
    p.add_argument("--cpu-check", action="store_true",
                   help="tiny shapes in Triton's CPU interpreter (implied without a GPU): the checksums only")
    p.add_argument("--compile-sm90", action="store_true",
                   help="only cross-compile the variants for sm_90 (no GPU needed)")
    for name in ("heads", "kv_heads", "head_dim", "warmup", "reps", "input_sets"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int)
    for name in ("density", "variant_timeout"):
        p.add_argument(f"--{name.replace('_', '-')}", type=float)
    return p.parse_args(argv)


def variant_names(text: str) -> List[str]:
    names = [v for v in text.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown or not names:
        raise SystemExit(f"spike_kv_stream.py: unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    return names


def make_config(args, device) -> Config:
    cpu = args.cpu_check or device.type != "cuda"
    values = dict(CPU_DEFAULTS if cpu else GPU_DEFAULTS)
    values.update({k: v for k, v in vars(args).items() if k in values and v is not None})
    cfg = Config(variants=variant_names(args.variants), heads_per_program=args.heads_per_program, cpu_check=cpu,
                 **values)
    group = cfg.heads // cfg.kv_heads
    if cfg.heads % cfg.kv_heads or group % cfg.heads_per_program:
        raise SystemExit(f"spike_kv_stream.py: --heads-per-program {cfg.heads_per_program} must divide the GQA "
                         f"group ({cfg.heads}/{cfg.kv_heads} heads)")
    if cfg.head_dim % 2:
        raise SystemExit("spike_kv_stream.py: head_dim must be even (tiles are read as int32 words)")
    return cfg


def output_path(args, cfg, device) -> str:
    if args.out:
        return args.out
    if cfg.cpu_check:  # CPU checks never land among the committed results
        return os.path.join(tempfile.gettempdir(), f"spike_kv_stream_cpu_{device_slug(device)}.json")
    return os.path.join(RESULTS_DIR, f"spike_kv_stream_{device_slug(device)}.json")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.compile_sm90:
        compiled = compile_sm90(variant_names(args.variants), args.heads_per_program)
        for name, e in compiled.items():
            print(f"sm_90 {name:>6}: " + (f"{e['num_warps']} warps, {e['shared_bytes']} B shared, cp.async "
                                         f"{e['async_copy']}, TMA {e['tma_copy']}" if "num_warps" in e else str(e)))
        if args.out:
            write_json(args.out, {"benchmark": "spike_kv_stream_compile_sm90", "triton": triton.__version__,
                                  "variants": compiled})
        return 0 if all("errors" not in e for e in compiled.values() if isinstance(e, dict)) else 1

    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu_check else "cpu")
    if device.type == "cpu" and not interpreting():
        raise SystemExit("spike_kv_stream.py: a CPU run needs TRITON_INTERPRET=1 set before Triton is imported")
    cfg = make_config(args, device)
    path = output_path(args, cfg, device)
    # Scratch for the descriptors that tl.make_tensor_descriptor builds in the kernel (TMA variants).
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device=device))

    result: Dict = {"benchmark": "spike_kv_stream", "cpu_check": cfg.cpu_check, "finished": False,
                    "meta": run_metadata(device), "config": {**dataclasses.asdict(cfg), "interpreter": interpreting()},
                    "problems": {}, "forward": {}, "variants": {}}

    def save():
        write_json(path, result)

    blocks = sorted({VARIANTS[n].block for n in cfg.variants})
    try:  # nothing runs without the problems; keep why in the JSON, then stop
        inputs = make_inputs(cfg, device, cfg.input_sets, cfg.seed + 1)  # shared by both block sizes
        problems = {B: build_problem(cfg, B, inputs, device) for B in blocks}
    except Exception as exc:
        result["errors"] = {"problem": f"{type(exc).__name__}: {exc}"[:1500]}
        save()
        raise
    for B, problem in problems.items():
        result["problems"][str(B)] = problem["describe"]
    # The production forward first: every variant's ratio needs it, and its number is the baseline.
    for B in blocks:
        run_forward(B, problems[B], result, cfg, device)
        save()
    for name in cfg.variants:
        run_variant(name, problems, result, save, cfg, device)
    checks = [e["check"]["pass"] for e in result["variants"].values() if "check" in e]
    failed = [n for n, e in result["variants"].items() if e["status"] == "failed"]
    result["all_checks_pass"] = bool(checks) and all(checks) and not failed
    result["finished"] = True
    save()
    print(f"wrote {path}")
    print_table(result)
    return 0 if result["all_checks_pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
