"""Where a forward+backward's GPU time goes besides kernels: the idle gaps between them.

kernel.py's per-kernel breakdown sums kernel durations; its wall time can be longer when the GPU
waits for the host between launches (launch overhead of many small operations, a host
synchronisation). This script profiles a few fwd+bwd of ``sparse_attention`` (the canonical shape
of kernel.py, the fixed index) and reports per call: wall time (CUDA events), the GPU's busy time
(the union of kernel intervals), the idle time between the first and the last kernel, and the
largest gaps with the kernels around them.

    python benchmarks/timeline.py [--seq-len 131072] [--documents] [--out results/timeline_<device>.json]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kernel  # noqa: E402
from common import (cu_seqlens_of, document_mix, fixed_packed_index, median, run_metadata, time_ms,  # noqa: E402
                    write_json)

from megatron_mtraining import sparse_attention  # noqa: E402


def kernel_intervals(fn, args) -> List[tuple]:
    """(start us, end us, name) of every GPU kernel of one call, in start order (one profile per
    call: the profiler's own host overhead stretches host-bound stretches, never kernels)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn(*args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn(*args)
        torch.cuda.synchronize()
    spans = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
             if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start]
    return sorted(spans)


def split_at_gaps(spans: List[tuple], min_gap_us: float) -> List[List[tuple]]:
    """The spans in runs separated by idle gaps of at least ``min_gap_us``."""
    runs, end = [[spans[0]]], spans[0][1]
    for span in spans[1:]:
        if span[0] - end >= min_gap_us:
            runs.append([])
        runs[-1].append(span)
        end = max(end, span[1])
    return runs


def analyse_call(spans: List[tuple], top: int = 8) -> Dict:
    busy, gaps, end, last = 0.0, [], spans[0][0], spans[0][2]
    for start, stop, name in spans:
        if start > end:
            gaps.append((start - end, last, name))
        busy += max(0.0, stop - max(start, end))
        if stop > end:
            end, last = stop, name
    span = end - spans[0][0]
    gaps.sort(reverse=True)
    return {"span_ms": span / 1e3, "busy_ms": busy / 1e3, "idle_ms": (span - busy) / 1e3, "kernels": len(spans),
            "largest_gaps_us": [(round(g, 1), a[:60], b[:60]) for g, a, b in gaps[:top]]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=131072)
    p.add_argument("--documents", action="store_true", help="packed.py's document mix and index")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    device = torch.device("cuda")
    cfg = kernel.Config(seq_lens=[args.seq_len])
    scale = 1.0 / math.sqrt(cfg.head_dim)
    cu = None
    if args.documents:
        cu = cu_seqlens_of(document_mix(args.seq_len, cfg.block_size), device)
        index = fixed_packed_index(cfg.batch, cfg.heads, args.seq_len, cu, cfg.block_size, cfg.density, device,
                                   cfg.seed)[0]
        arg_sets = kernel.make_inputs(cfg, args.seq_len, device, cfg.input_sets, cfg.seed + args.seq_len)
    else:
        index, arg_sets = kernel.index_and_inputs(cfg, args.seq_len, device)
    run = kernel.forward_and_backward(lambda q, k, v: sparse_attention(q, k, v, index, scale, cu_seqlens=cu))
    wall = median(time_ms(run, arg_sets, device, 3, 10))
    calls = []
    for _ in range(args.iters):
        spans = kernel_intervals(run, arg_sets[0])
        call = analyse_call(spans)
        # The stretches between long gaps: where the GPU works, and where it waits for the host.
        call["stretches"] = [{"first": r[0][2][:60], "kernels": len(r), **{k: v for k, v in analyse_call(r).items()
                                                                           if k in ("span_ms", "busy_ms")}}
                             for r in split_at_gaps(spans, 50.0)]
        calls.append(call)
    result = {"meta": run_metadata(device), "seq_len": args.seq_len, "documents": args.documents,
              "fwdbwd_wall_ms": wall, "calls": calls}
    for c in calls:
        print(f"wall {wall:.2f} ms | under the profiler: span {c['span_ms']:.2f} busy {c['busy_ms']:.2f} "
              f"idle {c['idle_ms']:.2f} ms, {c['kernels']} kernels")
        for r in c["stretches"]:
            print(f"    {r['kernels']:4d} kernels from {r['first']:40s} span {r['span_ms']:.2f} busy {r['busy_ms']:.2f}")
    if args.out:
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
