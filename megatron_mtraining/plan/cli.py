"""``python -m megatron_mtraining.plan``: predict a training step and recommend a configuration.

    python -m megatron_mtraining.plan --gpus 32 --seq-length 524288
    python -m megatron_mtraining.plan --gpus 16 --seq-length 1048576 --gpu-type h200 --json
    python -m megatron_mtraining.plan $MEGATRON_ARGS --context-parallel-size 32   # Megatron's own flags
    python -m megatron_mtraining.plan --gpus 8 --seq-length 262144 --telemetry train.log

The model shape defaults to Qwen2.5-3B; Megatron's flags (``--hidden-size``, ``--num-attention-heads``,
``--num-query-groups``, ``--kv-channels``, ``--ffn-hidden-size``, ``--num-layers``, ``--seq-length``,
``--padded-vocab-size``, ``--context-parallel-size``, ``--micro-batch-size``, ``--transformer-impl``,
``--fp8-format``, ``--recompute-granularity full``) are accepted as they are,
and Megatron flags the planner does not use are listed as ignored. See docs/scaling.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Dict, List, Optional

from .model import Cluster, ModelShape, Workload, plan
from .profiles import available_profiles, load_profile

TELEMETRY_LINE = re.compile(r"\[MTraining\] iteration \d+ \| density ([0-9.]+)(?:.*?approximator ([0-9.]+) ms"
                            r".*?attention ([0-9.]+) ms)?")
QWEN = ModelShape()


def read_telemetry(path: str) -> Dict:
    """Density (and, when logged, approximator and attention ms) of a run: a training log with
    MTraining's telemetry lines (the last one counts), or a JSON with a "density" entry (the
    telemetry's summary dict, or a list of them: the last counts)."""
    if not os.path.isfile(path):
        raise ValueError(f"telemetry file {path!r} does not exist")
    with open(path) as fh:
        text = fh.read()
    if path.endswith(".json"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"telemetry file {path!r} is not valid JSON: {exc}") from None
        if isinstance(data, list) and data:
            data = data[-1]
        if not isinstance(data, dict) or "density" not in data:
            raise ValueError(f"telemetry file {path!r} has no 'density' entry")
        return {"density": float(data["density"])}
    found = TELEMETRY_LINE.findall(text)
    if not found:
        raise ValueError(f"{path!r}: no '[MTraining] iteration N | density ...' telemetry line")
    density, approx, attention = found[-1]
    out = {"density": float(density)}
    if approx:
        out.update(approximator_ms=float(approx), attention_ms=float(attention))
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m megatron_mtraining.plan",
        description="Predict one training step of context-parallel attention (MTraining's sparse ring, flat and "
                    "hierarchical, against Transformer Engine's dense p2p and a2a+p2p) from a calibrated device "
                    "profile, and recommend a configuration. The model and its validation: docs/scaling.md.",
        epilog=__doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("model shape (default Qwen2.5-3B; Megatron's flag names work)")
    m.add_argument("--hidden", "--hidden-size", dest="hidden", type=int, default=None)
    m.add_argument("--heads", "--num-attention-heads", dest="heads", type=int, default=None)
    m.add_argument("--kv-groups", "--num-query-groups", dest="kv_groups", type=int, default=None)
    m.add_argument("--head-dim", "--kv-channels", dest="head_dim", type=int, default=None,
                   help="default: hidden / heads when either is given, else 128")
    m.add_argument("--layers", "--num-layers", dest="layers", type=int, default=None)
    m.add_argument("--ffn", "--ffn-hidden-size", dest="ffn", type=int, default=None)
    m.add_argument("--vocab", "--padded-vocab-size", "--vocab-size", dest="vocab", type=int, default=None)
    w = p.add_argument_group("workload")
    w.add_argument("--seq-length", "--seq-len", dest="seq_length", type=int, required=True, help="tokens per sequence")
    w.add_argument("--density", type=float, default=None,
                   help="active / causal pairs of the sparse index (default 0.05, the paper's 95%% sparsity)")
    w.add_argument("--telemetry", default=None, help="take the density from a run: its log or telemetry JSON")
    w.add_argument("--micro-batch-size", type=int, default=1)
    w.add_argument("--transformer-impl", choices=("local", "transformer_engine"), default="local",
                   help="the layers' implementation (the rest of the layer's rates; default local: the one every "
                        "profile has; transformer_engine needs a profile calibrated on TE runs, nvidia-h200)")
    w.add_argument("--fp8-format", default=None, help="any value: TE's FP8 GEMMs (attention stays bf16)")
    w.add_argument("--recompute-granularity", choices=("full",), default=None,
                   help="full: plan with full activation recompute (default: as the memory estimate needs)")
    c = p.add_argument_group("cluster")
    c.add_argument("--gpus", "--context-parallel-size", dest="gpus", type=int, default=None,
                   help="GPUs of the context-parallel group")
    c.add_argument("--gpus-per-node", type=int, default=8)
    c.add_argument("--gpu-type", "--profile", dest="gpu_type", default="nvidia-h100",
                   help=f"device profile: {', '.join(available_profiles())}, or a profile JSON")
    c.add_argument("--intra-gbps", type=float, default=None,
                   help="NCCL p2p GB/s per GPU in a node (default: the profile's)")
    c.add_argument("--intra-latency-us", type=float, default=None)
    c.add_argument("--inter-gbps", type=float, default=50.0,
                   help="GB/s per GPU between nodes (default 50: 400 Gb/s InfiniBand)")
    c.add_argument("--inter-latency-us", type=float, default=5.0)
    p.add_argument("--json", action="store_true", help="print the whole plan as JSON")
    return p


def shape_from(args) -> ModelShape:
    head_dim = args.head_dim
    if head_dim is None:
        if args.hidden is not None or args.heads is not None:
            hidden, heads = args.hidden or QWEN.hidden, args.heads or QWEN.heads
            if hidden % heads:
                raise ValueError(f"hidden size {hidden} is not a multiple of {heads} heads; pass --kv-channels")
            head_dim = hidden // heads
        else:
            head_dim = QWEN.head_dim
    return ModelShape(hidden=args.hidden or QWEN.hidden, heads=args.heads or QWEN.heads,
                      kv_groups=args.kv_groups or QWEN.kv_groups, head_dim=head_dim,
                      layers=args.layers or QWEN.layers, ffn=args.ffn or QWEN.ffn, vocab=args.vocab or QWEN.vocab)


def format_table(result: Dict) -> str:
    w, c, rec, mem = result["workload"], result["cluster"], result["recommendation"], result["memory"]
    s = result["shape"]
    lines = [f"{result['profile']} x {c['gpus']} (nodes of {c['gpus_per_node']}, {c['inter_gbps']:g} GB/s between), "
             f"{w['seq_len']} tokens, density {w['density']:.3g}, {w['layers']} layers"
             f"{', FP8 GEMMs' if w['fp8'] else ''}; model: hidden {s['hidden']}, "
             f"{s['heads']}/{s['kv_groups']} heads, d {s['head_dim']}, {s['layers']} layers, FFN {s['ffn']}",
             "per layer and GPU (ms): attention fwd / bwd with the ring's exposed communication; fwd/bwd per step: "
             "the kernels alone; host floor: the host's time to enqueue the ring's steps (* where it binds: the GPU "
             "waits for the host); step = all layers"]
    header = ["configuration", "fwd/step", "bwd/step", "attn fwd", "attn bwd", "exposed comm", "host floor", "approx",
              "rest", "step ms", "tokens/s", "limited by"]
    rows = []
    for p in result["predictions"]:
        floor = (f"{p['host_floor_ms']:.1f}" + ("*" if p["host_wait_ms"] > 0 else "")) if p["host_floor_ms"] else "-"
        rows.append([p["name"], f"{p['fwd_step_ms']:.2f}", f"{p['bwd_step_ms']:.2f}", f"{p['attention_fwd_ms']:.1f}",
                     f"{p['attention_bwd_ms']:.1f}", f"{p['exposed_comm_ms']:.1f}", floor,
                     f"{p['approximator_ms']:.2f}", f"{p['rest_of_layer_ms']:.1f}", f"{p['step_ms']:.0f}",
                     f"{p['tokens_per_s']:.0f}", p["limit"]])
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    for row in [header] + rows:
        lines.append("  ".join(x.ljust(wd) for x, wd in zip(row, widths)).rstrip())
    for name, why in result["skipped"].items():
        lines.append(f"skipped {name}: {why}")
    speedup = rec["speedup_over_best_dense"]
    inner = f" (inner ring {rec['inner_ring_size']})" if rec["inner_ring_size"] else ""
    versus = f", {speedup:.2f}x over {rec['best_dense']}" if speedup else ""
    lines.append(f"recommended: {rec['configuration']}{inner}, {rec['tokens_per_s']:.0f} tokens/s{versus}; "
                 f"limited by {rec['limited_by']}; steps with {rec['recompute']} recompute")
    if speedup and speedup < 1:
        lines.append(f"note: {rec['best_dense']} (dense) is predicted faster here"
                     + (" (MTraining's ring is host-bound: fewer GPUs, or fewer launches per ring step, e.g. CUDA "
                        "graphs)" if rec["limited_by"] == "host/launch floor" else ""))
    lines.append(f"memory per GPU: {mem['no_recompute_gib']:.1f} GiB without recompute, "
                 f"{mem['full_recompute_gib']:.1f} GiB with full recompute, of {mem['capacity_gib']:.0f}: "
                 + ("recompute needed" if mem["recompute_needed"] else "no recompute needed")
                 + ("" if mem["fits_with_recompute"] else "; does NOT fit even with full recompute (more GPUs, or "
                    "tensor/pipeline parallelism)"))
    if result.get("ignored_args"):
        lines.append(f"ignored flags: {' '.join(result['ignored_args'])}")
    return "\n".join(lines)


def run(argv: Optional[List[str]] = None) -> Dict:
    """Parse, validate and plan; raises ValueError (bad input) with a message that says what to fix."""
    p = parser()
    args, unknown = p.parse_known_args(argv)
    # A bare value after an unknown flag is that flag's value; a leading bare value is a mistake.
    if unknown and not unknown[0].startswith("--"):
        raise ValueError(f"unexpected argument {unknown[0]!r}")
    if args.gpus is None:
        raise ValueError("give the GPU count: --gpus N (or Megatron's --context-parallel-size N)")
    if args.density is not None and args.telemetry is not None:
        raise ValueError("give --density or --telemetry, not both")
    density = read_telemetry(args.telemetry)["density"] if args.telemetry else (
        0.05 if args.density is None else args.density)
    profile = load_profile(args.gpu_type)
    shape = shape_from(args)
    if args.fp8_format is not None and args.transformer_impl != "transformer_engine":
        raise ValueError("--fp8-format needs --transformer-impl transformer_engine (FP8 GEMMs are TE's)")
    work = Workload(args.seq_length, density, args.micro_batch_size, layers=args.transformer_impl,
                    fp8=args.fp8_format is not None, recompute=True if args.recompute_granularity else None)
    cluster = Cluster(args.gpus, args.gpus_per_node, args.inter_gbps, args.inter_latency_us, args.intra_gbps,
                      args.intra_latency_us)
    result = plan(shape, work, cluster, profile)
    result["ignored_args"] = [u for u in unknown if u.startswith("--")]
    result["as_json"] = args.json
    return result


def main(argv: Optional[List[str]] = None) -> int:
    try:
        result = run(argv)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=1) if result.pop("as_json") else format_table(result))
    return 0
