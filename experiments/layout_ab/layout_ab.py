"""Experiment (issue 29): strided q/k/v in the kernels against the copies that avoid them.
See README.md beside this file for the question and the decision rule."""

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [HERE, REPO, os.path.join(REPO, "benchmarks")]

from common import fixed_vs_index, median, run_metadata, time_ms  # noqa: E402
from permute import copy_rows  # noqa: E402

import megatron_mtraining as mm  # noqa: E402


def megatron_view(x: torch.Tensor) -> torch.Tensor:
    """``x`` [b, h, s, d] as Megatron's layer hands it over: a view of a contiguous [s, b, h, d]."""
    return x.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)


def check(device) -> dict:
    """copy_rows == .contiguous(), bit for bit, both ways, ragged s (under the interpreter on CPU)."""
    g = torch.Generator().manual_seed(0)
    results = {}
    for b, h, s, d in ((1, 3, 70, 16), (2, 2, 64, 32)):
        x = torch.randn(b, h, s, d, generator=g).to(device, torch.bfloat16)
        view = megatron_view(x)
        results[f"to bhsd {b}x{h}x{s}x{d}"] = bool(torch.equal(copy_rows(view), view.contiguous()))
        back = torch.empty(s, b, h, d, dtype=x.dtype, device=device).permute(1, 2, 0, 3)
        copy_rows(x, back)
        results[f"to sbhd {b}x{h}x{s}x{d}"] = bool(torch.equal(back.permute(2, 0, 1, 3), x.permute(2, 0, 1, 3)))
    return results


def gpu_run(args) -> dict:
    device = torch.device("cuda")
    n, hq, hkv, d = args.seq_len, 16, 2, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(1, h, n, d, device=device, generator=g, dtype=torch.bfloat16) for h in (hq, hkv, hkv, hq))
    index = fixed_vs_index(1, hq, n, 64, 0.05, device, seed=0)

    def fwd_bwd(q, k, v):
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        out = mm.sparse_attention(q, k, v, index)
        torch.autograd.grad(out, (q, k, v), do)

    rows = {}
    for name, inputs in (("contiguous", (q, k, v)), ("megatron_views", tuple(megatron_view(x) for x in (q, k, v)))):
        rows[f"fwd+bwd {name}"] = median(time_ms(fwd_bwd, [inputs], device, warmup=3, reps=args.reps))
    for what, x in (("q", q), ("k", k)):
        view = megatron_view(x)
        rows[f"copy {what} torch .contiguous()"] = median(time_ms(lambda t: t.contiguous(), [(view,)], device,
                                                                  warmup=3, reps=args.reps))
        rows[f"copy {what} triton copy_rows"] = median(time_ms(copy_rows, [(view,)], device, warmup=3, reps=args.reps))
        nbytes = 2 * x.numel() * x.element_size()
        for key in [r for r in rows if r.startswith(f"copy {what} ")]:
            rows[key.replace("copy", "TB/s")] = nbytes / (rows[key] * 1e-3) / 1e12
    return {"meta": run_metadata(device), "seq_len": n, "heads": [hq, hkv], "head_dim": d, "density": 0.05,
            "ms": rows, "check": check(device)}


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--check", action="store_true", help="only the permute kernel's check (CPU: TRITON_INTERPRET=1)")
    p.add_argument("--seq-len", type=int, default=131072)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        p.error("no GPU: run the check under Triton's interpreter (TRITON_INTERPRET=1 ... --check)")
    if args.check or not torch.cuda.is_available():
        result = check(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        print(result)
        return 0 if all(result.values()) else 1
    result = gpu_run(args)
    for key, value in result["ms"].items():
        print(f"{key:40s} {value:9.3f}")
    print(result["check"])
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
