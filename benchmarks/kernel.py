"""Single-GPU kernel benchmark: vertical-slash sparse attention against dense cuDNN and FlexAttention.

Canonical shape (docs/benchmarks.md): Qwen2.5-3B attention, batch 1, 16 query heads, 2 KV
heads, head dim 128, bf16, causal; the `fixed` synthetic index at ~5% density. Per sequence
length it records, each item on its own so one failure loses nothing else:

  ours   forward (no grad) and forward+backward ms of `sparse_attention`, the plan conversion
         alone, the backward step alone, and a per-kernel profile of forward+backward;
  dense  cuDNN causal SDPA (flash when cuDNN is missing), forward and forward+backward;
  flex   compiled FlexAttention with a 128-block BlockMask of exactly the same active pairs;
  effective TFLOP/s, peak extra memory, speed ratios, and a correctness spot check.

With ``--index block`` each length also runs a block-sparse ``BlockIndex`` of about the same
density (``--block-pattern moba``: the MoBA builder's index on the benchmark's own q/k, top-k
chosen for the density; ``random``: random key blocks) through the same kernels and through
FlexAttention with the same BlockMask: its TFLOP/s on active pairs over the vertical-slash
kernel's, and FlexAttention's time over ours.

    python benchmarks/kernel.py                  # GPU: writes benchmarks/results/kernel_<device>.json
    python benchmarks/kernel.py --smoke          # tiny CPU run of the whole script
    python benchmarks/kernel.py --seq-lens 131072 --index block --block-pattern moba --skip dense,flex  # block keys
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import tempfile
import warnings
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import (describe_index, device_slug, fixed_vs_index, json_ready, kernel_times_ms,  # noqa: E402
                    median, moba_top_k_for_density, peak_extra_mb, relative_l2, run_metadata,
                    synchronize, tflops, time_ms)

from megatron_mtraining import BlockIndex, MTrainingConfig, reference_attention, sparse_attention  # noqa: E402
from megatron_mtraining.block_approx import moba_index  # noqa: E402
from megatron_mtraining.kernels import resolve_backend, single_device_plan, step_backward  # noqa: E402
from megatron_mtraining.config import KERNEL_CHOICES, Settings, environment_settings  # noqa: E402
from megatron_mtraining.kernels.dispatch import backward_kernel, forward_kernel  # noqa: E402

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FWD_BWD_FLOP_FACTOR = 3.5   # backward = 2.5x forward (dQ, dK, dV and the recomputed scores)
CHECK_TOLERANCE = 2e-2      # relative L2 of bf16 kernels against the fp32 reference
# Profiled kernel name -> group of the breakdown (first match wins: '_dkdv_col' before '_dkdv').
KERNEL_GROUPS = (("_vs_attn_fwd_kernel", "fwd"), ("_vs_attn_fwd_sm90_kernel", "fwd"),
                 ("_vs_attn_fwd_pingpong_kernel", "fwd"),
                 ("_dkdv_col_kernel", "dkdv_col"), ("_dkdv_col_sm90_kernel", "dkdv_col"),
                 ("_dkdv_kernel", "dkdv_block"), ("_dkdv_sm90_kernel", "dkdv_block"),
                 ("_dq_kernel", "dq"), ("_dq_sm90_kernel", "dq"))


@dataclasses.dataclass
class Config:
    seq_lens: List[int]
    block_size: int = 64
    batch: int = 1
    heads: int = 16
    kv_heads: int = 2
    head_dim: int = 128
    dtype: str = "bf16"
    density: float = 0.05
    seed: int = 0
    backend: str = "auto"
    warmup: int = 3
    reps: int = 10
    input_sets: int = 3
    check_len: int = 4096
    skip: Sequence[str] = ()
    smoke: bool = False
    launch: str = ""  # "fwd:WxS,bwd:WxS" num_warps x num_stages overrides ("" = the defaults)
    forward_kernel: str = "auto"  # kernels/dispatch.py KERNEL_CHOICES: the GPU forward (auto: Hopper's on sm_90)
    backward_kernel: str = "auto"  # the same for the backward's dK/dV (key blocks and columns)
    index: str = "vs"  # "block": also a block-sparse index of about the same density (INDEX_KINDS)
    block_pattern: str = "moba"  # BLOCK_PATTERNS
    moba_block_size: int = 512  # tokens per MoBA key block (a multiple of block_size)


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def attempt(section: Dict, key: str, fn: Callable, keep: bool = True):
    """fn(), kept as section[key]; a failure goes to section['errors'][key] and loses only this item."""
    value = None
    try:
        value = fn()
    except Exception as exc:  # noqa: BLE001  (any failure, OOM and compile errors included)
        section.setdefault("errors", {})[key] = f"{type(exc).__name__}: {exc}"[:800]
    else:
        if keep:
            section[key] = value
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # an OOM must not starve the next item
    return value


def timed(section: Dict, name: str, fn: Callable, arg_sets: Sequence[Sequence], cfg: Config,
          device: torch.device) -> Optional[float]:
    """Median ms of fn over the rotating input sets, stored as section['<name>_ms']."""
    def run():
        samples = time_ms(fn, arg_sets, device, cfg.warmup, cfg.reps)
        section.setdefault("samples_ms", {})[name] = samples
        return median(samples)
    return attempt(section, f"{name}_ms", run)


def make_inputs(cfg: Config, seq_len: int, device: torch.device, n_sets: int, seed: int) -> List[tuple]:
    """n_sets of (q, k, v, dout), leaves that require grad, standard normal."""
    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = DTYPES[cfg.dtype]

    def rand(heads, grad=True):
        x = torch.randn(cfg.batch, heads, seq_len, cfg.head_dim, generator=gen, device=device, dtype=dtype)
        return x.requires_grad_(grad)

    return [(rand(cfg.heads), rand(cfg.kv_heads), rand(cfg.kv_heads), rand(cfg.heads, grad=False))
            for _ in range(n_sets)]


def forward_and_backward(attn: Callable) -> Callable:
    """(q, k, v, dout) -> grads, timing the forward with autograd plus the backward."""
    def run(q, k, v, dout):
        out = attn(q, k, v)
        return torch.autograd.grad(out, (q, k, v), dout)
    return run


def forward_only(attn: Callable) -> Callable:
    def run(q, k, v, dout):
        with torch.no_grad():
            return attn(q, k, v)
    return run


def measure_pair(section: Dict, attn: Callable, arg_sets, cfg: Config, device: torch.device) -> None:
    """fwd and fwd+bwd ms plus the peak extra memory of one fwd+bwd."""
    fwd_bwd = forward_and_backward(attn)
    timed(section, "fwd", forward_only(attn), arg_sets, cfg, device)
    timed(section, "fwdbwd", fwd_bwd, arg_sets, cfg, device)
    if device.type == "cuda":
        attempt(section, "fwdbwd_peak_extra_mb", lambda: peak_extra_mb(fwd_bwd, arg_sets[0], device))


# ----------------------------------------------------------------------------------------------
# Ours
# ----------------------------------------------------------------------------------------------


def kernel_breakdown(fn: Callable, args: Sequence) -> Dict:
    """Device ms per call, grouped by our Triton kernels; everything else summed under 'other'."""
    per_kernel = kernel_times_ms(fn, args)
    groups: Dict[str, float] = {name: 0.0 for _, name in KERNEL_GROUPS}
    groups["other"] = 0.0
    for kernel, ms in per_kernel.items():
        group = next((name for key, name in KERNEL_GROUPS if key in kernel), "other")
        groups[group] += ms
    groups["total"] = sum(per_kernel.values())
    others = sorted(((ms, k) for k, ms in per_kernel.items()
                     if not any(key in k for key, _ in KERNEL_GROUPS)), reverse=True)
    groups["top_other"] = {k[:120]: ms for ms, k in others[:6]}
    return groups


def kernel_settings(cfg: Config) -> Settings:
    """The settings our attention runs with: the kernels asked for (--forward-kernel, --backward-kernel)
    and their launch settings (--launch)."""
    return Settings(forward_kernel=cfg.forward_kernel, backward_kernel=cfg.backward_kernel,
                    kernel_launch=parse_launch(cfg.launch))


def backward_step_inputs(index, arg_sets, backend: str, scale: float, settings: Settings) -> List[tuple]:
    """Per input set: what the backward step reads (forward's out/lse, delta) plus fp32 grads."""
    prepared = []
    for q, k, v, dout in arg_sets:
        with torch.no_grad():
            out, lse = sparse_attention(q, k, v, index, scale, backend, return_lse=True, settings=settings)
            delta = (dout.float() * out.float()).sum(-1)
        grads = [torch.zeros(x.shape, dtype=torch.float32, device=x.device) for x in (q, k, v)]
        prepared.append((q.detach(), k.detach(), v.detach(), dout, lse, delta, *grads))
    return prepared


def bench_ours(cfg: Config, index, seq_len: int, arg_sets, device: torch.device) -> Dict:
    backend = resolve_backend(cfg.backend, device)
    scale = 1.0 / math.sqrt(cfg.head_dim)
    section: Dict = {"backend": backend}
    settings = kernel_settings(cfg)

    def attn(q, k, v):
        return sparse_attention(q, k, v, index, scale, backend, settings=settings)

    if backend == "triton":  # which kernels ran (dispatch.py: Hopper's on sm_90 unless forced)
        q, k, v, dout = arg_sets[0]
        plan = single_device_plan(index, seq_len)
        attempt(section, "forward_kernel", lambda: forward_kernel(q, k, v, plan, q, settings.forward_kernel))
        attempt(section, "backward_kernel", lambda: backward_kernel(q, k, v, dout, plan, settings.backward_kernel))
    measure_pair(section, attn, arg_sets, cfg, device)
    timed(section, "plan", lambda: single_device_plan(index, seq_len), [()], cfg, device)

    def backward_step():
        plan = single_device_plan(index, seq_len)
        prepared = backward_step_inputs(index, arg_sets[:2], backend, scale, settings)

        def step(q, k, v, dout, lse, delta, dq, dk, dv):
            step_backward(backend, q, k, v, dout, lse, delta, plan, dq, dk, dv, scale, settings=settings)
        return median(time_ms(step, prepared, device, cfg.warmup, cfg.reps))
    attempt(section, "bwd_step_ms", backward_step)

    if device.type == "cuda" and "breakdown" not in cfg.skip:
        attempt(section, "fwdbwd_kernels_ms", lambda: kernel_breakdown(forward_and_backward(attn), arg_sets[0]))
    return section


# ----------------------------------------------------------------------------------------------
# Dense baseline: cuDNN causal SDPA (flash if cuDNN is not there)
# ----------------------------------------------------------------------------------------------


def dense_candidates():
    from torch.nn.attention import SDPBackend
    # (name, backend, GQA inside the kernel?): native GQA first, K/V expanded outside the timing next.
    return [("cudnn", SDPBackend.CUDNN_ATTENTION, True), ("cudnn", SDPBackend.CUDNN_ATTENTION, False),
            ("flash", SDPBackend.FLASH_ATTENTION, True), ("flash", SDPBackend.FLASH_ATTENTION, False)]


def dense_attention(backend, gqa: bool) -> Callable:
    from torch.nn.attention import sdpa_kernel

    def attn(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return attn


def expand_kv(arg_sets, group: int) -> List[tuple]:
    """K/V repeated to the query heads, as new leaves: the expansion is not part of the timing."""
    def rep(x):
        return x.detach().repeat_interleave(group, dim=1).requires_grad_()
    return [(q, rep(k), rep(v), dout) for q, k, v, dout in arg_sets]


def pick_dense(cfg: Config, device: torch.device):
    """First candidate that runs forward+backward on a small problem of the same head layout."""
    probe = make_inputs(cfg, 1024, device, 1, cfg.seed)
    tried = {}
    for name, backend, gqa in dense_candidates():
        args = probe if gqa else expand_kv(probe, cfg.heads // cfg.kv_heads)
        try:
            forward_and_backward(dense_attention(backend, gqa))(*args[0])
            synchronize(device)
            return name, backend, gqa, tried
        except Exception as exc:  # noqa: BLE001
            tried[f"{name}{'+gqa' if gqa else '+expanded'}"] = f"{type(exc).__name__}: {exc}"[:300]
    return None, None, None, tried


def bench_dense(cfg: Config, arg_sets, device: torch.device, choice) -> Dict:
    name, backend, gqa, tried = choice
    if name is None:
        return {"skipped": "no dense SDPA backend ran", "probe_errors": tried}
    section: Dict = {"backend": name, "gqa": "enable_gqa" if gqa else "K/V expanded outside the timing"}
    if tried:
        section["probe_errors"] = tried
    sets = arg_sets if gqa else expand_kv(arg_sets, cfg.heads // cfg.kv_heads)
    measure_pair(section, dense_attention(backend, gqa), sets, cfg, device)
    return section


# ----------------------------------------------------------------------------------------------
# FlexAttention with the same active pairs
# ----------------------------------------------------------------------------------------------

FLEX_BLOCK = 128
_compiled_flex = None


def compiled_flex_attention():
    global _compiled_flex
    if _compiled_flex is None:
        from torch.nn.attention.flex_attention import flex_attention
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def flex_block_mask(index, seq_len: int, device: torch.device):
    """BlockMask of docs/design.md §1's function, built from the index's own bitmap and columns."""
    from torch.nn.attention.flex_attention import create_block_mask

    B = index.block_size
    if isinstance(index, BlockIndex):
        blocks = index.to_mask()                       # [b, h, num_blocks, num_blocks]

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & blocks[b, h, q_idx // B, kv_idx // B]
    else:
        slash = index.slash_bitmap(seq_len // B).bool()   # [b, h, num_blocks]
        columns = index.column_mask(seq_len)               # [b, h, seq_len]

        def mask_mod(b, h, q_idx, kv_idx):
            delta = (q_idx // B - kv_idx // B).clamp(min=0)  # causal below makes the clamped pairs inactive
            return (kv_idx <= q_idx) & (slash[b, h, delta] | columns[b, h, kv_idx])

    # _compile=True: without it create_block_mask materialises the dense mask (OOM at 128K).
    # torch 2.11 flags the argument as deprecated but still honours it; keep the log clean.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*_compile flag on create_block_mask.*")
        return create_block_mask(mask_mod, index.batch, index.heads, seq_len, seq_len, device=device,
                                 BLOCK_SIZE=FLEX_BLOCK, _compile=True)


def flex_block_density(block_mask, seq_len: int) -> float:
    """Blocks Flex computes (partial + full) over causal 128-blocks: its work relative to dense."""
    nqb = -(-seq_len // FLEX_BLOCK)
    active = block_mask.kv_num_blocks.sum().item()
    if block_mask.full_kv_num_blocks is not None:
        active += block_mask.full_kv_num_blocks.sum().item()
    b, h = block_mask.kv_num_blocks.shape[:2]
    return active / (b * h * nqb * (nqb + 1) / 2)


def flex_attention_fn(block_mask) -> Callable:
    flex = compiled_flex_attention()

    def attn(q, k, v):
        return flex(q, k, v, block_mask=block_mask, enable_gqa=True)
    return attn


def bench_flex(index, seq_len: int, arg_sets, cfg: Config, device: torch.device) -> Dict:
    section: Dict = {"block_size": FLEX_BLOCK}
    block_mask = attempt(section, "block_mask", lambda: flex_block_mask(index, seq_len, device), keep=False)
    if block_mask is None:
        return section
    attempt(section, "block_density", lambda: flex_block_density(block_mask, seq_len))
    measure_pair(section, flex_attention_fn(block_mask), arg_sets, cfg, device)
    return section


# ----------------------------------------------------------------------------------------------
# Block-sparse index (--index block): the same kernels and FlexAttention on a BlockIndex
# ----------------------------------------------------------------------------------------------

INDEX_KINDS = ("vs", "block")
BLOCK_PATTERNS = ("moba", "random")


def moba_top_k_for(seq_len: int, cfg: Config) -> int:
    """The top-k whose MoBA index density is closest to ``cfg.density``."""
    return moba_top_k_for_density(seq_len, cfg.block_size, cfg.moba_block_size, cfg.density)


def random_block_index(cfg: Config, seq_len: int, device: torch.device) -> BlockIndex:
    """Each causal key block kept with the probability that gives ``cfg.density`` (the diagonal
    always); the capacity is the widest row (the plan's lists are no longer than needed)."""
    B = cfg.block_size
    nb = seq_len // B
    diagonal = nb * B * (B + 1) / 2
    below = B * B * nb * (nb - 1) / 2
    p = min(max((cfg.density * seq_len * (seq_len + 1) / 2 - diagonal) / below, 0.0), 1.0) if nb > 1 else 0.0
    gen = torch.Generator().manual_seed(cfg.seed + seq_len)
    mask = torch.rand(cfg.batch, cfg.heads, nb, nb, generator=gen) < p
    full = (mask & torch.ones(nb, nb, dtype=torch.bool).tril()) | torch.eye(nb, dtype=torch.bool)
    return BlockIndex.from_mask(full.to(device), B, max_blocks=int(full.sum(-1).max()))


def block_index_for(cfg: Config, seq_len: int, device: torch.device, q: torch.Tensor, k: torch.Tensor):
    """(BlockIndex, how it was made) of ``cfg.block_pattern`` at about ``cfg.density``."""
    if cfg.block_pattern == "random":
        return random_block_index(cfg, seq_len, device), {"pattern": "random"}
    top_k = moba_top_k_for(seq_len, cfg)
    config = MTrainingConfig(block_size=cfg.block_size, index="moba", moba_block_size=cfg.moba_block_size,
                             moba_top_k=top_k, settings=kernel_settings(cfg))
    with torch.no_grad():
        index = moba_index(q.detach(), k.detach(), config)
    return index, {"pattern": "moba", "moba_block_size": cfg.moba_block_size, "moba_top_k": top_k,
                   "built_by": "block_approx.moba_index on the first input set"}


def describe_block_index(index: BlockIndex, seq_len: int) -> Dict:
    """``describe_index``'s figures for a BlockIndex."""
    dens = index.density(seq_len).float()
    causal_pairs = seq_len * (seq_len + 1) / 2
    return {"density_mean": float(dens.mean()), "density_min": float(dens.min()), "density_max": float(dens.max()),
            "capacity": index.capacity, "max_key_blocks": int(index.n_key_blocks.max()),
            "active_pairs": float(dens.sum()) * causal_pairs, "causal_pairs_per_head": causal_pairs}


def bench_block(cfg: Config, seq_len: int, arg_sets, device: torch.device, vs_entry: Dict) -> Dict:
    """The block index through our kernels and FlexAttention; rates against the VS run of ``vs_entry``."""
    section: Dict = {"pattern": cfg.block_pattern}
    q, k = arg_sets[0][:2]
    built = attempt(section, "index", lambda: block_index_for(cfg, seq_len, device, q, k), keep=False)
    if built is None:
        return section
    index, made = built
    section["index"] = dict(describe_block_index(index, seq_len), **made)
    section["ours"] = bench_ours(cfg, index, seq_len, arg_sets, device)
    if device.type != "cuda":
        section["flex"] = {"skipped": "no CUDA"}
    else:
        section["flex"] = ({"skipped": "--skip block_flex"} if "block_flex" in cfg.skip
                           else bench_flex(index, seq_len, arg_sets, cfg, device))
    add_rates(section, cfg, seq_len)
    vs = vs_entry.get("ours", {})
    section["rate_ratio_over_vs"] = {
        kind: section["ours"][f"{kind}_tflops"] / vs[f"{kind}_tflops"] for kind in ("fwd", "fwdbwd")
        if section["ours"].get(f"{kind}_tflops") and vs.get(f"{kind}_tflops")}
    return section


# ----------------------------------------------------------------------------------------------
# Correctness spot check: the benchmark's own generator on a short sequence
# ----------------------------------------------------------------------------------------------


def _check_against_reference(result: Dict, cfg: Config, device: torch.device, index, q, k, v, dout,
                             flex_skip: str) -> Dict:
    """Ours (benchmark dtype and backend) and Flex's mask of ``index`` against the fp32 reference,
    forward and gradients, into ``result`` under "ours" and "flex" (unless ``flex_skip`` is skipped)."""
    seq_len = q.shape[2]
    ref_inputs = [x.detach().float().requires_grad_() for x in (q, k, v)]
    ref_out = reference_attention(*ref_inputs, index)[0]
    ref_grads = torch.autograd.grad(ref_out, ref_inputs, dout.float())
    ref_out = ref_out.detach()

    def check(attn):
        out = attn(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        errors = {"out": relative_l2(out, ref_out)}
        errors.update({f"d{n}": relative_l2(g, r) for n, g, r in zip("qkv", grads, ref_grads)})
        errors["pass"] = all(e < CHECK_TOLERANCE for e in errors.values())
        return errors

    backend = resolve_backend(cfg.backend, device)
    attempt(result, "ours", lambda: check(lambda *a: sparse_attention(*a, index, backend=backend,
                                                                      settings=kernel_settings(cfg))))
    if device.type == "cuda" and flex_skip not in cfg.skip:
        attempt(result, "flex", lambda: check(flex_attention_fn(flex_block_mask(index, seq_len, device))))
    return result


def spot_check(cfg: Config, device: torch.device) -> Dict:
    """Ours (benchmark dtype and backend) and Flex's mask against the fp32 reference."""
    seq_len = cfg.check_len
    index = fixed_vs_index(cfg.batch, cfg.heads, seq_len, cfg.block_size, cfg.density, device, cfg.seed)
    q, k, v, dout = make_inputs(cfg, seq_len, device, 1, cfg.seed + 1)[0]
    result: Dict = {"seq_len": seq_len, "density": float(index.density(seq_len).mean()),
                    "tolerance": CHECK_TOLERANCE}
    _check_against_reference(result, cfg, device, index, q, k, v, dout, "flex")
    if cfg.index == "block":
        attempt(result, "block", lambda: spot_check_block(cfg, device, q, k, v, dout))
    return result


def spot_check_block(cfg: Config, device: torch.device, q, k, v, dout) -> Dict:
    """The block index of ``cfg.block_pattern`` (ours and Flex's mask) against the fp32 reference."""
    seq_len = q.shape[2]
    index, made = block_index_for(cfg, seq_len, device, q, k)
    result: Dict = {"pattern": cfg.block_pattern, "density": float(index.density(seq_len).mean()), **made}
    return _check_against_reference(result, cfg, device, index, q, k, v, dout, "block_flex")


# ----------------------------------------------------------------------------------------------
# One sequence length
# ----------------------------------------------------------------------------------------------


def add_rates(entry: Dict, cfg: Config, seq_len: int) -> None:
    """Effective TFLOP/s (active pairs for ours and Flex, the causal half for dense) and ratios."""
    pairs = entry["index"]["active_pairs"]
    sparse_fwd = 4 * cfg.head_dim * pairs
    dense_fwd = 2 * seq_len**2 * cfg.head_dim * cfg.heads * cfg.batch   # benchmarks.md convention
    for name, flops in (("ours", sparse_fwd), ("flex", sparse_fwd), ("dense", dense_fwd)):
        section = entry.get(name, {})
        for kind, factor in (("fwd", 1.0), ("fwdbwd", FWD_BWD_FLOP_FACTOR)):
            rate = tflops(flops * factor, section.get(f"{kind}_ms"))
            if rate is not None:
                section[f"{kind}_tflops"] = rate
    ratios = {}
    for other in ("dense", "flex"):
        for kind in ("fwd", "fwdbwd"):
            ours, theirs = entry["ours"].get(f"{kind}_ms"), entry.get(other, {}).get(f"{kind}_ms")
            if ours and theirs:
                ratios[f"{other}_over_ours_{kind}"] = theirs / ours
    entry["speedup"] = ratios


def index_and_inputs(cfg: Config, seq_len: int, device: torch.device):
    """The fixed index and the rotated input sets of one sequence length."""
    index = fixed_vs_index(cfg.batch, cfg.heads, seq_len, cfg.block_size, cfg.density, device, cfg.seed)
    return index, make_inputs(cfg, seq_len, device, cfg.input_sets, cfg.seed + seq_len)


def bench_seq_len(cfg: Config, seq_len: int, device: torch.device, dense_choice) -> Dict:
    index, arg_sets = index_and_inputs(cfg, seq_len, device)
    entry: Dict = {"seq_len": seq_len, "index": describe_index(index, seq_len)}
    entry["ours"] = bench_ours(cfg, index, seq_len, arg_sets, device)
    if device.type != "cuda":
        entry["dense"] = entry["flex"] = {"skipped": "no CUDA"}
    else:
        entry["dense"] = ({"skipped": "--skip dense"} if "dense" in cfg.skip
                          else bench_dense(cfg, arg_sets, device, dense_choice))
        entry["flex"] = ({"skipped": "--skip flex"} if "flex" in cfg.skip
                         else bench_flex(index, seq_len, arg_sets, cfg, device))
    add_rates(entry, cfg, seq_len)
    if cfg.index == "block":
        del index
        entry["block"] = bench_block(cfg, seq_len, arg_sets, device, entry)
    return entry


# ----------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------


def fmt(x, spec=".2f", width=8) -> str:
    return f"{x:{width}{spec}}" if isinstance(x, (int, float)) else f"{'-':>{width}}"


def print_table(result: Dict) -> None:
    """Short fixed-width summary; the JSON has every figure."""
    cfg = result["config"]
    dense = {r["dense"].get("backend", "skipped") for r in result["runs"]}
    print(f"\n{result['meta']['device']} | {cfg['heads']}/{cfg['kv_heads']} heads, d {cfg['head_dim']}, "
          f"{cfg['dtype']}, block {cfg['block_size']} | dense: {', '.join(sorted(dense))}")
    header = (f"{'S':>7} {'dens':>6} | {'ours f':>8} {'ours fb':>8} | {'dense f':>8} {'dense fb':>8} | "
              f"{'flex f':>8} {'flex fb':>8} {'blk':>4} | {'x dense':>7} {'x flex':>7} | {'TF/s fb':>7} {'plan':>6}")
    print(header)
    print("-" * len(header))
    for r in result["runs"]:
        o, d, f, s = r["ours"], r["dense"], r["flex"], r["speedup"]
        print(f"{r['seq_len']:>7} {r['index']['density_mean']:6.3f} | {fmt(o.get('fwd_ms'))} "
              f"{fmt(o.get('fwdbwd_ms'))} | {fmt(d.get('fwd_ms'))} {fmt(d.get('fwdbwd_ms'))} | "
              f"{fmt(f.get('fwd_ms'))} {fmt(f.get('fwdbwd_ms'))} {fmt(f.get('block_density'), '.2f', 4)} | "
              f"{fmt(s.get('dense_over_ours_fwdbwd'), '.1f', 7)} {fmt(s.get('flex_over_ours_fwdbwd'), '.1f', 7)} | "
              f"{fmt(o.get('fwdbwd_tflops'), '.0f', 7)} {fmt(o.get('plan_ms'), '.2f', 6)}")
    print("(ms, median; blk = share of causal 128-blocks Flex computes; 'x dense' / 'x flex' = their\n"
          " fwd+bwd time over ours; TF/s fb = ours on active pairs; ours f includes the plan conversion)")
    for r in result["runs"]:
        if "block" in r:
            b = r["block"]
            o, f = b.get("ours", {}), b.get("flex", {})
            print(f"block {b['pattern']} S={r['seq_len']} density {fmt(b.get('index', {}).get('density_mean'), '.3f', 5)}: "
                  f"ours fb {fmt(o.get('fwdbwd_ms'))} ms, {fmt(o.get('fwdbwd_tflops'), '.0f', 4)} TF/s "
                  f"(x{fmt(b.get('rate_ratio_over_vs', {}).get('fwdbwd'), '.2f', 4)} the VS rate); flex fb "
                  f"{fmt(f.get('fwdbwd_ms'))} ms (x{fmt(b.get('speedup', {}).get('flex_over_ours_fwdbwd'), '.1f', 4)})")
            for name in ("index", "ours", "flex"):
                for key, msg in (b.get("errors", {}) if name == "index" else b.get(name, {}).get("errors", {})).items():
                    print(f"error S={r['seq_len']} block {name} {key}: {msg[:160]}")
    check = result.get("check", {})
    block_check = check.get("block") if isinstance(check.get("block"), dict) else {}
    for name in ("ours", "flex"):
        if isinstance(block_check.get(name), dict):
            c = block_check[name]
            print(f"check S={check['seq_len']} block {block_check['pattern']} {name}: out {c['out']:.2e} "
                  f"dq {c['dq']:.2e} dk {c['dk']:.2e} dv {c['dv']:.2e} -> {'pass' if c['pass'] else 'FAIL'}")
    for name in ("ours", "flex"):
        if isinstance(check.get(name), dict):
            c = check[name]
            print(f"check S={check['seq_len']} {name}: out {c['out']:.2e} dq {c['dq']:.2e} dk {c['dk']:.2e} "
                  f"dv {c['dv']:.2e} -> {'pass' if c['pass'] else 'FAIL'}")
    errors = [(r["seq_len"], name, r[name]["errors"]) for r in result["runs"] for name in ("ours", "dense", "flex")
              if "errors" in r[name]]
    for where in ("errors",):  # whole-run items (the check) that failed
        errors += [("-", "run", result[where])] if where in result else []
    errors += [("check", "", check["errors"])] if "errors" in check else []
    for seq_len, name, errs in errors:
        for key, msg in errs.items():
            print(f"error S={seq_len} {name} {key}: {msg[:160]}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-lens", default="65536,131072", help="comma-separated sequence lengths")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--density", type=float, default=0.05, help="target density of the fixed index")
    p.add_argument("--backend", default="auto", choices=("auto", "triton", "torch"), help="our kernels")
    p.add_argument("--forward-kernel", default=environment_settings().forward_kernel, choices=KERNEL_CHOICES,
                   help="our GPU forward (default: MTRAINING_FORWARD_KERNEL, else auto: the Hopper kernel on sm_90 "
                   "GPUs)")
    p.add_argument("--backward-kernel", default=environment_settings().backward_kernel, choices=KERNEL_CHOICES,
                   help="our GPU dK/dV, key blocks and columns (default: MTRAINING_BACKWARD_KERNEL, else auto: the "
                   "Hopper kernel on sm_90)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--input-sets", type=int, default=3, help="input sets rotated between repetitions")
    p.add_argument("--check-len", type=int, default=4096, help="sequence length of the correctness check")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip", default="", help="comma-separated: dense, flex, breakdown, check, block_flex")
    p.add_argument("--index", default="vs", choices=INDEX_KINDS,
                   help="block: also time a block-sparse index of about the same density (--block-pattern) through "
                   "our kernels and FlexAttention, against the vertical-slash kernel")
    p.add_argument("--block-pattern", default="moba", choices=BLOCK_PATTERNS,
                   help="moba: the MoBA builder's index on the benchmark's q/k (top-k for --density); random: random "
                   "key blocks")
    p.add_argument("--moba-block-size", type=int, default=512, help="tokens per MoBA key block (--block-pattern moba)")
    p.add_argument("--smoke", action="store_true", help="tiny fp32 shapes on CPU: tests the script itself")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/kernel_<device>.json)")
    p.add_argument("--launch", default="", help="launch settings instead of the defaults, e.g. fwd:4x3,bwd:8x2m "
                   "(num_warps x num_stages per kernel family, then option letters: LAUNCH_OPTIONS)")
    p.add_argument("--sweep", default="", help="compare launch settings instead of the full benchmark: "
                   "comma-separated WxS[options] candidates (see --launch), tried for fwd then for bwd (our kernels only)")
    return p.parse_args(argv)


# Letters after a launch setting that set kernel options (triton_common.tile_config's keys):
# m: the causal mask on every slash tile of the forward and dQ (not only the diagonal block's);
# c: 4x the column-gradient programs (shorter ones). (Running a GQA group's query heads as
# adjacent programs was also tried: no gain, removed; docs/performance.md.)
LAUNCH_OPTIONS = {"m": ("MASK_EVERY_TILE", True), "c": ("COLUMN_PROGRAMS", 4096)}


def parse_launch(text: str) -> Dict[str, dict]:
    """'fwd:4x3,bwd:8x2m' -> {'fwd': {'num_warps': 4, 'num_stages': 3}, 'bwd': {..., 'MASK_EVERY_TILE': True}}.
    Trailing letters switch kernel options (``LAUNCH_OPTIONS``), e.g. 4x2mc."""
    out: Dict[str, dict] = {}
    for item in filter(None, text.split(",")):
        try:
            family, setting = item.split(":")
            letters = setting.lower().lstrip("0123456789x")
            options = dict(LAUNCH_OPTIONS[c] for c in letters)
            warps, stages = (int(x) for x in setting.lower()[:len(setting) - len(letters)].split("x"))
        except (ValueError, KeyError):
            raise SystemExit(f"kernel.py: bad --launch item {item!r}; expected FAMILY:WARPSxSTAGES[options], "
                             f"e.g. fwd:4x3 or fwd:4x2m (options: {LAUNCH_OPTIONS})")
        if family not in ("fwd", "bwd") or warps not in (1, 2, 4, 8, 16) or not 1 <= stages <= 8:
            raise SystemExit(f"kernel.py: bad --launch item {item!r}: family fwd/bwd, warps a power of 2 <= 16, "
                             "stages 1-8")
        out[family] = {"num_warps": warps, "num_stages": stages, **options}
    return out


def sweep(cfg: Config, candidates: str, device: torch.device) -> Dict:
    """Our fwd and fwd+bwd times per launch setting: each fwd candidate with the default bwd,
    then each bwd candidate with the default fwd (the two families are independent kernels)."""
    rows = []
    for seq_len in cfg.seq_lens:
        index, arg_sets = index_and_inputs(cfg, seq_len, device)  # the same inputs for every setting
        for family in ("fwd", "bwd"):
            for setting in filter(None, candidates.split(",")):
                ours_only = dataclasses.replace(cfg, skip=tuple(cfg.skip) + ("breakdown",),
                                                launch=f"{family}:{setting}")
                ours = bench_ours(ours_only, index, seq_len, arg_sets, device)
                rows.append({"family": family, "launch": setting, "seq_len": seq_len,
                             "fwd_ms": ours.get("fwd_ms"), "fwdbwd_ms": ours.get("fwdbwd_ms"),
                             "errors": ours.get("errors")})
                print(f"{family} {setting:>5} S={seq_len}: fwd {fmt(ours.get('fwd_ms'))} ms, "
                      f"fwd+bwd {fmt(ours.get('fwdbwd_ms'))} ms", flush=True)
    return {"benchmark": "kernel_sweep", "meta": run_metadata(device), "config": dataclasses.asdict(cfg),
            "rows": rows}


def make_config(args) -> Config:
    skip = tuple(s for s in args.skip.split(",") if s)
    if args.smoke:
        return Config(seq_lens=[256], block_size=64, heads=4, kv_heads=2, head_dim=64, dtype="fp32",
                      density=args.density, seed=args.seed, backend="torch", warmup=1, reps=3,
                      input_sets=2, check_len=256, skip=skip, smoke=True, launch=args.launch,
                      index=args.index, block_pattern=args.block_pattern, moba_block_size=128)
    if args.moba_block_size < args.block_size or args.moba_block_size % args.block_size:
        raise SystemExit(f"kernel.py: --moba-block-size {args.moba_block_size} must be a multiple of --block-size "
                         f"{args.block_size}")
    return Config(seq_lens=[int(s) for s in args.seq_lens.split(",")], block_size=args.block_size,
                  density=args.density, seed=args.seed, backend=args.backend, warmup=args.warmup,
                  reps=args.reps, input_sets=args.input_sets, check_len=args.check_len, skip=skip,
                  launch=args.launch, forward_kernel=args.forward_kernel, backward_kernel=args.backward_kernel,
                  index=args.index, block_pattern=args.block_pattern, moba_block_size=args.moba_block_size)


def output_path(args, device: torch.device) -> str:
    if args.out:
        return args.out
    if args.smoke:  # smoke runs never land among the committed results
        return os.path.join(tempfile.gettempdir(), f"kernel_smoke_{device_slug(device)}.json")
    return os.path.join(RESULTS_DIR, f"kernel_{device_slug(device)}.json")


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = make_config(args)
    device = torch.device("cuda" if torch.cuda.is_available() and not cfg.smoke else "cpu")
    parse_launch(cfg.launch)  # a bad --launch fails before any run
    if args.sweep:
        if cfg.launch:
            raise SystemExit("kernel.py: --sweep tries each setting against the other family's defaults; "
                             "it does not combine with --launch")
        result = sweep(cfg, args.sweep, device)
        path = args.out or os.path.join(RESULTS_DIR, f"kernelsweep_{device_slug(device)}.json")
        with open(path, "w") as fh:
            json.dump(json_ready(result), fh, indent=1)
        print(f"wrote {path}")
        return 0
    result: Dict = {"benchmark": "kernel", "smoke": cfg.smoke, "meta": run_metadata(device),
                    "config": dataclasses.asdict(cfg), "runs": []}
    result["config"]["index_kind"] = "fixed"
    if "check" not in cfg.skip:
        attempt(result, "check", lambda: spot_check(cfg, device))
    dense_choice = pick_dense(cfg, device) if device.type == "cuda" and "dense" not in cfg.skip else None
    for seq_len in cfg.seq_lens:
        result["runs"].append(bench_seq_len(cfg, seq_len, device, dense_choice))

    path = output_path(args, device)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(json_ready(result), fh, indent=1)
        fh.write("\n")
    print(f"wrote {path}")
    print_table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
