"""Cross-compile the Hopper kernels (``kernels/hopper_fwd.py``, ``kernels/hopper_bwd.py``) for sm_90a
on a machine without a GPU, and report what ptxas says: the CPU half of their tests (Gluon has no
interpreter).

Run as a script in a process without TRITON_INTERPRET (the tests do that in a subprocess):
    python tests/sm90_compile.py [--out compile.json]
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
from megatron_mtraining.kernels import hopper_bwd, hopper_common, hopper_fwd  # noqa: E402


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
        fn=hopper_fwd._vs_attn_fwd_pingpong_kernel,
        args={"Q": None, "K": None, "V": None, "Out": "Out", "Lse": "*fp32", "QBlk": "*i32", "KBlk": "*i32",
              "KVCnt": "*i32", "KVIdx": "*i32", "ColLimit": "*i32", "Cols": "*i32", "ColPos": "*i64",
              "Words": "*i64", "Diag": "*i8", "DocStart": "*i32", "DocLast": "*i32", "ColStart": "*i32",
              **{s: "i32" for s in _strides("q", "k", "v", "o", "l")}, "qk_scale": "fp32",
              **{s: "i32" for s in ("HQ", "GROUP", "NQB", "MAX_S", "MAX_V", "N_WORDS")},
              **{c: "constexpr" for c in ("BLOCK", "HEAD_DIM", "STAGES", "CHUNK", "ACCUMULATE", "INT64", "DOCS",
                                          "HAS_COLS", "SMEM_LAYOUT")}},
        base=dict(BLOCK=128, HEAD_DIM=128, STAGES=hopper_fwd.PINGPONG_STAGES, CHUNK=hopper_fwd.CHUNK,
                  ACCUMULATE=False, INT64=False, DOCS=False, HAS_COLS=True),  # B = 128 only
        options={"maxnreg": 168},
        changes=[{}, {"ACCUMULATE": True}, {"DOCS": True}, {"HAS_COLS": False}, {"INT64": True}, {"HEAD_DIM": 64},
                 {"dtype": "fp16"}, {"DOCS": True, "ACCUMULATE": True, "INT64": True}]),
    "dkdv_col": dict(
        fn=hopper_bwd._dkdv_col_sm90_kernel,
        args={"Q": None, "K": None, "V": None, "DO": None, "Lse": "*fp32", "Delta": "*fp32", "DKP": "*fp32",
              "DVP": "*fp32", "QBlk": "*i32", "ColCnt": "*i32", "Cols": "*i32", "ColPos": "*i64", "Words": "*i64",
              "HeadDiag": "*i8", "QFirst": "*i32", "QEnd": "*i32", "DocStart": "*i32",
              **{s: "i32" for s in _strides("q", "k", "v", "o", "l")}, "qk_scale": "fp32", "sm_scale": "fp32",
              **{s: "i32" for s in ("HQ", "GROUP", "NQB", "MAX_V", "N_TILES", "N_WORDS", "SPLITS")},
              **{c: "constexpr" for c in ("BLOCK", "HEAD_DIM", "INT64", "DOCS", "SMEM_LAYOUT")}},
        base=dict(BLOCK=64, HEAD_DIM=128, INT64=False, DOCS=False),
        changes=[{}, {"DOCS": True}, {"INT64": True}, {"BLOCK": 128}, {"HEAD_DIM": 64}, {"dtype": "fp16"}]),
    "dkdv": dict(
        fn=hopper_bwd._dkdv_sm90_kernel,
        args={"Q": None, "K": None, "V": None, "DO": None, "Lse": "*fp32", "Delta": "*fp32", "DK": "*fp32",
              "DV": "*fp32", "QBlk": "*i32", "KBlk": "*i32", "QCnt": "*i32", "QIdx": "*i32", "DocStart": "*i32",
              "DocLast": "*i32", **{s: "i32" for s in _strides("q", "k", "v", "o", "l", "g")}, "qk_scale": "fp32",
              "sm_scale": "fp32", **{s: "i32" for s in ("HQ", "HKV", "GROUP", "NKB", "MAX_S")},
              **{c: "constexpr" for c in ("BLOCK", "KEYS", "HEAD_DIM", "HEADS", "INT64", "DOCS", "SMEM_LAYOUT")}},
        base=dict(BLOCK=128, KEYS=128, HEAD_DIM=128, HEADS=8, INT64=False, DOCS=False),  # B = 128 only
        changes=[{}, {"DOCS": True}, {"INT64": True}, {"HEAD_DIM": 64}, {"dtype": "fp16"}, {"HEADS": 1}]),
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
DIVISIBLE = ("MAX_S", "MAX_V")


def num_warps(cfg: dict) -> int:
    """A warpgroup per 64 rows of the program (KEYS or ROWS; 64 where the kernel has neither).
    The warp-specialised ping-pong forward launches 4 (its default partition) and adds its workers."""
    return cfg.get("KEYS", cfg.get("ROWS", 64)) // 16


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
    constexprs["SMEM_LAYOUT"] = hopper_common.shared_layout(cfg["HEAD_DIM"], torch.bfloat16 if dtype == "bf16"
                                                         else torch.float16)
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
    entry.update(shared_bytes=compiled.metadata.shared, num_warps=compiled.metadata.num_warps,
                 wgmma=ptx.count("wgmma.mma_async"), cp_async=copies,
                 cp_async_16=copies > 0 and copies == ptx.count("0x10, 0x10;"), bar_sync=ptx.count("bar.sync"),
                 **ptxas_report(ptx))
    return entry


def config_name(kernel: str, cfg: dict) -> str:
    base = KERNELS[kernel]["base"]
    changed = ",".join(f"{k}={v}" for k, v in cfg.items() if base.get(k, "bf16" if k == "dtype" else None) != v)
    return f"{kernel}:{changed or 'default'}"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
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
