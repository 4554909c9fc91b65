"""The step-time model: one training step of a decoder with context-parallel attention.

What a step costs, per GPU (``docs/scaling.md`` explains it with its validation):

* attention, per ring step and rank: the kernel's cost ``per_call + per_item * items +
  per_tile * tiles`` (``profiles.KernelCost``, fitted on one GPU), where items are the rank's
  (query block, head) units and tiles the active B x B blocks of that step: the striped layout
  gives every (rank, step) an equal share of the active pairs, so a step holds 1 / W^2 of them
  while every step still walks all of the rank's items: the per-item and per-call costs do not
  shrink with more GPUs, which is what ends strong scaling;
* the host/launch floor: the host needs a fixed time to enqueue a ring step (plan conversion, ~100
  small launches per step and direction), whatever the step's work, and the GPU cannot run a step
  before it is enqueued; so a step takes max(its kernels, the floor), forward and backward apart
  (``profiles.HostFloor``, measured on one GPU at small work), a call's first step of each
  direction also waits for the host's lead before its kernels (a share of the floor), and a call
  over W > 1 ranks adds its own set-up once (the agreement, the first posting: measured on W GPUs
  at the same work). At
  8-16K tokens per GPU the floor, not the kernels, sets the attention time;
* the ring: the schedule of ``ring/schedule.py`` (flat, or hierarchical with an inner ring of
  ``inner`` ranks and an outer ring over the groups), as ``ring/program.py`` records it from the
  code the ring runs, simulated rank by rank: a transfer starts
  when both ends have posted it and the link it crosses (NVLink inside a node, the inter-node
  link otherwise) is free, and a rank waits where the schedule waits; exposed communication is
  what the simulated time adds to the compute;
* the approximator (local work linear in tokens, plus a few latency-bound collectives), and the
  rest of the layer (projection and MLP GEMMs at a calibrated rate, elementwise work per token);
* the dense baselines are Transformer Engine's context parallelism: ``p2p`` (a load-balanced
  ring of cuDNN calls, each step a causal half of the chunk pair) and ``a2a+p2p`` (an all-to-all
  over the heads inside a node, a p2p ring across nodes).

All times are milliseconds.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ..ring.program import ring_program
from .profiles import Profile

BF16, FP32 = 2, 4


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The decoder's shape (defaults: Qwen2.5-3B, whose output layer is its input embedding: tied)."""

    hidden: int = 2048
    heads: int = 16
    kv_groups: int = 2
    head_dim: int = 128
    layers: int = 36
    ffn: int = 11008
    vocab: int = 151936
    qkv_bias: bool = True           # Qwen2.5's q/k/v projections have biases (Llama's do not)
    untied_embeddings: bool = False  # separate input embedding and output layer (Qwen2.5-3B ties them)

    def __post_init__(self):
        for name in ("hidden", "heads", "kv_groups", "head_dim", "layers", "ffn", "vocab"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model shape: {name} must be a positive integer, got {value!r}")
        if self.heads % self.kv_groups:
            raise ValueError(f"model shape: heads ({self.heads}) must be a multiple of kv_groups ({self.kv_groups})")

    def parameters(self) -> int:
        """Every parameter: per layer the q/k/v (and their biases), output and SwiGLU weights and two
        norms; the embedding (and a separate output layer when untied); the final norm."""
        h, d = self.hidden, self.head_dim
        qkv = (self.heads + 2 * self.kv_groups) * d
        layer = h * qkv + (qkv if self.qkv_bias else 0) + self.heads * d * h + 3 * h * self.ffn + 2 * h
        return self.layers * layer + (2 if self.untied_embeddings else 1) * self.vocab * h + h

    def layer_gemm_flops_per_token(self) -> float:
        """Forward + backward (x3) FLOPs of one layer's projections and SwiGLU MLP, per token."""
        h, d = self.hidden, self.head_dim
        qkv = h * (self.heads + 2 * self.kv_groups) * d
        proj = self.heads * d * h
        mlp = 3 * h * self.ffn
        return 6.0 * (qkv + proj + mlp)

    def head_flops_per_token(self) -> float:
        return 6.0 * self.hidden * self.vocab

    def attention_shard(self, tp: int) -> "ModelShape":
        """The heads one of ``tp`` tensor-parallel ranks holds (Megatron splits query heads and groups)."""
        return dataclasses.replace(self, heads=self.heads // tp, kv_groups=self.kv_groups // tp)


@dataclasses.dataclass(frozen=True)
class Cluster:
    """GPUs in nodes of ``gpus_per_node``; NVLink inside a node, one inter-node link per GPU.

    Bandwidths are what one GPU's transfer achieves, GB/s (400 Gb/s InfiniBand: 50); None takes
    the profile's NVLink figures."""

    gpus: int
    gpus_per_node: int = 8
    inter_gbps: float = 50.0
    inter_latency_us: float = 5.0
    intra_gbps: Optional[float] = None
    intra_latency_us: Optional[float] = None

    def __post_init__(self):
        if not isinstance(self.gpus, int) or self.gpus < 1:
            raise ValueError(f"cluster: gpus must be a positive integer, got {self.gpus!r}")
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(f"cluster: gpus_per_node must be a positive integer, got {self.gpus_per_node!r}")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise ValueError(f"cluster: {self.gpus} GPUs do not fill nodes of {self.gpus_per_node} "
                             "(the GPU count must be a multiple of the GPUs per node)")
        for name in ("inter_gbps", "intra_gbps"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"cluster: {name} must be > 0 GB/s, got {value!r}")
        for name in ("inter_latency_us", "intra_latency_us"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"cluster: {name} must be >= 0, got {value!r}")

    def same_node(self, a: int, b: int) -> bool:
        return a // self.gpus_per_node == b // self.gpus_per_node

    def context_parallel(self, tp: int) -> "Cluster":
        """The context-parallel ring's view of the GPUs when ``tp`` consecutive GPUs of a node form a
        tensor-parallel group: ``gpus / tp`` ring ranks, ``gpus_per_node / tp`` of them per node."""
        if not isinstance(tp, int) or tp < 1 or self.gpus % tp:
            raise ValueError(f"tensor parallel size {tp!r} must divide the {self.gpus} GPUs")
        if tp == 1:
            return self
        if self.gpus_per_node % tp and self.gpus > tp:
            raise ValueError(f"tensor parallel size {tp} must divide the {self.gpus_per_node} GPUs of a node "
                             "(a TP group stays inside a node)")
        return dataclasses.replace(self, gpus=self.gpus // tp, gpus_per_node=max(1, self.gpus_per_node // tp))


LAYER_IMPLS = ("local", "transformer_engine")


@dataclasses.dataclass(frozen=True)
class Workload:
    """What one step computes, and how the rest of the layer runs.

    ``layers``: Megatron's ``--transformer-impl`` (its rest-of-layer rates differ: TE fuses the
    norms into the GEMMs); ``fp8``: TE's FP8 GEMMs (``--fp8-format``; attention stays bf16);
    ``recompute``: "full" (every layer recomputed), "none", a number of layers recomputed
    (Megatron's ``--recompute-method block --recompute-num-layers k``), or None: the fewest that fit."""

    seq_len: int
    density: float = 0.05       # active pairs / causal pairs of the sparse index
    micro_batch: int = 1        # sequences per micro-batch
    layers: str = "local"
    fp8: bool = False
    recompute: Optional[object] = None

    def __post_init__(self):
        if not isinstance(self.seq_len, int) or self.seq_len < 1:
            raise ValueError(f"workload: seq_len must be a positive integer, got {self.seq_len!r}")
        if not 0 < self.density <= 1:
            raise ValueError(f"workload: density must be in (0, 1], got {self.density!r}")
        if not isinstance(self.micro_batch, int) or self.micro_batch < 1:
            raise ValueError(f"workload: micro_batch must be a positive integer, got {self.micro_batch!r}")
        if self.layers not in LAYER_IMPLS:
            raise ValueError(f"workload: layers must be one of {', '.join(LAYER_IMPLS)}, got {self.layers!r}")
        if self.fp8 and self.layers != "transformer_engine":
            raise ValueError("workload: FP8 GEMMs need Transformer Engine's layers (layers='transformer_engine')")
        if not (self.recompute in (None, "full", "none") or (type(self.recompute) is int and self.recompute >= 0)):
            raise ValueError(f"workload: recompute must be 'full', 'none', a number of layers or None, "
                             f"got {self.recompute!r}")

    def recomputed_layers(self, layers: int) -> Optional[int]:
        """Layers recomputed out of ``layers`` (None: the planner chooses)."""
        if self.recompute is None:
            return None
        if self.recompute == "full":
            return layers
        if self.recompute == "none":
            return 0
        if self.recompute > layers:
            raise ValueError(f"workload: {self.recompute} recomputed layers of a {layers}-layer model")
        return self.recompute


# ----------------------------------------------------------------------------------------------
# The ring, simulated rank by rank
# ----------------------------------------------------------------------------------------------

Link = Callable[[int, int], Tuple[float, float]]  # (src, dst) -> (GB/s, latency ms)

# The share of a sparse backward step that is dQ (the queries' kernel), which the ring runs after
# sending the step's dK/dV on: 10.3-11.5 of 27.0-29.0 ms per step at 512K over 4 ranks, one H100
# (docs/performance.md, "the backward step's parts, measured alone").
BWD_QUERIES_SHARE = 0.39


def simulate_ring(world: int, inner: int, compute_ms: Sequence[float], nbytes: Dict[str, float], link: Link,
                  add_ms: float = 0.0, backward: bool = False, queries_share: float = 0.0) -> float:
    """Milliseconds until the last rank finishes one pass (forward or backward) of the ring.

    ``compute_ms[step]`` is every rank's compute at that step; ``nbytes`` the bytes of a "kv" and a
    "grad" message, and of the "grad_home" one (default: a "grad" message's). A transfer starts once
    sender and receiver have both posted it and the receiving end of its link is free (messages on
    one link queue in posting order). ``queries_share``: the share of a backward step's compute run
    after its sums are sent on (dQ), 0 for a ring whose backward step computes everything first."""
    if world % inner:
        raise ValueError(f"inner ring size {inner} does not divide {world} ranks")
    if not 0.0 <= queries_share < 1.0:
        raise ValueError(f"queries_share must be in [0, 1), got {queries_share}")
    nbytes = {"grad_home": nbytes["grad"], **nbytes}
    outer = world // inner
    program = ring_program(outer, inner, backward)
    share = {"all": 1.0, "keys": 1.0 - queries_share, "queries": queries_share}

    def prev(rank: int, ring: str) -> int:
        node, i = divmod(rank, inner)
        if ring == "inner":
            return node * inner + (i - 1) % inner
        return ((node - 1) % outer) * inner + i

    ring_size = {"inner": inner, "outer": outer}
    t = [0.0] * world
    posted: Dict = {}
    arrival: Dict = {}
    link_free: Dict = {}
    for op in program:
        kind = op[0]
        if kind == "compute":
            step_ms = compute_ms[op[1]] * share[op[2]]
            t = [x + step_ms for x in t]
        elif kind == "add":
            t = [x + add_ms for x in t]
        elif kind == "post":
            _, xid, ring, payload = op
            posted[xid] = list(t)
            arrival[xid] = [0.0] * world
            for r in range(world):
                if ring_size[ring] == 1:  # a one-rank ring hands the tensor to itself
                    arrival[xid][r] = t[r]
                    continue
                src = prev(r, ring)
                gbps, latency_ms = link(src, r)
                start = max(posted[xid][src], t[r], link_free.get((r, ring), 0.0))
                end = start + latency_ms + nbytes[payload] / (gbps * 1e9) * 1e3
                link_free[(r, ring)] = end
                arrival[xid][r] = end
        elif kind == "wait":
            t = [max(x, a) for x, a in zip(t, arrival[op[1]])]
    return max(t)


# ----------------------------------------------------------------------------------------------
# One configuration
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Prediction:
    """One configuration's predicted step; per-layer figures are one attention layer on one GPU."""

    name: str
    method: str                   # "mtraining" or "dense"
    inner: Optional[int]          # hierarchical ring: ranks per inner ring (None: flat)
    fwd_step_ms: float            # attention compute per ring step
    bwd_step_ms: float
    attention_fwd_ms: float       # per layer, with the ring's exposed communication
    attention_bwd_ms: float
    attention_compute_ms: float   # per layer, the kernels alone
    exposed_comm_ms: float        # per layer
    fixed_cost_ms: float          # per layer: the per-call and per-item parts of the kernels
    approximator_ms: float        # per layer
    rest_of_layer_ms: float       # per layer
    head_ms: float                # embedding, output layer and loss, per step
    step_ms: float
    tokens_per_s: float
    limit: str = ""
    note: str = ""
    host_floor_ms: float = 0.0    # per layer: the host's enqueue time of the ring (W steps x the floor)
    host_wait_ms: float = 0.0     # per layer: the GPU waiting for the host (steps where the floor binds)
    host_lead_ms: float = 0.0     # per layer: the host's lead before each direction's first kernels

    @property
    def attention_ms(self) -> float:
        return self.attention_fwd_ms + self.attention_bwd_ms

    def as_dict(self) -> Dict:
        d = dataclasses.asdict(self)
        d["attention_ms"] = self.attention_ms
        return d


def _link_fn(cluster: Cluster, profile: Profile) -> Link:
    intra_gbps = cluster.intra_gbps or profile.intra_gbps
    intra_lat = (profile.intra_latency_us if cluster.intra_latency_us is None else cluster.intra_latency_us) / 1e3
    inter_lat = cluster.inter_latency_us / 1e3

    def link(src: int, dst: int) -> Tuple[float, float]:
        if cluster.same_node(src, dst):
            return intra_gbps, intra_lat
        return cluster.inter_gbps, inter_lat
    return link


def rest_rates(profile: Profile, layers: str = "local", fp8: bool = False) -> Tuple[float, float, float]:
    """(layer GEMM TFLOP/s, elementwise ns per token and layer, output-layer GEMM TFLOP/s) of a layer
    implementation; the output layer stays bf16 under FP8 (Megatron keeps it out of TE's FP8)."""
    if layers == "local":
        return profile.gemm_tflops, profile.elementwise_ns_per_token_layer, profile.gemm_tflops
    precision = "fp8" if fp8 else "bf16"
    if precision not in profile.te_rest_of_layer or "bf16" not in profile.te_rest_of_layer:
        raise ValueError(f"profile {profile.name} has no Transformer Engine {precision} rates (no TE run calibrates "
                         "it); plan with --transformer-impl local, or another --gpu-type")
    gemm_tflops, elementwise = profile.te_rest_of_layer[precision]
    return gemm_tflops, elementwise, profile.te_rest_of_layer["bf16"][0]


def tp_collectives_ms(shape: ModelShape, tokens: float, tp: int, profile: Profile, collectives: int) -> float:
    """Sequence-parallel TP traffic: ``collectives`` all-gathers or reduce-scatters of the layer's
    [tokens x hidden] bf16 activations (4 in a layer's forward, 6 in its backward: Megatron's and
    TE's defaults, not overlapped with the GEMMs)."""
    if tp == 1:
        return 0.0
    if not profile.tp_collective_gbps > 0:
        raise ValueError(f"profile {profile.name} has no tensor-parallel collective rate (tensor_parallel."
                         "collective_gbps); plan without TP or add it to the profile")
    nbytes = tokens * shape.hidden * BF16 * (tp - 1) / tp
    return collectives * nbytes / (profile.tp_collective_gbps * 1e9) * 1e3


TP_FORWARD_COLLECTIVES, TP_BACKWARD_COLLECTIVES = 4, 6


def rest_of_layer_ms(shape: ModelShape, tokens: float, profile: Profile, layers: str = "local",
                     fp8: bool = False, tp: int = 1) -> Tuple[float, float]:
    """(one layer's non-attention fwd+bwd, the output layer and loss) for ``tokens`` on one of ``tp``
    tensor-parallel GPUs (the GEMMs and, with sequence parallelism, the elementwise work split over
    them; the layer's TP collectives added)."""
    gemm_tflops, elementwise_ns, head_tflops = rest_rates(profile, layers, fp8)
    gemm = shape.layer_gemm_flops_per_token() * tokens / tp / (gemm_tflops * 1e12) * 1e3
    elementwise = elementwise_ns * 1e-6 * tokens * (shape.hidden / 2048.0) / tp
    comm = tp_collectives_ms(shape, tokens, tp, profile, TP_FORWARD_COLLECTIVES + TP_BACKWARD_COLLECTIVES)
    head = shape.head_flops_per_token() * tokens / tp / (head_tflops * 1e12) * 1e3
    return gemm + elementwise + comm, head


def _rest(shape: ModelShape, work: Workload, tokens: float, profile: Profile, tp: int = 1) -> Tuple[float, float]:
    return rest_of_layer_ms(shape, tokens, profile, work.layers, work.fp8, tp)


def _small_collective_ms(world: int, cluster: Cluster, profile: Profile) -> float:
    """Latency of one small all-reduce (tree: 2 log2 W hops), inter-node hops at the link's latency."""
    if world == 1:
        return 0.0
    hops = 2 * math.ceil(math.log2(world))
    intra = profile.intra_latency_us if cluster.intra_latency_us is None else cluster.intra_latency_us
    latency = cluster.inter_latency_us if world > cluster.gpus_per_node else intra
    return hops * latency / 1e3


def approximator_ms(shape: ModelShape, work: Workload, world: int, cluster: Cluster, profile: Profile) -> float:
    local = profile.approx_ms_per_token_head * work.seq_len / world * shape.heads * work.micro_batch
    return local + profile.approx_collectives * _small_collective_ms(world, cluster, profile)


def _limit(parts: Dict[str, float]) -> str:
    return max(parts, key=parts.get)


def predict_mtraining(shape: ModelShape, work: Workload, cluster: Cluster, profile: Profile,
                      inner: Optional[int] = None, kernel_scale: float = 1.0,
                      grad_home_in_kv_dtype: bool = True, queries_after_send: bool = True,
                      tp: int = 1) -> Prediction:
    """MTraining's striped sparse ring, flat (``inner`` None or W) or hierarchical, over the
    ``cluster.gpus / tp`` context-parallel ranks (``tp``: tensor parallelism, heads split).

    ``kernel_scale`` multiplies the sparse kernel times (validation uses it for results taken with
    older kernels, from that generation's own one-GPU kernel benchmark; planning leaves it at 1);
    ``grad_home_in_kv_dtype=False`` models a ring whose last hop home carries fp32 sums, and
    ``queries_after_send=False`` one whose backward step sends its sums after dQ (validation uses both
    for results of older rings; benchmarks/plan_validation.py says which)."""
    model, shape, cluster = shape, shape.attention_shard(tp), cluster.context_parallel(tp)
    W = cluster.gpus
    inner = W if inner is None else int(inner)
    if inner < 1 or W % inner:
        raise ValueError(f"inner ring size {inner} must divide the context-parallel size {W}")
    if work.seq_len % (W * profile.block_size):
        raise ValueError(f"sequence length {work.seq_len} is not a multiple of the context-parallel size x block "
                         f"size ({W} x {profile.block_size}): the striped layout needs whole blocks per rank")
    B, H, d, b = profile.block_size, shape.heads, shape.head_dim, work.micro_batch
    n_local = work.seq_len // W
    items = b * H * n_local / B
    tiles_total = work.density * work.seq_len * (work.seq_len + 1) / 2 * H * b / B ** 2
    tiles_step = tiles_total / W ** 2
    fwd_step = profile.sparse_fwd.ms(items, tiles_step, d) * kernel_scale
    bwd_step = profile.sparse_bwd.ms(items, tiles_step, d) * kernel_scale
    kv_bytes = 2 * n_local * shape.kv_groups * d * BF16 * b
    grad_bytes = 2 * n_local * shape.kv_groups * d * FP32 * b  # dK/dV travel in fp32, home in bf16
    # The backward adds the arriving partial dK/dV to its own (fp32, read 2 write 1) and zeroes its own.
    add_ms = 3 * grad_bytes / (profile.hbm_gbps * 1e9) * 1e3
    zero_ms = grad_bytes / (profile.hbm_gbps * 1e9) * 1e3
    bwd_step += zero_ms
    fixed_fwd = kernel_scale * (profile.sparse_fwd.per_call + profile.sparse_fwd.per_item * items)
    fixed_bwd = zero_ms + kernel_scale * (profile.sparse_bwd.per_call + profile.sparse_bwd.per_item * items)
    # A step lasts max(its kernels, the host's enqueue time): the floor replaces the GPU time where it
    # binds (it is not added to the kernels' own fixed costs, which it hides).
    floor = profile.ring_host_floor
    fwd_span, bwd_span = max(fwd_step, floor.fwd), max(bwd_step, floor.bwd)
    link = _link_fn(cluster, profile)
    home_bytes = kv_bytes if grad_home_in_kv_dtype else grad_bytes
    nbytes = {"kv": kv_bytes, "grad": grad_bytes, "grad_home": home_bytes}
    fwd = simulate_ring(W, inner, [fwd_span] * W, nbytes, link)
    bwd = simulate_ring(W, inner, [bwd_span] * W, nbytes, link, add_ms=add_ms, backward=True,
                        queries_share=BWD_QUERIES_SHARE if queries_after_send else 0.0)
    # Where the host binds, a call over several ranks also waits for its own set-up (the agreement,
    # the first transfer's posting): once per call, not per step. (Fitted as T_W - W x floor at the
    # floor's work, it also holds that run's small exposed transfers and adds, counted again here:
    # a few tenths of a millisecond at 16K tokens per GPU.)
    call_ms = floor.call_multi_rank if W > 1 and (floor.fwd > fwd_step or floor.bwd > bwd_step) else 0.0
    # The host's lead before a call's first kernels: the first step of each direction lasts
    # max(floor, lead + kernels); later steps' host work hides behind the GPU's previous step.
    lead_fwd = max(fwd_span, floor.lead_share * floor.fwd + fwd_step) - fwd_span
    lead_bwd = max(bwd_span, floor.lead_share * floor.bwd + bwd_step) - bwd_span
    lead_ms = lead_fwd + lead_bwd
    fwd += call_ms + lead_fwd
    bwd += lead_bwd
    compute = W * (fwd_step + bwd_step)
    host_wait = W * (fwd_span - fwd_step + bwd_span - bwd_step) + call_ms
    adds = (W - 1) * add_ms if W > 1 else 0.0
    exposed = max(0.0, fwd + bwd - compute - host_wait - lead_ms - adds)
    fixed = W * (fixed_fwd + fixed_bwd)
    # What the attention's time is made of: per direction, the kernels (work and fixed costs) where
    # they outlast the floor, the floor where it binds.
    parts = {"attention kernels (work)": 0.0, "per-step fixed costs": adds, "host/launch floor": call_ms + lead_ms}
    for kernels, fixed_part, floor_ms in ((fwd_step, fixed_fwd, floor.fwd), (bwd_step, fixed_bwd, floor.bwd)):
        if floor_ms > kernels:
            parts["host/launch floor"] += W * floor_ms
        else:
            parts["attention kernels (work)"] += W * (kernels - fixed_part)
            parts["per-step fixed costs"] += W * fixed_part
    approx = approximator_ms(shape, work, W, cluster, profile)
    rest, head = _rest(model, work, n_local * b, profile, tp)
    layer = fwd + bwd + approx + rest
    step = shape.layers * layer + head + profile.step_fixed_ms
    name = "mtraining_flat" if inner == W else f"mtraining_hier_{inner}"
    limit = _limit({**parts, "exposed communication": exposed, "rest of the layer": rest, "approximator": approx})
    return Prediction(name, "mtraining", None if inner == W else inner, fwd_step, bwd_step, fwd, bwd, compute,
                      exposed, fixed, approx, rest, head, step, work.seq_len * b / step * 1e3, limit,
                      host_floor_ms=W * floor.per_step + call_ms + lead_ms, host_wait_ms=host_wait,
                      host_lead_ms=lead_ms)


def _dense_step(profile: Profile, calls: int, tiles: float, d: int) -> Tuple[float, float]:
    fwd = calls * profile.dense_fwd.per_call + profile.dense_fwd.ms(0, tiles, d) - profile.dense_fwd.per_call
    bwd = calls * profile.dense_bwd.per_call + profile.dense_bwd.ms(0, tiles, d) - profile.dense_bwd.per_call
    return fwd, bwd


def predict_dense_p2p(shape: ModelShape, work: Workload, cluster: Cluster, profile: Profile,
                      grad_bytes_per_value: int = BF16, grad_home_in_kv_dtype: bool = True, tp: int = 1) -> Prediction:
    """Transformer Engine's ``p2p`` context parallelism: a flat ring of cuDNN calls on the load-balanced
    (zigzag) layout, every step a causal half of its chunk pair. (``grad_bytes_per_value`` 4 models
    this package's own dense zigzag ring, which sends dK/dV in fp32 and home in K/V's dtype:
    ``grad_home_in_kv_dtype``.)"""
    model, shape, cluster = shape, shape.attention_shard(tp), cluster.context_parallel(tp)
    W, B, H, d, b = cluster.gpus, profile.block_size, shape.heads, shape.head_dim, work.micro_batch
    if work.seq_len % (2 * W):
        raise ValueError(f"sequence length {work.seq_len} must split into 2 x {W} zigzag chunks (2 per "
                         "context-parallel rank)")
    n_local = work.seq_len // W
    tiles_step = work.seq_len * (work.seq_len + 1) / 2 * H * b / B ** 2 / W ** 2
    fwd_step, bwd_step = _dense_step(profile, 2, tiles_step, d)  # two cuDNN calls per step (half chunks)
    kv_bytes = 2 * n_local * shape.kv_groups * d * BF16 * b
    grad_bytes = 2 * n_local * shape.kv_groups * d * grad_bytes_per_value * b
    add_ms = 3 * grad_bytes / (profile.hbm_gbps * 1e9) * 1e3
    link = _link_fn(cluster, profile)
    home_bytes = kv_bytes if grad_home_in_kv_dtype else grad_bytes
    nbytes = {"kv": kv_bytes, "grad": grad_bytes, "grad_home": home_bytes}
    fwd = simulate_ring(W, W, [fwd_step] * W, nbytes, link)
    bwd = simulate_ring(W, W, [bwd_step] * W, nbytes, link, add_ms=add_ms, backward=True)
    compute = W * (fwd_step + bwd_step)
    exposed = max(0.0, fwd + bwd - compute - (W - 1) * add_ms)
    fixed = W * 2 * (profile.dense_fwd.per_call + profile.dense_bwd.per_call)
    rest, head = _rest(model, work, n_local * b, profile, tp)
    layer = fwd + bwd + rest
    step = shape.layers * layer + head + profile.step_fixed_ms
    limit = _limit({"attention kernels (work)": compute - fixed, "per-step fixed costs": fixed,
                    "exposed communication": exposed, "rest of the layer": rest})
    return Prediction("dense_te_p2p", "dense", None, fwd_step, bwd_step, fwd, bwd, compute, exposed, fixed, 0.0,
                      rest, head, step, work.seq_len * b / step * 1e3, limit)


def predict_dense_a2a_p2p(shape: ModelShape, work: Workload, cluster: Cluster, profile: Profile,
                          a2a_size: Optional[int] = None, tp: int = 1) -> Prediction:
    """Transformer Engine's ``a2a+p2p``: an all-to-all over the heads among groups of a consecutive
    ranks (each then holds a x the tokens and 1/a of the heads), a p2p ring across the groups.
    ``a2a_size`` is Megatron's first ``--hierarchical-context-parallel-sizes`` entry; by default
    a = min(GPUs per node, GPUs): the all-to-all inside a node, the ring across nodes. K/V heads are
    replicated up to a when there are fewer (GQA); the all-to-alls are not overlapped with compute."""
    model, shape, cluster = shape, shape.attention_shard(tp), cluster.context_parallel(tp)
    W, B, H, d, b = cluster.gpus, profile.block_size, shape.heads, shape.head_dim, work.micro_batch
    a = min(cluster.gpus_per_node, W) if a2a_size is None else a2a_size
    if not isinstance(a, int) or a < 1 or W % a:
        raise ValueError(f"a2a+p2p: the all-to-all size {a!r} must be a positive divisor of the context-parallel "
                         f"size {W}")
    if a > cluster.gpus_per_node:
        raise ValueError(f"a2a+p2p: the all-to-all size {a} spans more than a node of {cluster.gpus_per_node} GPUs")
    if H % a:
        raise ValueError(f"a2a+p2p needs the heads ({H}) divisible by the all-to-all size {a}")
    nodes = W // a
    kv_heads = max(shape.kv_groups, a)
    n_local = work.seq_len // W
    # Per ring step (over nodes): a*n_local queries and keys, H/a heads, a causal half.
    tiles_step = work.seq_len * (work.seq_len + 1) / 2 * H * b / B ** 2 / W / nodes
    fwd_step, bwd_step = _dense_step(profile, 2, tiles_step, d)
    kv_bytes = 2 * a * n_local * (kv_heads // a) * d * BF16 * b
    grad_bytes = kv_bytes
    add_ms = 3 * grad_bytes / (profile.hbm_gbps * 1e9) * 1e3
    intra_gbps = cluster.intra_gbps or profile.intra_gbps
    intra_lat = (profile.intra_latency_us if cluster.intra_latency_us is None else cluster.intra_latency_us) / 1e3
    share = (a - 1) / a

    def a2a_ms(values_per_token: float) -> float:
        if a == 1:
            return 0.0
        return (a - 1) * intra_lat + n_local * b * values_per_token * d * BF16 * share / (intra_gbps * 1e9) * 1e3

    a2a_fwd = a2a_ms(H + 2 * kv_heads) + a2a_ms(H)           # q, k, v in; out back
    a2a_bwd = a2a_ms(2 * H) + a2a_ms(H + 2 * kv_heads)       # dout (and out) in; dq, dk, dv back

    link = _link_fn(cluster, profile)

    def node_link(src: int, dst: int) -> Tuple[float, float]:  # ring positions are groups of a ranks
        return link(src * a, dst * a)

    nbytes = {"kv": kv_bytes, "grad": grad_bytes}
    fwd = simulate_ring(nodes, nodes, [fwd_step] * nodes, nbytes, node_link) + a2a_fwd
    bwd = simulate_ring(nodes, nodes, [bwd_step] * nodes, nbytes, node_link, add_ms=add_ms, backward=True) + a2a_bwd
    compute = nodes * (fwd_step + bwd_step)
    exposed = max(0.0, fwd + bwd - compute - (nodes - 1) * add_ms)
    fixed = nodes * 2 * (profile.dense_fwd.per_call + profile.dense_bwd.per_call)
    rest, head = _rest(model, work, n_local * b, profile, tp)
    layer = fwd + bwd + rest
    step = shape.layers * layer + head + profile.step_fixed_ms
    limit = _limit({"attention kernels (work)": compute - fixed, "per-step fixed costs": fixed,
                    "exposed communication": exposed, "rest of the layer": rest})
    note = f"all-to-all over {a} GPUs, ring over {nodes} groups" + (
        f"; K/V heads replicated {shape.kv_groups} -> {kv_heads}" if kv_heads > shape.kv_groups else "")
    return Prediction("dense_te_a2a_p2p", "dense", a if nodes > 1 else None, fwd_step, bwd_step, fwd, bwd, compute,
                      exposed, fixed, 0.0, rest, head, step, work.seq_len * b / step * 1e3, limit, note)


def with_recompute(p: Prediction, shape: ModelShape, work: Workload, layers: Optional[int] = None) -> Prediction:
    """The step with ``layers`` recomputed (default all: full recompute): each such layer's forward runs
    again inside the backward (the attention forward with its ring, the approximator, which rebuilds
    the same index, and the forward third of the rest of the layer)."""
    layers = shape.layers if layers is None else layers
    if not isinstance(layers, int) or not 0 <= layers <= shape.layers:
        raise ValueError(f"recomputed layers must be an integer in [0, {shape.layers}], got {layers!r}")
    p.step_ms += layers * (p.attention_fwd_ms + p.approximator_ms + p.rest_of_layer_ms / 3)
    p.tokens_per_s = work.seq_len * work.micro_batch / p.step_ms * 1e3
    if layers:
        what = "full recompute" if layers == shape.layers else f"{layers} of {shape.layers} layers recomputed"
        p.note = "; ".join(x for x in (p.note, f"with {what}") if x)
    return p


def inner_sizes(gpus: int) -> List[int]:
    """Every hierarchical inner ring size: divisors of the GPU count strictly between 1 and it."""
    return [i for i in range(2, gpus) if gpus % i == 0]
