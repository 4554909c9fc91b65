"""Spike (issue 17, session 12): how many programs should the backward's column gradients run?

The column kernels split each (64-column tile, head) over query-block ranges so that about
``COLUMN_PROGRAMS`` programs run (triton_fwd.tile_config; 1024, tuned for the Triton kernel in
session 5). At 128K with the canonical index that is 3 splits: programs up to ~680 query tiles
long over ~5 waves, so the last wave may leave SMs idle. This times one backward step's kernels
(torch.profiler: column kernel, the partials' reduction and scatter under "other") per target, for
the Hopper and the Triton column kernels, at the kernel benchmark's shape.

    python benchmarks/spike_column_programs.py [--seq-len 131072] [--targets 1024,2048,4096,8192]
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from common import kernel_times_ms, run_metadata, write_json  # noqa: E402
from kernel import Config, backward_step_inputs, index_and_inputs  # noqa: E402
from megatron_mtraining.kernels import single_device_plan, triton_fwd  # noqa: E402
from megatron_mtraining.kernels.triton_bwd import vs_attention_bwd_triton  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=131072)
    p.add_argument("--targets", default="1024,2048,4096,8192")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    device = torch.device("cuda")
    cfg = Config(seq_lens=[args.seq_len])
    index, arg_sets = index_and_inputs(cfg, args.seq_len, device)
    plan = single_device_plan(index, args.seq_len)
    scale = 1.0 / math.sqrt(cfg.head_dim)
    step_args = backward_step_inputs(index, arg_sets[:1], "triton", scale)[0]
    rows = []
    for kernels in ("hopper", "triton"):
        for target in (int(t) for t in args.targets.split(",")):
            triton_fwd.LAUNCH_OVERRIDES["bwd"] = {"COLUMN_PROGRAMS": target}

            def step(q, k, v, do, lse, delta, dq, dk, dv):
                vs_attention_bwd_triton(q, k, v, do, lse, delta, plan, dq, dk, dv, scale, kernels=kernels)
            times = kernel_times_ms(step, step_args)
            column = sum(ms for name, ms in times.items() if "dkdv_col" in name)
            ours = ("_dq", "_dkdv")
            other = sum(ms for name, ms in times.items() if not any(k in name for k in ours))
            rows.append(dict(kernels=kernels, column_programs=target, column_ms=column, other_ms=other,
                             total_ms=sum(times.values())))
            print(f"{kernels:7s} target {target:6d}: column {column:6.3f} ms, other {other:6.3f} ms, "
                  f"step {rows[-1]['total_ms']:7.3f} ms", flush=True)
    triton_fwd.LAUNCH_OVERRIDES.clear()
    if args.out:
        write_json(args.out, dict(meta=run_metadata(device), seq_len=args.seq_len, rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
