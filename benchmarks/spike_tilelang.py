"""Issue 17 spike: TileLang kernels (``tilelang_slash.py``) on our problem's slash part, against our
kernels on the same pairs, one call.

The same problem as ``spike_fa4.py`` (the canonical fixed 5% index at 128K, columns dropped), so
the two candidates' figures sit side by side: per query block the key blocks ``q - o``, causal on
the diagonal. Measured, each on the same inputs:

  ours      ``sparse_attention`` on the slash-only index (the default kernels)
  tilelang  the four TileLang kernels (forward; delta, dK/dV and dQ backward, deterministic)

Correctness first, on the timed problem itself (TileLang against ours, relative L2 of out and the
three gradients; the backward run twice must agree bit for bit), then the timings. Each kernel's
shapes are compile-time constants in TileLang, so one length means one build per block size. Rates are on active
pairs (4d FLOPs per pair forward, x3.5 forward+backward, as kernel.py).

    python benchmarks/spike_tilelang.py [--seq-len 131072] [--block-sizes 128,64] [--out F.json]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from common import describe_index, median, relative_l2, run_metadata, tflops, time_ms, write_json  # noqa: E402
from kernel import FWD_BWD_FLOP_FACTOR, Config, forward_and_backward, forward_only, index_and_inputs  # noqa: E402
from megatron_mtraining import sparse_attention  # noqa: E402
from spike_fa4 import attempt, slash_only  # noqa: E402
from tilelang_slash import compile_kernels, slash_attention, slash_block_lists  # noqa: E402


def lists_of(index, seq_len: int, kv_heads: int):
    B = index.block_size
    return slash_block_lists(index.slash_bitmap(seq_len // B), seq_len // B, kv_heads, B)


# (num_stages, programs per SM) of each kernel, per block size. B = 128 programs have 2 consumer
# warpgroups and ~190 KB of shared memory at 2 stages: one per SM. B = 64 ones have one consumer
# warpgroup: a second program per SM is the only other warpgroup there to overlap with.
SWEEP = {128: [(1, 1), (2, 1)], 64: [(2, 1), (1, 2), (2, 2)]}


def sweep(args, cfg, scale, device, result) -> None:
    """Each TileLang kernel alone, per (num_stages, programs per SM), against our kernels' own
    breakdown of the same fwd+bwd (torch.profiler); variants must reproduce the default's outputs."""
    from concurrent.futures import ThreadPoolExecutor

    import tilelang_slash as tls
    from common import kernel_times_ms

    out = result.setdefault("sweep", {})
    for B in args.block_sizes:
        index, arg_sets = index_and_inputs(Config(seq_lens=[args.seq_len], block_size=B), args.seq_len, device)
        index = slash_only(index)
        fi, fc, bi, bc = lists_of(index, args.seq_len, cfg.kv_heads)
        q, k, v, dout = (x.detach() for x in arg_sets[0])
        b, hq, n, d = q.shape
        hk = k.shape[1]
        shapes = dict(fwd=(b, hq, hk, n, d, B, fi.shape[-1], scale), dkdv=(b, hq, hk, n, d, B, bi.shape[-1], scale),
                      dq=(b, hq, hk, n, d, B, fi.shape[-1], scale))
        factories = dict(fwd=tls.forward_kernel, dkdv=tls.dkdv_kernel, dq=tls.dq_kernel)
        jobs = [(name, variant) for name in factories for variant in SWEEP[B]]
        with ThreadPoolExecutor(8) as pool:
            built = {job: pool.submit(factories[job[0]], *shapes[job[0]], *job[1]) for job in jobs}
        o, lse = torch.empty_like(q), torch.empty(b, hq, n, dtype=torch.float32, device=device)
        delta = torch.empty_like(lse)
        outputs = {"fwd": lambda: (torch.empty_like(q), torch.empty_like(lse)),
                   "dkdv": lambda: (torch.empty_like(k), torch.empty_like(v)), "dq": lambda: (torch.empty_like(q),)}
        inputs = {"fwd": lambda: (q, k, v, fi, fc), "dkdv": lambda: (q, k, v, dout, lse, delta, bi, bc),
                  "dq": lambda: (q, k, v, dout, lse, delta, fi, fc)}
        first = {}
        for name, variant in jobs:  # the forward's variants first: its first output feeds the backward's
            key = f"b{B}_{name}_stages{variant[0]}_programs{variant[1]}"
            kernel = attempt(out, key + "_build", lambda: built[name, variant].result())
            if kernel is None:
                continue
            out.pop(key + "_build")
            dst = outputs[name]()
            if name == "fwd" and not first:
                kernel(*inputs[name](), o, lse)
                tls.delta_kernel(b, hq, n, d)(o, dout, delta)
            ms = attempt(out, key + "_ms", lambda: median(time_ms(lambda: kernel(*inputs[name](), *dst), [()],
                                                                  device, 3, args.reps)))
            if ms is None:
                continue
            if name in first:  # every variant computes the same numbers
                out[key + "_equal"] = all(torch.equal(x, y) for x, y in zip(dst, first[name]))
            else:
                first[name] = dst
            print(f"{key:40s} {ms:.3f} ms", flush=True)
        ours = kernel_times_ms(forward_and_backward(lambda q_, k_, v_: sparse_attention(q_, k_, v_, index, scale)),
                               arg_sets[0])
        out[f"b{B}_ours_kernels_ms"] = {name: t for name, t in ours.items() if t > 0.05}
        print(f"b{B} ours:", {name[:60]: round(t, 3) for name, t in ours.items() if t > 0.05}, flush=True)
        if args.out:
            write_json(args.out, result)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=131072)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--block-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[128, 64])
    p.add_argument("--sweep", action="store_true", help="each kernel alone over SWEEP's variants instead")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    device = torch.device("cuda")
    cfg = Config(seq_lens=[args.seq_len], reps=args.reps)
    scale = 1.0 / math.sqrt(cfg.head_dim)
    result = dict(meta=run_metadata(device), seq_len=args.seq_len, block_sizes=args.block_sizes, ms={}, tflops={},
                  checks={}, compile_s={})

    if args.sweep:
        sweep(args, cfg, scale, device, result)
        return 0

    def ours_fn(index):
        return lambda q, k, v: sparse_attention(q, k, v, index, scale)

    def tilelang_fn(lists, B):
        return lambda q, k, v: slash_attention(q, k, v, lists, B, scale)

    def measure(run_name, attn, sets, flops):
        for kind, wrap, factor in (("fwd", forward_only, 1.0), ("fwdbwd", forward_and_backward, FWD_BWD_FLOP_FACTOR)):
            key = f"{run_name}_{kind}"
            ms = attempt(result["ms"], key, lambda: median(time_ms(wrap(attn), sets, device, 3, args.reps)))
            if ms is not None:
                result["tflops"][key] = tflops(flops * factor, ms)
            print(f"{key:32s} {ms if ms is None else round(ms, 3)} ms  {result['tflops'].get(key)} TFLOP/s",
                  flush=True)
            if args.out:  # after every run: a call cut short keeps what it measured
                write_json(args.out, result)
        torch.cuda.empty_cache()

    for B in args.block_sizes:
        index, arg_sets = index_and_inputs(Config(seq_lens=[args.seq_len], block_size=B), args.seq_len, device)
        index = slash_only(index)
        lists = lists_of(index, args.seq_len, cfg.kv_heads)
        q, k, v, dout = arg_sets[0]
        def build():
            start = time.time()
            compile_kernels(q.shape, k.shape[1], lists, B, scale)
            return time.time() - start

        if attempt(result["compile_s"], f"b{B}", build) is None:
            continue
        # Correctness first: TileLang against ours on the same inputs and index.
        attn = tilelang_fn(lists, B)
        ref_out = ours_fn(index)(q, k, v)
        ref = forward_and_backward(ours_fn(index))(q, k, v, dout)
        got_out = attempt(result["checks"], f"b{B}_out", lambda: relative_l2(attn(q, k, v), ref_out))
        got = attempt(result["checks"], f"b{B}_grads", lambda: forward_and_backward(attn)(q, k, v, dout))
        if got is not None:
            result["checks"].pop(f"b{B}_grads")
            for name, g, r in zip(("dq", "dk", "dv"), got, ref):
                result["checks"][f"b{B}_{name}"] = relative_l2(g, r)
            again = forward_and_backward(attn)(q, k, v, dout)
            result["checks"][f"b{B}_bitwise_repeatable"] = all(torch.equal(a, b) for a, b in zip(got, again))
        ref_out = ref = None  # the memory, before the timings
        print("checks (rel L2, TileLang against ours):", result["checks"], flush=True)
        if got_out is None or got is None:
            continue

        pairs = describe_index(index, args.seq_len)["active_pairs"]
        result[f"b{B}_active_pairs"] = pairs
        flops = 4 * cfg.head_dim * pairs
        measure(f"b{B}_ours", ours_fn(index), arg_sets, flops)
        measure(f"b{B}_tilelang", attn, arg_sets, flops)
        for kind in ("fwd", "fwdbwd"):
            ours, theirs = result["ms"].get(f"b{B}_ours_{kind}"), result["ms"].get(f"b{B}_tilelang_{kind}")
            if ours and theirs:
                result.setdefault("ours_over_tilelang", {})[f"b{B}_{kind}"] = ours / theirs
    print({k: v for k, v in result.items() if k != "meta"})
    if args.out:
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
