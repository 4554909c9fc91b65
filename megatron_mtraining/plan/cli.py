"""``python -m megatron_mtraining.plan``: the fastest configuration that fits, its step time and memory.

    python -m megatron_mtraining.plan --gpus 8 --seq-length 524288 --gpu-type h200
    python -m megatron_mtraining.plan --gpus 16 --seq-length 1048576 --gpu-type h200 --json
    python -m megatron_mtraining.plan $MEGATRON_ARGS --gpu-type h200   # Megatron's own flags: also "as configured"
    python -m megatron_mtraining.plan --gpus 8 --seq-length 262144 --telemetry train.log

The model shape defaults to Qwen2.5-3B; Megatron's flags (``--hidden-size``, ``--num-attention-heads``,
``--num-query-groups``, ``--kv-channels``, ``--ffn-hidden-size``, ``--num-layers``, ``--seq-length``,
``--padded-vocab-size``, ``--context-parallel-size``, ``--tensor-model-parallel-size``,
``--sequence-parallel``, ``--micro-batch-size``, ``--transformer-impl``, ``--fp8-format``,
``--recompute-*``, ``--cp-comm-type``, ``--use-distributed-optimizer``, ``--mtraining*``) are accepted
as they are, and Megatron flags the planner does not use are listed as ignored. See docs/scaling.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from typing import Dict, List, Optional

from .model import Cluster, ModelShape, Workload
from .search import configurations, plan
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


# Megatron flags the planner reads only to know the run's configuration, or that set nothing it models.
NOT_MODELLED = ("--mtraining-top-p", "--mtraining-layout", "--mtraining-log-interval", "--mtraining-index",
                "--mtraining-min-vertical", "--mtraining-last-q")
DEVICE_PROFILES = (("H200", "nvidia-h200"), ("H100", "nvidia-h100"))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m megatron_mtraining.plan",
        description="The fastest way to train a model at a sequence length on a number of GPUs, and whether it "
                    "fits: every tensor x context-parallel split, attention (MTraining's sparse ring, flat and "
                    "hierarchical; Transformer Engine's dense p2p and a2a+p2p) and recompute choice, its step time "
                    "from a calibrated device profile and its peak memory per GPU. The model and its validation: "
                    "docs/scaling.md.",
        epilog=__doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False)  # a Megatron flag such as --fp8 must not read as an abbreviation of --fp8-format
    m = p.add_argument_group("model shape (default Qwen2.5-3B; Megatron's flag names work, and with any of them "
                             "Megatron's defaults hold: tied embeddings, no QKV bias, unless the flags say otherwise)")
    m.add_argument("--hidden", "--hidden-size", dest="hidden", type=int, default=None)
    m.add_argument("--heads", "--num-attention-heads", dest="heads", type=int, default=None)
    m.add_argument("--kv-groups", "--num-query-groups", dest="kv_groups", type=int, default=None)
    m.add_argument("--head-dim", "--kv-channels", dest="head_dim", type=int, default=None,
                   help="default: hidden / heads when either is given, else 128")
    m.add_argument("--layers", "--num-layers", dest="layers", type=int, default=None)
    m.add_argument("--ffn", "--ffn-hidden-size", dest="ffn", type=int, default=None)
    m.add_argument("--vocab", "--padded-vocab-size", "--vocab-size", dest="vocab", type=int, default=None)
    m.add_argument("--add-qkv-bias", action="store_true", default=None)
    m.add_argument("--swiglu", action="store_true", help="(Megatron's) the FFN size default is SwiGLU's")
    m.add_argument("--untie-embeddings-and-output-weights", dest="untied", action="store_true", default=None)
    w = p.add_argument_group("workload")
    w.add_argument("--seq-length", "--seq-len", dest="seq_length", type=int, required=True, help="tokens per sequence")
    w.add_argument("--density", type=float, default=None,
                   help="active / causal pairs of the sparse index (default 0.05, the paper's 95%% sparsity; "
                        "--mtraining-top-p does not set it: a run's telemetry does)")
    w.add_argument("--telemetry", default=None, help="take the density from a run: its log or telemetry JSON")
    w.add_argument("--micro-batch-size", type=int, default=1)
    w.add_argument("--transformer-impl", choices=("local", "transformer_engine"), default=None,
                   help="the layers' implementation (the rest of the layer's rates; default local, or with "
                        "Megatron's shape flags Megatron's default, transformer_engine)")
    w.add_argument("--fp8-format", default=None, help="any value: TE's FP8 GEMMs (attention stays bf16)")
    w.add_argument("--recompute-granularity", choices=("full", "selective"), default=None,
                   help="full: recompute as --recompute-method says (default: the fewest layers that fit); "
                        "selective is planned as no recompute (with flash-style attention it saves no memory)")
    w.add_argument("--recompute-method", choices=("uniform", "block"), default="uniform")
    w.add_argument("--recompute-num-layers", type=int, default=1,
                   help="with --recompute-method block: the layers recomputed")
    w.add_argument("--use-distributed-optimizer", dest="distributed_optimizer", action="store_true", default=None,
                   help="Adam's states sharded over the data x context-parallel ranks: the search's default; a run's "
                        "own flags (with --context-parallel-size) without it are Megatron's default, unsharded")
    w.add_argument("--no-distributed-optimizer", dest="distributed_optimizer", action="store_false")
    c = p.add_argument_group("GPUs")
    c.add_argument("--gpus", type=int, default=None, help="GPUs in all (tensor x context parallel)")
    c.add_argument("--context-parallel-size", dest="cp", type=int, default=None,
                   help="a run's CP size: the GPUs are CP x TP, and the run's own configuration is predicted too")
    c.add_argument("--tensor-model-parallel-size", "--tp", dest="tp", type=int, default=None,
                   help="fix the TP size (default: every size the model takes is searched)")
    c.add_argument("--sequence-parallel", action="store_true",
                   help="a run's TP with Megatron's sequence parallelism (with --context-parallel-size: without "
                        "it, the run's residual stream is whole on every TP rank; the search plans TP with it)")
    c.add_argument("--gpus-per-node", type=int, default=8)
    c.add_argument("--gpu-type", dest="gpu_type", default="nvidia-h100",
                   help=f"device profile: {', '.join(available_profiles())}, a profile JSON, or auto (this "
                        "machine's GPU, through nvidia-smi)")
    c.add_argument("--intra-gbps", type=float, default=None,
                   help="NCCL p2p GB/s per GPU in a node (default: the profile's)")
    c.add_argument("--intra-latency-us", type=float, default=None)
    c.add_argument("--inter-gbps", type=float, default=50.0,
                   help="GB/s per GPU between nodes (default 50: 400 Gb/s InfiniBand)")
    c.add_argument("--inter-latency-us", type=float, default=5.0)
    r = p.add_argument_group("the run's own attention (with --context-parallel-size)")
    r.add_argument("--mtraining", action="store_true", help="the run uses MTraining (else TE's dense CP)")
    r.add_argument("--mtraining-inner-ring-size", type=int, default=None)
    r.add_argument("--mtraining-block-size", type=int, default=None)
    r.add_argument("--cp-comm-type", nargs="+", default=["p2p"], help="one type for every layer")
    p.add_argument("--json", action="store_true", help="print the whole plan as JSON")
    p.add_argument("--startup", action="store_true",
                   help="one line for a launcher's log: the run's predicted tokens/s and memory, and the fastest "
                        "configuration that fits")
    return p


def megatron_style(args) -> bool:
    """Whether the flags describe a Megatron model (any shape flag): then Megatron's defaults hold."""
    given = [args.hidden, args.heads, args.kv_groups, args.head_dim, args.layers, args.ffn, args.vocab]
    return any(x is not None for x in given) or bool(args.add_qkv_bias or args.untied)


def shape_from(args) -> ModelShape:
    """The model: Qwen2.5-3B without shape flags; with them, what Megatron would build from the same
    flags (query groups = heads without --num-query-groups, FFN 4 x hidden, or SwiGLU's 8/3 x hidden
    rounded down to a multiple of 64, tied embeddings and no QKV bias unless the flags say otherwise)."""
    if not megatron_style(args):
        return QWEN
    hidden, heads = args.hidden or QWEN.hidden, args.heads or QWEN.heads
    head_dim = args.head_dim
    if head_dim is None:
        if hidden % heads:
            raise ValueError(f"hidden size {hidden} is not a multiple of {heads} heads; pass --kv-channels")
        head_dim = hidden // heads
    ffn = args.ffn or (int(4 * hidden * 2 / 3 / 64) * 64 if args.swiglu else 4 * hidden)
    return ModelShape(hidden=hidden, heads=heads, kv_groups=args.kv_groups or heads, head_dim=head_dim,
                      layers=args.layers or QWEN.layers, ffn=ffn, vocab=args.vocab or QWEN.vocab,
                      qkv_bias=bool(args.add_qkv_bias), untied_embeddings=bool(args.untied))


def detect_profile(query=None) -> str:
    """The profile of this machine's GPU (nvidia-smi's first GPU name), or ValueError."""
    import shutil
    import subprocess
    if query is None:
        if shutil.which("nvidia-smi") is None:
            raise ValueError("--gpu-type auto: no nvidia-smi here (no NVIDIA GPU); name a profile: "
                             + ", ".join(available_profiles()))
        query = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                               text=True, timeout=30).stdout
    name = query.strip().splitlines()[0] if query.strip() else ""
    for key, profile in DEVICE_PROFILES:
        if key in name:
            return profile
    raise ValueError(f"--gpu-type auto: no profile for {name or 'this GPU'!r}; known: "
                     + ", ".join(available_profiles()) + " (benchmarks/calibrate.py --gpu writes one)")


def _recompute(args):
    """Workload.recompute for the run's flags (None: the planner chooses)."""
    if args.recompute_granularity is None:
        return None
    if args.recompute_granularity == "selective":
        return "none"
    if args.recompute_method == "block":
        return args.recompute_num_layers
    return "full"


def _configured_row(args, shape, work, cluster, profile) -> Optional[Dict]:
    """The run's own configuration (its split, attention and recompute), when the flags give its CP size."""
    if args.cp is None:
        return None
    fixed = work if work.recompute is not None else dataclasses.replace(work, recompute="none")
    rows = configurations(shape, fixed, cluster, profile, tp=args.tp or 1,
                          distributed_optimizer=bool(args.distributed_optimizer),  # Megatron's default: off
                          sequence_parallel=args.sequence_parallel)["rows"]
    if args.mtraining:
        # --mtraining-inner-ring-size counts global ranks per node (default: the launch's ranks per node);
        # the inner ring is the CP ranks among them, CP groups being strided by TP.
        per_node, tp = args.mtraining_inner_ring_size or args.gpus_per_node, args.tp or 1
        if per_node % tp:
            raise ValueError(f"--mtraining-inner-ring-size {per_node} (ranks per node) is not a multiple of "
                             f"--tensor-model-parallel-size {tp}")
        inner = per_node // tp
        name = "mtraining_flat" if inner >= args.cp else f"mtraining_hier_{inner}"
    elif args.cp_comm_type == "p2p":
        name = "dense_te_p2p"
    elif args.cp_comm_type == "a2a+p2p" or (args.cp_comm_type == "a2a" and cluster.gpus <= cluster.gpus_per_node):
        name = "dense_te_a2a_p2p"  # (a2a inside one node: the all-to-all over the whole CP group, no ring)
    else:
        raise ValueError(f"--cp-comm-type {args.cp_comm_type} is not modelled (p2p, a2a+p2p, and a2a inside a node "
                         "are)")
    row = next((r for r in rows if r["name"] == name), None)
    if row is None:
        raise ValueError(f"the run's configuration ({name}) cannot be predicted for these settings")
    return row


def _gib(x: float) -> str:
    return f"{x:.1f}"


def format_table(result: Dict) -> str:
    w, c, rec, s = result["workload"], result["cluster"], result["recommendation"], result["shape"]
    lines = [f"{result['profile']} x {c['gpus']} (nodes of {c['gpus_per_node']}, {c['inter_gbps']:g} GB/s between), "
             f"{w['seq_len']} tokens, density {w['density']:.3g}, {w['layers']} layers"
             f"{', FP8 GEMMs' if w['fp8'] else ''}; model: hidden {s['hidden']}, "
             f"{s['heads']}/{s['kv_groups']} heads, d {s['head_dim']}, {s['layers']} layers, FFN {s['ffn']}, "
             f"vocabulary {s['vocab']}",
             "per layer and GPU (ms): attention fwd / bwd with the ring's exposed communication; host floor: the "
             "host's time to enqueue the ring's steps (* where it binds); recompute: the fewest layers that fit "
             "(or as given); GiB: peak allocated per GPU; step = all layers"]
    header = ["configuration", "TP", "CP", "recompute", "GiB", "fits", "attn fwd", "attn bwd", "exposed comm",
              "host floor", "approx", "rest", "step ms", "tokens/s", "limited by"]
    rows = []
    for p in result["predictions"]:
        floor = (f"{p['host_floor_ms']:.1f}" + ("*" if p["host_wait_ms"] > 0 else "")) if p["host_floor_ms"] else "-"
        rows.append([p["name"], str(p["tp"]), str(p["cp"]), p["recompute"], _gib(p["memory"]["peak_gib"]),
                     "yes" if p["fits"] else "NO", f"{p['attention_fwd_ms']:.1f}", f"{p['attention_bwd_ms']:.1f}",
                     f"{p['exposed_comm_ms']:.1f}", floor, f"{p['approximator_ms']:.2f}",
                     f"{p['rest_of_layer_ms']:.1f}", f"{p['step_ms']:.0f}", f"{p['tokens_per_s']:.0f}", p["limit"]])
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    for row in [header] + rows:
        lines.append("  ".join(x.ljust(wd) for x, wd in zip(row, widths)).rstrip())
    for name, why in result["skipped"].items():
        lines.append(f"skipped {name}: {why}")
    configured = result.get("configured")
    if configured:
        lines.append(f"as configured: {configured['name']}, TP {configured['tp']} x CP {configured['cp']}, "
                     f"recompute {configured['recompute']}: {configured['tokens_per_s']:.0f} tokens/s, "
                     f"{_gib(configured['memory']['peak_gib'])} GiB per GPU"
                     + ("" if configured["fits"] else " (does NOT fit)"))
    if rec is None:
        adv = result["advice"]
        options = []
        if adv["gpus"]:
            options.append(f"{adv['gpus']} GPUs at this length")
        if adv["seq_len"]:
            options.append(f"at most {adv['seq_len']} tokens on these {c['gpus']} GPUs")
        if adv.get("fits_unconstrained"):
            lines.append(f"nothing fits in {result['capacity_gib']:.0f} GiB per GPU with the TP size or recompute "
                         "given; without them (every TP size, the fewest recomputed layers that fit) this run fits: "
                         "leave out --tp / --tensor-model-parallel-size and the --recompute-* flags")
            return "\n".join(lines)
        lines.append(f"nothing fits in {result['capacity_gib']:.0f} GiB per GPU"
                     + (" with the TP size or recompute given" if adv.get("constrained") else
                        ", even with full recompute and every TP size")
                     + (f"; what would: {' or '.join(options)}" if options else
                        "; no tried GPU count or length does (pipeline parallelism is not planned)"))
        return "\n".join(lines)
    speedup = rec["speedup_over_best_dense"]
    inner = f" (inner ring {rec['inner_ring_size']})" if rec["inner_ring_size"] else ""
    versus = f", {speedup:.2f}x over {rec['best_dense']} (the fastest dense that fits)" if speedup else (
        ", no dense configuration fits")
    lines.append(f"recommended: {rec['configuration']}{inner}, TP {rec['tp']} x CP {rec['cp']}, recompute "
                 f"{rec['recompute']}: {rec['tokens_per_s']:.0f} tokens/s ({rec['tokens_per_s_per_gpu']:.0f} per GPU)"
                 f"{versus}; limited by {rec['limited_by']}")
    if speedup and speedup < 1:
        lines.append(f"note: {rec['best_dense']} (dense) is predicted faster here"
                     + (" (MTraining's ring is host-bound: fewer GPUs, or fewer launches per ring step, e.g. CUDA "
                        "graphs)" if rec["limited_by"] == "host/launch floor" else ""))
    best = next(p for p in result["predictions"] if p["megatron_flags"] == rec["megatron_flags"])
    parts = ", ".join(f"{k.replace('_', ' ')} {v:.1f}" for k, v in best["memory"]["components_gib"].items() if v)
    lines.append(f"memory per GPU: {_gib(rec['peak_gib'])} GiB peak of {result['capacity_gib']:.0f} ({parts}; "
                 f"transient: {best['memory']['transient']})")
    lines.append("flags: " + " ".join(rec["megatron_flags"])
                 + (" (no recompute: without any --recompute-* flag)" if rec["recompute_layers"] == 0 else ""))
    alt = result.get("fp8_alternative")
    if alt:
        lines.append(f"with FP8 GEMMs (--fp8-format hybrid): {alt['configuration']}, TP {alt['tp']}, recompute "
                     f"{alt['recompute']}: {alt['tokens_per_s']:.0f} tokens/s")
    if result.get("ignored_args"):
        lines.append(f"ignored flags: {' '.join(result['ignored_args'])}")
    return "\n".join(lines)


def startup_line(result: Dict) -> str:
    """One line for a launcher's log: the run as configured against the fastest configuration that fits."""
    c, rec, run = result["cluster"], result["recommendation"], result.get("configured")
    head = f"[mtraining plan] {result['profile']} x {c['gpus']}, {result['workload']['seq_len']} tokens"
    if run is not None:
        head += (f": this run ({run['name']}, TP {run['tp']} x CP {run['cp']}, recompute {run['recompute']}) predicted "
                 f"{run['tokens_per_s']:.0f} tokens/s ({run['tokens_per_s'] / c['gpus']:.0f} per GPU), peak "
                 f"{run['memory']['peak_gib']:.1f} GiB per GPU of {result['capacity_gib']:.0f}"
                 + (" (fits)" if run["fits"] else " (does NOT fit)"))
    if rec is None:
        return head + "; nothing fits on these GPUs (python -m megatron_mtraining.plan for what would)"
    return head + (f"; fastest that fits: {rec['configuration']}, TP {rec['tp']}, recompute {rec['recompute']}, "
                   f"{rec['tokens_per_s']:.0f} tokens/s ({' '.join(rec['megatron_flags'])}"
                   + (", without any --recompute-* flag" if rec["recompute_layers"] == 0 else "") + ")")


def run(argv: Optional[List[str]] = None) -> Dict:
    """Parse, validate and plan; raises ValueError (bad input) with a message that says what to fix."""
    p = parser()
    args, unknown = p.parse_known_args(argv)
    # A bare value after an unknown flag is that flag's value; a leading bare value is a mistake.
    if unknown and not unknown[0].startswith("--"):
        raise ValueError(f"unexpected argument {unknown[0]!r}")
    tp = args.tp
    if args.cp is not None:
        gpus = args.cp * (tp or 1)
        if args.gpus is not None and args.gpus != gpus:
            raise ValueError(f"--gpus {args.gpus} disagrees with --context-parallel-size {args.cp} x "
                             f"--tensor-model-parallel-size {tp or 1}")
    elif args.gpus is None:
        raise ValueError("give the GPU count: --gpus N (or Megatron's --context-parallel-size N)")
    else:
        gpus = args.gpus
    if args.density is not None and args.telemetry is not None:
        raise ValueError("give --density or --telemetry, not both")
    density = read_telemetry(args.telemetry)["density"] if args.telemetry else (
        0.05 if args.density is None else args.density)
    profile = load_profile(detect_profile() if args.gpu_type == "auto" else args.gpu_type)
    if args.mtraining_block_size not in (None, profile.block_size):
        raise ValueError(f"profile {profile.name} is calibrated at block size {profile.block_size}, not "
                         f"--mtraining-block-size {args.mtraining_block_size}")
    shape = shape_from(args)
    if args.transformer_impl is None:
        args.transformer_impl = "transformer_engine" if megatron_style(args) else "local"
    if len(set(args.cp_comm_type)) > 1:
        raise ValueError(f"--cp-comm-type {' '.join(args.cp_comm_type)}: a type per layer is not planned; give one")
    args.cp_comm_type = args.cp_comm_type[0]
    if args.fp8_format is not None and args.transformer_impl != "transformer_engine":
        raise ValueError("--fp8-format needs --transformer-impl transformer_engine (FP8 GEMMs are TE's)")
    work = Workload(args.seq_length, density, args.micro_batch_size, layers=args.transformer_impl,
                    fp8=args.fp8_format is not None, recompute=_recompute(args))
    cluster = Cluster(gpus, args.gpus_per_node, args.inter_gbps, args.inter_latency_us, args.intra_gbps,
                      args.intra_latency_us)
    # With a run's CP size the flags describe that run: it is predicted as configured, and the
    # recommendation searches every TP size and recompute choice; otherwise they constrain the search.
    searched = dataclasses.replace(work, recompute=None) if args.cp is not None else work
    result = plan(shape, searched, cluster, profile, tp=None if args.cp is not None else tp,
                  distributed_optimizer=args.distributed_optimizer is not False)
    result["configured"] = _configured_row(args, shape, work, cluster, profile)
    result["ignored_args"] = [u for u in unknown if u.startswith("--") and u.split("=")[0] not in NOT_MODELLED]
    result["output"] = "json" if args.json else "startup" if args.startup else "table"
    return result


def main(argv: Optional[List[str]] = None) -> int:
    try:
        result = run(argv)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    output = result.pop("output")
    if output == "json":
        print(json.dumps(result, indent=1))
    else:
        print(startup_line(result) if output == "startup" else format_table(result))
    return 0
