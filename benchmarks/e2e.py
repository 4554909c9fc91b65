"""End-to-end Megatron training: MTraining against Megatron's own context parallelism, tokens/s.

Runs ``examples/pretrain_gpt_mtraining.py`` (``megatron.training.pretrain``, mock data) with
torchrun on every GPU of the machine, context parallel over all of them, once per run in ``--runs``
from the same settings. On Transformer Engine layers (``--transformer-impl auto``: TE when it
imports, the configuration users run) the baseline is Megatron itself:

* ``te_cp``: Transformer Engine's own CP attention (``--cp-comm-type p2p``, cuDNN fused
  attention; plain TE attention on one GPU), no ``--mtraining``;
* ``mtraining``: MTraining (``vs`` index, top-p 0.9) in place of TE's core attention.

Without TE (``--transformer-impl local``) Megatron has no CP attention, and the baseline is
``dense``: exact causal attention with cuDNN through MTraining's ring (the zigzag ring over CP, SDPA
on one GPU; ``--mtraining-index dense --mtraining-layout zigzag --no-mtraining-deterministic``).
``--runs`` can add ``dense_sparse_kernels`` (the dense index through MTraining's own kernels) and
``mtraining_b128`` (128-token index blocks). ``--fp8`` adds TE's FP8 linear layers to every run
(``--fp8-format hybrid``; attention stays bf16 on both sides).

Model: Qwen2.5-3B attention and MLP shapes (hidden 2048, FFN 11008, 16 query heads / 2 KV groups,
head dim 128, QKV bias, SwiGLU, RMSNorm) with fewer layers and a small vocabulary (flags below).
Parses Megatron's "elapsed time per iteration" lines, drops the warm-up iterations, and writes one
JSON with every run and each run's speedup over the baseline. ``--profile-iteration N`` also traces
iteration N on rank 0 (Megatron's ``--profile --use-pytorch-profiler``; that iteration is left out
of the mean) and records where its GPU time went (``gpu_time_breakdown``: MTraining's kernels,
dense attention, GEMMs, NCCL, the rest).

    python benchmarks/e2e.py --seq-length 262144 --num-layers 4 --train-iters 8 --out e2e.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import device_slug, json_ready, run_metadata  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ITERATION_MS = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")
TELEMETRY_LINE = re.compile(r"\[MTraining\] iteration (\d+) \|")


def telemetry_interval(flags) -> int:
    """The run's ``--mtraining-log-interval`` (0: no telemetry); as argparse reads it, the last one
    given, as ``--flag N`` or ``--flag=N``."""
    interval, flags = 0, list(flags)
    for i, flag in enumerate(flags):
        if flag == "--mtraining-log-interval" and i + 1 < len(flags):
            interval = int(flags[i + 1])
        elif flag.startswith("--mtraining-log-interval="):
            interval = int(flag.split("=", 1)[1])
    return interval


def timed_iterations(times, log, warmup_iters, profile_iteration, log_interval=0):
    """(mean over the plain training iterations, the iterations left out and why). Left out: the
    warm-up, the iterations MTraining's telemetry recorded (``--mtraining-log-interval``: CUDA-event
    timing and one exchange across ranks, a diagnostic a user runs every N iterations: every
    multiple of ``log_interval``, and any iteration with a telemetry line; a run that ends on one
    never prints its line, which comes at the next iteration's first forward), and with
    ``--profile-iteration`` P: P - 1 (Megatron's ``torch.profiler.schedule`` makes it the profiler's
    warm-up: tracing is on and its events are dropped), P itself (traced) and P + 1 (the profiler
    writes its trace)."""
    excluded = {i: "warm-up" for i in range(1, warmup_iters + 1)}
    recorded = {int(i) for i in TELEMETRY_LINE.findall(log)}
    if log_interval:
        recorded.update(range(log_interval, len(times) + 1, log_interval))
    excluded.update({i: "telemetry" for i in sorted(recorded) if i not in excluded})
    if profile_iteration:
        if profile_iteration > 1:
            excluded[profile_iteration - 1] = "profiler warm-up"
        excluded.update({profile_iteration: "profiled", profile_iteration + 1: "trace export"})
    measured = [t for i, t in enumerate(times, start=1) if i not in excluded]
    return (sum(measured) / len(measured) if measured else None), {i: excluded[i] for i in sorted(excluded)
                                                                    if i <= len(times)}


def transformer_engine_version():
    """TE's version when ``transformer_engine.pytorch`` imports, else None. Asked of a child
    python: importing TE here loads its own cuDNN into this process, which then fails torch's
    cuDNN version check in ``run_metadata`` (seen with TE 2.20.2 on the GPU machines)."""
    proc = subprocess.run([sys.executable, "-c", "import transformer_engine as te, transformer_engine.pytorch; "
                           "print(te.__version__)"], capture_output=True, text=True)
    return proc.stdout.strip().splitlines()[-1] if proc.returncode == 0 and proc.stdout.strip() else None


def resolve_transformer_impl(requested: str, te_version) -> str:
    if requested == "auto":
        return "transformer_engine" if te_version else "local"
    if requested == "transformer_engine" and not te_version:
        raise SystemExit("--transformer-impl transformer_engine: Transformer Engine does not import here")
    return requested


def model_flags(args):
    if args.transformer_impl == "transformer_engine":
        impl = ["--transformer-impl", "transformer_engine"]  # Megatron's defaults: fused RoPE, TE layers
    else:
        impl = ["--transformer-impl", "local", "--no-rope-fusion",  # the fused RoPE needs Transformer Engine
                "--no-persist-layer-norm"]  # the persistent LayerNorm kernel needs apex
    return [
        "--num-layers", str(args.num_layers), "--hidden-size", "2048", "--ffn-hidden-size", "11008",
        "--num-attention-heads", "16", "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "128",
        "--swiglu", "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--disable-bias-linear",
        "--add-qkv-bias", "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope",
        "--rotary-base", "1000000", "--seq-length", str(args.seq_length),
        "--max-position-embeddings", str(args.seq_length), "--attention-dropout", "0", "--hidden-dropout", "0",
        *impl, "--no-create-attention-mask-in-dataloader",  # causal attention: no [s, s] mask per sample
    ]


def training_flags(args, world):
    flags = [
        "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", str(args.train_iters),
        "--lr", "3e-4", "--min-lr", "3e-5", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1",
        "--weight-decay", "0.1", "--clip-grad", "1.0", "--bf16", "--no-gradient-accumulation-fusion",
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
        "--context-parallel-size", str(world), "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", str(args.vocab_size), "--log-interval", "1", "--eval-iters", "0",
        "--eval-interval", "100000", "--seed", "1234",
    ]
    if args.recompute:
        flags += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    if args.fp8:  # TE's FP8 linear layers; attention stays bf16 on both sides
        flags += FP8_FLAGS
    return flags


FP8_FLAGS = ["--fp8-format", "hybrid", "--fp8-amax-history-len", "16", "--fp8-amax-compute-algo", "max"]


# Kernel-name fragments of each category of GPU time, checked in this order (ours first: their
# names contain "attn" too). MTraining's: the attention and approximator kernels and the plan's.
KERNEL_CATEGORIES = (
    ("mtraining", ("_vs_attn", "_dq_", "_dkdv", "_delta_kernel", "_column_words", "_vs_masses", "_row_partials",
                   "mtraining::")),
    ("dense_attention", ("cudnn", "fmha", "flash", "attn", "sdpa", "softmax")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "wgmma", "sm90_")),
    ("nccl", ("nccl",)),
)


def kernel_category(name: str) -> str:
    lowered = name.lower()
    for category, fragments in KERNEL_CATEGORIES:
        if any(fragment.lower() in lowered for fragment in fragments):
            return category
    return "other"


def gpu_time_breakdown(trace_path: str, top: int = 30) -> dict:
    """GPU kernel milliseconds by category (``KERNEL_CATEGORIES``) and the top kernels, from a
    torch.profiler chrome trace (.json or .json.gz) of one iteration; memcpy/memset apart. Also the
    GPU time covered by MTraining's profiler ranges (``mtraining::approximator``, ``mtraining::ring
    forward`` / ``backward``) per name: what the approximator costs on the GPU, its sorts and
    collectives included, which the kernel names alone do not tell. The profiler writes a range once
    per stream it launched on (compute, NCCL's), so the spans are merged before they are summed."""
    import gzip

    opener = gzip.open if trace_path.endswith(".gz") else open
    with opener(trace_path, "rt") as f:
        events = json.load(f).get("traceEvents", [])
    by_category, by_kernel, by_range, span = {}, {}, {}, [float("inf"), 0.0]
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "gpu_user_annotation" and e.get("name", "").startswith("mtraining::"):
            by_range.setdefault(e["name"], []).append((e["ts"], e["ts"] + e.get("dur", 0)))
            continue
        if e.get("ph") != "X" or e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        ms = e.get("dur", 0) / 1e3
        name = e.get("name", "")
        category = kernel_category(name) if e["cat"] == "kernel" else "memcpy_memset"
        by_category[category] = by_category.get(category, 0.0) + ms
        by_kernel[name] = by_kernel.get(name, 0.0) + ms
        span = [min(span[0], e["ts"]), max(span[1], e["ts"] + e.get("dur", 0))]
    busy = sum(by_category.values())
    return {"gpu_busy_ms": busy, "gpu_span_ms": (span[1] - span[0]) / 1e3 if busy else 0.0,
            "by_category_ms": dict(sorted(by_category.items(), key=lambda kv: -kv[1])),
            "top_kernels_ms": dict(sorted(by_kernel.items(), key=lambda kv: -kv[1])[:top]),
            "mtraining_ranges_ms": {name: covered_ms(spans) for name, spans in sorted(by_range.items())}}


def covered_ms(spans) -> float:
    """Milliseconds covered by the union of ``(start, end)`` spans in microseconds."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total / 1e3


def profile_flags(args, trace_dir: str):
    """Megatron's flags that trace iteration ``args.profile_iteration`` on rank 0; the trace lands
    in ``trace_dir``/torch_profile/rank-0.json.gz (Megatron writes it beside the tensorboard dir)."""
    return ["--profile", "--use-pytorch-profiler", "--profile-ranks", "0",
            "--profile-step-start", str(args.profile_iteration), "--profile-step-end", str(args.profile_iteration + 1),
            "--tensorboard-dir", os.path.join(trace_dir, "tensorboard")]


def run_one(name, extra, args, world, log_dir):
    import tempfile

    trace_dir = tempfile.mkdtemp(prefix=f"e2e_{name}_") if args.profile_iteration else None
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           os.path.join(REPO, "examples", "pretrain_gpt_mtraining.py"),
           *model_flags(args), *training_flags(args, world), *(profile_flags(args, trace_dir) if trace_dir else []),
           *extra]
    env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="1", OMP_NUM_THREADS="4")
    start = time.time()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
    log = proc.stdout + proc.stderr
    with open(os.path.join(log_dir, f"e2e_{name}.log"), "w") as f:
        f.write(" ".join(cmd) + "\n\n" + log)
    times = [float(x) for x in ITERATION_MS.findall(log)]
    mean_ms, excluded = timed_iterations(times, log, args.warmup_iters, args.profile_iteration,
                                         telemetry_interval(extra))
    row = {"name": name, "flags": extra, "returncode": proc.returncode, "wall_s": time.time() - start,
           "iteration_ms": times, "excluded_iterations": excluded}
    if proc.returncode == 0 and mean_ms:
        row.update(mean_iteration_ms=mean_ms, tokens_per_s=args.seq_length / (mean_ms / 1e3))
    if trace_dir:
        trace = os.path.join(trace_dir, "torch_profile", "rank-0.json.gz")
        if os.path.exists(trace):
            row["profiled_iteration"] = args.profile_iteration
            row["gpu_time_breakdown"] = gpu_time_breakdown(trace)
            breakdown = row["gpu_time_breakdown"]
            print(f"{name}: iteration {args.profile_iteration} GPU ms by category",
                  {k: round(v, 1) for k, v in breakdown["by_category_ms"].items()},
                  "| MTraining's ranges", {k: round(v, 1) for k, v in breakdown["mtraining_ranges_ms"].items()},
                  flush=True)
        else:
            row["gpu_time_breakdown_error"] = f"no trace at {trace}"
    print(f"{name}: rc={proc.returncode} iteration ms {['%.0f' % t for t in times]}", flush=True)
    if proc.returncode != 0:
        print(log[-3000:], flush=True)
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-length", type=int, default=262144)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--train-iters", type=int, default=8)
    p.add_argument("--warmup-iters", type=int, default=3, help="first iterations left out of the mean")
    p.add_argument("--recompute", action="store_true")
    p.add_argument("--timeout", type=int, default=300)
    p.add_argument("--runs", default=None,
                   help="comma-separated runs (default: te_cp,mtraining on TE layers, mtraining,dense on local ones)")
    p.add_argument("--transformer-impl", choices=("auto", "transformer_engine", "local"), default="auto",
                   help="auto: Transformer Engine when it imports (the configuration users run), else local")
    p.add_argument("--fp8", action="store_true", help="TE's FP8 linear layers in every run (attention bf16)")
    p.add_argument("--profile-iteration", type=int, default=0,
                   help="trace this iteration on rank 0 and record its GPU time by category (0: off)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.profile_iteration and args.profile_iteration >= args.train_iters:
        # The profiler writes its trace during the next iteration; a traced last iteration never gets
        # written, and every process then died at exit (SIGSEGV, 4 H200, ad8c1fa).
        p.error(f"--profile-iteration {args.profile_iteration} needs a later iteration to write its trace: "
                f"at most --train-iters - 1 = {args.train_iters - 1}")
    te_version = transformer_engine_version()
    args.transformer_impl = resolve_transformer_impl(args.transformer_impl, te_version)
    te = args.transformer_impl == "transformer_engine"
    if args.fp8 and not te:
        raise SystemExit("--fp8 needs Transformer Engine layers (TE's FP8 linear layers)")
    if args.runs is None:
        args.runs = "te_cp,mtraining" if te else "mtraining,dense"
    world = torch.cuda.device_count()
    variants = {"te_cp": ["--cp-comm-type", "p2p"],
                # TE's hierarchical CP: all-to-all inside pairs of GPUs, p2p between them (its choice across
                # nodes); needs an even CP size and the 2 KV heads split over the a2a pairs.
                "te_cp_a2a_p2p": ["--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2",
                                  str(max(world // 2, 1))],
                "mtraining": ["--mtraining", "--mtraining-top-p", "0.9", "--mtraining-log-interval", "5"],
                "dense": ["--mtraining", "--mtraining-index", "dense", "--mtraining-layout", "zigzag",
                          "--no-mtraining-deterministic"],
                "dense_sparse_kernels": ["--mtraining", "--mtraining-index", "dense"],
                "mtraining_b128": ["--mtraining", "--mtraining-top-p", "0.9", "--mtraining-log-interval", "5",
                                   "--mtraining-block-size", "128"]}
    unknown = [name for name in args.runs.split(",") if name not in variants]
    if unknown:
        raise SystemExit(f"--runs: unknown {unknown}; choose from {sorted(variants)}")
    if {"te_cp", "te_cp_a2a_p2p"} & set(args.runs.split(",")) and not te:
        raise SystemExit("--runs te_cp / te_cp_a2a_p2p are Transformer Engine's context parallelism: "
                         "they need TE layers")
    if world < 1:
        raise SystemExit("benchmarks/e2e.py needs GPUs (megatron.training is CUDA-only)")
    out = args.out or os.path.join(REPO, "benchmarks", "results", f"e2e_{device_slug(torch.device('cuda'))}_{world}gpu.json")
    log_dir = os.path.dirname(os.path.abspath(out))
    rows = [run_one(name, variants[name], args, world, log_dir) for name in args.runs.split(",")]
    by_name = {r["name"]: r for r in rows}
    result = {"benchmark": "e2e", "meta": run_metadata(torch.device("cuda")), "world_size": world,
              "model": {"num_layers": args.num_layers, "hidden": 2048, "ffn": 11008, "heads": 16, "kv_groups": 2,
                        "head_dim": 128, "vocab": args.vocab_size, "shape_of": "Qwen2.5-3B (fewer layers)"},
              "seq_length": args.seq_length, "recompute": args.recompute, "fp8": args.fp8,
              "transformer_impl": args.transformer_impl, "transformer_engine": te_version,
              "runs": rows}
    baseline = "te_cp" if "te_cp" in by_name else "dense"
    if by_name.get(baseline, {}).get("tokens_per_s"):  # every run against the baseline
        result["baseline"] = baseline
        result["speedups"] = {r["name"]: r["tokens_per_s"] / by_name[baseline]["tokens_per_s"]
                              for r in rows if r.get("tokens_per_s")}
        print(f"speedups over {baseline}:", {k: round(v, 2) for k, v in result["speedups"].items()})
        if "mtraining" in result["speedups"]:
            result["e2e_speedup"] = result["speedups"]["mtraining"]
            print(f"tokens/s: MTraining {by_name['mtraining']['tokens_per_s']:.0f}, {baseline} "
                  f"{by_name[baseline]['tokens_per_s']:.0f}: speedup {result['e2e_speedup']:.2f}x")
    with open(out, "w") as f:
        json.dump(json_ready(result), f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
