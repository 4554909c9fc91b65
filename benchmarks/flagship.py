"""The flagship launchers as shipped: full-depth models, measured against the planner's prediction.

Runs ``examples/pretrain_qwen2.5_3b_512k_mtraining.sh`` or ``examples/pretrain_llama3.1_8b_512k_mtraining.sh``
on every GPU of the machine, changing only what their headers document (``SEQ_LENGTH``,
``TRAIN_ITERS``, ``TP``, ``CHECKPOINT_PATH``, mock data), once per run of ``--runs``:

* ``mtraining``: the launcher as shipped (MTraining attention);
* ``te_cp``: the same launcher with ``MTRAINING=0`` (Megatron's own context-parallel attention,
  Transformer Engine's p2p ring), the baseline;
* a run name followed by ``+`` and Megatron flags sets that run's own settings (appended to the
  launcher's, so they win), e.g. ``mtraining+--recompute-method block --recompute-num-layers 29``.

Per run it records the iteration times (warm-up and telemetry iterations left out), tokens/s and
tokens/s per GPU, executed TFLOP/s per GPU (the GEMMs, and attention on its active pairs: the
index density from the run's telemetry, 1 for dense) and its share of the GPU's bf16 dense peak,
the peak memory per GPU (allocated and reserved, the largest over ranks, from Megatron's memory
report), and the planner's prediction of the same run (``python -m megatron_mtraining.plan`` on the
run's own Megatron flags and measured density), with the errors of both. ``--profile-iteration N``
traces iteration N on rank 0 and records where its GPU time went.

    python benchmarks/flagship.py --model qwen2.5_3b --seq-length 262144 --train-iters 12
    python benchmarks/flagship.py --model qwen2.5_3b --seq-length 65536 --runs mtraining \\
        --runs "mtraining+--recompute-method block --recompute-num-layers 34"

The parsing (``parse_log``, ``executed_flops``) runs without a GPU; the runs need one.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron_mtraining.plan import cli as plan_cli  # noqa: E402
from megatron_mtraining.plan.model import ModelShape  # noqa: E402

LAUNCHERS = {"qwen2.5_3b": "pretrain_qwen2.5_3b_512k_mtraining.sh",
             "llama3.1_8b": "pretrain_llama3.1_8b_512k_mtraining.sh"}
ITERATION_MS = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")
MEMORY = re.compile(r"\[Rank (\d+)\] \(after \d+ iterations\) memory \(MB\) \| allocated: ([0-9.]+) \| "
                    r"max allocated: ([0-9.]+) \| reserved: ([0-9.]+) \| max reserved: ([0-9.]+)")
DENSITY = re.compile(r"\[MTraining\] iteration (\d+) \| density ([0-9.]+)")
LOSS = re.compile(r" iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)")
PLAN_LINE = re.compile(r"^\[mtraining plan\] .*$", re.M)
# bf16 dense peak of the GPUs the profiles cover (SXM parts), TFLOP/s.
BF16_PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4}


def parse_log(text: str, warmup_iters: int = 2) -> Dict:
    """Iteration times, losses, memory per rank and telemetry density of one Megatron run's log."""
    times = [float(x) for x in ITERATION_MS.findall(text)]
    telemetry = {int(i): float(d) for i, d in DENSITY.findall(text)}
    skip = set(range(1, warmup_iters + 1)) | set(telemetry)
    measured = [t for i, t in enumerate(times, start=1) if i not in skip]
    memory: Dict[int, Dict[str, float]] = {}
    for rank, allocated, max_allocated, reserved, max_reserved in MEMORY.findall(text):
        m = memory.setdefault(int(rank), {"max_allocated_mib": 0.0, "max_reserved_mib": 0.0})
        m["max_allocated_mib"] = max(m["max_allocated_mib"], float(max_allocated))
        m["max_reserved_mib"] = max(m["max_reserved_mib"], float(max_reserved))
    plan_line = PLAN_LINE.search(text)
    return {
        "iteration_ms": times, "excluded_iterations": sorted(i for i in skip if i <= len(times)),
        "mean_iteration_ms": sum(measured) / len(measured) if measured else None,
        "losses": {int(i): float(v) for i, v in LOSS.findall(text)},
        "memory_per_rank": memory,
        "peak_allocated_gib": max((m["max_allocated_mib"] / 1024 for m in memory.values()), default=None),
        "peak_reserved_gib": max((m["max_reserved_mib"] / 1024 for m in memory.values()), default=None),
        "density": telemetry[max(telemetry)] if telemetry else None,
        "planner_line": plan_line.group(0) if plan_line else None,
    }


def _flag(argv: List[str], name: str, default=None):
    value = default
    for i, token in enumerate(argv):
        if token == name and i + 1 < len(argv):
            value = argv[i + 1]
    return value


def shape_of(argv: List[str]) -> ModelShape:
    return ModelShape(hidden=int(_flag(argv, "--hidden-size")), heads=int(_flag(argv, "--num-attention-heads")),
                      kv_groups=int(_flag(argv, "--num-query-groups")), head_dim=int(_flag(argv, "--kv-channels")),
                      layers=int(_flag(argv, "--num-layers")), ffn=int(_flag(argv, "--ffn-hidden-size")),
                      vocab=int(_flag(argv, "--vocab-size")), qkv_bias="--add-qkv-bias" in argv,
                      untied_embeddings="--untie-embeddings-and-output-weights" in argv)


def recomputed_layers(argv: List[str], layers: int) -> int:
    if _flag(argv, "--recompute-granularity") != "full":
        return 0
    if _flag(argv, "--recompute-method") == "block":
        return int(_flag(argv, "--recompute-num-layers", 1))
    return layers


def executed_flops(argv: List[str], density: float) -> Dict[str, float]:
    """FLOPs of one step: the GEMMs (6 per parameter and token), attention on its active pairs
    (4 d per pair and head forward, 3.5x that forward and backward), and the recomputed layers'
    forwards again ("executed"); "model" leaves the recompute out."""
    shape, seq = shape_of(argv), int(_flag(argv, "--seq-length"))
    pairs = density * seq * (seq + 1) / 2
    attention_fwd = 4 * shape.head_dim * shape.heads * pairs
    layer_gemm = shape.layer_gemm_flops_per_token() * seq
    model = shape.layers * (layer_gemm + 3.5 * attention_fwd) + shape.head_flops_per_token() * seq
    extra = recomputed_layers(argv, shape.layers) * (layer_gemm / 3 + attention_fwd)
    return {"model": model, "executed": model + extra}


def megatron_argv(launcher: str, env: Dict[str, str], extra: List[str]) -> List[str]:
    """The Megatron flags the launcher runs with (its DRY_RUN command after pretrain_gpt.py)."""
    proc = subprocess.run(["bash", os.path.join(REPO, "examples", launcher), *extra],
                          env={**env, "DRY_RUN": "1", "PLAN_PROFILE": "none"}, capture_output=True, text=True,
                          timeout=120)
    if proc.returncode:
        raise SystemExit(f"{launcher} DRY_RUN failed:\n{proc.stderr}")
    command = shlex.split(proc.stdout)
    start = next(i for i, token in enumerate(command) if token.endswith("pretrain_gpt.py"))
    return command[start + 1:]


def predict(argv: List[str], profile: str, gpus_per_node: int, density: Optional[float]) -> Dict:
    """The planner's prediction of the run as configured (``configured``)."""
    plan_args = [*argv, "--gpu-type", profile, "--gpus-per-node", str(gpus_per_node)]
    if density is not None and "--mtraining" in argv:
        plan_args += ["--density", f"{density:.6f}"]
    result = plan_cli.run(plan_args)
    run = result["configured"]
    rec = result["recommendation"]
    return {"tokens_per_s": run["tokens_per_s"], "step_ms": run["step_ms"], "peak_gib": run["memory"]["peak_gib"],
            "fits": run["fits"], "memory_components_gib": run["memory"]["components_gib"],
            "recommended": None if rec is None else {k: rec[k] for k in ("configuration", "tp", "recompute",
                                                                         "tokens_per_s", "megatron_flags")}}


def run_one(name: str, flags: List[str], args, world: int, log_dir: str, profile: Optional[str]) -> Dict:
    launcher = LAUNCHERS[args.model]
    env = dict(os.environ, MEGATRON_LM=args.megatron_lm, GPUS_PER_NODE=str(world), SEQ_LENGTH=str(args.seq_length),
               TRAIN_ITERS=str(args.train_iters), TP=str(args.tp), MTRAINING="0" if name.startswith("te_cp") else "1",
               CHECKPOINT_PATH=tempfile.mkdtemp(prefix=f"flagship_{name.split('+')[0]}_"), LOG_INTERVAL="1",
               **({"GLOBAL_BATCH_SIZE": str(args.global_batch_size)} if args.global_batch_size else {}),
               MTRAINING_LOG_INTERVAL=str(args.telemetry_interval), OMP_NUM_THREADS="4")
    if profile:
        env["PLAN_PROFILE"] = profile
    extra = list(flags)
    trace_dir = None
    if args.profile_iteration:
        trace_dir = tempfile.mkdtemp(prefix="flagship_trace_")
        extra += ["--profile", "--use-pytorch-profiler", "--profile-ranks", "0", "--profile-step-start",
                  str(args.profile_iteration), "--profile-step-end", str(args.profile_iteration + 1),
                  "--tensorboard-dir", os.path.join(trace_dir, "tensorboard")]
    argv = megatron_argv(launcher, env, extra)
    start = time.time()
    try:
        proc = subprocess.run(["bash", os.path.join(REPO, "examples", launcher), *extra], env=env, cwd=REPO,
                              capture_output=True, text=True, timeout=args.timeout)
    finally:
        # Megatron saves a checkpoint at the end of training whatever --save-interval says (the
        # launchers pass --save): tens of GB per run (14 bytes per parameter), which the next runs
        # would otherwise pile up on the machine's disk.
        shutil.rmtree(env["CHECKPOINT_PATH"], ignore_errors=True)
    log = proc.stdout + proc.stderr
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:80]
    with open(os.path.join(log_dir, f"flagship_{args.model}_{slug}.log"), "w") as fh:
        fh.write(log)
    parsed = parse_log(log, args.warmup_iters)
    if args.profile_iteration:
        parsed["excluded_iterations"] = sorted(set(parsed["excluded_iterations"])
                                               | {args.profile_iteration - 1, args.profile_iteration,
                                                  args.profile_iteration + 1})
        kept = [t for i, t in enumerate(parsed["iteration_ms"], 1) if i not in parsed["excluded_iterations"]]
        parsed["mean_iteration_ms"] = sum(kept) / len(kept) if kept else None
    row = {"name": name, "flags": flags, "megatron_argv": argv, "returncode": proc.returncode,
           "wall_s": time.time() - start, **parsed}
    density = parsed["density"] if "--mtraining" in argv else 1.0
    if proc.returncode == 0 and parsed["mean_iteration_ms"]:
        seconds = parsed["mean_iteration_ms"] / 1e3
        # An iteration trains the global batch: its sequences over the data-parallel ranks' micro-batches.
        sequences = int(_flag(argv, "--global-batch-size", 1))
        flops = executed_flops(argv, density or 0.05)
        tokens = args.seq_length * sequences
        row.update(sequences_per_iteration=sequences, tokens_per_s=tokens / seconds,
                   tokens_per_s_per_gpu=tokens / seconds / world,
                   executed_tflops_per_gpu=sequences * flops["executed"] / seconds / world / 1e12,
                   model_tflops_per_gpu=sequences * flops["model"] / seconds / world / 1e12)
        peak = next((v for k, v in BF16_PEAK_TFLOPS.items() if k in args.device_name), None)
        if peak:
            row["executed_share_of_bf16_peak"] = row["executed_tflops_per_gpu"] / peak
    if trace_dir:
        from e2e import gpu_time_breakdown
        trace = os.path.join(trace_dir, "torch_profile", "rank-0.json.gz")
        if os.path.exists(trace):
            row["gpu_time_breakdown"] = gpu_time_breakdown(trace)
    if profile:
        try:
            row["planner"] = predict(argv, profile, world, parsed["density"])
        except (ValueError, SystemExit) as exc:
            row["planner_error"] = str(exc)
        p = row.get("planner")
        if p and row.get("tokens_per_s"):
            row["planner_tokens_per_s_error"] = p["tokens_per_s"] / row["tokens_per_s"] - 1
        if p and row.get("peak_allocated_gib"):
            row["planner_memory_error"] = p["peak_gib"] / row["peak_allocated_gib"] - 1
    print(f"{name}: rc={proc.returncode} ms {['%.0f' % t for t in parsed['iteration_ms']]} "
          f"peak {row.get('peak_allocated_gib') or 0:.1f} GiB, tokens/s {row.get('tokens_per_s') or 0:.0f}; "
          f"planner {row.get('planner', {}).get('tokens_per_s') or 0:.0f} tokens/s, "
          f"{row.get('planner', {}).get('peak_gib') or 0:.1f} GiB", flush=True)
    if proc.returncode:
        print(log[-3000:], flush=True)
    return row


# Bit-exact cuBLAS, NCCL and Transformer Engine for the resume check (MTraining's kernels are
# deterministic by default).
DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
                     "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def resume_check(args, world: int, log_dir: str) -> Dict:
    """Exact resume of the launcher as shipped: an uninterrupted run to N iterations saving at N/2 and
    N, and a run from that N/2 checkpoint to N; the second's losses must equal the first's, and its
    checkpoint at N the first's, tensor by tensor (scripts/compare_checkpoints.py; RNG states aside:
    the resumed run's data iterators draw from the CPU generator once more)."""
    n, half = args.train_iters, args.train_iters // 2
    if half < 1:
        raise SystemExit("--resume-check needs --train-iters >= 2 (it saves at half of them)")
    full_dir, resume_dir = tempfile.mkdtemp(prefix="flagship_full_"), tempfile.mkdtemp(prefix="flagship_resume_")
    try:
        return _resume_runs(args, world, log_dir, n, half, full_dir, resume_dir)
    finally:  # three full checkpoints (optimizer states included): tens to hundreds of GB
        shutil.rmtree(full_dir, ignore_errors=True)
        shutil.rmtree(resume_dir, ignore_errors=True)


def _resume_runs(args, world: int, log_dir: str, n: int, half: int, full_dir: str, resume_dir: str) -> Dict:
    launcher = os.path.join(REPO, "examples", LAUNCHERS[args.model])
    base = dict(os.environ, MEGATRON_LM=args.megatron_lm, GPUS_PER_NODE=str(world), SEQ_LENGTH=str(args.seq_length),
                TRAIN_ITERS=str(n), TP=str(args.tp), MTRAINING="1", PLAN_PROFILE="none", LOG_INTERVAL="1",
                **({"GLOBAL_BATCH_SIZE": str(args.global_batch_size)} if args.global_batch_size else {}),
                **DETERMINISTIC_ENV)
    logs = {}
    for name, path in (("full", full_dir), ("resumed", resume_dir)):
        if name == "resumed":
            # Moved, not copied: only the uninterrupted run's checkpoint at N is compared (one copy less on disk).
            shutil.move(os.path.join(full_dir, f"iter_{half:07d}"), os.path.join(resume_dir, f"iter_{half:07d}"))
            with open(os.path.join(resume_dir, "latest_checkpointed_iteration.txt"), "w") as fh:
                fh.write(str(half))
        proc = subprocess.run(["bash", launcher, "--save-interval", str(half), "--seed", "1234"],
                              env={**base, "CHECKPOINT_PATH": path}, cwd=REPO, capture_output=True, text=True,
                              timeout=args.timeout)
        logs[name] = proc.stdout + proc.stderr
        with open(os.path.join(log_dir, f"flagship_{args.model}_resume_{name}.log"), "w") as fh:
            fh.write(logs[name])
        if proc.returncode:
            return {"ok": False, "error": f"the {name} run failed (rc {proc.returncode})", "log_tail": logs[name][-2000:]}
    full, resumed = parse_log(logs["full"])["losses"], parse_log(logs["resumed"])["losses"]
    after = {i: full.get(i) for i in range(half + 1, n + 1)}
    losses_equal = bool(after) and all(resumed.get(i) == v and v is not None for i, v in after.items())
    compare = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "compare_checkpoints.py"), resume_dir,
                              full_dir, "--iteration", str(n), "--ignore", "rng_state"],
                             capture_output=True, text=True, timeout=args.timeout)
    return {"ok": losses_equal and compare.returncode == 0, "iterations": n, "saved_at": half,
            "losses_full": after, "losses_resumed": {i: resumed.get(i) for i in after},
            "losses_equal": losses_equal, "checkpoints_equal": compare.returncode == 0,
            "compare_tail": (compare.stdout + compare.stderr)[-1500:]}


def parse_runs(specs: List[str]) -> List[tuple]:
    runs = []
    for spec in specs:
        name, _, flags = spec.partition("+")
        if name not in ("mtraining", "te_cp"):
            raise SystemExit(f"--runs {spec!r}: a run is mtraining or te_cp, optionally followed by +FLAGS")
        runs.append((spec if flags else name, shlex.split(flags)))
    return runs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(LAUNCHERS), default="qwen2.5_3b")
    p.add_argument("--seq-length", type=int, default=262144)
    p.add_argument("--train-iters", type=int, default=12)
    p.add_argument("--warmup-iters", type=int, default=2)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--global-batch-size", type=int, default=None,
                   help="sequences per iteration (default: the launcher's, gradient accumulation over them)")
    p.add_argument("--runs", action="append", default=None,
                   help="a run (mtraining, te_cp), optionally +FLAGS; repeat for more (default: mtraining and te_cp)")
    p.add_argument("--telemetry-interval", type=int, default=5)
    p.add_argument("--profile-iteration", type=int, default=0)
    p.add_argument("--resume-check", action="store_true",
                   help="also check exact resume: save at --train-iters / 2, resume to --train-iters, compare")
    p.add_argument("--megatron-lm", default=os.environ.get("MEGATRON_LM"), help="Megatron-LM checkout")
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import torch

    from common import device_slug, json_ready, run_metadata

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/flagship.py needs GPUs (megatron.training is CUDA-only)")
    if not args.megatron_lm:
        raise SystemExit("--megatron-lm (or MEGATRON_LM): a Megatron-LM core_r0.19.x checkout")
    world = torch.cuda.device_count()
    device = torch.device("cuda")
    args.device_name = torch.cuda.get_device_name(0)
    try:
        profile = plan_cli.detect_profile(args.device_name)
    except ValueError:
        profile = None
    out = args.out or os.path.join(REPO, "benchmarks", "results",
                                   f"flagship_{args.model}_{args.seq_length // 1024}k_{device_slug(device)}_{world}gpu.json")
    log_dir = os.path.join(os.path.dirname(os.path.abspath(out)), "logs")
    os.makedirs(log_dir, exist_ok=True)
    result = {"benchmark": "flagship", "meta": run_metadata(device), "world_size": world, "model": args.model,
              "launcher": f"examples/{LAUNCHERS[args.model]}", "seq_length": args.seq_length, "tp": args.tp,
              "profile": profile, "runs": []}
    for name, flags in parse_runs(args.runs or ["mtraining", "te_cp"]):
        result["runs"].append(run_one(name, flags, args, world, log_dir, profile))
        by_name = {r["name"]: r for r in result["runs"]}
        if by_name.get("te_cp", {}).get("tokens_per_s") and by_name.get("mtraining", {}).get("tokens_per_s"):
            result["speedup_vs_te_cp"] = by_name["mtraining"]["tokens_per_s"] / by_name["te_cp"]["tokens_per_s"]
        with open(out, "w") as fh:  # after every run: a run cut short keeps the ones before it
            json.dump(json_ready(result), fh, indent=1)
    if args.resume_check:
        result["resume"] = resume_check(args, world, log_dir)
        print(f"exact resume: {'PASS' if result['resume']['ok'] else 'FAIL'}", flush=True)
        with open(out, "w") as fh:
            json.dump(json_ready(result), fh, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
