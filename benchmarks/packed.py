"""Packed documents on one GPU: our document-masked sparse kernels against FlexAttention's
document-causal attention, and against our own unpacked kernels (per-pair rate).

The mix (``common.DOCUMENT_MIX_128K``, x4 at 512K) packs ten documents into one sequence; the
fixed index keeps ~5% of the DOCUMENT-causal pairs (``common.fixed_packed_index``, exact pair
counts). Per sequence length:

  packed    ours with cu_seqlens: fwd, fwd+bwd ms, TFLOP/s on the active pairs;
  flex      compiled FlexAttention (compiled create_block_mask) with the document-causal mask:
            the dense baseline with the same documents (TFLOP/s on document-causal pairs);
  unpacked  ours on the same length without documents at the same density of causal pairs
            (``kernel.py``'s index): the per-pair rate that packing should keep;
  check     ours and Flex against the fp32 reference with documents on a short sequence.

    python benchmarks/packed.py            # GPU: writes benchmarks/results/packed_<device>.json
    python benchmarks/packed.py --smoke    # tiny CPU run of the whole script
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import tempfile
from typing import Dict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kernel  # noqa: E402
from common import (cu_seqlens_of, describe_index, device_slug, document_mix, fixed_packed_index,  # noqa: E402
                    fixed_vs_index, relative_l2, run_metadata, tflops, write_json)

from megatron_mtraining import Documents, reference_attention, sparse_attention  # noqa: E402
from megatron_mtraining.kernels import resolve_backend  # noqa: E402

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def flex_document_mask(cu_seqlens: torch.Tensor, seq_len: int, device: torch.device):
    """Flex BlockMask of document-causal attention (compiled create_block_mask: no dense mask)."""
    from torch.nn.attention.flex_attention import create_block_mask
    doc = torch.searchsorted(cu_seqlens.to(device).long(), torch.arange(seq_len, device=device), right=True)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (doc[q_idx] == doc[kv_idx])

    make = torch.compile(create_block_mask)
    return make(mask_mod, None, None, seq_len, seq_len, device=device, BLOCK_SIZE=kernel.FLEX_BLOCK)


def rates(section: Dict, active_pairs: float, head_dim: int) -> None:
    """fwd and fwd+bwd TFLOP/s on ``active_pairs`` (summed over batch and heads)."""
    for kind, factor in (("fwd", 1.0), ("fwdbwd", kernel.FWD_BWD_FLOP_FACTOR)):
        rate = tflops(4 * head_dim * active_pairs * factor, section.get(f"{kind}_ms"))
        if rate is not None:
            section[f"{kind}_tflops"] = rate


def bench_unpacked(cfg: kernel.Config, seq_len: int, density: float, arg_sets, backend: str,
                   device: torch.device) -> Dict:
    """Our kernels without documents on kernel.py's fixed index at ``density`` of causal pairs."""
    index = fixed_vs_index(cfg.batch, cfg.heads, seq_len, cfg.block_size, density, device, cfg.seed)
    described = describe_index(index, seq_len)
    section: Dict = {"density": described["density_mean"], "active_pairs": described["active_pairs"]}
    scale = 1.0 / math.sqrt(cfg.head_dim)
    kernel.measure_pair(section, lambda q, k, v: sparse_attention(q, k, v, index, scale, backend), arg_sets, cfg,
                        device)
    rates(section, described["active_pairs"], cfg.head_dim)
    return section


def bench_packed(cfg: kernel.Config, seq_len: int, device: torch.device) -> Dict:
    lengths = document_mix(seq_len, cfg.block_size)
    cu = cu_seqlens_of(lengths, device)
    index, pairs, doc_pairs = fixed_packed_index(cfg.batch, cfg.heads, seq_len, cu, cfg.block_size, cfg.density,
                                                 device, cfg.seed)
    arg_sets = kernel.make_inputs(cfg, seq_len, device, cfg.input_sets, cfg.seed + seq_len)
    backend = resolve_backend(cfg.backend, device)
    scale = 1.0 / math.sqrt(cfg.head_dim)
    entry: Dict = {"seq_len": seq_len, "documents": lengths,
                   "index": {"active_pairs": float(pairs.sum()), "document_causal_pairs_per_head": doc_pairs,
                             "density_of_document_pairs": float(pairs.mean()) / doc_pairs,
                             "n_slash": int(index.n_slash.max()), "n_vertical": int(index.n_vertical.max())}}

    documents = Documents(cu, seq_len)  # once per batch, as the Megatron path builds it

    def ours(q, k, v):
        return sparse_attention(q, k, v, index, scale, backend, cu_seqlens=documents)

    packed: Dict = {"backend": backend}
    kernel.measure_pair(packed, ours, arg_sets, cfg, device)
    rates(packed, float(pairs.sum()), cfg.head_dim)
    if device.type == "cuda" and "breakdown" not in cfg.skip:
        kernel.attempt(packed, "fwdbwd_kernels_ms",
                       lambda: kernel.kernel_breakdown(kernel.forward_and_backward(ours), arg_sets[0]))
    entry["packed"] = packed

    if device.type == "cuda" and "flex" not in cfg.skip:
        flex: Dict = {"block_size": kernel.FLEX_BLOCK}
        mask = kernel.attempt(flex, "block_mask", lambda: flex_document_mask(cu, seq_len, device), keep=False)
        if mask is not None:
            kernel.measure_pair(flex, kernel.flex_attention_fn(mask), arg_sets, cfg, device)
        rates(flex, doc_pairs * cfg.heads * cfg.batch, cfg.head_dim)  # Flex computes every document pair
        entry["flex"] = flex
    if "unpacked" not in cfg.skip:
        # The same density of causal pairs (kernel.py's run), and the same active pairs per query as
        # the packed run (a sparser index): packing leaves ~4x less work per query block here.
        causal_pairs = seq_len * (seq_len + 1) / 2
        for name, density in (("unpacked", cfg.density), ("unpacked_equal_work", float(pairs.mean()) / causal_pairs)):
            entry[name] = bench_unpacked(cfg, seq_len, density, arg_sets, backend, device)

    ratios = {}
    for kind in ("fwd", "fwdbwd"):
        if packed.get(f"{kind}_ms") and entry.get("flex", {}).get(f"{kind}_ms"):
            ratios[f"flex_over_ours_{kind}"] = entry["flex"][f"{kind}_ms"] / packed[f"{kind}_ms"]
        for name in ("unpacked", "unpacked_equal_work"):
            if packed.get(f"{kind}_tflops") and entry.get(name, {}).get(f"{kind}_tflops"):
                ratios[f"packed_over_{name}_tflops_{kind}"] = packed[f"{kind}_tflops"] / entry[name][f"{kind}_tflops"]
    entry["ratios"] = ratios
    return entry


def spot_check(cfg: kernel.Config, device: torch.device) -> Dict:
    """Ours (benchmark dtype) against the fp32 reference with the documents, on a short mix."""
    seq_len = cfg.check_len
    cu = cu_seqlens_of(document_mix(seq_len, cfg.block_size), device)
    index, _, _ = fixed_packed_index(cfg.batch, cfg.heads, seq_len, cu, cfg.block_size, cfg.density, device,
                                     cfg.seed)
    q, k, v, dout = kernel.make_inputs(cfg, seq_len, device, 1, cfg.seed + 1)[0]
    ref_in = [x.detach().float().requires_grad_() for x in (q, k, v)]
    ref = reference_attention(*ref_in, index, cu_seqlens=cu)[0]
    ref_grads = torch.autograd.grad(ref, ref_in, dout.float())
    out = sparse_attention(q, k, v, index, backend=resolve_backend(cfg.backend, device), cu_seqlens=cu)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    errors = {"out": relative_l2(out, ref.detach())}
    errors.update({f"d{n}": relative_l2(g, r) for n, g, r in zip("qkv", grads, ref_grads)})
    errors["pass"] = all(e < kernel.CHECK_TOLERANCE for e in errors.values())
    return {"seq_len": seq_len, "ours": errors, "tolerance": kernel.CHECK_TOLERANCE}


def print_table(result: Dict) -> None:
    f = kernel.fmt
    cfg = result['config']
    print(f"\n{result['meta']['device']} | packed documents | {cfg['heads']}/{cfg['kv_heads']} heads, "
          f"d {cfg['head_dim']}, {cfg['dtype']}")
    header = (f"{'S':>7} {'docs':>4} {'dens':>6} | {'ours f':>8} {'ours fb':>8} {'TF/s fb':>7} | "
              f"{'flex fb':>8} {'x flex':>7} | {'unp TF/s':>8} {'rate':>5} | {'eq TF/s':>7} {'rate':>5}")
    print(header)
    print("-" * len(header))
    for r in result["runs"]:
        p, fl, s = r["packed"], r.get("flex", {}), r["ratios"]
        u, eq = r.get("unpacked", {}), r.get("unpacked_equal_work", {})
        print(f"{r['seq_len']:>7} {len(r['documents']):>4} {r['index']['density_of_document_pairs']:6.3f} | "
              f"{f(p.get('fwd_ms'))} {f(p.get('fwdbwd_ms'))} {f(p.get('fwdbwd_tflops'), '.0f', 7)} | "
              f"{f(fl.get('fwdbwd_ms'))} {f(s.get('flex_over_ours_fwdbwd'), '.1f', 7)} | "
              f"{f(u.get('fwdbwd_tflops'), '.0f', 8)} {f(s.get('packed_over_unpacked_tflops_fwdbwd'), '.2f', 5)} | "
              f"{f(eq.get('fwdbwd_tflops'), '.0f', 7)} {f(s.get('packed_over_unpacked_equal_work_tflops_fwdbwd'), '.2f', 5)}")
    print("(ms, median; dens = active pairs over document-causal pairs; x flex = Flex fwd+bwd over ours; TF/s on\n"
          " active pairs; unp = ours unpacked at the same density of causal pairs, eq = ours unpacked with the\n"
          " packed run's active pairs; rate = packed TF/s over theirs)")
    c = result.get("check", {}).get("ours")
    if isinstance(c, dict):
        print(f"check S={result['check']['seq_len']}: out {c['out']:.2e} dq {c['dq']:.2e} dk {c['dk']:.2e} "
              f"dv {c['dv']:.2e} -> {'pass' if c['pass'] else 'FAIL'}")
    for r in result["runs"]:
        for name in ("packed", "flex", "unpacked", "unpacked_equal_work"):
            for key, msg in r.get(name, {}).get("errors", {}).items():
                print(f"error S={r['seq_len']} {name} {key}: {msg[:160]}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-lens", default="131072")
    p.add_argument("--density", type=float, default=0.05, help="target share of document-causal pairs")
    p.add_argument("--block-size", type=int, default=64, help="index block size (the unpacked runs' too)")
    p.add_argument("--skip", default="", help="comma-separated: flex, unpacked, breakdown, check")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="tiny fp32 shapes on CPU: tests the script itself")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    skip = tuple(s for s in args.skip.split(",") if s)
    if args.smoke:
        cfg = kernel.Config(seq_lens=[1024], heads=4, kv_heads=2, head_dim=32, dtype="fp32", density=args.density,
                            backend="torch", warmup=1, reps=2, input_sets=1, check_len=1024, skip=skip, smoke=True)
    else:
        cfg = kernel.Config(seq_lens=[int(s) for s in args.seq_lens.split(",")], block_size=args.block_size,
                            density=args.density, reps=args.reps, skip=skip)
    device = torch.device("cuda" if torch.cuda.is_available() and not cfg.smoke else "cpu")
    result: Dict = {"benchmark": "packed", "smoke": cfg.smoke, "meta": run_metadata(device),
                    "config": dataclasses.asdict(cfg), "runs": []}
    if "check" not in skip:
        kernel.attempt(result, "check", lambda: spot_check(cfg, device))
    for seq_len in cfg.seq_lens:
        result["runs"].append(bench_packed(cfg, seq_len, device))
    path = args.out or (os.path.join(tempfile.gettempdir(), "packed_smoke.json") if cfg.smoke
                        else os.path.join(RESULTS_DIR, f"packed_{device_slug(device)}.json"))
    write_json(path, result)
    print(f"wrote {path}")
    print_table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
