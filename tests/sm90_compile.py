"""Cross-compile the Hopper kernels (``kernels/hopper_fwd.py``, ``kernels/hopper_bwd.py``) for sm_90a
on a machine without a GPU, and report what ptxas says: the CPU half of their tests (Gluon has no
interpreter). ``--triton-dkdv`` does the same for Triton's key-block kernel with and without the
fused dQ schedule (the interpreter cannot show its atomics' memory order).

Run as a script in a process without TRITON_INTERPRET (the tests do that in a subprocess):
    python tests/sm90_compile.py [--triton-dkdv] [--out compile.json]
Per kernel and configuration: compiled or the error, shared memory, warps, wgmma and cp.async
counts, registers, spills, and whether ptxas serialised the wgmma groups (C7513/C7514).
"""

from __future__ import annotations

import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "benchmarks")]

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from common import ptxas_report  # noqa: E402
from megatron_mtraining.kernels import hopper_bwd, hopper_common, hopper_fwd, hopper_pingpong  # noqa: E402


def _strides(*tensors: str) -> list:
    return [f"stride_{t}{axis}" for t in tensors for axis in ("bh" if t == "l" else "bhn")]


# Per kernel: its function, its arguments in order (pointer element types, None = the input dtype;
# "i32" / "fp32" scalars; "constexpr"), and the configurations the tests require to compile
# cleanly: the default path (B 64, d 128, bf16, columns) and one change at a time from it.
KERNELS = {
    "fwd": dict(
        fn=hopper_fwd._vs_attn_fwd_sm90_kernel,
        args={"Q": None, "K": None, "V": None, "Out": "Out", "Lse": "*fp32", "QBlk": "*i32", "KBlk": "*i32",
              "KVCnt": "*i32", "KVIdx": "*i32", "ColLimit": "*i32", "Cols": "*i32", "ColPos": "*i64",
              "Words": "*i64", "Diag": "*i8", "DocStart": "*i32", "DocLast": "*i32", "ColStart": "*i32",
              **{s: "i32" for s in _strides("q", "k", "v", "o", "l")}, "qk_scale": "fp32",
              **{s: "i32" for s in ("HQ", "GROUP", "NQB", "MAX_S", "MAX_V", "N_WORDS")},
              **{c: "constexpr" for c in ("BLOCK", "HEAD_DIM", "STAGES", "ACCUMULATE", "INT64", "DOCS", "HAS_COLS",
                                          "SMEM_LAYOUT")}},
        base=dict(BLOCK=64, HEAD_DIM=128, STAGES=hopper_fwd.STAGES, ACCUMULATE=False, INT64=False, DOCS=False,
                  HAS_COLS=True),
        changes=[{}, {"ACCUMULATE": True}, {"DOCS": True}, {"HAS_COLS": False}, {"INT64": True}, {"BLOCK": 128},
                 {"HEAD_DIM": 64}, {"dtype": "fp16"}, {"DOCS": True, "ACCUMULATE": True, "INT64": True}]),
    "fwd_pp": dict(
        fn=hopper_pingpong._vs_attn_fwd_pingpong_kernel,
        args={"Q": None, "K": None, "V": None, "Out": "Out", "Lse": "*fp32", "QBlk": "*i32", "KBlk": "*i32",
              "KVCnt": "*i32", "KVIdx": "*i32", "ColLimit": "*i32", "Cols": "*i32", "ColPos": "*i64",
              "Words": "*i64", "Diag": "*i8", "DocStart": "*i32", "DocLast": "*i32", "ColStart": "*i32",
              **{s: "i32" for s in _strides("q", "k", "v", "o", "l")}, "qk_scale": "fp32",
              **{s: "i32" for s in ("HQ", "GROUP", "NQB", "MAX_S", "MAX_V", "N_WORDS")},
              **{c: "constexpr" for c in ("BLOCK", "HEAD_DIM", "STAGES", "CHUNK", "ACCUMULATE", "INT64", "DOCS",
                                          "HAS_COLS", "SMEM_LAYOUT")}},
        base=dict(BLOCK=128, HEAD_DIM=128, STAGES=hopper_pingpong.STAGES, CHUNK=hopper_pingpong.CHUNK,
                  ACCUMULATE=False, INT64=False, DOCS=False, HAS_COLS=True),  # B = 128 only
        options={"maxnreg": 168},
        changes=[{}, {"ACCUMULATE": True}, {"DOCS": True}, {"HAS_COLS": False}, {"INT64": True}, {"HEAD_DIM": 64},
                 {"dtype": "fp16"}, {"DOCS": True, "ACCUMULATE": True, "INT64": True}]),
    "dq_pp": dict(
        fn=hopper_pingpong._dq_pingpong_kernel,
        args={"Q": None, "K": None, "V": None, "DO": None, "Lse": "*fp32", "Delta": "*fp32", "DQ": "DQ",
              "QBlk": "*i32", "KBlk": "*i32", "KVCnt": "*i32", "KVIdx": "*i32", "ColLimit": "*i32", "Cols": "*i32",
              "ColPos": "*i64", "Words": "*i64", "Diag": "*i8", "DocStart": "*i32", "DocLast": "*i32",
              "ColStart": "*i32", **{s: "i32" for s in _strides("q", "k", "v", "o", "l", "g")}, "qk_scale": "fp32",
              "sm_scale": "fp32", **{s: "i32" for s in ("HQ", "GROUP", "NQB", "MAX_S", "MAX_V", "N_WORDS")},
              **{c: "constexpr" for c in ("BLOCK", "HEAD_DIM", "STAGES", "CHUNK", "ACCUMULATE", "INT64", "DOCS",
                                          "HAS_COLS", "SMEM_LAYOUT")}},
        base=dict(BLOCK=128, HEAD_DIM=128, STAGES=hopper_pingpong.DQ_STAGES, CHUNK=hopper_pingpong.CHUNK,
                  ACCUMULATE=False, INT64=False, DOCS=False, HAS_COLS=True),  # B = 128 only
        options={"maxnreg": 168},
        changes=[{}, {"ACCUMULATE": True}, {"DOCS": True}, {"HAS_COLS": False}, {"INT64": True}, {"HEAD_DIM": 64},
                 {"dtype": "fp16"}, {"DOCS": True, "ACCUMULATE": True}]),
    "dkdv_pp": dict(
        fn=hopper_pingpong._dkdv_pingpong_kernel,
        args={"Q": None, "K": None, "V": None, "DO": None, "Lse": "*fp32", "Delta": "*fp32", "DK": "*fp32",
              "DV": "*fp32", "QBlk": "*i32", "KBlk": "*i32", "QCnt": "*i32", "QIdx": "*i32", "DocStart": "*i32",
              "DocLast": "*i32", **{s: "i32" for s in _strides("q", "k", "v", "o", "l", "g")}, "qk_scale": "fp32",
              "sm_scale": "fp32", **{s: "i32" for s in ("HQ", "HKV", "GROUP", "NKB", "MAX_S")},
              **{c: "constexpr" for c in ("BLOCK", "HEAD_DIM", "HEADS", "STAGES", "CHUNK", "INT64", "DOCS",
                                          "SMEM_LAYOUT")}},
        base=dict(BLOCK=128, HEAD_DIM=128, HEADS=8, STAGES=hopper_pingpong.DKDV_STAGES,
                  CHUNK=hopper_pingpong.CHUNK, INT64=False, DOCS=False),  # B = 128 only
        options={"maxnreg": 168},
        changes=[{}, {"DOCS": True}, {"INT64": True}, {"HEAD_DIM": 64}, {"dtype": "fp16"}, {"HEADS": 1}]),
    "dkdv_col": dict(
        fn=hopper_bwd._dkdv_col_sm90_kernel,
        args={"Q": None, "K": None, "V": None, "DO": None, "Lse": "*fp32", "Delta": "*fp32", "DKP": "*fp32",
              "DVP": "*fp32", "QBlk": "*i32", "ColCnt": "*i32", "Cols": "*i32", "ColPos": "*i64", "Words": "*i64",
              "HeadDiag": "*i8", "QFirst": "*i32", "QEnd": "*i32", "DocStart": "*i32",
              **{s: "i32" for s in _strides("q", "k", "v", "o", "l")}, "qk_scale": "fp32", "sm_scale": "fp32",
              **{s: "i32" for s in ("HQ", "GROUP", "NQB", "MAX_V", "MAX_V_PAD", "N_WORDS", "SPLITS", "BH")},
              **{c: "constexpr" for c in ("BLOCK", "HEAD_DIM", "INT64", "DOCS", "SMEM_LAYOUT")}},
        base=dict(BLOCK=64, HEAD_DIM=128, INT64=False, DOCS=False),
        changes=[{}, {"DOCS": True}, {"INT64": True}, {"BLOCK": 128}, {"HEAD_DIM": 64}, {"dtype": "fp16"}]),
    "dkdv": dict(
        fn=hopper_bwd._dkdv_sm90_kernel,
        args={"Q": None, "K": None, "V": None, "DO": None, "Lse": "*fp32", "Delta": "*fp32", "DK": "*fp32",
              "DV": "*fp32", "DQ": "*fp32", "QBlk": "*i32", "KBlk": "*i32", "QCnt": "*i32", "QIdx": "*i32",
              "KVCnt": "*i32", "KVIdx": "*i32", "DocStart": "*i32", "DocLast": "*i32", "Order": "*i32",
              **{s: "i32" for s in _strides("q", "k", "v", "o", "l", "g", "dq")}, "qk_scale": "fp32",
              "sm_scale": "fp32", **{s: "i32" for s in ("HQ", "HKV", "GROUP", "NKB", "NQB", "MAX_S", "MAX_S_KV")},
              **{c: "constexpr" for c in ("BLOCK", "KEYS", "HEAD_DIM", "HEADS", "INT64", "DOCS", "SMEM_LAYOUT",
                                          "FUSED_DQ", "ORDERED", "MAX_S_POW2", "DS_LAYOUT")}},
        base=dict(BLOCK=128, KEYS=128, HEAD_DIM=128, HEADS=8, INT64=False, DOCS=False, FUSED_DQ=False,
                  ORDERED=False, MAX_S_POW2=256),  # B = 128 only
        # The fused dQ schedules (triton_bwd.DQ_SCHEDULES): in turn (ORDERED) or by atomics.
        changes=[{}, {"DOCS": True}, {"INT64": True}, {"HEAD_DIM": 64}, {"dtype": "fp16"}, {"HEADS": 1},
                 {"FUSED_DQ": True, "ORDERED": True}, {"FUSED_DQ": True, "ORDERED": True, "DOCS": True, "INT64": True},
                 {"FUSED_DQ": True, "ORDERED": True, "HEAD_DIM": 64}, {"FUSED_DQ": True}]),
    "dq": dict(
        fn=hopper_bwd._dq_sm90_kernel,
        args={"Q": None, "K": None, "V": None, "DO": None, "Lse": "*fp32", "Delta": "*fp32", "DQ": "DQ",
              "QBlk": "*i32", "KBlk": "*i32", "KVCnt": "*i32", "KVIdx": "*i32", "ColLimit": "*i32", "Cols": "*i32",
              "ColPos": "*i64", "Words": "*i64", "Diag": "*i8", "DocStart": "*i32", "DocLast": "*i32",
              "ColStart": "*i32", **{s: "i32" for s in _strides("q", "k", "v", "o", "l", "g")}, "qk_scale": "fp32",
              "sm_scale": "fp32", **{s: "i32" for s in ("HQ", "GROUP", "NQB", "MAX_S", "MAX_V", "N_WORDS")},
              **{c: "constexpr" for c in ("BLOCK", "ROWS", "HEAD_DIM", "ACCUMULATE", "INT64", "DOCS", "HAS_COLS",
                                          "SMEM_LAYOUT")}},
        base=dict(BLOCK=128, ROWS=128, HEAD_DIM=128, ACCUMULATE=False, INT64=False, DOCS=False,
                  HAS_COLS=True),  # B = 128 only
        changes=[{}, {"ACCUMULATE": True}, {"DOCS": True}, {"HAS_COLS": False}, {"INT64": True}, {"HEAD_DIM": 64},
                 {"dtype": "fp16"}, {"DOCS": True, "ACCUMULATE": True}]),
}
# The JIT's specialisation on a GPU: 16-byte aligned pointers, strides and row lengths divisible by
# 16 (row strides of [b, h, n, d] views are multiples of d).
DIVISIBLE = ("MAX_S", "MAX_V", "MAX_V_PAD", "MAX_S_KV")


def num_warps(cfg: dict) -> int:
    """A warpgroup per 64 rows of the program (KEYS or ROWS; 64 where the kernel has neither).
    The warp-specialised ping-pong forward launches 4 (its default partition) and adds its workers."""
    return cfg.get("KEYS", cfg.get("ROWS", 64)) // 16


def turn_in_order(ir: str) -> bool:
    """In the kernel's IR (Triton's ttir or Gluon's ttgir, where text order is program order, which
    PTX's is not): the turn's acquire, then the dQ loads past L1, their store, a barrier and only
    then the release; no dQ load before the acquire, no release before the barrier."""
    lines = ir.splitlines()

    def first(marker, start=0):
        return next((i for i in range(start, len(lines)) if marker in lines[i]), None)

    acquire = first("add, acquire")
    load = first("cacheModifier = cg")
    if acquire is None or load is None or load < acquire:
        return False
    store = first("tt.store", load)
    barrier = first("gpu.barrier", store) if store is not None else None
    release = first("add, release")
    return barrier is not None and release is not None and release > barrier


def memory_order_report(ptx: str, ir: str) -> dict:
    """What the fused dQ schedules need of the PTX: acquire loads (the turn's wait), release adds
    (the hand-over), dQ loads past L1 (``.cg``), fp32 atomics (the unordered schedule), and how
    many atomics there are in all; and of the IR, their order (``turn_in_order``)."""
    import re
    return dict(turn_in_order=turn_in_order(ir), acquire_loads=len(re.findall(r"ld\.global\.gpu\.acquire\.b32", ptx)),
                release_adds=len(re.findall(r"atom\.global\.gpu\.release\.add", ptx)),
                atomics=len(re.findall(r"\batom\.|\bred\.", ptx)),
                float_atomics=len(re.findall(r"\b(?:atom|red)\.[a-z.]*add\.(?:v\d\.)?f32", ptx)),
                cg_loads=ptx.count("ld.global.cg"), cg_loads_16=ptx.count("ld.global.cg.v4."))


def compile_config(kernel: str, cfg: dict) -> dict:
    spec = KERNELS[kernel]
    dtype = cfg.get("dtype", "bf16")
    sig = {}
    for name, kind in spec["args"].items():
        if kind is None:  # an input
            kind = "*" + dtype
        elif kind in ("Out", "DQ"):  # an output: fp32 when steps accumulate into it
            kind = "*fp32" if cfg.get("ACCUMULATE") else "*" + dtype
        sig[name] = kind
    names = list(sig)
    constexprs = {k: v for k, v in cfg.items() if k != "dtype"}
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float16
    constexprs["SMEM_LAYOUT"] = hopper_common.shared_layout(cfg["HEAD_DIM"], torch_dtype)
    if "DS_LAYOUT" in spec["args"]:  # the fused dQ's [keys, 64 queries] dS tile
        constexprs["DS_LAYOUT"] = hopper_common.shared_layout(hopper_common.TILE.value, torch_dtype)
    divisible = [n for n in names if sig[n].startswith("*") or n.startswith("stride_") or n in DIVISIBLE]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    entry = {"kernel": kernel, "config": {**cfg, "dtype": dtype}}
    try:
        compiled = triton.compile(GluonASTSource(spec["fn"], sig, constexprs, attrs),
                                  target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": num_warps(cfg), **spec.get("options", {})})
    except Exception as e:  # noqa: BLE001  (reported, the test fails on it)
        entry["error"] = f"{type(e).__name__}: {e}"[:4000]
        return entry
    ptx = compiled.asm["ptx"]
    copies = ptx.count("cp.async.cg.shared.global")
    entry.update(**memory_order_report(ptx, compiled.asm["ttgir"]))
    entry.update(shared_bytes=compiled.metadata.shared, num_warps=compiled.metadata.num_warps,
                 wgmma=ptx.count("wgmma.mma_async"), cp_async=copies,
                 cp_async_16=copies > 0 and copies == ptx.count("0x10, 0x10;"), bar_sync=ptx.count("bar.sync"),
                 **ptxas_report(ptx))
    return entry


def config_name(kernel: str, cfg: dict) -> str:
    base = KERNELS[kernel]["base"]
    changed = ",".join(f"{k}={v}" for k, v in cfg.items() if base.get(k, "bf16" if k == "dtype" else None) != v)
    return f"{kernel}:{changed or 'default'}"


def compile_triton_dkdv(block: int, schedule: str, docs: bool = False) -> dict:
    """Triton's key-block dK/dV kernel (``triton_bwd._dkdv_kernel``) for sm_90a as the GPU launches
    it at bf16, d 128, under a dQ schedule (``triton_bwd.DQ_SCHEDULES``). The fused schedule's turns
    need an acquire load (the wait), a release add (the hand-over) and dQ loads that skip L1
    (``.cg``); the atomic one adds dQ by fp32 atomics."""
    import inspect

    from triton.compiler import ASTSource

    from megatron_mtraining.kernels import triton_bwd, triton_fwd

    cfg = triton_fwd.tile_config(block, torch.bfloat16, "bwd")
    fn = triton_bwd._dkdv_kernel
    fused, ordered = schedule != "split", schedule == "fused"
    constexprs = dict(BLOCK=block, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], HEAD_DIM=128, INT64=False,
                      UPCAST=False, DOT_PRECISION="tf32", DOCS=docs, FUSED_DQ=fused, ORDERED=ordered,
                      MAX_S_POW2=32 if ordered else 1, SPIN=True)
    inputs = ("Q", "K", "V", "DO")
    fp32 = ("Lse", "Delta", "DK", "DV", "DQ")
    sig = {}
    for name in inspect.signature(fn.fn).parameters:
        sig[name] = ("constexpr" if name in constexprs else "*bf16" if name in inputs else "*fp32" if name in fp32
                     else "fp32" if name in ("qk_scale", "sm_scale") else "i32" if name.isupper() or name[0] == "s"
                     else "*i32")
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if sig[n].startswith("*") or n.startswith("stride_")}
    launch = triton_bwd.block_gradients_launch(cfg, fused)
    compiled = triton.compile(ASTSource(fn, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                              options=launch)
    ptx = compiled.asm["ptx"]
    return dict(block=block, schedule=schedule, docs=docs, num_warps=compiled.metadata.num_warps,
                wgmma=ptx.count("wgmma.mma_async"), **memory_order_report(ptx, compiled.asm["ttir"]),
                **ptxas_report(ptx))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--triton-dkdv" in argv:  # Triton's key-block kernel, split and fused dQ schedules
        results = [compile_triton_dkdv(block, schedule, docs) for block in (64, 128)
                   for schedule in ("split", "fused", "atomic") for docs in ((False, True) if schedule == "fused"
                                                                             else (False,))]
        for entry in results:
            print(entry)
        if "--out" in argv:
            with open(argv[argv.index("--out") + 1], "w") as f:
                json.dump({"triton": triton.__version__, "configs": results}, f, indent=1)
        return 0
    results = {}
    for kernel, spec in KERNELS.items():
        for change in spec["changes"]:
            cfg = {**spec["base"], **change}
            results[config_name(kernel, cfg)] = compile_config(kernel, cfg)
    for name, entry in results.items():
        print(name, {k: v for k, v in entry.items() if k not in ("config", "kernel")})
    if "--out" in argv:
        with open(argv[argv.index("--out") + 1], "w") as f:
            json.dump({"triton": triton.__version__, "configs": results}, f, indent=1, default=str)
    return 0 if all("error" not in e for e in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
