"""Cross-compile the Hopper forward (``kernels/hopper_fwd.py``) for sm_90a on a machine without a
GPU, and report what ptxas says: the CPU half of its tests (Gluon has no interpreter).

Run as a script in a process without TRITON_INTERPRET (the tests do that in a subprocess):
    python tests/sm90_compile.py [--out compile.json]
Per configuration: compiled or the error, shared memory, warps, wgmma and cp.async counts,
registers, spills, and whether ptxas serialised the wgmma groups (C7513/C7514).
"""

from __future__ import annotations

import itertools
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
from megatron_mtraining.kernels import hopper_fwd  # noqa: E402

# The kernel's arguments in order (pointer element types; "i32" scalars), as the JIT sees them.
POINTERS = {"Q": None, "K": None, "V": None, "Out": None, "Lse": "fp32", "QBlk": "i32", "KBlk": "i32", "KVCnt": "i32",
            "KVIdx": "i32", "ColLimit": "i32", "Cols": "i32", "ColPos": "i64", "Words": "i64", "Diag": "i8",
            "DocStart": "i32", "DocLast": "i32", "ColStart": "i32"}
STRIDES = [f"stride_{t}{s}" for t, axes in (("q", "bhn"), ("k", "bhn"), ("v", "bhn"), ("o", "bhn"), ("l", "bh"))
           for s in axes]
SCALARS = ["HQ", "GROUP", "NQB", "MAX_S", "MAX_V", "N_WORDS"]
CONSTEXPRS = ["BLOCK", "HEAD_DIM", "STAGES", "ACCUMULATE", "INT64", "DOCS", "HAS_COLS", "SMEM_LAYOUT"]

# The configurations the tests require to compile cleanly: the default path (B 64, d 128, bf16,
# columns), and one change at a time from it.
BASE = dict(BLOCK=64, HEAD_DIM=128, ACCUMULATE=False, INT64=False, DOCS=False, HAS_COLS=True, dtype="bf16")
CHANGES = [{}, {"ACCUMULATE": True}, {"DOCS": True}, {"HAS_COLS": False}, {"INT64": True}, {"BLOCK": 128},
           {"HEAD_DIM": 64}, {"dtype": "fp16"}, {"DOCS": True, "ACCUMULATE": True, "INT64": True}]


def config_name(cfg: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in cfg.items() if BASE.get(k) != v) or "default"


def compile_config(cfg: dict) -> dict:
    dtype = cfg["dtype"]
    names = list(POINTERS) + STRIDES + ["qk_scale"] + SCALARS + CONSTEXPRS
    sig = {}
    for name, elem in POINTERS.items():
        if name == "Out" and cfg["ACCUMULATE"]:
            elem = "fp32"  # ring attention merges into an fp32 out
        sig[name] = "*" + (elem or dtype)
    sig.update({s: "i32" for s in STRIDES + SCALARS})
    sig["qk_scale"] = "fp32"
    sig.update({c: "constexpr" for c in CONSTEXPRS})
    constexprs = {k: cfg[k] for k in CONSTEXPRS if k not in ("STAGES", "SMEM_LAYOUT")}
    constexprs["STAGES"] = hopper_fwd.STAGES
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float16
    constexprs["SMEM_LAYOUT"] = hopper_fwd.shared_layout(cfg["HEAD_DIM"], torch_dtype)
    # The JIT's specialisation on a GPU: 16-byte aligned pointers, strides and sizes divisible by 16
    # (row strides of [b, h, n, d] views are multiples of d).
    divisible = [n for n in names if sig[n].startswith("*") or n.startswith("stride_") or n in ("MAX_S", "MAX_V")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    entry = {"config": cfg}
    try:
        kernel = triton.compile(GluonASTSource(hopper_fwd._vs_attn_fwd_sm90_kernel, sig, constexprs, attrs),
                                target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    except Exception as e:  # noqa: BLE001  (reported, the test fails on it)
        entry["error"] = f"{type(e).__name__}: {e}"[:4000]
        return entry
    ptx = kernel.asm["ptx"]
    entry.update(shared_bytes=kernel.metadata.shared, num_warps=kernel.metadata.num_warps,
                 wgmma=ptx.count("wgmma.mma_async"), cp_async=ptx.count("cp.async.cg.shared.global"),
                 cp_async_16=ptx.count("cp.async.cg.shared.global") - ptx.count("0x10, 0x10;") == 0,
                 **ptxas_report(ptx))
    return entry


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    results = {}
    for change in CHANGES:
        cfg = {**BASE, **change}
        results[config_name(cfg)] = compile_config(cfg)
    for name, entry in results.items():
        print(name, {k: v for k, v in entry.items() if k != "config"})
    if "--out" in argv:
        with open(argv[argv.index("--out") + 1], "w") as f:
            json.dump({"triton": triton.__version__, "configs": results}, f, indent=1, default=str)
    return 0 if all("error" not in e for e in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
