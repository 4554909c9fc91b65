"""The planner's question: what is the fastest way to train this model at this length on these GPUs,
and will it fit?

Every configuration is a tensor x context-parallel split of the GPUs, an attention (MTraining's
sparse ring, flat or hierarchical; Transformer Engine's dense ``p2p`` or ``a2a+p2p`` rings) and a
recompute choice; with ``Workload.recompute`` None each configuration takes the fewest recomputed
layers that fit (recompute only adds time). The recommendation is the fastest MTraining
configuration that fits, never one that does not; when none fits, ``advice`` says what would
(more GPUs, a shorter sequence). The dense baseline it is compared with is likewise the fastest
dense configuration that fits.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

from .memory import Split, fewest_recomputed_layers, memory_estimate, tp_problem
from .model import (Cluster, ModelShape, Workload, inner_sizes, predict_dense_a2a_p2p, predict_dense_p2p,
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
    if row["tp"] > 1 and row.get("sequence_parallel", True):
        flags.append("--sequence-parallel")
    flags += recompute_flags(row["recompute_layers"], shape.layers)
    if row.get("distributed_optimizer"):  # the memory it fits in counts on it (Megatron's default is off)
        flags.append("--use-distributed-optimizer")
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


def _predictions(shape: ModelShape, work: Workload, cluster: Cluster, profile: Profile, tp: int, skipped: Dict):
    cp = cluster.gpus // tp
    out = []
    calls = [("mtraining_flat", lambda: predict_mtraining(shape, work, cluster, profile, tp=tp))]
    calls += [(f"mtraining_hier_{i}", lambda i=i: predict_mtraining(shape, work, cluster, profile, inner=i, tp=tp))
              for i in inner_sizes(cp)]
    calls += [("dense_te_p2p", lambda: predict_dense_p2p(shape, work, cluster, profile, tp=tp)),
              ("dense_te_a2a_p2p", lambda: predict_dense_a2a_p2p(shape, work, cluster, profile, tp=tp))]
    for name, call in calls:
        try:
            out.append(call())
        except ValueError as exc:
            skipped[name if tp == 1 else f"{name} (TP {tp})"] = str(exc)
    return out


def configurations(shape: ModelShape, work: Workload, cluster: Cluster, profile: Profile,
                   tp: Optional[int] = None, distributed_optimizer: bool = True,
                   sequence_parallel: bool = True) -> Dict:
    """Every configuration with its step time, recompute choice and memory (``rows``), and why any was
    left out (``skipped``). ``sequence_parallel`` False: TP without Megatron's ``--sequence-parallel``
    (a run's own flags; the search itself always plans TP with it)."""
    rows, skipped = [], {}
    fixed = work.recomputed_layers(shape.layers)
    for t in ([tp] if tp else tensor_parallel_sizes(shape, cluster)):
        problem = tp_problem(shape, t)
        if problem:
            raise ValueError(problem)
        split = Split(tp=t, cp=cluster.gpus // t, sequence_parallel=sequence_parallel)
        for p in _predictions(shape, work, cluster, profile, t, skipped):
            if fixed is None:
                layers, memory = fewest_recomputed_layers(shape, work, split, profile, p.method,
                                                          distributed_optimizer)
                layers = shape.layers if layers is None else layers
            else:
                layers = fixed
                memory = memory_estimate(shape, work, split, profile, p.method, layers, distributed_optimizer)
            p = with_recompute(p, shape, work, layers)
            rows.append({**p.as_dict(), "tp": t, "cp": split.cp, "sequence_parallel": sequence_parallel and t > 1,
                         "distributed_optimizer": distributed_optimizer,
                         "recompute_layers": layers,
                         "recompute": recompute_name(layers, shape.layers), "memory": memory,
                         "fits": memory["fits"]})
    if not any(r["method"] == "mtraining" for r in rows):
        reasons = {why for name, why in skipped.items() if name.startswith("mtraining")}
        raise ValueError("no MTraining configuration can be planned: " + "; ".join(sorted(reasons)))
    for row in rows:
        row["megatron_flags"] = megatron_flags(row, shape)
    return {"rows": rows, "skipped": skipped}


def _fastest(rows: List[Dict], method: str) -> Optional[Dict]:
    fitting = [r for r in rows if r["method"] == method and r["fits"]]
    return min(fitting, key=lambda r: r["step_ms"]) if fitting else None


def _fits_somewhere(shape: ModelShape, work: Workload, cluster: Cluster, profile: Profile,
                    distributed_optimizer: bool) -> bool:
    try:
        rows = configurations(shape, dataclasses.replace(work, recompute=None), cluster, profile,
                              distributed_optimizer=distributed_optimizer)["rows"]
    except ValueError:
        return False
    return any(r["method"] == "mtraining" and r["fits"] for r in rows)


def advice(shape: ModelShape, work: Workload, cluster: Cluster, profile: Profile,
           distributed_optimizer: bool = True) -> Dict:
    """What would fit when nothing does here: the fewest GPUs (whole nodes, or powers of two inside one)
    at this length, and the longest sequence on these GPUs (whole striped blocks per rank)."""
    gpus = None
    for count in (cluster.gpus * 2 ** i for i in range(1, 11)):
        if count > cluster.gpus_per_node and count % cluster.gpus_per_node:
            continue
        if work.seq_len % (count * profile.block_size):
            break
        if _fits_somewhere(shape, work, dataclasses.replace(cluster, gpus=count), profile, distributed_optimizer):
            gpus = count
            break
    unit = cluster.gpus * profile.block_size * 2
    longest, lo, hi = None, 1, work.seq_len // unit
    while lo <= hi:  # memory grows with the length: bisect on whole units
        mid = (lo + hi) // 2
        if _fits_somewhere(shape, dataclasses.replace(work, seq_len=mid * unit), cluster, profile,
                           distributed_optimizer):
            longest, lo = mid * unit, mid + 1
        else:
            hi = mid - 1
    return {"gpus": gpus, "seq_len": longest}


def plan(shape: ModelShape, work: Workload, cluster: Cluster, profile: Profile, tp: Optional[int] = None,
         distributed_optimizer: bool = True) -> Dict:
    """Every configuration's prediction and memory, and the fastest MTraining configuration that fits."""
    found = configurations(shape, work, cluster, profile, tp, distributed_optimizer)
    rows = found["rows"]
    best, best_dense = _fastest(rows, "mtraining"), _fastest(rows, "dense")
    recommendation = None
    if best is not None:
        recommendation = {
            "configuration": best["name"], "inner_ring_size": best["inner"], "tp": best["tp"], "cp": best["cp"],
            "step_ms": best["step_ms"], "tokens_per_s": best["tokens_per_s"],
            "tokens_per_s_per_gpu": best["tokens_per_s"] / cluster.gpus, "limited_by": best["limit"],
            "recompute": best["recompute"], "recompute_layers": best["recompute_layers"],
            "peak_gib": best["memory"]["peak_gib"], "megatron_flags": best["megatron_flags"],
            "best_dense": best_dense["name"] if best_dense else None,
            "best_dense_flags": best_dense["megatron_flags"] if best_dense else None,
            "speedup_over_best_dense": best_dense["step_ms"] / best["step_ms"] if best_dense else None,
        }
    result = {"shape": dataclasses.asdict(shape), "workload": dataclasses.asdict(work),
              "cluster": dataclasses.asdict(cluster), "profile": profile.name, "capacity_gib": profile.memory_gib,
              "distributed_optimizer": distributed_optimizer, "predictions": rows, "skipped": found["skipped"],
              "recommendation": recommendation,
              "advice": None}
    if best is None:
        # The advice plans freely (every TP size, the fewest recomputed layers that fit): where the search
        # was held to a TP size or a recompute choice, it may find that this very run fits without them.
        result["advice"] = dict(advice(shape, work, cluster, profile, distributed_optimizer),
                                constrained=tp is not None or work.recompute is not None)
        if result["advice"]["constrained"]:
            result["advice"]["fits_unconstrained"] = _fits_somewhere(shape, work, cluster, profile,
                                                                     distributed_optimizer)
    if work.layers == "transformer_engine" and not work.fp8 and "fp8" in profile.te_rest_of_layer:
        fp8_rows = configurations(shape, dataclasses.replace(work, fp8=True), cluster, profile, tp,
                                  distributed_optimizer)["rows"]
        fp8_best = _fastest(fp8_rows, "mtraining")
        if fp8_best is not None:
            result["fp8_alternative"] = {"configuration": fp8_best["name"], "tp": fp8_best["tp"],
                                         "recompute": fp8_best["recompute"], "tokens_per_s": fp8_best["tokens_per_s"]}
    return result
