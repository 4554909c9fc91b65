"""Spike M4 (issue 17): does Triton 3.6 warp specialisation speed up our slash forward loop on Hopper?

benchmarks/spike_hopper_kernels.md, sections 0.5, 7 (M4) and appendix A.3. The slash-only forward
(the `fixed` benchmark index with its columns emptied, 64-token blocks; 16 query / 2 KV heads,
d 128, bf16, batch 1) in these versions:

  a        the production ``_vs_attn_fwd_kernel`` through ``step_forward`` (pointer loads, no
           columns: ``max_v = 0``), its own launch settings (4 warps, 2 stages at B = 64);
  b*       a standalone spike kernel with the same slash loop (the plan's key-block list per query
           block, online softmax in fp32 with exp2, causal mask on the diagonal block, out and
           natural-log lse like production) whose Q/K/V/O tiles go through
           ``tl.make_tensor_descriptor(...).load([row, 0])`` (TMA);
  c*       the same with the loop as ``tl.range(..., warp_specialize=True)`` (Triton's automatic
           warp specialisation: a TMA producer partition and compute partitions).

Suffixes: ``_every`` the causal ``where`` on every tile instead of a peeled diagonal; ``_s3`` 3
pipeline stages instead of 2; ``_host`` host-side ``TensorDescriptor`` arguments instead of
descriptors built in the kernel (which costs every program a tensormap write and fence).
Why two diagonal styles: the plan lists the diagonal block last, and a data-dependent ``if`` on
it inside the loop (production's form) silently disables autoWS (no ``ttg.warp_specialize`` in the
sm_90 compile, checked on CPU); peeling the diagonal after the loop, or masking every tile with an
arithmetic ``where`` (production measured ~8% for that on its forward), keep it. On the sm_90
compile (CPU, --compile-sm90) the c variants become 12 warps (TMA producer + two 4-warp compute
partitions) with 115-181 KB of shared memory: one program per SM, where (a) and b fit two (82 KB).

Every version is checked at --check-seq-len against ``reference.py`` (fp32) and against (a), then
timed at --seq-len. Reported: median ms, TFLOP/s on computed pairs (whole 64x64 tiles, counted
from the plan's lists) and on active pairs (4*d FLOPs per pair), speedup over (a), and whether the
compiled kernel holds ``ttg.warp_specialize`` with its warps, shared memory and registers. A
failure of one version (compile error, wrong result) is recorded under its ``errors`` and the
others still run; the JSON is rewritten after every step, with each version's ``status``, so a
hang (a watchdog ends the process after --variant-timeout s) still leaves what ran.

    # GPU (H200; about a minute with a cold Triton cache; 9 variants):
    python benchmarks/spike_autows.py --out $OUT/spike_autows_nvidia-h200.json
    # CPU: Triton's interpreter, tiny fp32 shapes: correctness only (warp_specialize is ignored there)
    python benchmarks/spike_autows.py --smoke
    # CPU: cross-compile the spike kernels for sm_90: does ttg.warp_specialize appear?
    python benchmarks/spike_autows.py --compile-sm90
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import math
import os
import sys
import tempfile
from typing import Dict, List, Optional

import torch

# Without a GPU the kernels run in Triton's CPU interpreter, which must be chosen before any kernel
# is decorated. The sm_90 cross-compile needs real (not interpreted) kernels, so it keeps it off.
if not torch.cuda.is_available() and "--compile-sm90" not in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import (describe_index, device_slug, fixed_vs_index, median, relative_l2, run_metadata,  # noqa: E402
                    tflops, time_ms, write_json)

from megatron_mtraining import VSIndex  # noqa: E402
from megatron_mtraining.kernels import reference_attention, single_device_plan, step_forward  # noqa: E402
from megatron_mtraining.kernels.triton_fwd import LOG2E, _vs_attn_fwd_kernel, interpreting  # noqa: E402

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
# Tolerances of the checks: relative L2 of out, max |lse difference| (natural log). bf16 as the GPU
# tests use (tests/test_gpu.py: out within 1e-2 of the fp32 reference); fp32 (the CPU interpreter)
# must be exact up to summation order.
TOLERANCES = {torch.bfloat16: (1e-2, 1e-2), torch.float32: (1e-4, 1e-4)}
WS_MARKER = "ttg.warp_specialize"


# ----------------------------------------------------------------------------------------------
# The spike kernel: slash loop only, TMA tiles, optionally warp specialised
# ----------------------------------------------------------------------------------------------


@triton.jit
def _descriptor(X, ROWS, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, HOST: tl.constexpr):
    """A [BLOCK, HEAD_DIM] tile descriptor over X seen as [ROWS, HEAD_DIM]: X itself when the host
    passed a TensorDescriptor, else built here (needs ``triton.set_allocator``)."""
    if HOST:
        return X
    else:
        return tl.make_tensor_descriptor(X, shape=[ROWS, HEAD_DIM], strides=[HEAD_DIM, 1],
                                         block_shape=[BLOCK, HEAD_DIM])


@triton.jit
def _fold_tile(q, k_desc, v_desc, kv_row, k_first, q_pos, offs, m_i, l_i, acc, qk_scale, MASK: tl.constexpr):
    """One key tile into (m, l, acc), base 2, as production's ``_online_softmax_step``. No guard for
    rows without keys: every tile of a slash list has a key for every row (the diagonal tile the
    query itself), so the running maximum is finite from the first tile on."""
    k = k_desc.load([kv_row, 0])
    s = tl.dot(q, k.T)
    if MASK:
        s = tl.where((k_first + offs)[None, :] <= q_pos[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    p = tl.math.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = v_desc.load([kv_row, 0])
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _slash_fwd_tma_kernel(Q, K, V, Out, Lse, KVCnt, KVIdx, HQ, GROUP, N, NQB, MAX_S, Q_ROWS, KV_ROWS, qk_scale,
                          HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, WS: tl.constexpr, PEEL: tl.constexpr,
                          HOST: tl.constexpr):
    """One program per (query block, batch x query head); tiles are whole index blocks. Q/O are
    [b*hq*N, d] and K/V [b*hkv*N, d] row-major, so a tile is one TMA box at a row coordinate."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HQ
    h = pid_bh % HQ
    kv_row0 = (b * (HQ // GROUP) + h // GROUP) * N  # first row of this query head's KV head
    q_row = pid_bh * N + pid_m * BLOCK
    q_desc = _descriptor(Q, Q_ROWS, HEAD_DIM, BLOCK, HOST)
    k_desc = _descriptor(K, KV_ROWS, HEAD_DIM, BLOCK, HOST)
    v_desc = _descriptor(V, KV_ROWS, HEAD_DIM, BLOCK, HOST)
    o_desc = _descriptor(Out, Q_ROWS, HEAD_DIM, BLOCK, HOST)

    offs = tl.arange(0, BLOCK)
    q_pos = pid_m * BLOCK + offs  # the single-device plan: local query block = global block
    q = q_desc.load([q_row, 0])
    m_i = tl.full([BLOCK], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK], tl.float32)
    acc = tl.zeros([BLOCK, HEAD_DIM], tl.float32)

    plan_row = pid_bh * NQB + pid_m
    n_blocks = tl.load(KVCnt + plan_row)
    # PEEL: the plan lists the diagonal block last (checked on the host), so the loop runs the
    # unmasked blocks and the diagonal follows it; else every tile takes the (arithmetic) mask.
    for t in tl.range(0, n_blocks - 1 if PEEL else n_blocks, warp_specialize=WS):
        j = tl.load(KVIdx + plan_row * MAX_S + t)
        m_i, l_i, acc = _fold_tile(q, k_desc, v_desc, kv_row0 + j * BLOCK, j * BLOCK, q_pos, offs, m_i, l_i, acc,
                                   qk_scale, not PEEL)
    if PEEL:
        m_i, l_i, acc = _fold_tile(q, k_desc, v_desc, kv_row0 + pid_m * BLOCK, pid_m * BLOCK, q_pos, offs, m_i,
                                   l_i, acc, qk_scale, True)

    o_desc.store([q_row, 0], (acc / l_i[:, None]).to(q.dtype))  # Out may be a descriptor: q's dtype
    tl.store(Lse + pid_bh * N + q_pos, (m_i + tl.math.log2(l_i)) * 0.6931471805599453)


# ----------------------------------------------------------------------------------------------
# Variants
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Variant:
    about: str
    production: bool = False
    ws: bool = False           # tl.range(..., warp_specialize=True)
    peel: bool = True          # diagonal after the loop (else the mask on every tile)
    host_desc: bool = False    # TensorDescriptor arguments (else tl.make_tensor_descriptor in the kernel)
    num_warps: int = 4
    num_stages: int = 2
    kernel: str = "triton"     # "triton": this file's kernels; else a launcher from register_variants


VARIANTS: Dict[str, Variant] = {
    "a": Variant("production _vs_attn_fwd_kernel, max_v = 0 (pointer loads)", production=True),
    "b": Variant("TMA tiles, peeled diagonal, 2 stages"),
    "b_every": Variant("TMA tiles, mask on every tile, 2 stages", peel=False),
    # Not b with 3 stages: with the peeled diagonal the sm_90 compile keeps 2 K/V buffers at
    # num_stages 3 (the same kernel as b; CPU compile); masking every tile gets 3.
    "b_every_s3": Variant("TMA tiles, mask on every tile, 3 stages", peel=False, num_stages=3),
    "b_host": Variant("TMA tiles via host descriptors, peeled diagonal, 2 stages", host_desc=True),
    "c": Variant("autoWS, TMA tiles, peeled diagonal, 2 stages", ws=True),
    "c_s3": Variant("autoWS, TMA tiles, peeled diagonal, 3 stages", ws=True, num_stages=3),
    "c_every": Variant("autoWS, TMA tiles, mask on every tile, 2 stages", ws=True, peel=False),
    "c_host": Variant("autoWS, TMA tiles via host descriptors, peeled diagonal, 2 stages", ws=True, host_desc=True),
}


def launch_production(q, k, v, plan, out, lse, scale):
    step_forward("triton", q, k, v, plan, out, lse, scale, accumulate=False)
    return None


def launch_spike(var: Variant, q, k, v, plan, out, lse, scale):
    """Run the spike kernel; returns the compiled kernel (None in the interpreter)."""
    b, hq, n, d = q.shape
    hkv, B = k.shape[1], plan.block_size
    tiles = [x.view(-1, d) for x in (q, k, v, out)]  # contiguous [b, h, n, d] -> [b*h*n, d]
    if var.host_desc:
        tiles = [TensorDescriptor.from_tensor(x, [B, d]) for x in tiles]
    return _slash_fwd_tma_kernel[(n // B, b * hq)](
        *tiles, lse, plan.kv_count, plan.kv_blocks, hq, hq // hkv, n, n // B, plan.kv_blocks.shape[-1],
        b * hq * n, b * hkv * n, scale * LOG2E,
        HEAD_DIM=d, BLOCK=B, WS=var.ws, PEEL=var.peel, HOST=var.host_desc,
        num_warps=var.num_warps, num_stages=var.num_stages)


# kernel name -> launch(var, q, k, v, plan, out, lse, scale) for variants other scripts add
# (spike_gluon.py): they then run through this file's checks, timing and table.
EXTRA_LAUNCHERS: Dict[str, object] = {}


def register_variants(variants: Dict[str, Variant], launch) -> None:
    for var in variants.values():
        EXTRA_LAUNCHERS[var.kernel] = launch
    VARIANTS.update(variants)


def launcher(var: Variant):
    if var.production:
        return launch_production
    if var.kernel != "triton":
        return lambda *args: EXTRA_LAUNCHERS[var.kernel](var, *args)
    return lambda *args: launch_spike(var, *args)


def compiled_info(kernel) -> Dict:
    """What the compiled kernel is: warp specialised or not, warps, shared memory, registers."""
    if kernel is None:
        return {"warp_specialized": None, "note": "interpreter: no compiled kernel"}
    ttgir = kernel.asm.get("ttgir")  # None if the cache kept no TTGIR: then unknown, not False
    info = {"warp_specialized": None if ttgir is None else WS_MARKER in ttgir,
            # 12 warps at num_warps 4 is the other sign of the partitions (producer + 2 x 4 compute)
            "num_warps": kernel.metadata.num_warps, "shared_bytes": kernel.metadata.shared}
    try:
        kernel._init_handles()  # loads the binary once: registers and spills come from there
        info.update(n_regs=kernel.n_regs, n_spills=kernel.n_spills)
    except Exception as exc:  # noqa: BLE001  (diagnostics only)
        info["n_regs_error"] = f"{type(exc).__name__}: {exc}"[:200]
    return info


def production_compiled():
    """The production forward's compiled kernel (the last one the JIT cache holds), or None."""
    caches = getattr(_vs_attn_fwd_kernel, "device_caches", {})  # the interpreter has none
    kernels = [kern for cache, *_ in caches.values() for kern in cache.values()]
    return kernels[-1] if kernels else None


# ----------------------------------------------------------------------------------------------
# Problem: slash-only index, plan, work counts, inputs
# ----------------------------------------------------------------------------------------------


def slash_only_index(cfg, seq_len: int, density: float, device) -> VSIndex:
    """The `fixed` benchmark index with its columns emptied (vertical capacity 0: max_v = 0)."""
    full = fixed_vs_index(1, cfg.heads, seq_len, cfg.block, density, device, cfg.seed)
    no_cols = full.vertical[..., :0].contiguous()
    return VSIndex(full.slash, full.n_slash, no_cols, torch.zeros_like(full.n_vertical), cfg.block).validate(seq_len)


def check_plan(plan) -> None:
    """What the spike kernel assumes of the plan: the single-device case (local = global block)
    and every query block's list ending with its own (diagonal) block, which PEEL relies on."""
    nqb = plan.q_block_ids.numel()
    assert torch.equal(plan.q_block_ids.cpu(), torch.arange(nqb, dtype=torch.int32)), "not a single-device plan"
    last = plan.kv_blocks.gather(-1, (plan.kv_count.long() - 1).clamp(min=0)[..., None])[..., 0]
    assert bool((plan.kv_count >= 1).all()), "a query block with an empty slash list"
    assert torch.equal(last, plan.q_block_ids.expand_as(last)), "the diagonal block is not last in every list"


def work_counts(index: VSIndex, plan, seq_len: int, head_dim: int) -> Dict:
    """Pairs and FLOPs: computed = whole BxB tiles of the plan's lists; active = the same minus the
    masked upper triangle of each diagonal tile (cross-checked with the index's own density)."""
    B = plan.block_size
    tiles = int(plan.kv_count.sum())
    diag_tiles = plan.kv_count.numel()  # one diagonal tile per (batch, head, query block)
    computed = tiles * B * B
    active = computed - diag_tiles * B * (B - 1) // 2
    described = describe_index(index, seq_len)
    n_slash = int(index.n_slash.max())
    return {"seq_len": seq_len, "n_slash": n_slash, "slash_offsets": index.slash[0, 0, :n_slash].tolist(),
            "tiles": tiles, "tiles_per_query_block_head": tiles / diag_tiles,
            "computed_pairs": float(computed), "active_pairs": float(active),
            "active_pairs_index_density": described["active_pairs"], "density_mean": described["density_mean"],
            "flops_computed": 4.0 * head_dim * computed, "flops_active": 4.0 * head_dim * active}


def make_inputs(cfg, seq_len: int, device, n_sets: int, seed: int) -> List[tuple]:
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(heads):
        return torch.randn(1, heads, seq_len, cfg.head_dim, generator=gen, device=device, dtype=cfg.dtype)

    return [(rand(cfg.heads), rand(cfg.kv_heads), rand(cfg.kv_heads)) for _ in range(n_sets)]


def outputs_like(q):
    return torch.empty_like(q), torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)


# ----------------------------------------------------------------------------------------------
# Checks and timing of one variant
# ----------------------------------------------------------------------------------------------


def check_variant(var: Variant, problem: Dict, baseline: Optional[tuple], cfg) -> tuple:
    """out and lse against the fp32 reference and (for the spike kernels) against (a); returns
    (figures, (out, lse), the compiled kernel or None)."""
    q, k, v = problem["inputs"]
    out, lse = outputs_like(q)
    kernel = launcher(var)(q, k, v, problem["plan"], out, lse, problem["scale"])
    if q.is_cuda:
        torch.cuda.synchronize()
    ref_out, ref_lse = problem["reference"]
    tol_out, tol_lse = TOLERANCES[cfg.dtype]
    result = {"finite": bool(torch.isfinite(out).all() and torch.isfinite(lse).all()),
              "out_rel_l2_vs_ref": relative_l2(out, ref_out),
              "lse_max_abs_vs_ref": float((lse - ref_lse).abs().max()),
              "tolerance_out": tol_out, "tolerance_lse": tol_lse}
    ok = result["finite"] and result["out_rel_l2_vs_ref"] < tol_out and result["lse_max_abs_vs_ref"] < tol_lse
    if baseline is not None:
        result["out_rel_l2_vs_a"] = relative_l2(out, baseline[0])
        result["lse_max_abs_vs_a"] = float((lse - baseline[1]).abs().max())
        ok = ok and result["out_rel_l2_vs_a"] < tol_out and result["lse_max_abs_vs_a"] < tol_lse
    result["pass"] = ok
    return result, (out, lse), kernel


def time_variant(var: Variant, problem: Dict, cfg) -> Dict:
    plan, scale = problem["plan"], problem["scale"]
    out, lse = outputs_like(problem["inputs"][0][0])
    run = launcher(var)
    samples = time_ms(lambda q, k, v: run(q, k, v, plan, out, lse, scale), problem["inputs"], problem["device"],
                      cfg.warmup, cfg.reps)
    ms = median(samples)
    work = problem["work"]
    return {"ms": ms, "samples_ms": samples, "tflops_computed": tflops(work["flops_computed"], ms),
            "tflops_active": tflops(work["flops_active"], ms)}


def attempt(entry: Dict, key: str, fn):
    """fn(); a failure is kept as entry['errors'][key] (the string) and returns None."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001  (compile errors, wrong shapes, CUDA errors: record, go on)
        entry.setdefault("errors", {})[key] = f"{type(exc).__name__}: {exc}"[:1500]
        return None


def run_variant(name: str, problems: Dict, result: Dict, save, cfg) -> None:
    var = VARIANTS[name]
    entry = result["variants"][name] = {"about": var.about, **dataclasses.asdict(var)}
    if var.ws and interpreting():
        entry["note"] = "TRITON_INTERPRET: warp_specialize is ignored by the interpreter; this ran as (b)"
    # A deadlocked warp-specialised kernel would hang the device call: end the process instead. The
    # JSON already on disk then shows this variant's status (a C-level timer, so it fires even while
    # Python waits inside a CUDA call).
    if cfg.variant_timeout > 0:
        faulthandler.dump_traceback_later(cfg.variant_timeout, exit=True)
    try:
        entry["status"] = "checking"
        save()
        checked = attempt(entry, "check", lambda: check_variant(var, problems["check"], problems.get("baseline"), cfg))
        if checked is not None:
            entry["check"], outputs, kernel = checked
            if var.production:
                problems["baseline"] = outputs  # what the spike kernels are compared with
            entry["compiled"] = attempt(entry, "compiled", lambda: compiled_info(
                production_compiled() if var.production else kernel))
            if var.ws and entry["compiled"] and entry["compiled"]["warp_specialized"] is False:
                entry["note"] = "warp_specialize=True was not applied by the compiler (no ttg.warp_specialize)"
        entry["status"] = "timing"
        save()
        timing = attempt(entry, "timing", lambda: time_variant(var, problems["time"], cfg))
        if timing:
            entry.update(timing)
        entry["status"] = "done"
    finally:
        if cfg.variant_timeout > 0:
            faulthandler.cancel_dump_traceback_later()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    save()


def build_problem(cfg, seq_len: int, density: float, device, n_sets: int, seed: int, reference: bool) -> Dict:
    index = slash_only_index(cfg, seq_len, density, device)
    # The PyTorch conversion: the plan is input here, not measured, and this path needs no compiled
    # extension (its tensors are identical to the extension's: tests/test_convert.py).
    plan = single_device_plan(index, seq_len, impl="torch")
    check_plan(plan)
    inputs = make_inputs(cfg, seq_len, device, n_sets, seed)
    problem = {"device": device, "plan": plan, "scale": 1.0 / math.sqrt(cfg.head_dim),
               "work": work_counts(index, plan, seq_len, cfg.head_dim), "inputs": inputs}
    if reference:  # one input set: the check's
        problem["inputs"] = inputs[0]
        with torch.no_grad():
            problem["reference"] = reference_attention(*(x.float() for x in inputs[0]), index,
                                                       softmax_scale=problem["scale"])
    return problem


# ----------------------------------------------------------------------------------------------
# sm_90 cross-compile (no GPU needed)
# ----------------------------------------------------------------------------------------------


def compile_sm90(names: List[str], head_dim: int = 128, block: int = 64) -> Dict:
    """Compile the spike variants for sm_90 as appendix A.3 does; per variant whether the TTGIR holds
    ttg.warp_specialize, with warps and shared memory. (a) is left out: it is not the question."""
    if interpreting():
        return {"skipped": "TRITON_INTERPRET=1 is set: the interpreter has no compiler; unset it"}
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    out: Dict = {}
    for name in names:
        var = VARIANTS[name]
        if var.production or var.kernel != "triton":
            continue
        tile = f"tensordesc<bf16[{block},{head_dim}]>" if var.host_desc else "*bf16"
        sig = {"Q": tile, "K": tile, "V": tile, "Out": tile, "Lse": "*fp32", "KVCnt": "*i32", "KVIdx": "*i32",
               **{p: "i32" for p in ("HQ", "GROUP", "N", "NQB", "MAX_S", "Q_ROWS", "KV_ROWS")}, "qk_scale": "fp32",
               **{p: "constexpr" for p in ("HEAD_DIM", "BLOCK", "WS", "PEEL", "HOST")}}
        constexprs = {"HEAD_DIM": head_dim, "BLOCK": block, "WS": var.ws, "PEEL": var.peel, "HOST": var.host_desc}
        entry = out[name] = {}
        kernel = attempt(entry, "compile", lambda: triton.compile(
            ASTSource(_slash_fwd_tma_kernel, sig, constexprs), target=GPUTarget("cuda", 90, 32),
            options={"num_warps": var.num_warps, "num_stages": var.num_stages}))
        if kernel is not None:
            entry.update(warp_specialized=WS_MARKER in kernel.asm["ttgir"], num_warps=kernel.metadata.num_warps,
                         shared_bytes=kernel.metadata.shared)
    return out


# ----------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------


def fmt(x, spec=".2f", width=8) -> str:
    return f"{x:{width}{spec}}" if isinstance(x, (int, float)) and not isinstance(x, bool) else f"{'-':>{width}}"


def print_table(result: Dict) -> None:
    cfg, work = result["config"], result.get("work", {})
    print(f"\n{result['meta']['device']} | slash only, {cfg['heads']}/{cfg['kv_heads']} heads, d {cfg['head_dim']}, "
          f"{cfg['dtype']}, block {cfg['block']} | S {cfg['seq_len']}: {work.get('n_slash')} offsets, "
          f"{work.get('computed_pairs', 0):.3e} computed / {work.get('active_pairs', 0):.3e} active pairs")
    header = (f"{'variant':>10} {'check':>5} {'out err':>8} {'vs a':>8} | {'ms':>8} {'TF/s cmp':>8} {'TF/s act':>8} "
              f"{'x a':>5} | {'WS':>3} {'warps':>5} {'smem KB':>7} {'regs':>4}")
    print(header)
    print("-" * len(header))
    for name, e in result["variants"].items():
        c, k = e.get("check") or {}, e.get("compiled") or {}
        ws = {True: "yes", False: "no"}.get(k.get("warp_specialized"), "-")
        check = {True: "pass", False: "FAIL"}.get(c.get("pass"), "-")
        smem = k["shared_bytes"] / 1024 if isinstance(k.get("shared_bytes"), int) else None
        errs = f"{fmt(c.get('out_rel_l2_vs_ref'), '.1e')} {fmt(c.get('out_rel_l2_vs_a'), '.1e')}"
        print(f"{name:>10} {check:>5} {errs} | "
              f"{fmt(e.get('ms'), '.3f')} {fmt(e.get('tflops_computed'), '.0f')} {fmt(e.get('tflops_active'), '.0f')} "
              f"{fmt(e.get('speedup_vs_a'), '.2f', 5)} | {ws:>3} {fmt(k.get('num_warps'), 'd', 5)} "
              f"{fmt(smem, '.0f', 7)} {fmt(k.get('n_regs'), 'd', 4)}")
    print(f"(check at S={cfg['check_seq_len']} against the fp32 reference (out rel. L2) and variant a; ms median at "
          f"S={cfg['seq_len']}; TF/s on computed tiles / active pairs; x a = speedup over a; WS = the compiled "
          "TTGIR holds ttg.warp_specialize)")
    print(f"all checks pass: {'yes' if result.get('all_checks_pass') else 'NO'}")
    if result.get("note"):
        print(f"note: {result['note']}")
    for name, e in result["variants"].items():
        for key, msg in (e.get("errors") or {}).items():
            print(f"error {name} {key}: {msg[:300]}")
        if e.get("note"):
            print(f"note {name}: {e['note']}")


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------

GPU_DEFAULTS = dict(seq_len=131072, check_seq_len=4096, heads=16, kv_heads=2, head_dim=128, density=0.05,
                    check_density=0.3, warmup=3, reps=20, input_sets=3, variant_timeout=90)
# The interpreter is slow: 4 query heads over 2 KV heads (GQA still exercised), d 64, 8 blocks, and a
# density high enough for off-diagonal offsets (0, 1, 2) in the lists.
SMOKE_DEFAULTS = dict(seq_len=512, check_seq_len=512, heads=4, kv_heads=2, head_dim=64, density=0.8,
                      check_density=0.8, warmup=0, reps=1, input_sets=1, variant_timeout=600)


@dataclasses.dataclass
class Config:
    seq_len: int
    check_seq_len: int
    heads: int
    kv_heads: int
    head_dim: int
    density: float
    check_density: float
    warmup: int
    reps: int
    input_sets: int
    variant_timeout: float
    variants: List[str]
    smoke: bool
    block: int = 64
    seed: int = 0
    dtype: torch.dtype = torch.bfloat16


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, help="timed sequence length (default 131072; smoke 512)")
    p.add_argument("--check-seq-len", type=int, help="sequence length of the correctness check (default 4096)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {', '.join(VARIANTS)}")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/spike_autows_<device>.json)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny fp32 shapes in the CPU interpreter (implied without a GPU)")
    p.add_argument("--compile-sm90", action="store_true",
                   help="only cross-compile the spike variants for sm_90 (no GPU needed); report ttg.warp_specialize")
    p.add_argument("--block", type=int, choices=(64, 128),
                   help="index block size: the fixed index and the plan are built at it (default 64)")
    for name in ("heads", "kv_heads", "head_dim", "warmup", "reps", "input_sets"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int)
    for name in ("density", "check_density", "variant_timeout"):
        p.add_argument(f"--{name.replace('_', '-')}", type=float)
    return p.parse_args(argv)


def make_config(args, device) -> Config:
    smoke = args.smoke or device.type != "cuda"
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown or not names:
        raise SystemExit(f"spike_autows.py: unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    values = dict(SMOKE_DEFAULTS if smoke else GPU_DEFAULTS)
    values.update({k: v for k, v in vars(args).items() if k in values and v is not None})
    if getattr(args, "block", None):
        values["block"] = args.block
    return Config(variants=names, smoke=smoke, dtype=torch.float32 if smoke else torch.bfloat16, **values)


def output_path(args, cfg, device) -> str:
    if args.out:
        return args.out
    if cfg.smoke:  # smoke runs never land among the committed results
        return os.path.join(tempfile.gettempdir(), f"spike_autows_smoke_{device_slug(device)}.json")
    return os.path.join(RESULTS_DIR, f"spike_autows_{device_slug(device)}.json")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.compile_sm90:
        names = [v for v in args.variants.split(",") if v in VARIANTS]
        compiled = compile_sm90(names)
        for name, e in compiled.items():
            print(f"sm_90 {name:>10}: " + (f"{WS_MARKER} {'yes' if e['warp_specialized'] else 'NO'}, "
                                          f"{e['num_warps']} warps, {e['shared_bytes']} B shared"
                                          if "warp_specialized" in e else str(e)))
        if args.out:
            write_json(args.out, {"benchmark": "spike_autows_compile_sm90", "triton": triton.__version__,
                                  "variants": compiled})
        return 0

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if device.type == "cpu" and not interpreting():
        raise SystemExit("spike_autows.py: a CPU run needs TRITON_INTERPRET=1 set before Triton is imported")
    cfg = make_config(args, device)
    path = output_path(args, cfg, device)
    # Scratch for the descriptors that tl.make_tensor_descriptor builds in the kernel.
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device=device))

    config = {k: (str(v).replace("torch.", "") if k == "dtype" else v) for k, v in dataclasses.asdict(cfg).items()}
    result: Dict = {"benchmark": "spike_autows", "smoke": cfg.smoke, "finished": False, "meta": run_metadata(device),
                    "config": {**config, "interpreter": interpreting()}, "variants": {}}

    def save():
        write_json(path, result)

    try:  # nothing can run without the problems; keep why in the JSON, then stop
        problems = {
            "check": build_problem(cfg, cfg.check_seq_len, cfg.check_density, device, 1, cfg.seed + 1, reference=True),
            "time": build_problem(cfg, cfg.seq_len, cfg.density, device, cfg.input_sets, cfg.seed + 2,
                                  reference=False),
        }
    except Exception as exc:
        result["errors"] = {"problem": f"{type(exc).__name__}: {exc}"[:1500]}
        save()
        raise
    result["check_work"] = problems["check"]["work"]
    result["work"] = problems["time"]["work"]
    # (a) first: the spike kernels are compared with its output, and its numbers come before any
    # risky kernel runs.
    order = sorted(cfg.variants, key=lambda v: not VARIANTS[v].production)
    if not VARIANTS[order[0]].production:
        result["note"] = "variant a not run: no comparison with production"
    for name in order:
        run_variant(name, problems, result, save, cfg)
    a_ms = result["variants"].get("a", {}).get("ms")
    for entry in result["variants"].values():
        if a_ms and entry.get("ms"):
            entry["speedup_vs_a"] = a_ms / entry["ms"]
    checks = [e.get("check", {}).get("pass") for e in result["variants"].values()]
    result["all_checks_pass"] = all(c is True for c in checks)
    result["finished"] = True
    save()
    print(f"wrote {path}")
    print_table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
