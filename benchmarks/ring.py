"""Ring (context-parallel) benchmark: one attention layer forward+backward over W GPUs.

Canonical shape (docs/benchmarks.md): batch 1, 16 query heads, 2 KV heads, head dim 128, bf16,
causal, block 64, the `fixed` synthetic index at ~5% density (the same seed on every rank, so
every rank holds the identical global index). Every rank generates only its own N/W tokens of
q, k, v (random, in the layout's local order); no full-sequence tensor exists, except for
PyTorch's native context parallel, whose API shards full buffers itself.

Variants, each measured on its own (a failure is recorded and the run goes on):

  dense_zigzag         dense_ring_attention, zigzag layout (cuDNN; the impl that ran is recorded)
  torch_native_cp      torch.distributed.tensor.experimental.context_parallel around causal SDPA
                       (head-tail load balancing, K/V expanded to the 16 query heads)
  sparse_zigzag        sparse_ring_attention, zigzag layout, flat ring
  sparse_striped       sparse_ring_attention, striped layout, flat ring
  sparse_striped_hier  the same on the hierarchical ring (inner_size 2; needs W > 2)
  sparse_moba          only when named: a MoBA-pattern BlockIndex (--moba-block-size, top-k for
                       --density unless --moba-top-k) on the striped ring (make_tables.py's
                       ring_moba_speedup_vs_dense_512k_4gpu)

Times: forward+backward (``out.backward(grad)``) and forward-only milliseconds, CUDA events,
a barrier before every repetition, median over repetitions per rank, then the max over ranks.
One extra instrumented repetition of the ring variants records every rank's per-step compute
and wait times: the imbalance degrees of the paper's appendix and a rank x step heatmap; with
them each step's plan conversion (forward) and partial dK/dV merge (backward), and a timeline
per phase (``steps.timeline``: every kind's ms summed over steps, mean and max over ranks).

Scaling: ``--seq-lens`` fixes the total length (strong scaling: run it on 1 and on W GPUs);
``--tokens-per-gpu`` fixes the tokens per GPU (weak scaling: S = tokens x W on this run's W
GPUs); both may be given, the lengths are then the union. make_tables.py pairs the files of one
device and commit: ``ring_strong_scaling_<W>gpu`` and ``ring_weak_scaling_<T>k_per_gpu_<W>gpu``.

    python -m torch.distributed.run --nproc_per_node 4 benchmarks/ring.py                 # GPU, 256K and 512K
    python -m torch.distributed.run --nproc_per_node 2 benchmarks/ring.py --smoke         # tiny fp32 run on CPU (gloo)
    python -m torch.distributed.run --nproc_per_node 4 benchmarks/ring.py --tokens-per-gpu 16384,32768,131072 \
        --variants sparse_striped --no-fwd                                                 # weak scaling, 4 GPUs
    python -m torch.distributed.run --nproc_per_node 4 benchmarks/ring.py --seq-lens 524288 \
        --variants dense_zigzag,sparse_striped,sparse_moba                                 # MoBA pattern, 4 GPUs
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import (cu_seqlens_of, describe_index, device_slug, document_mix, fixed_moba_index,  # noqa: E402
                    fixed_packed_index, fixed_vs_index, json_ready, median, moba_top_k_for_density, run_metadata,
                    synchronize)

from megatron_mtraining import BlockIndex  # noqa: E402
from megatron_mtraining.documents import Documents  # noqa: E402
from megatron_mtraining.ring import (dense_ring_attention, imbalance_metrics, record_ring_steps,  # noqa: E402
                                     sparse_ring_attention)

DEFAULT_SEQ_LENS = "262144,524288"
RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
VARIANTS = ("dense_zigzag", "torch_native_cp", "sparse_zigzag", "sparse_striped", "sparse_striped_hier")
# Run only when --variants names them: sparse_moba, a MoBA-pattern BlockIndex on the striped ring.
OPTIONAL_VARIANTS = ("sparse_moba",)
DENSE_BASELINES = ("dense_zigzag", "torch_native_cp")
NOTES = [
    "Times are the max over ranks of each rank's median; speedup = the faster dense baseline "
    "(dense_zigzag, torch_native_cp) over the variant, forward+backward.",
    "Strong / weak scaling: this script cannot change its world size; run it again with another "
    "--nproc_per_node and compare the files (make_tables.py does: strong at fixed S, weak at fixed "
    "tokens per GPU, the 1-GPU time scaled by the causal work ratio (W*T+1)/(T+1)).",
]


@dataclasses.dataclass
class Config:
    seq_lens: List[int]
    world_size: int = 1
    block_size: int = 64
    batch: int = 1
    heads: int = 16
    kv_heads: int = 2
    head_dim: int = 128
    dtype: str = "bf16"
    density: float = 0.05
    seed: int = 0
    sparse_backend: str = "auto"
    dense_impl: str = "auto"
    inner_size: int = 2
    native_rotate: str = "alltoall"
    native_sdpa: Sequence[str] = ("cudnn", "flash")
    warmup: int = 2
    reps: int = 5
    forward_only: bool = True
    variants: Sequence[str] = VARIANTS
    scaling: bool = False
    smoke: bool = False
    slow_link_gbps: Optional[float] = None  # emulated inter-node link (benchmarks/slow_link.py); None: off
    slow_link_latency_us: float = 0.0
    documents: bool = False  # pack common.DOCUMENT_MIX_128K (scaled) into every sequence
    tokens_per_gpu: Sequence[int] = ()  # weak scaling: these tokens per GPU (S = T x W), beside seq_lens
    kernel_profile: bool = False  # one more fwd+bwd under torch.profiler: its kernels' time on rank 0
    moba_block_size: int = 4096  # sparse_moba: tokens per MoBA key block (MoBA's default)
    moba_top_k: int = 0  # sparse_moba: MoBA blocks per query block; 0: the top-k closest to `density`


# ----------------------------------------------------------------------------------------------
# Process group and small collective helpers
# ----------------------------------------------------------------------------------------------


def setup_distributed(smoke: bool, timeout_s: float) -> torch.device:
    """NCCL on the GPU of LOCAL_RANK, or gloo on the CPU for smoke runs. Needs torchrun's env.

    The timeout bounds a hang: a failure on some ranks only, in the middle of a ring, leaves the
    others waiting for a transfer that never comes; after ``timeout_s`` the watchdog ends the
    run, and the JSON written after every variant keeps what was measured before it.
    """
    if "RANK" not in os.environ:
        raise SystemExit("run under torchrun: python -m torch.distributed.run --nproc_per_node N benchmarks/ring.py [...]")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    timeout = datetime.timedelta(seconds=timeout_s)
    if smoke or not torch.cuda.is_available():
        dist.init_process_group("gloo", timeout=timeout)
        return torch.device("cpu")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", timeout=timeout, device_id=device)
    return device


def rank() -> int:
    return dist.get_rank()


def say(msg: str) -> None:
    """Progress line from rank 0."""
    if rank() == 0:
        print(f"[ring {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def gather(obj) -> list:
    """Every rank's ``obj`` (picklable), in rank order, on every rank."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:800]


def free_memory() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------


def time_reps(fn: Callable[[], None], device: torch.device, warmup: int, reps: int) -> List[float]:
    """Milliseconds of every repetition of ``fn()`` after ``warmup`` calls; a barrier before each.

    CUDA events on the current stream (the ring's last transfer is waited on that stream, so the
    end event follows all of it); wall clock on the CPU.
    """
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(reps):
        dist.barrier()
        synchronize(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def make_fwd_bwd(attn: Callable[[], torch.Tensor], leaves: Sequence[torch.Tensor], grad: torch.Tensor):
    """``out = attn(); out.backward(grad)``; the leaves' .grad is cleared first (no accumulation)."""
    def run():
        for x in leaves:
            x.grad = None
        attn().backward(grad)
    return run


def make_fwd(attn: Callable[[], torch.Tensor]):
    def run():
        with torch.no_grad():
            attn()
    return run


def measure_local(attn: Callable[[], torch.Tensor], leaves, grad, cfg: Config, device: torch.device,
                  per_step: bool) -> Dict:
    """This rank's figures of one variant: fwd+bwd (and fwd) samples, and one instrumented rep."""
    fwd_bwd = make_fwd_bwd(attn, leaves, grad)
    local = {"fwdbwd_samples_ms": time_reps(fwd_bwd, device, cfg.warmup, cfg.reps)}
    if cfg.forward_only:
        local["fwd_samples_ms"] = time_reps(make_fwd(attn), device, 1, cfg.reps)
    if per_step:
        dist.barrier()
        with record_ring_steps() as timer:
            fwd_bwd()
        local["steps"] = timer.summary()
    if cfg.kernel_profile:
        local["kernel_profile"] = profile_kernels(fwd_bwd, device)
    return local


KERNEL_PROFILE_TOP = 25


def profile_kernels(fn: Callable[[], None], device: torch.device) -> Dict:
    """One more ``fn()`` under torch.profiler: its GPU kernels' total time and the longest
    ``KERNEL_PROFILE_TOP`` by name (summed over launches), in ms; on the CPU (smoke runs) the
    operators' own CPU time instead. Which kernels grow from one GPU to W at the same S is where a
    ring's strong-scaling loss goes (docs/performance.md)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    dist.barrier()
    synchronize(device)
    with profile(activities=activities) as prof:
        fn()
        synchronize(device)
    totals: Dict[str, float] = {}
    for event in prof.key_averages():
        if getattr(event, "is_user_annotation", False):
            continue  # a record_function range (the ring's own): it spans the kernels counted below
        if cuda:
            ms = event.self_device_time_total / 1e3 if event.device_type == torch.autograd.DeviceType.CUDA else 0.0
        else:
            ms = event.self_cpu_time_total / 1e3
        if ms > 0:
            totals[event.key] = totals.get(event.key, 0.0) + ms
    top = dict(sorted(totals.items(), key=lambda kv: -kv[1])[:KERNEL_PROFILE_TOP])
    return {"what": "GPU kernels" if cuda else "CPU operators (no GPU)", "total_ms": sum(totals.values()),
            "top_ms": top}


# ----------------------------------------------------------------------------------------------
# Combining the ranks' figures
# ----------------------------------------------------------------------------------------------


def summarise(per_rank: List[Dict]) -> Dict:
    """Medians per rank and their max over ranks; step matrices and imbalance degrees."""
    section: Dict = {}
    for kind in ("fwdbwd", "fwd"):
        samples = [r.get(f"{kind}_samples_ms") for r in per_rank]
        if all(samples):
            medians = [median(s) for s in samples]
            section[f"{kind}_ms"] = max(medians)
            section[f"{kind}_ms_per_rank"] = medians
            section[f"{kind}_samples_ms"] = samples
    if all("steps" in r for r in per_rank):
        section["steps"] = step_matrices([r["steps"] for r in per_rank])
    extras = {k: v for k, v in per_rank[0].items() if not k.endswith("_samples_ms") and k != "steps"}
    if "kernel_profile" in extras:
        extras["kernel_profile"] = dict(extras["kernel_profile"], rank=0)
    section.update(extras)
    return section


STEP_KINDS = ("compute", "wait", "plan", "merge")  # instrument.py's kinds; plan: forward, merge: backward


def step_matrices(per_rank_steps: List[Dict]) -> Dict:
    """rank x step matrices of every kind per phase (a kind a rank did not record is zeros: the
    dense ring has no plan, one rank no merge), their fwd+bwd sum, the imbalance metrics of each
    (compute and wait only, as in the paper) and the timeline: per phase and kind, the ms summed
    over steps, mean and max over ranks."""
    out: Dict = {}
    steps = max(len(r[phase].get("compute_ms", [])) for r in per_rank_steps for phase in ("forward", "backward"))

    def matrix(phase, kind):
        rows = [list(r.get(phase, {}).get(f"{kind}_ms", [])) for r in per_rank_steps]
        return [row + [0.0] * (steps - len(row)) for row in rows]

    for phase in ("forward", "backward"):
        out[phase] = {f"{kind}_ms": matrix(phase, kind) for kind in STEP_KINDS}
        out[phase]["imbalance"] = imbalance_metrics(out[phase]["compute_ms"], out[phase]["wait_ms"])

    def add(a, b):
        return [[x + y for x, y in zip(ra, rb)] for ra, rb in zip(a, b)]
    out["fwd_bwd"] = {f"{kind}_ms": add(out["forward"][f"{kind}_ms"], out["backward"][f"{kind}_ms"])
                      for kind in STEP_KINDS}
    out["fwd_bwd"]["imbalance"] = imbalance_metrics(out["fwd_bwd"]["compute_ms"], out["fwd_bwd"]["wait_ms"])
    out["timeline"] = {phase: {f"{kind}_ms": {"mean": sum(map(sum, out[phase][f"{kind}_ms"])) / len(per_rank_steps),
                                              "max": max(map(sum, out[phase][f"{kind}_ms"]))}
                               for kind in STEP_KINDS}
                       for phase in ("forward", "backward", "fwd_bwd")}
    return out


def run_variant(name: str, body: Callable[[], Dict]) -> Dict:
    """``body()`` on every rank, then one all-gather of (ok, result or error) that every rank
    reaches: a failure on some ranks cannot leave the others in a different branch."""
    say(f"  {name} ...")
    t0 = time.perf_counter()
    try:
        local, error = body(), None
    except Exception as exc:  # noqa: BLE001  (OOM, kernel or API errors: recorded, never fatal)
        local, error = None, error_text(exc)
    free_memory()
    dist.barrier()
    everyone = gather((error is None, local if error is None else error))
    if all(ok for ok, _ in everyone):
        section = summarise([payload for _, payload in everyone])
    else:
        section = {"errors": {f"rank{r}": payload for r, (ok, payload) in enumerate(everyone) if not ok}}
    section["wall_s"] = time.perf_counter() - t0
    if "errors" in section:
        say(f"  {name}: FAILED {next(iter(section['errors'].values()))[:200]}")
    else:
        fwd = f", fwd {section['fwd_ms']:.2f} ms" if "fwd_ms" in section else ""
        say(f"  {name}: fwd+bwd {section['fwdbwd_ms']:.2f} ms{fwd} ({section['wall_s']:.1f} s)")
    return section


# ----------------------------------------------------------------------------------------------
# Variants
# ----------------------------------------------------------------------------------------------


def local_inputs(cfg: Config, seq_len: int, device: torch.device) -> Dict[str, torch.Tensor]:
    """This rank's q [b, hq, N/W, d], k/v [b, hkv, N/W, d] (leaves) and the output gradient."""
    gen = torch.Generator(device=device).manual_seed(cfg.seed + 1000 * rank() + seq_len)
    dtype, n_local = DTYPES[cfg.dtype], seq_len // cfg.world_size

    def rand(heads):
        return torch.randn(cfg.batch, heads, n_local, cfg.head_dim, generator=gen, device=device, dtype=dtype)

    return {"q": rand(cfg.heads).requires_grad_(), "k": rand(cfg.kv_heads).requires_grad_(),
            "v": rand(cfg.kv_heads).requires_grad_(), "grad": rand(cfg.heads)}


def ring_settings(cfg: Config):
    """The ring calls' settings: the environment's, with the emulated slow link's arrival hook
    (``slow_link.emulated_arrival``) when ``cfg`` asks for one."""
    if not cfg.slow_link_gbps:
        return None
    from slow_link import emulated_arrival

    from megatron_mtraining.config import environment_settings
    return dataclasses.replace(environment_settings(), ring_arrival_hook=emulated_arrival)


def bench_dense_zigzag(cfg: Config, x: Dict, device: torch.device, cu_seqlens=None) -> Dict:
    from megatron_mtraining.kernels.dispatch import dense_impl

    def attn():
        return dense_ring_attention(x["q"], x["k"], x["v"], layout="zigzag", impl=cfg.dense_impl,
                                    block_size=cfg.block_size, cu_seqlens=cu_seqlens, settings=ring_settings(cfg))

    local = measure_local(attn, (x["q"], x["k"], x["v"]), x["grad"], cfg, device, per_step=True)
    # "auto" resolves to cuDNN where it is present (a call whose cuDNN raises runs flash, with a warning).
    # With documents the dense ring runs our block-skipping kernels on the all-blocks index.
    local["impl"] = "sparse kernels, all blocks, documents" if cu_seqlens is not None else \
        dense_impl(cfg.dense_impl, x["q"])
    return local


def bench_sparse(cfg: Config, x: Dict, index, device: torch.device, layout: str,
                 inner_size: Optional[int], cu_seqlens=None) -> Dict:
    from megatron_mtraining.kernels import resolve_backend

    def attn():
        return sparse_ring_attention(x["q"], x["k"], x["v"], index, layout=layout, inner_size=inner_size,
                                     backend=cfg.sparse_backend, cu_seqlens=cu_seqlens, settings=ring_settings(cfg))

    local = measure_local(attn, (x["q"], x["k"], x["v"]), x["grad"], cfg, device, per_step=True)
    local.update(layout=layout, inner_size=inner_size, backend=resolve_backend(cfg.sparse_backend, device))
    return local


def bench_torch_native_cp(cfg: Config, seq_len: int, device: torch.device, sdpa: str) -> Dict:
    """PyTorch's context parallel around causal SDPA, one SDPA backend.

    ``context_parallel`` shards full-sequence buffers in place (head-tail load balancing), so
    full-size q/k/v exist here: allocated uninitialised, sharded, then filled with random
    values on each rank's shard. K/V are expanded to the query heads (no GQA in the CP path).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
               "efficient": SDPBackend.EFFICIENT_ATTENTION}[sdpa]
    mesh = init_device_mesh(device.type, (cfg.world_size,))
    set_rotate_method(cfg.native_rotate)
    shape = (cfg.batch, cfg.heads, seq_len, cfg.head_dim)
    q, k, v = (torch.empty(shape, device=device, dtype=DTYPES[cfg.dtype]) for _ in range(3))
    gen = torch.Generator(device=device).manual_seed(cfg.seed + 1000 * rank() + seq_len + 7)
    with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2], no_restore_buffers={q, k, v}):
        for t in (q, k, v):
            t.normal_(generator=gen).requires_grad_()
        grad = torch.randn(q.shape, generator=gen, device=device, dtype=q.dtype)

        def attn():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        with sdpa_kernel(backend):
            local = measure_local(attn, (q, k, v), grad, cfg, device, per_step=False)
        local["local_q_shape"] = list(q.shape)
    local.update(sdpa=sdpa, rotate_method=cfg.native_rotate, load_balance="head-tail", kv_heads_expanded_to=cfg.heads)
    return local


def native_cp_section(cfg: Config, seq_len: int, device: torch.device) -> Dict:
    """The first SDPA backend of ``cfg.native_sdpa`` that runs; the failed ones are kept."""
    if device.type != "cuda":
        return {"skipped": "PyTorch's context parallel SDPA needs CUDA"}
    tried = {}
    for sdpa in cfg.native_sdpa:
        section = run_variant(f"torch_native_cp[{sdpa}]",
                              lambda: bench_torch_native_cp(cfg, seq_len, device, sdpa))
        if "errors" not in section:
            if tried:
                section["failed_sdpa"] = tried
            return section
        tried[sdpa] = section["errors"]
    return {"errors": {f"sdpa={s}": e for s, e in tried.items()}}


# ----------------------------------------------------------------------------------------------
# One sequence length
# ----------------------------------------------------------------------------------------------


def index_fingerprint(index) -> List[int]:
    if isinstance(index, BlockIndex):
        return [int(t.long().sum()) for t in (index.key_blocks, index.n_key_blocks)]
    return [int(t.long().sum()) for t in (index.slash, index.n_slash, index.vertical, index.n_vertical)]


def bench_moba(cfg: Config, seq_len: int, x: Dict, device: torch.device, entry: Dict, cu) -> Dict:
    """sparse_moba: MoBA's pattern (``common.fixed_moba_index``: per query block its own MoBA block and
    top-k - 1 earlier ones, seeded, the same on every rank) on the striped ring, like sparse_striped."""
    if cu is not None:
        return {"skipped": "the MoBA pattern is benchmarked without documents"}
    top_k = cfg.moba_top_k or moba_top_k_for_density(seq_len, cfg.block_size, cfg.moba_block_size, cfg.density)
    try:  # deterministic: every rank takes the same branch
        index = fixed_moba_index(cfg.batch, cfg.heads, seq_len, cfg.block_size, cfg.moba_block_size, top_k, device,
                                 cfg.seed)
    except Exception as exc:  # noqa: BLE001
        return {"errors": {"index": error_text(exc)}}
    dens = index.density(seq_len).float()
    entry["moba_index"] = {"moba_block_size": cfg.moba_block_size, "moba_top_k": top_k,
                           "density_mean": float(dens.mean()), "capacity": index.capacity,
                           "active_pairs": float(dens.sum()) * seq_len * (seq_len + 1) / 2,
                           "same_on_all_ranks": len({tuple(f) for f in gather(index_fingerprint(index))}) == 1}
    section = run_variant("sparse_moba", lambda: bench_sparse(cfg, x, index, device, "striped", None, None))
    section["pattern"] = f"MoBA, {cfg.moba_block_size}-token blocks, top-{top_k}"
    return section


def add_speedups(variants: Dict) -> Optional[str]:
    """Speedup of every variant over the faster dense baseline (and over each), fwd+bwd and fwd."""
    base = {name: variants.get(name, {}).get("fwdbwd_ms") for name in DENSE_BASELINES}
    base = {name: ms for name, ms in base.items() if ms}
    best = min(base, key=base.get) if base else None
    for section in variants.values():
        ms = section.get("fwdbwd_ms")
        if not ms:
            continue
        speed = {f"vs_{name}": base_ms / ms for name, base_ms in base.items()}
        if best:
            speed["vs_best_dense"] = base[best] / ms
            best_fwd, fwd = variants[best].get("fwd_ms"), section.get("fwd_ms")
            if best_fwd and fwd:
                speed["vs_best_dense_fwd"] = best_fwd / fwd
        section["speedup"] = speed
    return best


def bench_seq_len(cfg: Config, seq_len: int, device: torch.device, on_update: Callable[[Dict], None]) -> Dict:
    W = cfg.world_size
    say(f"S = {seq_len} ({seq_len // W} tokens per rank, {W} ranks)")
    entry: Dict = {"seq_len": seq_len, "world_size": W, "tokens_per_rank": seq_len // W, "variants": {}}
    variants = entry["variants"]
    cu = cu_seqlens_of(document_mix(seq_len, cfg.block_size), device) if cfg.documents else None
    if cu is None:
        index = fixed_vs_index(cfg.batch, cfg.heads, seq_len, cfg.block_size, cfg.density, device, cfg.seed)
        entry["index"] = describe_index(index, seq_len)
    else:  # `density` of the document-causal pairs, counted exactly
        index, pairs, doc_pairs = fixed_packed_index(cfg.batch, cfg.heads, seq_len, cu, cfg.block_size, cfg.density,
                                                     device, cfg.seed)
        entry["documents"] = document_mix(seq_len, cfg.block_size)
        entry["index"] = {"active_pairs": float(pairs.sum()), "density_of_document_pairs": float(pairs.mean()) / doc_pairs,
                          "density_mean": float(pairs.mean()) / (seq_len * (seq_len + 1) / 2)}
    entry["index_same_on_all_ranks"] = len({tuple(f) for f in gather(index_fingerprint(index))}) == 1
    x = local_inputs(cfg, seq_len, device)
    # Built and checked once, outside the timed calls, as the Megatron path does per batch.
    cu = None if cu is None else Documents(cu, seq_len)

    plan = {
        "dense_zigzag": lambda: run_variant("dense_zigzag", lambda: bench_dense_zigzag(cfg, x, device, cu)),
        "torch_native_cp": lambda: (native_cp_section(cfg, seq_len, device) if cu is None
                                    else {"skipped": "PyTorch's context parallel has no document mask"}),
        "sparse_zigzag": lambda: run_variant(
            "sparse_zigzag", lambda: bench_sparse(cfg, x, index, device, "zigzag", None, cu)),
        "sparse_striped": lambda: run_variant(
            "sparse_striped", lambda: bench_sparse(cfg, x, index, device, "striped", None, cu)),
        "sparse_striped_hier": lambda: (
            run_variant("sparse_striped_hier",
                        lambda: bench_sparse(cfg, x, index, device, "striped", cfg.inner_size, cu))
            if W > cfg.inner_size and W % cfg.inner_size == 0
            else {"skipped": f"needs a world size that is a multiple of inner_size {cfg.inner_size}, "
                             f"larger than it (have {W})"}),
        "sparse_moba": lambda: bench_moba(cfg, seq_len, x, device, entry, cu),
    }
    for name in cfg.variants:
        variants[name] = plan[name]()
        on_update(entry)
    entry["best_dense"] = add_speedups(variants)
    on_update(entry)
    return entry


# ----------------------------------------------------------------------------------------------
# Output: JSON, heatmaps, table
# ----------------------------------------------------------------------------------------------


def save_heatmap(path: str, title: str, steps: Dict) -> Optional[str]:
    """rank x step compute-time heatmaps (forward, backward) into one PNG; None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), constrained_layout=True)
    for ax, phase in zip(axes, ("forward", "backward")):
        data = steps[phase]["compute_ms"]
        image = ax.imshow(data, aspect="auto", cmap="viridis", interpolation="nearest")
        metrics = steps[phase]["imbalance"]
        ax.set_title(f"{phase}: worker {metrics['worker_imbalance']:.2f}, step {metrics['step_imbalance']:.2f}, "
                     f"compute {metrics['computation_ratio']:.2f}", fontsize=9)
        ax.set_xlabel("ring step")
        ax.set_ylabel("rank")
        ax.set_xticks(range(len(data[0])))
        ax.set_yticks(range(len(data)))
        fig.colorbar(image, ax=ax, label="compute ms")
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_heatmaps(result: Dict, json_path: str) -> None:
    stem = os.path.splitext(json_path)[0]
    for entry in result["runs"]:
        for name, section in entry["variants"].items():
            if "steps" not in section:
                continue
            path = f"{stem}_{name}_{tokens(entry['seq_len'])}.png"
            title = (f"{name}, S = {entry['seq_len']}, {entry['world_size']} ranks, "
                     f"{result['meta']['device']}: compute ms per rank and ring step")
            if save_heatmap(path, title, section["steps"]):
                section["heatmap"] = os.path.basename(path)


def write_json(result: Dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(json_ready(result), fh, indent=1)
        fh.write("\n")
    os.replace(tmp, path)


def tokens(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def fmt(x, digits=2, suffix="") -> str:
    return f"{x:.{digits}f}{suffix}" if isinstance(x, (int, float)) else "-"


def print_table(result: Dict) -> None:
    cfg = result["config"]
    print(f"\nring: {result['meta']['device']} x {cfg['world_size']}, {cfg['heads']}/{cfg['kv_heads']} heads, "
          f"d {cfg['head_dim']}, {cfg['dtype']}, block {cfg['block_size']}; ms = max over ranks of the "
          f"per-rank median of {cfg['reps']} reps")
    header = ["S", "per GPU", "variant", "fwd+bwd ms", "fwd ms", "speedup", "worker", "step", "compute",
              "steps: compute / wait / plan / merge ms", "note"]
    rows = []
    for entry in result["runs"]:
        size = f"{tokens(entry['seq_len'])} ({100 * entry['index']['density_mean']:.1f}%)"
        for name, s in entry["variants"].items():
            imb = s.get("steps", {}).get("fwd_bwd", {}).get("imbalance", {})
            line = s.get("steps", {}).get("timeline", {}).get("fwd_bwd")
            timeline = " / ".join(fmt(line[f"{kind}_ms"]["mean"], 1) for kind in STEP_KINDS) if line else "-"
            note = ""
            if "errors" in s:
                note = "FAILED: " + next(iter(s["errors"].values()))[:70].replace("\n", " ")
            elif "skipped" in s:
                note = "skipped: " + s["skipped"][:70]
            elif name == entry.get("best_dense"):
                note = "baseline"
            elif name == "sparse_moba" and "moba_index" in entry:
                note = f"{s.get('pattern', 'MoBA')}, {100 * entry['moba_index']['density_mean']:.1f}%"
            for key in ("impl", "sdpa", "backend"):
                if key in s:
                    note = f"{note} {key}={s[key]}".strip()
            rows.append([size, tokens(entry["tokens_per_rank"]), name, fmt(s.get("fwdbwd_ms")), fmt(s.get("fwd_ms")),
                         fmt(s.get("speedup", {}).get("vs_best_dense"), 2, "x"),
                         fmt(imb.get("worker_imbalance")), fmt(imb.get("step_imbalance")),
                         fmt(imb.get("computation_ratio")), timeline, note])
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    for row in [header] + rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-lens", default=None,
                   help=f"comma-separated total sequence lengths (default {DEFAULT_SEQ_LENS} without --tokens-per-gpu)")
    p.add_argument("--tokens-per-gpu", default=None,
                   help="comma-separated tokens per GPU: weak scaling, S = tokens x world size (with --seq-lens: both)")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--density", type=float, default=0.05, help="target density of the fixed index")
    p.add_argument("--backend", default="auto", choices=("auto", "triton", "torch"), help="sparse kernels")
    p.add_argument("--dense-impl", default="auto", choices=("auto", "cudnn", "flash", "torch"),
                   help="dense kernel of the dense zigzag ring")
    p.add_argument("--inner-size", type=int, default=2, help="ranks per inner ring of sparse_striped_hier")
    p.add_argument("--native-rotate", default="alltoall", choices=("alltoall", "allgather"),
                   help="K/V rotation of PyTorch's context parallel (alltoall: ring exchange)")
    p.add_argument("--native-sdpa", default="cudnn,flash",
                   help="SDPA backends tried in order for PyTorch's context parallel")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help="comma-separated subset of " + ", ".join(VARIANTS + OPTIONAL_VARIANTS) + " (default: all but "
                   + ", ".join(OPTIONAL_VARIANTS) + ")")
    p.add_argument("--moba-block-size", type=int, default=4096, help="sparse_moba: tokens per MoBA key block")
    p.add_argument("--moba-top-k", type=int, default=0,
                   help="sparse_moba: MoBA blocks per query block (0: the top-k whose density is closest to --density)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--no-fwd", action="store_true", help="skip the forward-only timings")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scaling", action="store_true",
                   help="also write a 'scaling' record (world size, tokens per rank, times) for combining runs")
    p.add_argument("--timeout-s", type=float, default=180.0,
                   help="process-group timeout: how long a hung collective may wait before the run ends")
    p.add_argument("--smoke", action="store_true", help="tiny fp32 shapes on CPU with gloo: tests the script")
    p.add_argument("--slow-link-gbps", type=float, default=None,
                   help="emulate a slow link between nodes of --inner-size GPUs at this many GB/s (GPU only): "
                        "flat vs hierarchical ring under a slow inter-node hop")
    p.add_argument("--slow-link-latency-us", type=float, default=0.0)
    p.add_argument("--kernel-profile", action="store_true",
                   help="one more fwd+bwd per variant under torch.profiler: rank 0's kernel times in the JSON")
    p.add_argument("--documents", action="store_true",
                   help="pack the benchmark's document mix into every sequence (index at --density of the document "
                        "pairs; the dense ring then runs our kernels on the all-blocks index with the documents)")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/ring_<device>_<W>gpu.json)")
    return p.parse_args(argv)


def parse_lengths(text: str, flag: str) -> List[int]:
    """A comma-separated list of positive token counts, or SystemExit naming the flag."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) <= 0:
        raise SystemExit(f"{flag} must be a comma-separated list of positive token counts, got {text!r}")
    return values


def make_config(args, world_size: int) -> Config:
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS + OPTIONAL_VARIANTS)
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}; choose from {VARIANTS + OPTIONAL_VARIANTS}")
    tokens_per_gpu = parse_lengths(args.tokens_per_gpu, "--tokens-per-gpu") if args.tokens_per_gpu else []
    explicit = parse_lengths(args.seq_lens, "--seq-lens") if args.seq_lens else []
    seq_lens = sorted(set(explicit) | {t * world_size for t in tokens_per_gpu}) or \
        parse_lengths(DEFAULT_SEQ_LENS, "--seq-lens")
    common = dict(world_size=world_size, density=args.density, tokens_per_gpu=tuple(tokens_per_gpu),
                  seed=args.seed, inner_size=args.inner_size,
                  native_rotate=args.native_rotate, native_sdpa=tuple(s for s in args.native_sdpa.split(",") if s),
                  forward_only=not args.no_fwd, variants=tuple(variants), scaling=args.scaling,
                  slow_link_gbps=args.slow_link_gbps, slow_link_latency_us=args.slow_link_latency_us,
                  documents=args.documents, kernel_profile=args.kernel_profile, moba_top_k=args.moba_top_k)
    if args.smoke:  # --tokens-per-gpu / --seq-lens still choose the lengths (tests of the scaling modes)
        return Config(seq_lens=seq_lens if (tokens_per_gpu or explicit) else [512], block_size=16, heads=4,
                      kv_heads=2, head_dim=32, dtype="fp32", moba_block_size=64,
                      sparse_backend="torch", dense_impl="torch", warmup=1, reps=3, smoke=True, **common)
    if args.moba_block_size < args.block_size or args.moba_block_size % args.block_size:
        raise SystemExit(f"--moba-block-size {args.moba_block_size} must be a multiple of --block-size {args.block_size}")
    return Config(seq_lens=seq_lens, block_size=args.block_size,
                  sparse_backend=args.backend, dense_impl=args.dense_impl, warmup=args.warmup, reps=args.reps,
                  moba_block_size=args.moba_block_size, **common)


def output_path(args, device: torch.device, world_size: int) -> str:
    if args.out:
        return args.out
    link = f"_slowlink{args.slow_link_gbps:g}GBps" if args.slow_link_gbps else ""
    kind = "ringpacked" if args.documents else "ring"  # packed runs are their own results kind
    weak = "_weak" if args.tokens_per_gpu else ""
    name = f"{kind}_{device_slug(device)}_{world_size}gpu{weak}{link}.json"
    if args.smoke:  # smoke runs never land among the committed results
        return os.path.join(tempfile.gettempdir(), name.replace("ring_", "ring_smoke_"))
    return os.path.join(RESULTS_DIR, name)


def scaling_record(result: Dict) -> Dict:
    """One point per (sequence length, variant) of this world size; other files give the others."""
    points = []
    for entry in result["runs"]:
        for name, s in entry["variants"].items():
            if s.get("fwdbwd_ms"):
                points.append({"variant": name, "seq_len": entry["seq_len"], "world_size": entry["world_size"],
                               "tokens_per_rank": entry["tokens_per_rank"], "fwdbwd_ms": s["fwdbwd_ms"]})
    return {"note": "strong: efficiency = T_1 / (T_W * W) at fixed seq_len; weak: T_1 * (W*T + 1) / (T + 1) / "
                    "T_W at fixed tokens_per_rank T (the causal work per GPU grows (W*T + 1) / (T + 1), about "
                    "W-fold); combine files from runs with other --nproc_per_node (make_tables.py)",
            "tokens_per_gpu": list(result["config"].get("tokens_per_gpu") or []),
            "points": points}


def main(argv=None) -> int:
    args = parse_args(argv)
    device = setup_distributed(args.smoke, args.timeout_s)
    cfg = make_config(args, dist.get_world_size())
    path = output_path(args, device, cfg.world_size)
    if cfg.slow_link_gbps:
        from slow_link import SlowLink, set_slow_link

        # Nodes of inner_size GPUs: the hierarchical variant's inner rings stay on "one node".
        set_slow_link(SlowLink(cfg.inner_size, cfg.slow_link_gbps, cfg.slow_link_latency_us))
    meta = run_metadata(device)
    meta.update(world_size=cfg.world_size, process_group=dist.get_backend(),
                nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE"),
                nccl=str(torch.cuda.nccl.version()) if device.type == "cuda" else None)
    result: Dict = {"benchmark": "ring", "smoke": cfg.smoke, "meta": meta, "config": dataclasses.asdict(cfg),
                    "notes": list(NOTES), "runs": []}
    result["config"]["index_kind"] = "fixed"
    if cfg.slow_link_gbps:
        result["notes"].insert(0, f"Emulated slow link between nodes of {cfg.inner_size} GPUs: "
                               f"{cfg.slow_link_gbps:g} GB/s, {cfg.slow_link_latency_us:g} us (benchmarks/slow_link.py); "
                               "every variant pays it on its cross-node hops.")
    else:
        result["notes"].insert(0, "All ranks share one host's NVLink: sparse_striped_hier shows the two-level "
                               "schedule's overhead, not its benefit (that needs --slow-link-gbps).")
    say(f"{meta['device']} x {cfg.world_size} ({dist.get_backend()}), seq lens {cfg.seq_lens}, "
        f"variants {list(cfg.variants)}, warmup {cfg.warmup}, reps {cfg.reps}; writing {path}")

    def save(entry: Dict) -> None:
        if rank() != 0:
            return
        runs = [e for e in result["runs"] if e is not entry] + [entry]
        write_json(dict(result, runs=sorted(runs, key=lambda e: e["seq_len"])), path)

    for seq_len in cfg.seq_lens:
        try:
            entry = bench_seq_len(cfg, seq_len, device, save)
        except Exception as exc:  # noqa: BLE001  (index or input generation: same on every rank)
            entry = {"seq_len": seq_len, "world_size": cfg.world_size, "tokens_per_rank": seq_len // cfg.world_size,
                     "variants": {}, "errors": {"setup": error_text(exc)}}
            say(f"S = {seq_len}: FAILED {entry['errors']['setup'][:200]}")
        result["runs"].append(entry)
        free_memory()

    if cfg.scaling or cfg.tokens_per_gpu:
        result["scaling"] = scaling_record(result)
    if rank() == 0:
        write_heatmaps(result, path)
        write_json(result, path)
        print(f"wrote {path}", flush=True)
        print_table(result)
        sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
