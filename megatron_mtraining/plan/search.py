"""The planner's question: what is the fastest way to train this model at this length on these GPUs,
and will it fit?

Every configuration is a split of the GPUs into data (DP) x pipeline (PP) x tensor (TP) x context
(CP) parallel ranks, an attention (MTraining's sparse ring, flat or hierarchical; Transformer
Engine's dense ``p2p`` or ``a2a+p2p`` rings) and a recompute choice; with ``Workload.recompute``
None each configuration takes the fewest recomputed layers that fit (recompute only adds time). A
step trains a global batch of sequences: each of the DP replicas runs its share as micro-batches
of ``Workload.micro_batch`` sequences, through PP stages of ``layers / PP`` layers on Megatron's
1F1B schedule (a step is ``micro-batches + PP - 1`` stage times: the bubble is ``(PP - 1) /
(micro-batches + PP - 1)``). Without a global batch a step is one micro-batch over all the GPUs
(DP 1). The recommendation is the fastest configuration that fits, whichever attention it uses,
never one that does not; beside it the fastest of the other kind (MTraining or dense) that fits,
and where the dense baseline wins, why. When nothing fits, ``advice`` says what would (more GPUs,
a shorter sequence).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Iterator, List, Optional, Tuple

from .memory import Split, fewest_recomputed_layers, memory_estimate, stage_layers, tp_problem
from .model import (BF16, Cluster, ModelShape, Workload, inner_sizes, predict_dense_a2a_p2p, predict_dense_p2p,
                    predict_mtraining, with_recompute)
from .profiles import Profile


def tensor_parallel_sizes(shape: ModelShape, cluster: Cluster) -> List[int]:
    """TP sizes Megatron takes for this shape that keep a TP group inside a node (powers of two)."""
    sizes, tp = [], 1
    while tp <= min(cluster.gpus, cluster.gpus_per_node):
        if cluster.gpus % tp == 0 and not tp_problem(shape, tp):
            sizes.append(tp)
        tp *= 2
    return sizes


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layout_problem(tp: int, cp: int, cluster: Cluster) -> str:
    """Why a TP x CP group does not tile the nodes ('' when it does): Megatron's rank order puts TP
    fastest, then CP, then DP, then PP, so a TP x CP group is consecutive ranks, and over several
    nodes it must fill whole nodes or share one without straddling two."""
    group, gpus_per_node = tp * cp, cluster.gpus_per_node
    if cluster.gpus <= gpus_per_node:
        return ""
    if (group > gpus_per_node and group % gpus_per_node) or (group < gpus_per_node and gpus_per_node % group):
        return f"a TP {tp} x CP {cp} group of {group} GPUs does not tile nodes of {gpus_per_node}"
    return ""


def splits(shape: ModelShape, cluster: Cluster, tp: Optional[int] = None, pp: Optional[int] = 1,
           dp: Optional[int] = 1, sequences: Optional[int] = None, micro_batch: int = 1) -> Iterator[Split]:
    """Every DP x PP x TP x CP split of the GPUs: TP (None: every size the model takes inside a node),
    PP (None: every stage count the layers divide into) and DP (None: every replica count the global
    batch of ``sequences`` divides over in whole micro-batches; without a global batch, 1) fixed or
    searched; CP is what remains."""
    if sequences is None and dp not in (None, 1):
        raise ValueError(f"data parallelism {dp} needs a global batch (--global-batch-tokens)")
    micro_batches = (sequences or micro_batch) // micro_batch
    for t in ([tp] if tp else tensor_parallel_sizes(shape, cluster)):
        problem = tp_problem(shape, t)
        if problem:
            raise ValueError(problem)
        if cluster.gpus % t:
            raise ValueError(f"TP {t} does not divide the {cluster.gpus} GPUs")
        for p in ([pp] if pp else [x for x in _divisors(shape.layers) if (cluster.gpus // t) % x == 0]):
            if pp:
                stage_layers(shape, p)
                if (cluster.gpus // t) % p:
                    raise ValueError(f"TP {t} x PP {p} does not divide the {cluster.gpus} GPUs")
            rest = cluster.gpus // (t * p)
            for d in ([dp] if dp else [x for x in _divisors(rest) if micro_batches % x == 0]):
                if rest % d:
                    raise ValueError(f"TP {t} x PP {p} x DP {d} does not divide the {cluster.gpus} GPUs")
                if micro_batches % d:
                    raise ValueError(f"a global batch of {sequences} sequences does not split over DP {d} in "
                                     f"micro-batches of {micro_batch}")
                c = rest // d
                if layout_problem(t, c, cluster):
                    continue
                yield Split(tp=t, cp=c, dp=d, pp=p)


def recompute_flags(layers: int, total: int) -> List[str]:
    if layers == 0:
        return []
    if layers == total:
        return ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    return ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", str(layers)]


def recompute_name(layers: int, total: int) -> str:
    return "none" if layers == 0 else "full" if layers == total else f"{layers}/{total} layers"


def megatron_flags(row: Dict, shape: ModelShape) -> List[str]:
    """The Megatron flags that select a configuration (beside the model's own)."""
    flags = ["--tensor-model-parallel-size", str(row["tp"]), "--context-parallel-size", str(row["cp"])]
    pp = row.get("pp", 1)
    if pp > 1:
        flags += ["--pipeline-model-parallel-size", str(pp)]
    if row["tp"] > 1 and row.get("sequence_parallel", True):
        flags.append("--sequence-parallel")
    # Megatron's --recompute-num-layers counts a pipeline stage's layers.
    flags += recompute_flags(row["recompute_layers"], shape.layers // pp)
    if row.get("distributed_optimizer"):  # the memory it fits in counts on it (Megatron's default is off)
        flags.append("--use-distributed-optimizer")
    if row.get("global_batch"):  # the data-parallel size is what the world size leaves: DP = GPUs / (TP x PP x CP)
        flags += ["--micro-batch-size", str(row["micro_batch"]), "--global-batch-size", str(row["global_batch"])]
    if row["method"] == "mtraining":
        flags.append("--mtraining")
        if row["inner"]:
            # The flag counts global ranks per node (CP groups are strided by TP): TP x the ring's CP ranks.
            flags += ["--mtraining-inner-ring-size", str(row["inner"] * row["tp"])]
    elif row["name"] == "dense_te_p2p":
        flags += ["--cp-comm-type", "p2p"]
    elif row["inner"]:  # all-to-all inside a node, a ring across: Megatron needs both sizes for a2a+p2p
        flags += ["--cp-comm-type", "a2a+p2p",
                  "--hierarchical-context-parallel-sizes", str(row["inner"]), str(row["cp"] // row["inner"])]
    else:  # the whole CP group in one all-to-all (one node): Megatron's and TE's a2a
        flags += ["--cp-comm-type", "a2a"]
    return flags


def split_name(split) -> str:
    """"TP 2 x CP 4", with "DP d x " and "PP p x " in front where they are above 1 (a Split or a row)."""
    get = (lambda k: split[k]) if isinstance(split, dict) else (lambda k: getattr(split, k))
    parts = [f"{k.upper()} {get(k)}" for k in ("dp", "pp") if get(k) > 1]
    return " x ".join(parts + [f"TP {get('tp')}", f"CP {get('cp')}"])


def group_cluster(cluster: Cluster, split: Split) -> Cluster:
    """The GPUs of one TP x CP group (consecutive ranks: the ring's view of its nodes)."""
    return dataclasses.replace(cluster, gpus=split.tp * split.cp)


def _predictions(shape: ModelShape, work: Workload, cluster: Cluster, profile: Profile, tp: int, skipped: Dict,
                 label: str = ""):
    cp = cluster.gpus // tp
    out = []
    calls = [("mtraining_flat", lambda: predict_mtraining(shape, work, cluster, profile, tp=tp))]
    calls += [(f"mtraining_hier_{i}", lambda i=i: predict_mtraining(shape, work, cluster, profile, inner=i, tp=tp))
              for i in inner_sizes(cp)]
    calls += [("dense_te_p2p", lambda: predict_dense_p2p(shape, work, cluster, profile, tp=tp))]
    if cp > 1:  # on one CP rank the all-to-all is no attention of its own: the p2p row is that run
        calls += [("dense_te_a2a_p2p", lambda: predict_dense_a2a_p2p(shape, work, cluster, profile, tp=tp))]
    for name, call in calls:
        try:
            out.append(call())
        except ValueError as exc:
            skipped[f"{name} ({label})" if label else name] = str(exc)
    return out


def _pipeline_p2p_ms(shape: ModelShape, work: Workload, cluster: Cluster, profile: Profile, split: Split) -> float:
    """One micro-batch's activations handed to the next stage and its gradient back (not overlapped):
    a CP rank's [tokens, hidden] bf16 tensor, split over TP by sequence parallelism. Stages are
    DP x TP x CP ranks apart: in another node once that many GPUs fill one."""
    if split.pp == 1:
        return 0.0
    nbytes = work.seq_len // split.cp * work.micro_batch * shape.hidden * BF16 / split.tp
    if split.dp * split.tp * split.cp >= cluster.gpus_per_node:
        gbps, latency_us = cluster.inter_gbps, cluster.inter_latency_us
    else:
        gbps = cluster.intra_gbps or profile.intra_gbps
        latency_us = profile.intra_latency_us if cluster.intra_latency_us is None else cluster.intra_latency_us
    return 2 * (latency_us / 1e3 + nbytes / (gbps * 1e9) * 1e3)


def _length_problem(shape: ModelShape, work: Workload, cluster: Cluster, profile: Profile, cps: List[int]) -> str:
    """One message for a length no searched split of MTraining's striped layout takes."""
    B, S = profile.block_size, work.seq_len
    if not cps or any(S % (c * B) == 0 for c in cps):
        return ""
    unit = min(cps) * B
    sizes = sorted(set(cps), reverse=True)
    lower, upper = S // unit * unit, (S // unit + 1) * unit
    near = " or ".join(tokens_both(x) for x in (lower, upper) if x > 0)
    if unit == B:
        return f"sequence length {S} is not a multiple of MTraining's {B}-token block: {near}, say"
    listed = ", ".join(map(str, sizes[:-1])) + (" or " if len(sizes) > 1 else "") + str(sizes[-1])
    return (f"sequence length {S} is not a multiple of {B} tokens (MTraining's block) x the context-parallel size "
            f"(CP {listed} for the splits of {gpus_text(cluster.gpus)}), so it does not split into whole blocks per "
            f"rank: a multiple of {unit}, {near}, say")


def gpus_text(n: int) -> str:
    return f"{n} GPU" + ("" if n == 1 else "s")


def tokens_both(n: int) -> str:
    """524288 -> "524288 (512K)"; 18816 -> "18816"."""
    short = tokens_text(n)
    return str(n) if short == str(n) else f"{n} ({short})"


def tokens_text(n: int) -> str:
    """524288 -> "512K", 1048576 -> "1M" (exact multiples only; else the number)."""
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20}M"
    if n >= 1 << 10 and n % (1 << 10) == 0:
        return f"{n >> 10}K"
    return str(n)


def configurations(shape: ModelShape, work: Workload, cluster: Cluster, profile: Profile,
                   tp: Optional[int] = None, distributed_optimizer: bool = True,
                   sequence_parallel: bool = True, pp: Optional[int] = 1, dp: Optional[int] = 1,
                   sequences: Optional[int] = None) -> Dict:
    """Every configuration with its step time, recompute choice and memory (``rows``), and why any was
    left out (``skipped``). ``tp``, ``pp``, ``dp``: a fixed size, or None to search every one (the
    defaults: TP searched, PP and DP 1); ``sequences``: the global batch per step (None: one
    micro-batch, ``work.micro_batch`` sequences). ``sequence_parallel`` False: TP without Megatron's
    ``--sequence-parallel`` (a run's own flags; the search itself always plans TP with it)."""
    b = work.micro_batch
    if sequences is not None and (sequences < 1 or sequences % b):
        raise ValueError(f"a global batch of {sequences} sequences is not a whole number of micro-batches of {b}")
    rows, skipped = [], {}
    cache: Dict[Tuple[int, int], list] = {}
    cps = []
    for split in splits(shape, cluster, tp, pp, dp, sequences, b):
        split = dataclasses.replace(split, sequence_parallel=sequence_parallel)
        cps.append(split.cp)
        key = (split.tp, split.cp)
        if key not in cache:
            label = "" if split.tp == 1 and (pp, dp) == (1, 1) else split_name(Split(tp=split.tp, cp=split.cp))
            cache[key] = _predictions(shape, work, group_cluster(cluster, split), profile, split.tp, skipped, label)
        L = stage_layers(shape, split.pp)
        micro_batches = (sequences or b) // (b * split.dp)
        fixed = work.recomputed_layers(L)
        p2p = _pipeline_p2p_ms(shape, work, cluster, profile, split)
        for base in cache[key]:
            if fixed is None:
                layers, memory = fewest_recomputed_layers(shape, work, split, profile, base.method,
                                                          distributed_optimizer, micro_batches)
                layers = L if layers is None else layers
            else:
                layers = fixed
                memory = memory_estimate(shape, work, split, profile, base.method, layers, distributed_optimizer,
                                         micro_batches)
            p = dataclasses.replace(base)
            if split.pp == 1:
                p = with_recompute(p, shape, work, layers)
                if micro_batches > 1:  # gradient accumulation: the micro-batches one after another
                    p.step_ms = micro_batches * (p.step_ms - profile.step_fixed_ms) + profile.step_fixed_ms
            else:
                layer = p.attention_fwd_ms + p.attention_bwd_ms + p.approximator_ms + p.rest_of_layer_ms
                recomputed = p.attention_fwd_ms + p.approximator_ms + p.rest_of_layer_ms / 3
                # The slowest stage (the last: it holds the output layer and the loss), m + PP - 1 times.
                stage = L * layer + p.head_ms + layers * recomputed + p2p
                p.step_ms = (micro_batches + split.pp - 1) * stage + profile.step_fixed_ms
                what = "full recompute" if layers == L else f"{layers} of {L} layers recomputed" if layers else ""
                p.note = "; ".join(x for x in (p.note, f"with {what}" if what else "") if x)
            sequences_per_step = micro_batches * b * split.dp
            p.tokens_per_s = work.seq_len * sequences_per_step / p.step_ms * 1e3
            rows.append({**p.as_dict(), "dp": split.dp, "pp": split.pp, "tp": split.tp, "cp": split.cp,
                         "sequence_parallel": sequence_parallel and split.tp > 1,
                         "distributed_optimizer": distributed_optimizer, "micro_batch": b,
                         "micro_batches": micro_batches, "global_batch": sequences,
                         "bubble": (split.pp - 1) / (micro_batches + split.pp - 1), "pipeline_p2p_ms": p2p,
                         "recompute_layers": layers, "recompute": recompute_name(layers, L), "memory": memory,
                         "fits": memory["fits"]})
    if not any(r["method"] == "mtraining" for r in rows):
        problem = _length_problem(shape, work, cluster, profile, cps)
        if problem:
            raise ValueError(problem)
        if not cps:
            raise ValueError(f"no split of {gpus_text(cluster.gpus)} into DP x PP x TP x CP suits this model and "
                             "batch (a TP x CP group must tile the nodes)")
        reasons = {why for name, why in skipped.items() if name.startswith("mtraining")}
        raise ValueError("no MTraining configuration can be planned: " + "; ".join(sorted(reasons)))
    for row in rows:
        row["megatron_flags"] = megatron_flags(row, shape)
    return {"rows": rows, "skipped": skipped}


def _fastest(rows: List[Dict], method: Optional[str] = None) -> Optional[Dict]:
    fitting = [r for r in rows if (method is None or r["method"] == method) and r["fits"]]
    return min(fitting, key=lambda r: r["step_ms"]) if fitting else None


def _fits_somewhere(shape: ModelShape, work: Workload, cluster: Cluster, profile: Profile,
                    distributed_optimizer: bool, search: Optional[Dict] = None) -> bool:
    try:
        rows = configurations(shape, dataclasses.replace(work, recompute=None), cluster, profile,
                              distributed_optimizer=distributed_optimizer, **dict(search or {}, tp=None))["rows"]
    except ValueError:
        return False
    return any(r["fits"] for r in rows)


def advice(shape: ModelShape, work: Workload, cluster: Cluster, profile: Profile,
           distributed_optimizer: bool = True, search: Optional[Dict] = None) -> Dict:
    """What would fit when nothing does here: the fewest GPUs (whole nodes, or powers of two inside one)
    at this length, and the longest sequence on these GPUs (whole striped blocks per rank); ``search``:
    ``configurations``' pp, dp and sequences (TP is searched)."""
    gpus = None
    search = dict(search or {})
    # With one sequence over all the GPUs (no PP, no DP), a CP size the length does not split over ends it.
    cp_is_all = search.get("pp", 1) == 1 and search.get("dp", 1) in (1, None) and search.get("sequences") is None
    for count in (cluster.gpus * 2 ** i for i in range(1, 11)):
        if count > cluster.gpus_per_node and count % cluster.gpus_per_node:
            continue
        if cp_is_all and work.seq_len % (count * profile.block_size):
            break
        if _fits_somewhere(shape, work, dataclasses.replace(cluster, gpus=count), profile, distributed_optimizer,
                           search):
            gpus = count
            break
    unit = cluster.gpus * profile.block_size * 2
    longest, lo, hi = None, 1, work.seq_len // unit
    while lo <= hi:  # memory grows with the length: bisect on whole units
        mid = (lo + hi) // 2
        if _fits_somewhere(shape, dataclasses.replace(work, seq_len=mid * unit), cluster, profile,
                           distributed_optimizer, search):
            longest, lo = mid * unit, mid + 1
        else:
            hi = mid - 1
    return {"gpus": gpus, "seq_len": longest}


def _summary(row: Dict, gpus: int) -> Dict:
    return {"configuration": row["name"], "method": row["method"], "inner_ring_size": row["inner"],
            "dp": row["dp"], "pp": row["pp"], "tp": row["tp"], "cp": row["cp"],
            "micro_batches": row["micro_batches"], "bubble": row["bubble"], "step_ms": row["step_ms"],
            "tokens_per_s": row["tokens_per_s"], "tokens_per_s_per_gpu": row["tokens_per_s"] / gpus,
            "limited_by": row["limit"], "recompute": row["recompute"], "recompute_layers": row["recompute_layers"],
            "peak_gib": row["memory"]["peak_gib"], "megatron_flags": row["megatron_flags"]}


def why_dense_wins(mtraining: Optional[Dict], dense: Dict, work: Workload, batch: bool = False) -> str:
    """One line: why the dense baseline is the faster tool here (MTraining's fastest that fits against
    the dense one); ``batch``: whether the step has a global batch the search spreads over replicas."""
    fewer = ("fewer GPUs per sequence (more data parallelism)" if batch else
             "fewer GPUs per sequence: a global batch of several sequences (--global-batch-tokens), which the search "
             "spreads over data-parallel replicas")
    if mtraining is None:
        return ("no MTraining configuration fits in memory here (its attention keeps its output twice, and its "
                "ring's fp32 dQ and dK/dV sums), and a dense one does")
    tokens = work.seq_len // mtraining["cp"] * work.micro_batch
    per_rank = f"{tokens_text(tokens)} tokens per context-parallel rank"
    limit = mtraining["limit"]
    if limit == "host/launch floor":
        return (f"at {per_rank} its ring is host/launch-bound: each ring step waits for the host to enqueue it "
                f"({mtraining['host_wait_ms']:.0f} ms per layer of GPU idle), so the sparse saving cannot show; "
                f"it pays with longer sequences or {fewer}")
    if limit == "per-step fixed costs":
        return (f"at {per_rank} its kernels' fixed costs per ring step (every step walks all of the rank's query "
                f"blocks) outweigh the sparse work it saves; it pays with longer sequences or {fewer}")
    if limit == "rest of the layer":
        return (f"at {per_rank} attention is a small part of a layer (the projections and MLP take "
                f"{mtraining['rest_of_layer_ms']:.1f} ms of it), so a sparse attention saves little, less than its "
                "index and ring cost; it pays at longer sequences")
    if limit == "approximator":
        return "its index approximator costs more than the sparse attention saves at this length"
    if limit == "exposed communication":
        return (f"its ring's communication is exposed ({mtraining['exposed_comm_ms']:.1f} ms per layer) over these "
                "links; a hierarchical ring, faster links or longer sequences per GPU would hide it")
    return (f"at density {work.density:g} the sparse kernels' work is not below the dense attention's: MTraining "
            "pays at high sparsity (low density) and long sequences")


def plan(shape: ModelShape, work: Workload, cluster: Cluster, profile: Profile, tp: Optional[int] = None,
         distributed_optimizer: bool = True, pp: Optional[int] = 1, dp: Optional[int] = 1,
         sequences: Optional[int] = None) -> Dict:
    """Every configuration's prediction and memory, and the fastest configuration that fits, MTraining
    or dense (the search's sizes as ``configurations`` takes them)."""
    search = {"pp": pp, "dp": dp, "sequences": sequences}
    found = configurations(shape, work, cluster, profile, tp, distributed_optimizer, **search)
    rows = found["rows"]
    best, best_mt, best_dense = _fastest(rows), _fastest(rows, "mtraining"), _fastest(rows, "dense")
    recommendation = None
    if best is not None:
        other = best_dense if best["method"] == "mtraining" else best_mt
        recommendation = {
            **_summary(best, cluster.gpus),
            "best_mtraining": _summary(best_mt, cluster.gpus) if best_mt else None,
            "best_dense": best_dense["name"] if best_dense else None,
            "best_dense_configuration": _summary(best_dense, cluster.gpus) if best_dense else None,
            "best_dense_flags": best_dense["megatron_flags"] if best_dense else None,
            # MTraining's fastest over the dense baseline's fastest (both fitting), whichever is recommended.
            # (Every row trains the same tokens per step: the step times' ratio is the tokens/s ratio.)
            "speedup_over_best_dense": best_dense["step_ms"] / best_mt["step_ms"] if best_mt and best_dense else None,
            "runner_up": other["name"] if other else None,
            "dense_wins_because": why_dense_wins(best_mt, best_dense, work, sequences is not None)
            if best["method"] == "dense" else None,
        }
    result = {"shape": dataclasses.asdict(shape), "workload": dataclasses.asdict(work),
              "cluster": dataclasses.asdict(cluster), "profile": profile.name, "capacity_gib": profile.memory_gib,
              "distributed_optimizer": distributed_optimizer, "global_batch": sequences, "predictions": rows,
              "skipped": found["skipped"], "recommendation": recommendation, "advice": None}
    if best is None:
        # The advice plans freely (every TP size, the fewest recomputed layers that fit): where the search
        # was held to a TP size or a recompute choice, it may find that this very run fits without them.
        result["advice"] = dict(advice(shape, work, cluster, profile, distributed_optimizer, search),
                                constrained=tp is not None or work.recompute is not None or pp not in (None, 1))
        if result["advice"]["constrained"]:
            free = dict(search, pp=None) if pp not in (None, 1) else search
            result["advice"]["fits_unconstrained"] = _fits_somewhere(shape, work, cluster, profile,
                                                                     distributed_optimizer, free)
    if work.layers == "transformer_engine" and not work.fp8 and "fp8" in profile.te_rest_of_layer:
        fp8_rows = configurations(shape, dataclasses.replace(work, fp8=True), cluster, profile, tp,
                                  distributed_optimizer, **search)["rows"]
        fp8_best = _fastest(fp8_rows)
        if fp8_best is not None:
            result["fp8_alternative"] = {"configuration": fp8_best["name"], "tp": fp8_best["tp"],
                                         "dp": fp8_best["dp"], "pp": fp8_best["pp"], "cp": fp8_best["cp"],
                                         "recompute": fp8_best["recompute"], "tokens_per_s": fp8_best["tokens_per_s"]}
    return result
