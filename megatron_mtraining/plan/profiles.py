"""Device profiles: the per-GPU rates the step-time model runs on.

A profile is plain JSON under ``plan/profiles/<name>.json``, written by
``benchmarks/calibrate.py`` (from the committed results, or measured on a GPU). Every figure in it
says where it came from (``sources``); figures no result file holds are listed under
``assumed`` so a reader can tell a measurement from a placeholder.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Dict, List, Optional, Tuple

PROFILE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")


@dataclasses.dataclass(frozen=True)
class KernelCost:
    """Milliseconds of one kernel call: ``per_call + per_item * items + per_tile * tiles``.

    An item is one (query block, head) work unit, a tile one B x B block of (query, key) pairs
    at head dim 128; the dense kernel uses only ``per_call`` and ``per_tile`` (tiles = causal pairs
    / B^2, the same unit, so dense and sparse rates compare directly)."""

    per_call: float
    per_item: float
    per_tile: float

    def ms(self, items: float, tiles: float, head_dim: int = 128) -> float:
        # Work per tile grows with the head dim (two d-long GEMMs per tile); the fixed costs do not.
        return self.per_call + self.per_item * items + self.per_tile * tiles * head_dim / 128.0


@dataclasses.dataclass(frozen=True)
class HostFloor:
    """Milliseconds the host needs to enqueue one step of the sparse ring, forward and backward: the
    plan conversion and the step's ~100 small launches, whatever the step's work. A step takes at
    least this long even when its kernels would finish sooner (the GPU waits for the host)."""

    fwd: float
    bwd: float
    call_multi_rank: float = 0.0  # per ring call over W > 1 ranks: the agreement, the first posting, the merge
    # The share of a step's floor the host spends before a call's first kernels can start: the first
    # step of each direction lasts max(floor, lead_share x floor + its kernels).
    lead_share: float = 0.0

    def __post_init__(self):
        for name in ("fwd", "bwd", "call_multi_rank"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"host floor: {name} must be >= 0 ms, got {value!r}")
        if not isinstance(self.lead_share, (int, float)) or not 0 <= self.lead_share <= 1:
            raise ValueError(f"host floor: lead_share must be in [0, 1], got {self.lead_share!r}")

    @property
    def per_step(self) -> float:
        return self.fwd + self.bwd


@dataclasses.dataclass(frozen=True)
class Profile:
    name: str
    device: str
    memory_gib: float
    hbm_gbps: float
    block_size: int
    sparse_fwd: KernelCost
    sparse_bwd: KernelCost
    dense_fwd: KernelCost
    dense_bwd: KernelCost
    approx_ms_per_token_head: float       # the approximator's local work, linear in tokens x heads
    approx_collectives: int               # small collectives per layer (latency-bound)
    intra_gbps: float                     # NCCL point-to-point, per GPU, inside a node
    intra_latency_us: float
    gemm_tflops: float                    # the rest of the layer: projections and MLP
    elementwise_ns_per_token_layer: float  # norms, RoPE, activations, residuals (per token, per layer)
    step_fixed_ms: float                  # optimizer step and the rest that does not scale with tokens
    ring_host_floor: HostFloor            # the sparse ring's host/launch floor per ring step
    kernel_generation: Dict
    sources: List[str]
    assumed: Dict[str, str]
    raw: Dict = dataclasses.field(default_factory=dict, compare=False, repr=False)
    # The rest of the layer on Transformer Engine's layers, per GEMM precision ("bf16", "fp8"): a
    # (GEMM TFLOP/s, elementwise ns per token and layer) pair; empty where no TE run calibrates it.
    te_rest_of_layer: Dict[str, Tuple[float, float]] = dataclasses.field(default_factory=dict)
    # Sequence-parallel TP all-gathers / reduce-scatters inside a node, GB/s per GPU (0: not in the profile).
    tp_collective_gbps: float = 0.0

    @classmethod
    def from_dict(cls, d: Dict) -> "Profile":
        try:
            return cls(
                name=d["name"], device=d["device"], memory_gib=float(d["memory_gib"]), hbm_gbps=float(d["hbm_gbps"]),
                block_size=int(d["sparse"]["block_size"]),
                sparse_fwd=KernelCost(**d["sparse"]["fwd"]), sparse_bwd=KernelCost(**d["sparse"]["bwd"]),
                dense_fwd=KernelCost(**d["dense"]["fwd"]), dense_bwd=KernelCost(**d["dense"]["bwd"]),
                approx_ms_per_token_head=float(d["approximator"]["ms_per_token_head"]),
                approx_collectives=int(d["approximator"]["collectives"]),
                intra_gbps=float(d["p2p"]["intra_gbps"]), intra_latency_us=float(d["p2p"]["intra_latency_us"]),
                gemm_tflops=float(d["rest_of_layer"]["gemm_tflops"]),
                elementwise_ns_per_token_layer=float(d["rest_of_layer"]["elementwise_ns_per_token_layer"]),
                step_fixed_ms=float(d["rest_of_layer"]["step_fixed_ms"]),
                ring_host_floor=HostFloor(fwd=float(d["ring"]["host_floor_ms_per_step"]["fwd"]),
                                          bwd=float(d["ring"]["host_floor_ms_per_step"]["bwd"]),
                                          call_multi_rank=float(d["ring"].get("host_call_ms_multi_rank", 0.0)),
                                          lead_share=float(d["ring"].get("host_lead_share", 0.0))),
                kernel_generation=dict(d.get("kernel_generation", {})), sources=list(d.get("sources", [])),
                assumed=dict(d.get("assumed", {})), raw=d,
                te_rest_of_layer={precision: (float(r["gemm_tflops"]), float(r["elementwise_ns_per_token_layer"]))
                                  for precision, r in d.get("rest_of_layer_te", {}).get("rates", {}).items()},
                tp_collective_gbps=float(d.get("tensor_parallel", {}).get("collective_gbps", 0.0)))
        except KeyError as exc:
            raise ValueError(f"profile {d.get('name', '?')!r} lacks the field {exc}; rewrite it with "
                             "benchmarks/calibrate.py") from None


def available_profiles(directory: str = PROFILE_DIR) -> List[str]:
    if not os.path.isdir(directory):
        return []
    return sorted(f[:-5] for f in os.listdir(directory) if f.endswith(".json"))


def load_profile(name_or_path: str, directory: str = PROFILE_DIR) -> Profile:
    """A committed profile by name (``nvidia-h200``, ``nvidia-h100``; ``h200`` and ``H100`` work too)
    or a profile JSON by path."""
    if name_or_path.endswith(".json") or os.sep in name_or_path:
        path = name_or_path
        if not os.path.isfile(path):
            raise ValueError(f"no profile file {path!r}")
    else:
        key = name_or_path.lower().replace(" ", "-")
        names = available_profiles(directory)
        match: Optional[str] = next((n for n in names if key in (n, n.replace("nvidia-", ""))), None)
        if match is None:
            raise ValueError(f"unknown GPU profile {name_or_path!r}; known: {', '.join(names) or 'none'} "
                             "(or pass a profile JSON written by benchmarks/calibrate.py)")
        path = os.path.join(directory, match + ".json")
    with open(path) as fh:
        return Profile.from_dict(json.load(fh))
