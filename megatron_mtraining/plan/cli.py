"""``python -m megatron_mtraining.plan``: the fastest configuration that fits, its step time and memory.

    python -m megatron_mtraining.plan --gpus 8 --seq-length 512k --gpu-type h200
    python -m megatron_mtraining.plan --model llama3.1-70b --gpus 64 --seq-length 128k
    python -m megatron_mtraining.plan --model llama3.1-8b --gpus 64 --seq-length 128k --global-batch-tokens 8M
    python -m megatron_mtraining.plan --gpus 16 --seq-length 1M --gpu-type h200 --json
    python -m megatron_mtraining.plan $MEGATRON_ARGS --gpu-type h200   # Megatron's own flags: also "as configured"
    python -m megatron_mtraining.plan --gpus 8 --seq-length 256k --telemetry train.log

The model is a preset (--model: qwen2.5-3b, the default, qwen2.5-7b, llama3.1-8b, llama3.1-70b) or
Megatron's shape flags (``--hidden-size``, ``--num-attention-heads``, ``--num-query-groups``,
``--kv-channels``, ``--ffn-hidden-size``, ``--num-layers``, ``--padded-vocab-size``; with a preset
they override its fields); the layers are Transformer Engine's (Megatron's default) unless
``--transformer-impl local``. Token counts take k/K (1024) and M suffixes (512k, 1M). Megatron's
``--seq-length``, ``--context-parallel-size``, ``--tensor-model-parallel-size``,
``--pipeline-model-parallel-size``, ``--sequence-parallel``, ``--micro-batch-size``,
``--global-batch-size``, ``--transformer-impl``, ``--fp8-format``, ``--recompute-*``, ``--cp-comm-type``,
``--use-distributed-optimizer`` and ``--mtraining*`` are accepted as they are, and Megatron flags the
planner does not use are listed as ignored. See docs/scaling.md.
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
from .presets import DEFAULT_MODEL, MODELS, TITLES, describe, preset_key
from .search import configurations, plan, split_name, tokens_both, tokens_text
from .profiles import available_profiles, load_profile

TELEMETRY_LINE = re.compile(r"\[MTraining\] iteration \d+ \| density ([0-9.]+)(?:.*?approximator ([0-9.]+) ms"
                            r".*?attention ([0-9.]+) ms)?")
QWEN = MODELS[DEFAULT_MODEL]
TOKENS = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kKmM]?)\s*$")
SUFFIX = {"": 1, "k": 1024, "m": 1024 ** 2}


def token_count(text: str) -> int:
    """A token count: 131072, 128k, 128K, 1M (k = 1024, M = 1024 x 1024); argparse's type for lengths."""
    match = TOKENS.match(str(text))
    value = None
    if match:
        number = float(match.group(1)) * SUFFIX[match.group(2).lower()]
        value = int(number) if number == int(number) and number >= 1 else None
    if value is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a token count: give a positive whole number of tokens, "
                                         "e.g. 131072, 128k or 1M (k = 1024, M = 1024 x 1024)")
    return value


def model_name(text: str) -> str:
    try:
        return preset_key(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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
                    "fits: every data x pipeline x tensor x context-parallel split, attention (MTraining's sparse "
                    "ring, flat and hierarchical; Transformer Engine's dense p2p and a2a+p2p) and recompute choice, "
                    "its step time from a calibrated device profile and its peak memory per GPU; the recommendation "
                    "is the fastest that fits, MTraining or dense. The model and its validation: docs/scaling.md.",
        epilog=__doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False)  # a Megatron flag such as --fp8 must not read as an abbreviation of --fp8-format
    m = p.add_argument_group("model (default Qwen2.5-3B; Megatron's shape flags override a preset's fields, and "
                             "without --model build Megatron's model from its defaults: tied embeddings, no QKV "
                             "bias, unless the flags say otherwise)")
    m.add_argument("--model", type=model_name, default=None, metavar="NAME",
                   help=f"a preset: {', '.join(MODELS)} (default {DEFAULT_MODEL}: "
                        f"{TITLES[DEFAULT_MODEL]}, tied embeddings)")
    m.add_argument("--hidden", "--hidden-size", dest="hidden", type=int, default=None)
    m.add_argument("--heads", "--num-attention-heads", dest="heads", type=int, default=None)
    m.add_argument("--kv-groups", "--num-query-groups", dest="kv_groups", type=int, default=None)
    m.add_argument("--head-dim", "--kv-channels", dest="head_dim", type=int, default=None,
                   help="default: the preset's; without --model hidden / heads when either is given, else 128")
    m.add_argument("--layers", "--num-layers", dest="layers", type=int, default=None)
    m.add_argument("--ffn", "--ffn-hidden-size", dest="ffn", type=int, default=None)
    m.add_argument("--vocab", "--padded-vocab-size", "--vocab-size", dest="vocab", type=int, default=None)
    m.add_argument("--add-qkv-bias", action="store_true", default=None)
    m.add_argument("--swiglu", action="store_true", help="(Megatron's) the FFN size default is SwiGLU's")
    m.add_argument("--untie-embeddings-and-output-weights", dest="untied", action="store_true", default=None)
    w = p.add_argument_group("workload")
    w.add_argument("--seq-length", "--seq-len", dest="seq_length", type=token_count, required=True,
                   metavar="TOKENS", help="tokens per sequence (131072, 128k, 1M)")
    w.add_argument("--global-batch-tokens", type=token_count, default=None, metavar="TOKENS",
                   help="tokens per training step (e.g. 8M): the search then splits the batch's sequences over "
                        "data-parallel replicas and micro-batches (default: one micro-batch over all the GPUs)")
    w.add_argument("--global-batch-size", type=int, default=None,
                   help="(Megatron's) sequences per step: --global-batch-tokens in sequences")
    w.add_argument("--density", type=float, default=None,
                   help="active / causal pairs of the sparse index (default 0.05, the paper's 95%% sparsity; "
                        "--mtraining-top-p does not set it: a run's telemetry does)")
    w.add_argument("--telemetry", default=None, help="take the density from a run: its log or telemetry JSON")
    w.add_argument("--micro-batch-size", type=int, default=1)
    w.add_argument("--transformer-impl", choices=("local", "transformer_engine"), default="transformer_engine",
                   help="the layers' implementation (the rest of the layer's rates; default transformer_engine, "
                        "Megatron's default, whatever gives the model)")
    w.add_argument("--fp8-format", default=None, help="any value: TE's FP8 GEMMs (attention stays bf16)")
    w.add_argument("--recompute-granularity", choices=("full", "selective"), default=None,
                   help="full: recompute as --recompute-method says (default: the fewest layers that fit); "
                        "selective is planned as no recompute (with flash-style attention it saves no memory)")
    w.add_argument("--recompute-method", choices=("uniform", "block"), default="uniform")
    w.add_argument("--recompute-num-layers", type=int, default=1,
                   help="with --recompute-method block: the layers recomputed (per pipeline stage)")
    w.add_argument("--use-distributed-optimizer", dest="distributed_optimizer", action="store_true", default=None,
                   help="Adam's states sharded over the data x context-parallel ranks: the search's default; a run's "
                        "own flags (with --context-parallel-size) without it are Megatron's default, unsharded")
    w.add_argument("--no-distributed-optimizer", dest="distributed_optimizer", action="store_false")
    c = p.add_argument_group("GPUs")
    c.add_argument("--gpus", type=int, default=None, help="GPUs in all (data x pipeline x tensor x context parallel)")
    c.add_argument("--context-parallel-size", dest="cp", type=int, default=None,
                   help="a run's CP size: the GPUs are CP x TP x PP (x DP with --gpus), and the run's own "
                        "configuration is predicted too")
    c.add_argument("--tensor-model-parallel-size", "--tp", dest="tp", type=int, default=None,
                   help="fix the TP size (default: every size the model takes is searched)")
    c.add_argument("--pipeline-model-parallel-size", "--pp", dest="pp", type=int, default=None,
                   help="fix the pipeline stages (default: every stage count the layers divide into is searched)")
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
    p.add_argument("--all", action="store_true",
                   help="list every configuration (default: each attention's fastest split)")
    p.add_argument("--json", action="store_true", help="print the whole plan as JSON")
    p.add_argument("--startup", action="store_true",
                   help="one line for a launcher's log: the run's predicted tokens/s and memory, and the fastest "
                        "configuration that fits")
    return p


SHAPE_FIELDS = (("hidden", "hidden"), ("heads", "heads"), ("kv_groups", "kv_groups"), ("head_dim", "head_dim"),
                ("layers", "layers"), ("ffn", "ffn"), ("vocab", "vocab"))


def megatron_style(args) -> bool:
    """Whether the flags describe a Megatron model (any shape flag): then Megatron's defaults hold."""
    given = [getattr(args, a) for a, _ in SHAPE_FIELDS]
    return any(x is not None for x in given) or bool(args.add_qkv_bias or args.untied)


def shape_from(args) -> ModelShape:
    """The model: the --model preset (Qwen2.5-3B without it or shape flags), its fields overridden by
    any shape flag; without --model, what Megatron would build from the flags (query groups = heads
    without --num-query-groups, FFN 4 x hidden, or SwiGLU's 8/3 x hidden rounded down to a multiple of
    64, tied embeddings and no QKV bias unless the flags say otherwise)."""
    if args.model is not None or not megatron_style(args):
        base = MODELS[args.model or DEFAULT_MODEL]
        changes = {field: getattr(args, a) for a, field in SHAPE_FIELDS if getattr(args, a) is not None}
        if args.add_qkv_bias:
            changes["qkv_bias"] = True
        if args.untied:
            changes["untied_embeddings"] = True
        return dataclasses.replace(base, **changes)
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


def model_title(args, shape: ModelShape) -> str:
    """The model's name: a preset's (with what the flags changed), else "custom"."""
    name = describe(shape)
    if name != "custom model":
        return name
    if args.model is not None:
        base = MODELS[args.model]
        changed = []
        for field in dataclasses.asdict(shape):
            value = getattr(shape, field)
            if value != getattr(base, field):
                changed.append({"qkv_bias": "QKV bias" if value else "no QKV bias",
                                "untied_embeddings": "untied embeddings" if value else "tied embeddings"}.get(
                                    field, f"{field.replace('_', ' ')} {value}"))
        return f"{TITLES[args.model]} with {', '.join(changed)}"
    return "custom model"


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


def _configured_row(args, shape, work, cluster, profile, sequences) -> Optional[Dict]:
    """The run's own configuration (its split, attention and recompute), when the flags give its CP size."""
    if args.cp is None:
        return None
    fixed = work if work.recompute is not None else dataclasses.replace(work, recompute="none")
    tp, pp = args.tp or 1, args.pp or 1
    rows = configurations(shape, fixed, cluster, profile, tp=tp, pp=pp, dp=cluster.gpus // (args.cp * tp * pp),
                          distributed_optimizer=bool(args.distributed_optimizer),  # Megatron's default: off
                          sequence_parallel=args.sequence_parallel, sequences=sequences)["rows"]
    if args.mtraining:
        # --mtraining-inner-ring-size counts global ranks per node (default: the launch's ranks per node);
        # the inner ring is the CP ranks among them, CP groups being strided by TP.
        per_node = args.mtraining_inner_ring_size or args.gpus_per_node
        if per_node % tp:
            raise ValueError(f"--mtraining-inner-ring-size {per_node} (ranks per node) is not a multiple of "
                             f"--tensor-model-parallel-size {tp}")
        inner = per_node // tp
        name = "mtraining_flat" if inner >= args.cp else f"mtraining_hier_{inner}"
    elif args.cp_comm_type == "p2p":
        name = "dense_te_p2p"
    elif args.cp_comm_type == "a2a+p2p" or (args.cp_comm_type == "a2a" and args.cp * tp <= cluster.gpus_per_node):
        name = "dense_te_a2a_p2p"  # (a2a inside one node: the all-to-all over the whole CP group, no ring)
    else:
        raise ValueError(f"--cp-comm-type {args.cp_comm_type} is not modelled (p2p, a2a+p2p, and a2a inside a node "
                         "are)")
    if args.cp == 1 and name == "dense_te_a2a_p2p":
        name = "dense_te_p2p"  # one CP rank: no all-to-all, the attention alone
    row = next((r for r in rows if r["name"] == name), None)
    if row is None:
        raise ValueError(f"the run's configuration ({name}) cannot be predicted for these settings")
    return row


def _gib(x: float) -> str:
    return f"{x:.1f}"


KINDS = {"mtraining_flat": "MTraining's sparse ring, flat", "dense_te_p2p": "Transformer Engine's dense CP, p2p ring",
         "dense_te_a2a_p2p": "Transformer Engine's dense CP, a2a+p2p"}


def kind(row: Dict) -> str:
    name = row["name"] if "name" in row else row["configuration"]
    if name.startswith("mtraining_hier"):
        return f"MTraining's sparse ring, hierarchical (inner ring {name.rsplit('_', 1)[1]})"
    return KINDS.get(name, name)


def family(name: str) -> str:
    return "mtraining_hier" if name.startswith("mtraining_hier") else name


def shown_rows(result: Dict, every: bool) -> List[Dict]:
    """The table's rows: every configuration, or each attention's fastest split that fits (the one
    with the least memory where none fits)."""
    rows = result["predictions"]
    if every:
        return rows
    best: Dict[str, Dict] = {}
    for r in rows:
        f, cur = family(r["name"]), best.get(family(r["name"]))
        if cur is None:
            best[f] = r
        elif r["fits"] != cur["fits"]:
            best[f] = r if r["fits"] else cur
        elif r["fits"]:
            best[f] = r if r["step_ms"] < cur["step_ms"] else cur
        else:
            best[f] = r if r["memory"]["peak_gib"] < cur["memory"]["peak_gib"] else cur
    order = ["mtraining_flat", "mtraining_hier", "dense_te_p2p", "dense_te_a2a_p2p"]
    return [best[f] for f in order if f in best]


def _per_sequence(result: Dict) -> str:
    w = result["workload"]
    b, seqs = w["micro_batch"], result.get("global_batch")
    tokens = f"{tokens_both(w['seq_len'])} tokens"
    if seqs is None:
        step = (f"one micro-batch of {b} sequence{'s' if b > 1 else ''} per step over all the GPUs "
                "(--global-batch-tokens for more: data parallelism)")
    else:
        total = seqs * w["seq_len"]
        step = f"{seqs} sequence{'s' if seqs > 1 else ''} per step ({tokens_text(total)} tokens), micro-batches of {b}"
    return f"{tokens} per sequence, {step}"


def _layers_text(w: Dict) -> str:
    if w["layers"] == "transformer_engine":
        return ("Transformer Engine's (--transformer-impl transformer_engine, Megatron's default), "
                + ("FP8 GEMMs" if w["fp8"] else "bf16 GEMMs"))
    return "Megatron's local layers (--transformer-impl local), bf16 GEMMs"


def _model_text(result: Dict) -> str:
    s = dataclasses.replace(QWEN, **result["shape"])
    billions = s.parameters() / 1e9
    return (f"{result.get('model', describe(s))} ({s.layers} layers, hidden {s.hidden}, {s.heads}/{s.kv_groups} "
            f"heads, d {s.head_dim}, FFN {s.ffn}, vocabulary {s.vocab}, "
            f"{'QKV bias' if s.qkv_bias else 'no QKV bias'}, {'untied' if s.untied_embeddings else 'tied'} "
            f"embeddings): {billions:.2f}B parameters")


def _row_text(r: Dict) -> str:
    pipeline = f", {r['micro_batches']} micro-batches" if r["micro_batches"] > 1 else ""
    if r["pp"] > 1:
        pipeline += f", pipeline bubble {100 * r['bubble']:.0f}%"
    return (f"{r['configuration'] if 'configuration' in r else r['name']}, {split_name(r)}, recompute {r['recompute']}"
            f"{pipeline}: {r['tokens_per_s']:.0f} tokens/s")


def format_table(result: Dict, every: bool = False) -> str:
    c, rec = result["cluster"], result["recommendation"]
    lines = [f"{result['profile']} x {c['gpus']} (nodes of {c['gpus_per_node']}, {c['inter_gbps']:g} GB/s between)",
             f"model: {_model_text(result)}",
             f"layers: {_layers_text(result['workload'])}",
             f"workload: {_per_sequence(result)}, density {result['workload']['density']:.3g}",
             "per layer and GPU (ms): attention fwd / bwd with the ring's exposed communication; host floor: the "
             "host's time to enqueue the ring's steps (* where it binds); recompute: the fewest layers that fit "
             "(or as given), per pipeline stage; GiB: peak allocated per GPU; step = all micro-batches through all "
             "layers" + ("" if every else "; each attention's fastest split that fits (--all: every configuration)")]
    header = ["configuration", "DP", "PP", "TP", "CP", "recompute", "GiB", "fits", "attn fwd", "attn bwd",
              "exposed comm", "host floor", "approx", "rest", "step ms", "tokens/s", "limited by"]
    rows = []
    shown = shown_rows(result, every)
    for p in shown:
        floor = (f"{p['host_floor_ms']:.1f}" + ("*" if p["host_wait_ms"] > 0 else "")) if p["host_floor_ms"] else "-"
        rows.append([p["name"], str(p["dp"]), str(p["pp"]), str(p["tp"]), str(p["cp"]), p["recompute"],
                     _gib(p["memory"]["peak_gib"]), "yes" if p["fits"] else "NO", f"{p['attention_fwd_ms']:.1f}",
                     f"{p['attention_bwd_ms']:.1f}", f"{p['exposed_comm_ms']:.1f}", floor,
                     f"{p['approximator_ms']:.2f}", f"{p['rest_of_layer_ms']:.1f}", f"{p['step_ms']:.0f}",
                     f"{p['tokens_per_s']:.0f}", p["limit"]])
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    for row in [header] + rows:
        lines.append("  ".join(x.ljust(wd) for x, wd in zip(row, widths)).rstrip())
    present = {family(p["name"]) for p in result["predictions"]}
    reasons: Dict[str, str] = {}
    for name, why in result["skipped"].items():
        key = name.split(" (")[0]
        if every or family(key) not in present:
            reasons.setdefault(why, name)
    for why, name in reasons.items():
        lines.append(f"not planned: {name}: {why}")
    configured = result.get("configured")
    if configured:
        lines.append(f"as configured: {_row_text(configured)}, {_gib(configured['memory']['peak_gib'])} GiB per GPU"
                     + ("" if configured["fits"] else " (does NOT fit)"))
    if rec is None:
        adv = result["advice"]
        options = []
        if adv["gpus"]:
            options.append(f"{adv['gpus']} GPUs at this length")
        if adv["seq_len"]:
            options.append(f"at most {tokens_both(adv['seq_len'])} tokens on "
                           + ("this GPU" if c["gpus"] == 1 else f"these {c['gpus']} GPUs"))
        if adv.get("fits_unconstrained"):
            lines.append(f"nothing fits in {result['capacity_gib']:.0f} GiB per GPU with the TP or PP size or "
                         "recompute given; without them (every TP and PP size, the fewest recomputed layers that fit) "
                         "this run fits: leave out --tp / --tensor-model-parallel-size, --pp / "
                         "--pipeline-model-parallel-size and the --recompute-* flags")
            return "\n".join(lines)
        lines.append(f"nothing fits in {result['capacity_gib']:.0f} GiB per GPU"
                     + (" with the TP or PP size or recompute given" if adv.get("constrained") else
                        ", even with full recompute and every split searched")
                     + (f"; what would: {' or '.join(options)}" if options else "; no tried GPU count or length does"))
        return "\n".join(lines)
    gpus = c["gpus"]
    pipeline = f", {rec['micro_batches']} micro-batches" if rec["micro_batches"] > 1 else ""
    if rec["pp"] > 1:
        pipeline += f", pipeline bubble {100 * rec['bubble']:.0f}%"
    lines.append(f"recommended: {rec['configuration']} ({kind(rec)}), {split_name(rec)}, recompute "
                 f"{rec['recompute']}{pipeline}: {rec['tokens_per_s']:.0f} tokens/s ({rec['tokens_per_s_per_gpu']:.0f} "
                 f"per GPU); limited by {rec['limited_by']}")
    speedup, mt, dense = rec["speedup_over_best_dense"], rec["best_mtraining"], rec["best_dense_configuration"]
    if rec["method"] == "mtraining":
        lines.append("against Transformer Engine's dense CP: " + (
            f"its fastest that fits is {_row_text(dense)}; MTraining is {speedup:.2f}x faster" if dense else
            "no dense configuration fits"))
    else:
        lines.append("against MTraining: " + (f"its fastest that fits is {_row_text(mt)} ({speedup:.2f}x the "
                                              "dense one)" if mt else "no MTraining configuration fits"))
        lines.append(f"MTraining is not the right tool here: {rec['dense_wins_because']}")
    if rec["pp"] > 1 and rec["micro_batches"] < rec["pp"]:
        m = rec["micro_batches"]
        lines.append(f"note: with {m} micro-batch{'es' if m > 1 else ''} per step "
                     f"the {rec['pp']} pipeline stages mostly wait for each other (bubble {100 * rec['bubble']:.0f}%): "
                     "this split is the fastest only because it uses fewer GPUs per sequence; a larger global batch "
                     "(--global-batch-tokens) fills the pipeline or replicates the model")
    best = next(p for p in result["predictions"] if p["megatron_flags"] == rec["megatron_flags"])
    parts = ", ".join(f"{k.replace('_', ' ')} {v:.1f}" for k, v in best["memory"]["components_gib"].items() if v)
    stage = f", the {best['memory']['stage']}'s" if best["memory"].get("stage") else ""
    lines.append(f"memory per GPU: {_gib(rec['peak_gib'])} GiB peak of {result['capacity_gib']:.0f}{stage} ({parts}; "
                 f"transient: {best['memory']['transient']})")
    lines.append("flags: " + " ".join(rec["megatron_flags"])
                 + (" (no recompute: without any --recompute-* flag)" if rec["recompute_layers"] == 0 else "")
                 + (f" (data parallel {rec['dp']}: the world size of {gpus} over TP x PP x CP)" if rec["dp"] > 1
                    else ""))
    alt = result.get("fp8_alternative")
    if alt:
        lines.append(f"with FP8 GEMMs (--fp8-format hybrid): {alt['configuration']}, {split_name(alt)}, recompute "
                     f"{alt['recompute']}: {alt['tokens_per_s']:.0f} tokens/s")
    if result.get("ignored_args"):
        lines.append(f"ignored flags: {' '.join(result['ignored_args'])}")
    return "\n".join(lines)


def startup_line(result: Dict) -> str:
    """One line for a launcher's log: the run as configured against the fastest configuration that fits."""
    c, rec, run = result["cluster"], result["recommendation"], result.get("configured")
    head = f"[mtraining plan] {result['profile']} x {c['gpus']}, {result['workload']['seq_len']} tokens"
    if run is not None:
        head += (f": this run ({run['name']}, {split_name(run)}, recompute {run['recompute']}) predicted "
                 f"{run['tokens_per_s']:.0f} tokens/s ({run['tokens_per_s'] / c['gpus']:.0f} per GPU), peak "
                 f"{run['memory']['peak_gib']:.1f} GiB per GPU of {result['capacity_gib']:.0f}"
                 + (" (fits)" if run["fits"] else " (does NOT fit)"))
    if rec is None:
        return head + "; nothing fits on these GPUs (python -m megatron_mtraining.plan for what would)"
    return head + (f"; fastest that fits: {rec['configuration']}, {split_name(rec)}, recompute {rec['recompute']}, "
                   f"{rec['tokens_per_s']:.0f} tokens/s ({' '.join(rec['megatron_flags'])}"
                   + (", without any --recompute-* flag" if rec["recompute_layers"] == 0 else "") + ")")


def _global_batch(args) -> Optional[int]:
    """Sequences per step from --global-batch-tokens or Megatron's --global-batch-size (None: neither)."""
    S, b = args.seq_length, args.micro_batch_size
    sequences = None
    if args.global_batch_tokens is not None:
        if args.global_batch_tokens % S:
            raise ValueError(f"--global-batch-tokens {args.global_batch_tokens} is not a whole number of "
                             f"{S}-token sequences")
        sequences = args.global_batch_tokens // S
    if args.global_batch_size is not None:
        if sequences is not None and sequences != args.global_batch_size:
            raise ValueError(f"--global-batch-tokens {args.global_batch_tokens} is {sequences} sequences, "
                             f"--global-batch-size says {args.global_batch_size}")
        sequences = args.global_batch_size
    if sequences is not None and (sequences < 1 or sequences % b):
        raise ValueError(f"a global batch of {sequences} sequences is not a whole number of micro-batches of "
                         f"--micro-batch-size {b}")
    return sequences


def run(argv: Optional[List[str]] = None) -> Dict:
    """Parse, validate and plan; raises ValueError (bad input) with a message that says what to fix."""
    p = parser()
    args, unknown = p.parse_known_args(argv)
    # A bare value after an unknown flag is that flag's value; a leading bare value is a mistake.
    if unknown and not unknown[0].startswith("--"):
        raise ValueError(f"unexpected argument {unknown[0]!r}")
    for name in ("gpus", "cp", "tp", "pp", "micro_batch_size", "global_batch_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            flag = {"cp": "--context-parallel-size", "tp": "--tensor-model-parallel-size",
                    "pp": "--pipeline-model-parallel-size"}.get(name, "--" + name.replace("_", "-"))
            raise ValueError(f"{flag} must be a positive integer, got {value}")
    tp, pp = args.tp, args.pp
    if args.cp is not None:
        group = args.cp * (tp or 1) * (pp or 1)
        gpus = args.gpus if args.gpus is not None else group
        if gpus % group:
            raise ValueError(f"--gpus {args.gpus} is not a multiple of --context-parallel-size {args.cp} x "
                             f"--tensor-model-parallel-size {tp or 1} x --pipeline-model-parallel-size {pp or 1}")
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
    if len(set(args.cp_comm_type)) > 1:
        raise ValueError(f"--cp-comm-type {' '.join(args.cp_comm_type)}: a type per layer is not planned; give one")
    args.cp_comm_type = args.cp_comm_type[0]
    if args.fp8_format is not None and args.transformer_impl != "transformer_engine":
        raise ValueError("--fp8-format needs --transformer-impl transformer_engine (FP8 GEMMs are TE's)")
    if args.transformer_impl == "transformer_engine" and "bf16" not in profile.te_rest_of_layer:
        raise ValueError(f"profile {profile.name} has no Transformer Engine rates (no TE run calibrates it): plan "
                         "with --transformer-impl local, or another --gpu-type")
    work = Workload(args.seq_length, density, args.micro_batch_size, layers=args.transformer_impl,
                    fp8=args.fp8_format is not None, recompute=_recompute(args))
    cluster = Cluster(gpus, args.gpus_per_node, args.inter_gbps, args.inter_latency_us, args.intra_gbps,
                      args.intra_latency_us)
    sequences = _global_batch(args)
    if args.cp is not None and sequences is None and gpus > group:
        # A run's data parallelism without a global batch: Megatron's default, one micro-batch per replica.
        sequences = gpus // group * args.micro_batch_size
    # With a run's CP size the flags describe that run: it is predicted as configured, and the
    # recommendation searches every split and recompute choice; otherwise they constrain the search.
    own = args.cp is not None
    searched = dataclasses.replace(work, recompute=None) if own else work
    result = plan(shape, searched, cluster, profile, tp=None if own else tp,
                  distributed_optimizer=args.distributed_optimizer is not False,
                  pp=None if own else pp, dp=None, sequences=sequences)
    result["model"] = model_title(args, shape)
    result["configured"] = _configured_row(args, shape, work, cluster, profile, sequences)
    result["ignored_args"] = [u for u in unknown if u.startswith("--") and u.split("=")[0] not in NOT_MODELLED]
    result["output"] = "json" if args.json else "startup" if args.startup else "all" if args.all else "table"
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
    elif output == "startup":
        print(startup_line(result))
    else:
        print(format_table(result, every=output == "all"))
    return 0
