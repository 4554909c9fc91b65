#!/usr/bin/env python3
"""MTraining on Transformer Engine layers computes what TE's own context parallelism computes.

    python scripts/check_te_equivalence.py --out te_equivalence.json     # every GPU (2 or more), TE installed

Trains one small GPT (``examples/pretrain_gpt_mtraining.py``, mock data, the same seed and data in
every run) with context parallelism over every GPU, once per run:

* ``te_cp``         Megatron's own attention on TE layers: TE's CP ring (``--cp-comm-type p2p``);
* ``te_cp_a2a``     TE's other CP implementation (``--cp-comm-type a2a``): the same function through
                    other kernels and another split, the control that shows how far two correct bf16
                    implementations drift apart;
* ``mtraining_te``  MTraining with the all-blocks index (``--mtraining-index dense``: exact causal
                    attention through MTraining's striped ring and kernels) on TE layers, with TE's
                    fused RoPE (the rows ``patches.install`` slices for the striped layout);
* ``mtraining_local`` the same on Megatron's local layers with the unfused RoPE, which ties the
                    local spec to TE's.

and compares each run's per-iteration lm loss and grad norm with ``te_cp``'s. The tolerance: the runs
differ only in the order of bf16/fp32 floating-point work inside attention (and in the RoPE kernel),
so their losses agree to a few 1e-4 relative at first and drift apart slowly as the updates differ
in their last bits; ``--loss-rtol`` (default 2e-3) and ``--grad-norm-rtol`` (default 2e-2, a norm
of bf16 gradients is the most sensitive figure) bound that drift over ``--train-iters`` iterations.
A wrong position, mask or layout moves the loss by 1e-2 or more within a few iterations. The control
pair's differences are printed beside the tolerance; RESULT is PASS only when every compared pair
stays inside it on every iteration.

``--study fp8`` asks another question: does MTraining's loss with FP8 GEMMs (``--fp8-format hybrid``,
TE's FP8 linear layers; attention stays bf16) track its bf16 loss as closely as Megatron's own
does? It trains MTraining with its real (vertical-slash) index in bf16 and in FP8, and TE's CP ring
in bf16 and in FP8, and compares each FP8 run with its bf16 twin. TE's pair is the control: FP8
rounding makes any model drift from its bf16 run, and by how much depends on the model and the
data, not on the attention. PASS when MTraining's drift stays within ``--fp8-factor`` (default 1.5)
times TE's at every iteration's running maximum, or within ``--loss-rtol``, whichever is larger,
and every run completes with finite losses.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
sys.path.insert(0, os.path.join(REPO, "scripts"))

from common import json_ready, run_metadata  # noqa: E402
from compare_megatron_runs import parse  # noqa: E402

FP8 = ["--fp8-format", "hybrid", "--fp8-amax-history-len", "16", "--fp8-amax-compute-algo", "max"]
TE_CP = ["--transformer-impl", "transformer_engine", "--cp-comm-type", "p2p"]
MTRAINING_VS = ["--transformer-impl", "transformer_engine", "--mtraining", "--mtraining-top-p", "0.9"]
RUNS = {
    "te_cp": TE_CP,
    "te_cp_a2a": ["--transformer-impl", "transformer_engine", "--cp-comm-type", "a2a"],
    "mtraining_te": ["--transformer-impl", "transformer_engine", "--mtraining", "--mtraining-index", "dense"],
    "mtraining_local": ["--transformer-impl", "local", "--no-rope-fusion", "--no-persist-layer-norm",
                        "--mtraining", "--mtraining-index", "dense"],
    "te_cp_fp8": TE_CP + FP8,
    "mtraining_te_vs": MTRAINING_VS,
    "mtraining_te_vs_fp8": MTRAINING_VS + FP8,
}
# Per study: (run, the run it is compared with, role). "control" pairs inform the tolerance.
STUDIES = {
    "equivalence": [("te_cp_a2a", "te_cp", "control"), ("mtraining_te", "te_cp", "checked"),
                    ("mtraining_local", "te_cp", "checked")],
    "fp8": [("te_cp_fp8", "te_cp", "control"), ("mtraining_te_vs_fp8", "mtraining_te_vs", "checked")],
}


def flags(args, world):
    return [
        "--num-layers", str(args.num_layers), "--hidden-size", "1024", "--ffn-hidden-size", "2816",
        "--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "128",
        "--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear", "--add-qkv-bias",
        "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope", "--rotary-base", "1000000",
        "--seq-length", str(args.seq_length), "--max-position-embeddings", str(args.seq_length),
        "--attention-dropout", "0", "--hidden-dropout", "0", "--no-create-attention-mask-in-dataloader",
        "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", str(args.train_iters),
        "--lr", "1e-4", "--min-lr", "1e-5", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
        "--weight-decay", "0.1", "--clip-grad", "1.0", "--bf16", "--no-gradient-accumulation-fusion",
        "--context-parallel-size", str(world), "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "8192", "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "100000",
        "--seed", "1234",
    ]


def train(name, args, world, log_dir):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           os.path.join(REPO, "examples", "pretrain_gpt_mtraining.py"), *flags(args, world), *RUNS[name]]
    env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="1", OMP_NUM_THREADS="4")
    start = time.time()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
    log = proc.stdout + proc.stderr
    with open(os.path.join(log_dir, f"te_equivalence_{name}.log"), "w") as f:
        f.write(" ".join(cmd) + "\n\n" + log)
    printed = parse(log)
    iterations = {i: (float(loss), float(gnorm)) for i, (loss, gnorm) in printed.items()}
    print(f"run {name}: rc={proc.returncode} {len(iterations)} iterations in {time.time() - start:.0f} s", flush=True)
    if proc.returncode:
        print(log[-2500:], flush=True)
    return {"name": name, "flags": RUNS[name], "returncode": proc.returncode, "iterations": iterations}


def differences(run, reference):
    common = sorted(set(run["iterations"]) & set(reference["iterations"]))
    rel = lambda a, b: abs(a - b) / abs(b) if b else abs(a - b)  # noqa: E731
    loss = [rel(run["iterations"][i][0], reference["iterations"][i][0]) for i in common]
    gnorm = [rel(run["iterations"][i][1], reference["iterations"][i][1]) for i in common]
    return {"iterations": common, "loss_rel": loss, "grad_norm_rel": gnorm,
            "max_loss_rel": max(loss, default=float("nan")), "max_grad_norm_rel": max(gnorm, default=float("nan"))}


def fp8_verdict(checked, control, loss_rtol: float, factor: float) -> dict:
    """``--study fp8``: the checked pair's loss drift against ``factor`` x the control's, compared
    as running maxima (a drift that grows with the updates is compared at the same point)."""
    run_max = lambda xs: [max(xs[: i + 1]) for i in range(len(xs))]  # noqa: E731
    mine, theirs = run_max(checked["loss_rel"]), run_max(control["loss_rel"])
    bounds = [max(loss_rtol, factor * t) for t in theirs]
    worst = max((m / b for m, b in zip(mine, bounds)), default=float("inf"))
    return {"bound_per_iteration": bounds, "worst_share_of_bound": worst,
            "inside": len(mine) == len(theirs) and len(mine) > 0 and worst <= 1.0}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--study", choices=sorted(STUDIES), default="equivalence")
    p.add_argument("--seq-length", type=int, default=16384)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--train-iters", type=int, default=24)
    p.add_argument("--loss-rtol", type=float, default=2e-3)
    p.add_argument("--grad-norm-rtol", type=float, default=2e-2, help="equivalence study only")
    p.add_argument("--fp8-factor", type=float, default=1.5, help="fp8 study: MTraining's drift over TE's, at most")
    p.add_argument("--timeout", type=int, default=240)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    world = torch.cuda.device_count()
    if world < 2:
        raise SystemExit("needs 2 or more GPUs (context parallelism over every GPU)")
    pairs_of_study = STUDIES[args.study]
    names = list(dict.fromkeys(name for pair in pairs_of_study for name in pair[:2]))
    log_dir = os.path.dirname(os.path.abspath(args.out))
    runs = {name: train(name, args, world, log_dir) for name in names}
    ok = all(r["returncode"] == 0 and len(r["iterations"]) == args.train_iters for r in runs.values())
    pairs = {}
    for name, reference, role in pairs_of_study:
        d = differences(runs[name], runs[reference])
        d.update(reference=reference, role=role)
        pairs[name] = d
    for name, reference, role in pairs_of_study:
        d = pairs[name]
        complete = runs[name]["returncode"] == 0 and len(d["iterations"]) == args.train_iters
        if role == "control":
            d["pass"], verdict = None, "[control]"
        elif args.study == "fp8":
            control = next(pairs[n] for n, _, r in pairs_of_study if r == "control")
            d.update(fp8_verdict(d, control, args.loss_rtol, args.fp8_factor))
            d["pass"] = bool(complete and d["inside"])
            verdict = f"{d['worst_share_of_bound']:.2f} of the bound  " + ("ok" if d["pass"] else "FAIL")
        else:
            d["pass"] = bool(complete and d["max_loss_rel"] <= args.loss_rtol
                             and d["max_grad_norm_rel"] <= args.grad_norm_rtol)
            verdict = "ok" if d["pass"] else "FAIL"
        ok = ok and d["pass"] is not False
        print(f"pair {name} vs {reference}: {len(d['iterations'])} iterations, largest relative difference "
              f"lm loss {d['max_loss_rel']:.2e} (tolerance {args.loss_rtol:g}), grad norm "
              f"{d['max_grad_norm_rel']:.2e} (tolerance {args.grad_norm_rtol:g})  {verdict}", flush=True)
    result = {"check": f"te_{args.study}", "meta": run_metadata(torch.device("cuda")), "world_size": world,
              "seq_length": args.seq_length, "num_layers": args.num_layers, "train_iters": args.train_iters,
              "tolerance": {"loss_rtol": args.loss_rtol, "grad_norm_rtol": args.grad_norm_rtol,
                            "fp8_factor": args.fp8_factor},
              "runs": list(runs.values()), "pairs": pairs, "pass": ok}
    with open(args.out, "w") as f:
        json.dump(json_ready(result), f, indent=1)
    print("RESULT:", "PASS" if ok else "FAIL")
    print(f"wrote {args.out}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
