"""Device profiles for the step-time model (``megatron_mtraining/plan``): derived or measured.

Two ways to a profile, one set of fits:

    python benchmarks/calibrate.py --from-results benchmarks/results          # CPU, seconds
        derives megatron_mtraining/plan/profiles/nvidia-h200.json and nvidia-h100.json from the
        committed results (every profile lists the files it read under "sources")
    python benchmarks/calibrate.py --gpu --out /tmp/profile.json              # one GPU
    python -m torch.distributed.run --nproc_per_node 2 benchmarks/calibrate.py --gpu --out P.json
        measures the same primitives directly (with 2+ ranks also NCCL point-to-point)
    python benchmarks/calibrate.py --gpu --smoke                              # CPU, tiny shapes: tests the script

What a profile holds (``plan/profiles.py``): the sparse kernels' forward and backward cost as
``per_call + per_item * items + per_tile * tiles`` (items: (query block, head) units; tiles: active
B x B blocks), fitted by relative least squares over one-GPU runs at several lengths and densities;
the dense (cuDNN) kernel's cost in the same units; the approximator's local rate; NCCL
point-to-point bandwidth and latency; the rest of the layer as a GEMM rate plus elementwise time per
token and layer; the sparse ring's host/launch floor per ring step (the time the host needs to
enqueue a step, which the step cannot undercut however little work it holds), from a one-GPU ring
call at small work. Figures no committed result holds are listed under "assumed" with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)

from megatron_mtraining.plan.cli import read_telemetry as telemetry  # noqa: E402
from megatron_mtraining.plan.model import ModelShape  # noqa: E402
from megatron_mtraining.plan.profiles import PROFILE_DIR, KernelCost  # noqa: E402

# The e2e benchmark's model (benchmarks/e2e.py): Qwen2.5-3B layers, vocabulary 8192.
E2E_VOCAB = 8192
# Device facts (vendor specifications), not measurements.
SPEC = {"nvidia-h200": {"memory_gib": 140.4, "hbm_gbps": 4800.0},
        "nvidia-h100": {"memory_gib": 79.6, "hbm_gbps": 3350.0}}
# The approximator's collectives per layer (megatron_mtraining/approx.py): all-reduces of the last
# queries, the row maxima, the normaliser and the slash masses; two all-gathers of candidates.
APPROX_COLLECTIVES = 6
# The host/launch floor is identified only where the kernels would take at most this share of the
# measured call: there the call's time is the host's, not the GPU's.
HOST_BOUND_SHARE = 0.5
LEAD_MAX_FLOORS = 4.0  # host_lead_share reads runs whose kernels take under this many floors
# The ring benchmark's per-step telemetry kinds (benchmarks/ring.py: steps.timeline).
STEP_KINDS = ("compute", "wait", "plan", "merge")
# Sequence-parallel TP collectives inside a node (all-gather / reduce-scatter bus bandwidth): assumed.
TP_COLLECTIVE_GBPS_ASSUMED = 350.0
# NCCL point-to-point inside a node: no committed result holds it (see "assumed").
INTRA_GBPS_DOCUMENTED = 161.0
INTRA_LATENCY_US_ASSUMED = 10.0


# ----------------------------------------------------------------------------------------------
# Fits
# ----------------------------------------------------------------------------------------------


def _solve(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> List[float]:
    """Least squares of ``rows @ x ~ ys`` relative to ys (each point weighs by its relative error)."""
    import numpy as np

    A = np.array(rows, dtype=float) / np.array(ys, dtype=float)[:, None]
    x, *_ = np.linalg.lstsq(A, np.ones(len(ys)), rcond=None)
    return [float(v) for v in x]


def fit_cost(points: Sequence[Dict], key: str, features: Sequence[str] = ("per_call", "per_item", "per_tile")) -> Dict:
    """``{per_call, per_item, per_tile}`` fitted to ``points`` (dicts with items, tiles and ``key`` in
    ms). A coefficient that comes out negative is dropped (set to 0) and the rest refitted: a
    negative fixed cost would predict negative times at small work."""
    value = {"per_call": lambda p: 1.0, "per_item": lambda p: p["items"], "per_tile": lambda p: p["tiles"]}
    active = list(features)
    if len(points) < len(active):
        raise ValueError(f"fit of {key}: {len(points)} points cannot determine {len(active)} coefficients")
    while True:
        x = _solve([[value[f](p) for f in active] for p in points], [p[key] for p in points])
        negative = [f for f, v in zip(active, x) if v < 0]
        if not negative:
            break
        active.remove(negative[0])
    cost = {f: 0.0 for f in ("per_call", "per_item", "per_tile")}
    cost.update(dict(zip(active, x)))
    errors = [(cost["per_call"] + cost["per_item"] * p["items"] + cost["per_tile"] * p["tiles"]) / p[key] - 1
              for p in points]
    return {"cost": cost, "max_abs_rel_error": max(abs(e) for e in errors), "points": len(points)}


# ----------------------------------------------------------------------------------------------
# From the committed results
# ----------------------------------------------------------------------------------------------


def _load(results_dir: str, name: str) -> Dict:
    path = os.path.join(results_dir, name)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"calibration needs {path} (a committed benchmark result)")
    with open(path) as fh:
        return json.load(fh)


def kernel_points(results_dir: str) -> Tuple[List[Dict], List[Dict], List[str]]:
    """One-GPU sparse and dense points of the current kernels: kernel.py at 64K / 128K / 512K and at
    2.5 / 5 / 10% density, and packed.py's unpacked run at the packed run's (smaller) work."""
    sparse, dense, sources = [], [], []
    files = ["kernel_nvidia-h200.json", "kernel_report_512k_nvidia-h200.json",
             "kernel_report_d025_nvidia-h200.json", "kernel_report_d10_nvidia-h200.json"]
    for name in files:
        d = _load(results_dir, name)
        cfg = d["config"]
        B, H = cfg["block_size"], cfg["heads"]
        for run in d["runs"]:
            S = run["seq_len"]
            items = H * S / B
            point = {"source": name, "seq_len": S, "density": run["index"]["density_mean"], "items": items,
                     "tiles": run["index"]["active_pairs"] / B ** 2, "fwd": run["ours"]["fwd_ms"],
                     "bwd": run["ours"]["fwdbwd_ms"] - run["ours"]["fwd_ms"]}
            sparse.append(point)
            causal_tiles = S * (S + 1) / 2 * H / B ** 2
            dense.append({"source": name, "seq_len": S, "items": 0.0, "tiles": causal_tiles,
                          "fwd": run["dense"]["fwd_ms"], "bwd": run["dense"]["fwdbwd_ms"] - run["dense"]["fwd_ms"]})
        sources.append(f"benchmarks/results/{name} (commit {d['meta'].get('commit', '?')})")
    d = _load(results_dir, "packed_nvidia-h200.json")
    cfg = d["config"]
    for run in d["runs"]:
        work = run.get("unpacked_equal_work")
        pairs = run.get("index", {}).get("active_pairs")
        if work and pairs:
            items = cfg["heads"] * run["seq_len"] / cfg["block_size"]
            sparse.append({"source": "packed_nvidia-h200.json", "seq_len": run["seq_len"], "items": items,
                           "tiles": pairs / cfg["block_size"] ** 2, "fwd": work["fwd_ms"],
                           "bwd": work["fwdbwd_ms"] - work["fwd_ms"]})
    sources.append("benchmarks/results/packed_nvidia-h200.json (unpacked_equal_work; "
                   f"commit {d['meta'].get('commit')})")
    return sparse, dense, sources


def _cost_ms(cost: Dict, items: float, tiles: float, head_dim: int = 128) -> float:
    """A profile's kernel cost (``per_call``, ``per_item``, ``per_tile``) as the model reads it
    (``KernelCost.ms``: the tiles' work scales with the head dim)."""
    return KernelCost(cost["per_call"], cost["per_item"], cost["per_tile"]).ms(items, tiles, head_dim)


def short_commit(commit) -> str:
    """A result's code commit as 7 hex digits, without a ``+dirty`` suffix (files carry either form)."""
    return str(commit).split("+")[0][:7]


def one_gpu_ring_points(results_dir: str, device: str = "nvidia-h200") -> List[Dict]:
    """Every one-GPU run of the sparse striped ring (``benchmarks/ring.py``) among the committed results:
    its length, measured forward+backward ms, the forward's share of the per-step telemetry (None
    without it), items and tiles, and where it came from."""
    points = []
    prefix = f"ring_{device}_"
    for name in sorted(f for f in os.listdir(results_dir) if f.startswith(prefix) and f.endswith(".json")):
        d = _load(results_dir, name)
        cfg = d["config"]
        if cfg.get("world_size") != 1 or cfg.get("slow_link_gbps"):
            continue
        B, H = cfg["block_size"], cfg["heads"]
        for run in d["runs"]:
            section = run["variants"].get("sparse_striped", {})
            if not section.get("fwdbwd_ms"):
                continue
            timeline = section.get("steps", {}).get("timeline")
            share = None
            if timeline:
                phase = {p: sum(timeline[p].get(f"{k}_ms", {}).get("mean", 0.0) for k in STEP_KINDS)
                         for p in ("forward", "backward")}
                share = phase["forward"] / (phase["forward"] + phase["backward"])
            points.append({"file": name, "commit": short_commit(d["meta"].get("commit")),
                           "time_utc": d["meta"].get("time_utc") or "", "seq_len": run["seq_len"],
                           "fwdbwd_ms": section["fwdbwd_ms"], "forward_share": share,
                           "items": H * run["seq_len"] / B, "tiles": run["index"]["active_pairs"] / B ** 2,
                           "kv_heads": cfg["kv_heads"], "head_dim": cfg["head_dim"]})
    return points


def host_floor(fwdbwd_ms: float, forward_share: float, kernels_ms: float, what: str) -> Dict:
    """The host/launch floor per ring step from a one-GPU ring call (one step) at small work: the
    call's forward+backward time, split by the forward's share of it. Refused where the kernels
    (``kernels_ms``, the profile's fits at that work) would take more than ``HOST_BOUND_SHARE`` of the
    call: there the time is not the host's alone."""
    if not 0 < forward_share < 1:
        raise ValueError(f"{what}: the forward's share of the ring call must be in (0, 1), got {forward_share!r}")
    if kernels_ms > HOST_BOUND_SHARE * fwdbwd_ms:
        raise ValueError(f"{what}: the kernels would take {kernels_ms:.2f} of the call's {fwdbwd_ms:.2f} ms, more "
                         f"than {HOST_BOUND_SHARE:.0%}: not host-bound, so it does not measure the host/launch floor "
                         "(a one-GPU ring run at 8-16K tokens does)")
    return {"fwd": fwdbwd_ms * forward_share, "bwd": fwdbwd_ms * (1 - forward_share)}


def multi_rank_call_cost(results_dir: str, device: str, floor_point: Dict, floor_per_step: float) -> Dict:
    """What a ring call over W > 1 ranks costs the host beyond W steps at the floor (the agreement's
    all-reduce, the first transfer's posting, the last merge): measured where the floor binds, i.e.
    the runs of the floor's own commit (same machine, same session) at its tokens per GPU, as
    ``T_W - W x floor``, averaged over their W. 0 without such runs (then said in ``how``)."""
    excess = []
    prefix = f"ring_{device}_"
    for name in sorted(f for f in os.listdir(results_dir) if f.startswith(prefix) and f.endswith(".json")):
        d = _load(results_dir, name)
        cfg = d["config"]
        if cfg.get("world_size", 1) < 2 or cfg.get("slow_link_gbps") or \
                short_commit(d["meta"].get("commit")) != floor_point["commit"]:
            continue
        W = cfg["world_size"]
        for run in d["runs"]:
            ms = run["variants"].get("sparse_striped", {}).get("fwdbwd_ms")
            if ms and run["seq_len"] == W * floor_point["seq_len"]:
                excess.append({"file": name, "world_size": W, "fwdbwd_ms": ms, "excess_ms": ms - W * floor_per_step})
    if not excess:
        return {"host_call_ms_multi_rank": 0.0, "multi_rank_source": []}
    return {"host_call_ms_multi_rank": max(0.0, sum(e["excess_ms"] for e in excess) / len(excess)),
            "multi_rank_source": excess}


def _dkdv_zeroing_ms(point: Dict, hbm_gbps: float) -> float:
    """The backward's zeroing of its fp32 dK/dV at a one-GPU ring point, as the model has it."""
    return 2 * point["seq_len"] * point["kv_heads"] * point["head_dim"] * 4 / (hbm_gbps * 1e9) * 1e3


def _lead_call_ms(share: float, floor: Dict, kernels: Dict) -> float:
    """A one-GPU ring call as the model has it: per direction, max(floor, share x floor + kernels)."""
    return sum(max(floor[d], share * floor[d] + kernels[d]) for d in ("fwd", "bwd"))


def host_lead_share(results_dir: str, device: str, sparse_fwd: Dict, sparse_bwd: Dict) -> Dict:
    """What share of the floor the host spends before a ring call's first kernels can start (the
    plan conversion and the launches ahead of them): a call whose kernels outlast the floor still
    pays it once per direction, on an idle GPU. From every session (one ring.py call) with two one-GPU runs:
    the shortest (with per-step telemetry) gives the floor per direction, and the share is the one
    with which the model's call, per direction max(floor, share x floor + kernels), takes the next
    run's measured time, where that run's kernels take under ``LEAD_MAX_FLOORS`` floors (beyond,
    the fits' error would swamp a fraction of a floor); the median over sessions (their hosts
    differ). 0 without such sessions."""
    by_call: Dict[str, List[Dict]] = {}  # one ring.py call (file): one session's machine
    for p in one_gpu_ring_points(results_dir, device):
        by_call.setdefault(p["file"], []).append(p)
    hbm_gbps = SPEC[device]["hbm_gbps"]
    sessions = []
    for _, points in sorted(by_call.items()):
        points = sorted(points, key=lambda q: q["seq_len"])
        floors = [q for q in points if q["forward_share"] is not None]
        if not floors:
            continue
        floor_point = floors[0]
        nxt = next((q for q in points if q["seq_len"] > floor_point["seq_len"]), None)
        if nxt is None:
            continue
        commit = floor_point["commit"]
        kernels = {"fwd": _cost_ms(sparse_fwd, nxt["items"], nxt["tiles"], nxt["head_dim"]),
                   "bwd": _cost_ms(sparse_bwd, nxt["items"], nxt["tiles"], nxt["head_dim"])
                   + _dkdv_zeroing_ms(nxt, hbm_gbps)}
        floor_kernels = (_cost_ms(sparse_fwd, floor_point["items"], floor_point["tiles"], floor_point["head_dim"])
                         + _cost_ms(sparse_bwd, floor_point["items"], floor_point["tiles"], floor_point["head_dim"])
                         + _dkdv_zeroing_ms(floor_point, hbm_gbps))
        total = floor_point["fwdbwd_ms"]
        if floor_kernels > HOST_BOUND_SHARE * total or sum(kernels.values()) > LEAD_MAX_FLOORS * total:
            continue  # no floor to take a share of (not host-bound), or the next run is far past it
        floor = {"fwd": total * floor_point["forward_share"], "bwd": total * (1 - floor_point["forward_share"])}
        low, high = 0.0, 1.0  # the call's time grows with the share: bisect for the measured one
        if _lead_call_ms(high, floor, kernels) <= nxt["fwdbwd_ms"]:
            low = high
        for _ in range(60):
            mid = (low + high) / 2
            low, high = (mid, high) if _lead_call_ms(mid, floor, kernels) < nxt["fwdbwd_ms"] else (low, mid)
        sessions.append({"commit": commit, "file": nxt["file"], "seq_len": nxt["seq_len"],
                         "measured_fwdbwd_ms": nxt["fwdbwd_ms"], "kernels_ms": kernels, "floor_ms": floor,
                         "share": low})
    if not sessions:
        return {"host_lead_share": 0.0, "lead_sources": []}
    return {"host_lead_share": statistics.median(e["share"] for e in sessions), "lead_sources": sessions}


def derive_ring_floor(results_dir: str, device: str, sparse_fwd: Dict, sparse_bwd: Dict,
                      commit: Optional[str] = None) -> Optional[Dict]:
    """The floor from the device's shortest one-GPU sparse ring run with per-step telemetry (one ring
    step; forward and backward split as its per-step telemetry splits them); None without such a run.
    ``commit``: only that commit's runs (one session's machine: the floor is its host's)."""
    points = [p for p in one_gpu_ring_points(results_dir, device)
              if p["forward_share"] is not None and (commit is None or short_commit(commit) == p["commit"])]
    if not points:
        return None
    hbm_gbps = SPEC[device]["hbm_gbps"]
    # The shortest run; of several at that length (one per session), the newest session's.
    p = min(sorted(points, key=lambda q: q["time_utc"], reverse=True), key=lambda q: q["seq_len"])
    # The kernels at that work, as the model has them (the backward also zeroes its fp32 dK/dV).
    kernels = _cost_ms(sparse_fwd, p["items"], p["tiles"], p["head_dim"]) \
        + _cost_ms(sparse_bwd, p["items"], p["tiles"], p["head_dim"]) + _dkdv_zeroing_ms(p, hbm_gbps)
    what = f"{p['file']} at {p['seq_len'] // 1024}K"
    floor = host_floor(p["fwdbwd_ms"], p["forward_share"], kernels, what)
    call = multi_rank_call_cost(results_dir, device, p, floor["fwd"] + floor["bwd"])
    lead = host_lead_share(results_dir, device, sparse_fwd, sparse_bwd)
    return {"host_floor_ms_per_step": floor, **call, **lead,
            "source": {"file": p["file"], "seq_len": p["seq_len"], "commit": p["commit"],
                       "measured_fwdbwd_ms": p["fwdbwd_ms"], "kernels_ms": kernels,
                       "forward_share": p["forward_share"]},
            "how": f"the one-GPU ring call (one step) at {p['seq_len'] // 1024}K, whose kernels would take "
                   f"{kernels:.2f} of its {p['fwdbwd_ms']:.2f} ms: its whole time is taken as the per-step floor, "
                   "split between forward and backward as its per-step telemetry (compute, wait, plan, merge) "
                   "splits them; a call over W > 1 ranks adds host_call_ms_multi_rank where the floor binds "
                   "(the same commit's W-GPU runs at the same tokens per GPU, less W steps at the floor); the first "
                   "step of each direction lasts max(floor, host_lead_share x floor + kernels): the host's lead "
                   "before a call's first kernels (host_lead_share's docstring)"}


def derive_h200(results_dir: str) -> Dict:
    sparse, dense, sources = kernel_points(results_dir)
    sparse_fwd, sparse_bwd = fit_cost(sparse, "fwd"), fit_cost(sparse, "bwd")
    # cuDNN: tiles only. Its per-call cost is not identified by calls of 64K-512K tokens (the fit's
    # intercept came out at ~2 ms, which 64 ring steps would multiply into a cost no one measured);
    # 0 favours the dense baselines where their chunks get small.
    dense_fwd = fit_cost(dense, "fwd", ("per_tile",))
    dense_bwd = fit_cost(dense, "bwd", ("per_tile",))
    kernel = _load(results_dir, "kernel_nvidia-h200.json")
    run128 = next(r for r in kernel["runs"] if r["seq_len"] == 131072)

    approx = _load(results_dir, "approx_nvidia-h200.json")["overhead"][0]
    heads = 16
    approx_rate = approx["approximator_ms"] / (approx["seq_len"] * heads)
    sources.append("benchmarks/results/approx_nvidia-h200.json (one GPU, 128K)")

    # The rest of the layer: a dense one-GPU training step minus its attention (predicted by the dense
    # fit above), split into GEMMs and elementwise work as the H100 profile of the same model splits it.
    e2e = _load(results_dir, "e2e_nvidia-h200_1gpu.json")
    S, layers = e2e["seq_length"], e2e["model"]["num_layers"]
    dense_run = next(r for r in e2e["runs"] if r["name"] == "dense")
    B = 64
    causal_tiles = S * (S + 1) / 2 * heads / B ** 2
    attention = layers * (_cost_ms(dense_fwd["cost"], 0, causal_tiles) + _cost_ms(dense_bwd["cost"], 0, causal_tiles))
    rest_total = dense_run["mean_iteration_ms"] - attention
    gemm_share = _gemm_share(results_dir)
    gemm_tflops, elementwise = _rest_rates(rest_total * gemm_share, rest_total * (1 - gemm_share), S, layers)
    sources.append("benchmarks/results/e2e_nvidia-h200_1gpu.json (the dense run: step minus predicted attention)")
    sources.append("benchmarks/results/profile_e2e_nvidia-h100-80gb-hbm3_1gpu.json (GEMM share of the rest)")

    ring_floor = derive_ring_floor(results_dir, "nvidia-h200", sparse_fwd["cost"], sparse_bwd["cost"])
    if ring_floor is None:
        raise FileNotFoundError(f"calibration needs a one-GPU sparse ring result with per-step telemetry in "
                                f"{results_dir} (benchmarks/ring.py --scaling on one GPU at 16K tokens)")
    sources.append(f"benchmarks/results/{ring_floor['source']['file']} (one GPU, "
                   f"{ring_floor['source']['seq_len'] // 1024}K: the ring's host/launch floor; "
                   f"commit {ring_floor['source']['commit']})")

    te_rest = te_rest_rates(results_dir)
    sources.extend(te_rest["sources"])
    profile = _profile("nvidia-h200", "NVIDIA H200", sparse_fwd, sparse_bwd, dense_fwd, dense_bwd, approx_rate,
                       gemm_tflops, elementwise, sources,
                       {"code_commit": "1d0b6f2", "note": "kernel_nvidia-h200.json was re-run at de3d354, whose "
                        "kernels are 1d0b6f2's with unchanged PTX (docs/performance.md)",
                        "kernel_128k_fwdbwd_ms": run128["ours"]["fwdbwd_ms"]},
                       fits={"sparse": sparse, "dense": dense, "rest_total_ms": rest_total, "gemm_share": gemm_share})
    profile["rest_of_layer_te"] = {"rates": te_rest["rates"]}
    profile["ring"] = ring_floor
    return profile


# The profiled TE-CP iterations that calibrate the rest of the layer on Transformer Engine's layers.
TE_REST_RUNS = {
    "nvidia-h200": (("bf16", "e2e_te_nvidia-h200_2gpu.json"), ("fp8", "e2e_te_fp8_nvidia-h200_2gpu.json")),
    "nvidia-h100": (("bf16", "e2e_te_nvidia-h100-80gb-hbm3_4gpu.json"),
                    ("fp8", "e2e_te_fp8_nvidia-h100-80gb-hbm3_4gpu.json")),
}


def te_rest_rates(results_dir: str, profile: str = "nvidia-h200") -> Dict:
    """The rest of the layer on TE's layers (bf16 and FP8 GEMMs), from the GPU time by category of the
    profiled iteration of TE's own CP run (no MTraining in it): the GEMMs give the rate, everything
    but attention, GEMMs and NCCL (norms, RoPE, activations, casts, the optimizer) the elementwise time.
    The output layer stays bf16 under FP8, so the FP8 rate is what is left after it at the bf16 rate."""
    rates: Dict[str, Dict] = {}
    sources = []
    for precision, name in TE_REST_RUNS[profile]:
        d = _load(results_dir, name)
        run = next(r for r in d["runs"] if r["name"] == "te_cp")
        if bool(d.get("fp8")) != (precision == "fp8") or d.get("transformer_impl") != "transformer_engine":
            raise ValueError(f"{name}: expected a Transformer Engine run with fp8={precision == 'fp8'}")
        category = run["gpu_time_breakdown"]["by_category_ms"]
        m = d["model"]
        shape = ModelShape(hidden=m["hidden"], heads=m["heads"], kv_groups=m["kv_groups"], head_dim=m["head_dim"],
                           layers=m["num_layers"], ffn=m["ffn"], vocab=m["vocab"])
        tokens = d["seq_length"] // d["world_size"]
        layer_flops = tokens * shape.layers * shape.layer_gemm_flops_per_token()
        head_flops = tokens * shape.head_flops_per_token()
        if precision == "bf16":
            gemm_tflops = (layer_flops + head_flops) / (category["gemm"] * 1e-3) / 1e12
        else:
            head_ms = head_flops / (rates["bf16"]["gemm_tflops"] * 1e12) * 1e3
            gemm_tflops = layer_flops / ((category["gemm"] - head_ms) * 1e-3) / 1e12
        elementwise_ms = sum(v for k, v in category.items() if k not in ("gemm", "dense_attention", "nccl"))
        rates[precision] = {"gemm_tflops": gemm_tflops,
                            "elementwise_ns_per_token_layer": elementwise_ms * 1e6 / (tokens * shape.layers)}
        sources.append(f"benchmarks/results/{name} (te_cp, profiled iteration {run['profiled_iteration']}: GPU time "
                       f"by category; commit {d['meta'].get('commit')})")
    return {"rates": rates, "sources": sources}


def _gemm_share(results_dir: str) -> float:
    prof = _load(results_dir, "profile_e2e_nvidia-h100-80gb-hbm3_1gpu.json")
    run = next(r for r in prof["runs"] if r["name"] == "dense")
    cat = run["gpu_time_breakdown"]["by_category_ms"]
    other = sum(v for k, v in cat.items() if k not in ("gemm", "dense_attention", "mtraining"))
    return cat["gemm"] / (cat["gemm"] + other)


def _rest_rates(gemm_ms: float, elementwise_ms: float, tokens: int, layers: int) -> Tuple[float, float]:
    """GEMM TFLOP/s and elementwise ns per token and layer of the e2e model (vocabulary 8192)."""
    shape = ModelShape(layers=layers, vocab=E2E_VOCAB)
    flops = tokens * (layers * shape.layer_gemm_flops_per_token() + shape.head_flops_per_token())
    return flops / (gemm_ms * 1e-3) / 1e12, elementwise_ms * 1e6 / (tokens * layers)


def derive_h100(results_dir: str, h200: Dict) -> Dict:
    """H100: the H200 kernel fits scaled by what the H100's one-GPU profiled training step measured
    (MTraining's kernels and cuDNN's, against the H200 profile's prediction of the same work)."""
    prof = _load(results_dir, "profile_e2e_nvidia-h100-80gb-hbm3_1gpu.json")
    tel = telemetry(os.path.join(results_dir, "logs", "profile_e2e_mtraining_nvidia-h100_1gpu.log"))
    S, layers, heads, B = prof["seq_length"], prof["model"]["num_layers"], 16, 64
    runs = {r["name"]: r["gpu_time_breakdown"]["by_category_ms"] for r in prof["runs"]}
    items = heads * S / B
    tiles = tel["density"] * S * (S + 1) / 2 * heads / B ** 2
    sp = h200["sparse"]
    h200_sparse = layers * (_cost_ms(sp["fwd"], items, tiles) + _cost_ms(sp["bwd"], items, tiles)
                            + h200["approximator"]["ms_per_token_head"] * S * heads)
    sparse_scale = runs["mtraining"]["mtraining"] / h200_sparse
    causal_tiles = S * (S + 1) / 2 * heads / B ** 2
    de = h200["dense"]
    h200_dense = layers * (_cost_ms(de["fwd"], 0, causal_tiles) + _cost_ms(de["bwd"], 0, causal_tiles))
    dense_scale = runs["dense"]["dense_attention"] / h200_dense
    gemm_ms = runs["mtraining"]["gemm"]
    other_ms = sum(v for k, v in runs["mtraining"].items() if k not in ("gemm", "mtraining"))
    gemm_tflops, elementwise = _rest_rates(gemm_ms, other_ms, S, layers)

    def scaled(cost: Dict, factor: float) -> Dict:
        return {"cost": {k: v * factor for k, v in cost.items()}, "max_abs_rel_error": None, "points": None}

    sources = [f"benchmarks/results/profile_e2e_nvidia-h100-80gb-hbm3_1gpu.json (GPU time by category, commit "
               f"{prof['meta'].get('commit')})",
               "benchmarks/results/logs/profile_e2e_mtraining_nvidia-h100_1gpu.log (telemetry: density)",
               "the nvidia-h200 profile (its kernel fits, scaled)"]
    profile = _profile("nvidia-h100", "NVIDIA H100 80GB HBM3", scaled(sp["fwd"], sparse_scale),
                       scaled(sp["bwd"], sparse_scale), scaled(de["fwd"], dense_scale), scaled(de["bwd"], dense_scale),
                       h200["approximator"]["ms_per_token_head"] * sparse_scale, gemm_tflops, elementwise, sources,
                       {"code_commit": "bfc9d97", "note": "kernels of 1d0b6f2; scale factors from one profiled step"},
                       fits={"sparse_scale_vs_h200": sparse_scale, "dense_scale_vs_h200": dense_scale,
                             "telemetry_density": tel["density"]})
    profile["assumed"]["p2p"] = ("NVLink figures of the H200 machines (same NV18 NVLink); no H100 point-to-point "
                                 "measurement is committed")
    ring_floor = derive_ring_floor(results_dir, "nvidia-h100", profile["sparse"]["fwd"], profile["sparse"]["bwd"])
    if ring_floor is None:
        # The floor is the host's enqueue time, not the GPU's speed: borrowed, and said so.
        ring_floor = {"host_floor_ms_per_step": dict(h200["ring"]["host_floor_ms_per_step"]),
                      "host_call_ms_multi_rank": h200["ring"].get("host_call_ms_multi_rank", 0.0),
                      "host_lead_share": h200["ring"].get("host_lead_share", 0.0),
                      "borrowed_from": "nvidia-h200"}
        profile["assumed"]["ring.host_floor_ms_per_step"] = (
            "borrowed from nvidia-h200: no one-H100 ring run at small work is committed, and the floor is "
            "host-bound (plan conversion and kernel launches), so it depends on the host and the launch path more "
            "than on the GPU")
    else:
        profile["sources"].append(f"benchmarks/results/{ring_floor['source']['file']} (one GPU: the ring's "
                                  "host/launch floor)")
    profile["ring"] = ring_floor
    te_rest = te_rest_rates(results_dir, "nvidia-h100")
    profile["rest_of_layer_te"] = {"rates": te_rest["rates"]}
    profile["sources"] += te_rest["sources"]
    return profile


def _profile(name, device, sparse_fwd, sparse_bwd, dense_fwd, dense_bwd, approx_rate, gemm_tflops, elementwise,
             sources, generation, fits=None) -> Dict:
    return {
        "name": name, "device": device, "memory_gib": SPEC[name]["memory_gib"], "hbm_gbps": SPEC[name]["hbm_gbps"],
        "sparse": {"block_size": 64, "fwd": sparse_fwd["cost"], "bwd": sparse_bwd["cost"],
                   "fit_max_abs_rel_error": {"fwd": sparse_fwd["max_abs_rel_error"],
                                             "bwd": sparse_bwd["max_abs_rel_error"]}},
        "dense": {"kernel": "cuDNN SDPA (causal, GQA)", "fwd": dense_fwd["cost"], "bwd": dense_bwd["cost"],
                  "fit_max_abs_rel_error": {"fwd": dense_fwd["max_abs_rel_error"],
                                            "bwd": dense_bwd["max_abs_rel_error"]}},
        "approximator": {"ms_per_token_head": approx_rate, "collectives": APPROX_COLLECTIVES},
        "p2p": {"intra_gbps": INTRA_GBPS_DOCUMENTED, "intra_latency_us": INTRA_LATENCY_US_ASSUMED},
        "tensor_parallel": {"collective_gbps": TP_COLLECTIVE_GBPS_ASSUMED},
        "rest_of_layer": {"gemm_tflops": gemm_tflops, "elementwise_ns_per_token_layer": elementwise,
                          "step_fixed_ms": 0.0},
        "kernel_generation": generation,
        "sources": sources,
        "assumed": {
            "memory_gib, hbm_gbps": "the memory CUDA reports (nvidia-smi: 143771 MiB on an H200, 81559 MiB on an H100 80GB HBM3) and the vendor bandwidth",
            "p2p.intra_gbps": "NCCL ring exchange of 134 MB on 4 H200s, measured in an early session and recorded "
                              "in docs/benchmarks.md, not in a result file; `calibrate.py --gpu` under torchrun "
                              "measures it",
            "p2p.intra_latency_us": "not measured here; typical NCCL point-to-point latency on NVLink",
            "rest_of_layer.step_fixed_ms": "0: the optimizer step of the 4-layer runs is inside the elementwise rate",
            "tensor_parallel.collective_gbps": "not measured: NCCL all-gather / reduce-scatter bus bandwidth of "
                                               "large messages over NVLink inside an 8-GPU node (NCCL tests report "
                                               "350-450 GB/s on H100 / H200 NVSwitch nodes), the low end",
        },
        "derivation": fits or {},
    }


def derive_all(results_dir: str) -> Dict[str, Dict]:
    h200 = derive_h200(results_dir)
    return {"nvidia-h200": h200, "nvidia-h100": derive_h100(results_dir, h200)}


def write_profile(profile: Dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(_rounded(profile), fh, indent=1)
        fh.write("\n")


def _rounded(obj):
    if isinstance(obj, dict):
        return {k: _rounded(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rounded(v) for v in obj]
    if isinstance(obj, float):
        return float(f"{obj:.6g}")
    return obj


# ----------------------------------------------------------------------------------------------
# Measured on a GPU
# ----------------------------------------------------------------------------------------------


def measure(smoke: bool, block_size: int = 64) -> Dict:
    """Every primitive measured on this machine's GPU (or tiny shapes on the CPU with --smoke)."""
    import torch
    import torch.distributed as dist

    from common import device_slug, fixed_vs_index, median, run_metadata, time_ms

    from megatron_mtraining import MTrainingConfig, approximate_index, sparse_attention

    distributed = "RANK" in os.environ
    if distributed:
        local = int(os.environ.get("LOCAL_RANK", 0))
        if smoke or not torch.cuda.is_available():
            dist.init_process_group("gloo")
            device = torch.device("cpu")
        else:
            device = torch.device("cuda", local)
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    if smoke:
        seq_lens, densities, B, heads, kv, d, dtype = [512, 1024], [0.2, 0.4], 64, 4, 2, 32, torch.float32
        backend, warmup, reps = "torch", 1, 2
    else:
        # 8K-128K: the small lengths pin the per-call and per-item costs that decide 32-64 GPUs.
        seq_lens, densities = [8192, 16384, 32768, 65536, 131072], [0.025, 0.05, 0.1]
        B, heads, kv, d, dtype = block_size, 16, 2, 128, torch.bfloat16
        backend, warmup, reps = "auto", 3, 10
    result = {"meta": run_metadata(device), "smoke": smoke, "block_size": B, "sparse": [], "dense": []}
    rank0 = not distributed or dist.get_rank() == 0

    if distributed:
        result["p2p"] = measure_p2p(device, smoke)
    if rank0:
        gen = torch.Generator(device="cpu").manual_seed(0)

        def rand(h, S):
            return torch.randn(1, h, S, d, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)

        for S in seq_lens:
            q, k, v = rand(heads, S), rand(kv, S), rand(kv, S)
            for density in densities:
                index = fixed_vs_index(1, heads, S, B, density, device)
                pairs = float(index.density(S).sum()) * S * (S + 1) / 2

                def fwd():
                    with torch.no_grad():
                        sparse_attention(q, k, v, index, backend=backend)

                def fwdbwd():
                    qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
                    sparse_attention(qq, kk, vv, index, backend=backend).sum().backward()

                f = median(time_ms(lambda: fwd(), [()], device, warmup, reps))
                fb = median(time_ms(lambda: fwdbwd(), [()], device, warmup, reps))
                result["sparse"].append({"seq_len": S, "density": density, "items": heads * S / B,
                                         "tiles": pairs / B ** 2, "fwd": f, "bwd": max(fb - f, 1e-6)})
            qe, ke, ve = (x.detach().requires_grad_() for x in (q, k, v))

            def dense_fwd():
                with torch.no_grad():
                    torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

            def dense_fwdbwd():
                out = torch.nn.functional.scaled_dot_product_attention(qe, ke, ve, is_causal=True, enable_gqa=True)
                out.sum().backward()

            f = median(time_ms(lambda: dense_fwd(), [()], device, warmup, reps))
            fb = median(time_ms(lambda: dense_fwdbwd(), [()], device, warmup, reps))
            result["dense"].append({"seq_len": S, "items": 0.0, "tiles": S * (S + 1) / 2 * heads / B ** 2,
                                    "fwd": f, "bwd": max(fb - f, 1e-6)})
        S = seq_lens[-1]
        config = MTrainingConfig(block_size=B, dense_max_seq_length=0) if smoke else MTrainingConfig(block_size=B)
        q, k = rand(heads, S), rand(kv, S)
        ms = median(time_ms(lambda: approximate_index(q, k, config, backend=backend), [()], device, warmup, reps))
        result["approximator"] = {"seq_len": S, "heads": heads, "ms": ms}
        result["rest_of_layer"] = measure_rest(device, dtype, smoke, warmup, reps)
        result["ring_floor"] = measure_ring_floor(device, dtype, smoke, warmup, reps, B, heads, kv, d, backend,
                                                  distributed)
        result["device_slug"] = device_slug(device)
        if device.type == "cuda":
            props = torch.cuda.get_device_properties(device)
            result["memory_gib"] = props.total_memory / 2 ** 30
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
    return result


def measure_ring_floor(device, dtype, smoke: bool, warmup: int, reps: int, B: int, heads: int, kv: int, d: int,
                       backend: str, distributed: bool) -> Dict:
    """The sparse ring on one rank (one ring step) at small work, forward and forward+backward: where
    the kernels are short, the call's time is the host's (the ring's host/launch floor)."""
    import torch
    import torch.distributed as dist

    from common import fixed_vs_index, median

    from megatron_mtraining import sparse_ring_attention

    S, density = (512, 0.4) if smoke else (16384, 0.05)
    gen = torch.Generator(device="cpu").manual_seed(2)
    q, k, v = (torch.randn(1, h, S, d, generator=gen).to(device=device, dtype=dtype) for h in (heads, kv, kv))
    index = fixed_vs_index(1, heads, S, B, density, device)
    pairs = float(index.density(S).sum()) * S * (S + 1) / 2
    # Under torchrun this runs on rank 0 alone: a group of that one rank (created by its member only).
    group = dist.new_group([dist.get_rank()], use_local_synchronization=True) if distributed else None

    def forward():
        qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
        return sparse_ring_attention(qq, kk, vv, index, group=group, backend=backend).sum()

    # Forward and backward timed within the same calls (a mark between them), so that the forward's
    # share is below 1 whatever the noise: timed apart, a loaded CPU made the forward alone the longer.
    forward_ms, total_ms = [], []
    for i in range(warmup + reps):
        marks = [_Mark(device) for _ in range(3)]
        marks[0].record()
        loss = forward()
        marks[1].record()
        loss.backward()
        marks[2].record()
        if i >= warmup:
            forward_ms.append(marks[0].ms_to(marks[1]))
            total_ms.append(marks[0].ms_to(marks[2]))
    return {"seq_len": S, "fwd_ms": median(forward_ms), "fwdbwd_ms": median(total_ms), "items": heads * S / B,
            "tiles": pairs / B ** 2, "kv_heads": kv, "head_dim": d}


class _Mark:
    """A point in time on ``device``'s stream (a CUDA event) or on the host clock (CPU)."""

    def __init__(self, device):
        import torch

        self.cuda = device.type == "cuda"
        self.event = torch.cuda.Event(enable_timing=True) if self.cuda else None
        self.t = None

    def record(self):
        if self.cuda:
            self.event.record()
        else:
            self.t = time.perf_counter()

    def ms_to(self, later: "_Mark") -> float:
        if self.cuda:
            later.event.synchronize()
            return self.event.elapsed_time(later.event)
        return (later.t - self.t) * 1e3


def measure_p2p(device, smoke: bool) -> Dict:
    """NCCL ring exchange (send to the next rank, receive from the previous, all ranks at once):
    per-GPU bandwidth of the largest message and the latency of the smallest."""
    import torch
    import torch.distributed as dist

    from common import median, time_ms

    world, rank = dist.get_world_size(), dist.get_rank()
    sizes = [4096, 1 << 20, 1 << 24] if smoke else [4096, 1 << 20, 1 << 24, 1 << 27]
    out = []
    for nbytes in sizes:
        send = torch.empty(nbytes, dtype=torch.uint8, device=device)
        recv = torch.empty_like(send)

        def exchange():
            ops = [dist.P2POp(dist.isend, send, (rank + 1) % world), dist.P2POp(dist.irecv, recv, (rank - 1) % world)]
            for req in dist.batch_isend_irecv(ops):
                req.wait()

        ms = median(time_ms(lambda: exchange(), [()], device, 3, 5 if smoke else 20))
        out.append({"bytes": nbytes, "ms": ms})
    return {"world_size": world, "points": out, "intra_gbps": out[-1]["bytes"] / (out[-1]["ms"] * 1e-3) / 1e9,
            "intra_latency_us": out[0]["ms"] * 1e3}


def measure_rest(device, dtype, smoke: bool, warmup: int, reps: int) -> Dict:
    """The non-attention part of a layer of the e2e model (RMSNorm, QKV and output projections,
    SwiGLU MLP), forward and backward: GEMMs timed alone for the rate, the whole for the rest."""
    import torch

    from common import median, time_ms

    shape = ModelShape() if not smoke else ModelShape(hidden=64, heads=4, kv_groups=2, head_dim=16, ffn=128)
    tokens = 256 if smoke else 32768
    h, d = shape.hidden, shape.head_dim
    gen = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(tokens, h, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    weights = {name: (torch.randn(*s, generator=gen) * s[0] ** -0.5).to(device=device, dtype=dtype).requires_grad_()
               for name, s in {"qkv": (h, (shape.heads + 2 * shape.kv_groups) * d), "proj": (shape.heads * d, h),
                               "fc1": (h, 2 * shape.ffn), "fc2": (shape.ffn, h)}.items()}

    def norm(t):
        return t * torch.rsqrt(t.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(t.dtype)

    def layer():
        y = norm(x) @ weights["qkv"]
        y = y[:, : shape.heads * d] @ weights["proj"] + x  # attention itself is not part of the rest
        gate, up = (norm(y) @ weights["fc1"]).chunk(2, -1)
        out = (torch.nn.functional.silu(gate) * up) @ weights["fc2"] + y
        out.float().sum().backward()

    def gemms():
        y = x @ weights["qkv"]
        y = y[:, : shape.heads * d] @ weights["proj"]
        gate, up = (y @ weights["fc1"]).chunk(2, -1)
        (gate @ weights["fc2"] + up @ weights["fc2"]).float().sum().backward()

    layer_ms = median(time_ms(lambda: layer(), [()], device, warmup, reps))
    gemm_ms = median(time_ms(lambda: gemms(), [()], device, warmup, reps))
    # gemms() runs the MLP's down projection twice (gate and up paths): count its FLOPs that way.
    flops = tokens * (shape.layer_gemm_flops_per_token() + 6.0 * shape.ffn * h)
    return {"tokens": tokens, "layer_ms": layer_ms, "gemm_ms": gemm_ms, "gemm_tflops": flops / (gemm_ms * 1e-3) / 1e12,
            "elementwise_ns_per_token_layer": max(layer_ms - gemm_ms * shape.layer_gemm_flops_per_token()
                                                  / (shape.layer_gemm_flops_per_token() + 6.0 * shape.ffn * h), 0.0)
            * 1e6 / tokens}


def profile_from_measurement(m: Dict, name: Optional[str] = None) -> Dict:
    """A profile from ``measure()``'s figures, through the same fits as the derivation."""
    name = name or m.get("device_slug", "measured")
    spec = SPEC.get(name, {"memory_gib": m.get("memory_gib", 80.0), "hbm_gbps": 3350.0})
    p2p = m.get("p2p")
    heads = m["approximator"]["heads"]
    # Short calls (8K+) identify cuDNN's per-call cost; with two lengths or fewer, tiles only.
    dense_features = ("per_call", "per_tile") if len(m["dense"]) > 2 else ("per_tile",)
    profile = _profile(
        name if name in SPEC else "nvidia-h100", m["meta"]["device"],
        fit_cost(m["sparse"], "fwd"), fit_cost(m["sparse"], "bwd"),
        fit_cost(m["dense"], "fwd", dense_features), fit_cost(m["dense"], "bwd", dense_features),
        m["approximator"]["ms"] / (m["approximator"]["seq_len"] * heads),
        m["rest_of_layer"]["gemm_tflops"], m["rest_of_layer"]["elementwise_ns_per_token_layer"],
        [f"measured by benchmarks/calibrate.py --gpu at commit {m['meta'].get('commit')}"],
        {"code_commit": m["meta"].get("commit"), "note": "measured directly"}, fits={"measurement": m})
    if "ring_floor" not in m:
        raise ValueError("the measurement has no 'ring_floor' (the one-rank ring call at small work): rerun "
                         "calibrate.py --gpu")
    ring = m["ring_floor"]
    zero_ms = 2 * ring["seq_len"] * ring["kv_heads"] * ring["head_dim"] * 4 / (spec["hbm_gbps"] * 1e9) * 1e3
    kernels = (_cost_ms(profile["sparse"]["fwd"], ring["items"], ring["tiles"], ring["head_dim"])
               + _cost_ms(profile["sparse"]["bwd"], ring["items"], ring["tiles"], ring["head_dim"]) + zero_ms)
    # The smoke run's CPU "kernels" are never host-bound: its floor only exercises the path.
    floor = host_floor(ring["fwdbwd_ms"], ring["fwd_ms"] / ring["fwdbwd_ms"], 0.0 if m.get("smoke") else kernels,
                       f"the one-rank ring call at {ring['seq_len']} tokens")
    profile["ring"] = {"host_floor_ms_per_step": floor,
                       "source": {"measured": "calibrate.py --gpu", "seq_len": ring["seq_len"],
                                  "measured_fwdbwd_ms": ring["fwdbwd_ms"], "measured_fwd_ms": ring["fwd_ms"],
                                  "kernels_ms": kernels}}
    profile["name"], profile["memory_gib"] = name, m.get("memory_gib", spec["memory_gib"])
    profile["sparse"]["block_size"] = m["block_size"]
    profile["assumed"] = {"hbm_gbps": "vendor specification"}
    if p2p:
        profile["p2p"] = {"intra_gbps": p2p["intra_gbps"], "intra_latency_us": p2p["intra_latency_us"]}
    else:
        profile["assumed"]["p2p"] = "run under torchrun with 2+ GPUs to measure NCCL point-to-point"
    return profile


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--from-results", metavar="DIR", help="derive the committed profiles from the results in DIR")
    mode.add_argument("--gpu", action="store_true", help="measure the primitives on this machine")
    p.add_argument("--smoke", action="store_true", help="with --gpu: tiny fp32 shapes on the CPU (tests the script)")
    p.add_argument("--out", default=None, help="--from-results: folder for the profiles (default: the package's); "
                                               "--gpu: the profile JSON (default: a temporary file)")
    p.add_argument("--block-size", type=int, default=64, choices=(64, 128), help="--gpu: index block size")
    p.add_argument("--name", default=None, help="--gpu: profile name (default: the device's, e.g. nvidia-h100)")
    args = p.parse_args(argv)
    if args.smoke and not args.gpu:
        p.error("--smoke goes with --gpu")
    if args.from_results:
        out_dir = args.out or PROFILE_DIR
        for name, profile in derive_all(args.from_results).items():
            path = os.path.join(out_dir, name + ".json")
            write_profile(profile, path)
            print(f"wrote {path}")
        return 0
    measured = measure(args.smoke, args.block_size)
    if "sparse" not in measured or not measured["sparse"]:
        return 0  # ranks other than 0
    profile = profile_from_measurement(measured, args.name)
    suffix = "_smoke" if args.smoke else ""
    path = args.out or os.path.join(tempfile.gettempdir(), f"profile_{profile['name']}{suffix}.json")
    write_profile(profile, path)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
