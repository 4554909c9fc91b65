"""Issue 17: at B = 128, the forward's kernels on one index, timed interleaved in one call: the
ping-pong Hopper forward (kernels/hopper_pingpong.py, one program per query block, the default
at B = 128), two 64-row Hopper programs per block (hopper_fwd.py) and the Triton forward.
(Session 12 ran this script as spike_hopper_rows.py with a lockstep 128-row kernel in place of the
ping-pong one: results/spike_hopper_rows_nvidia-h200.json.)

    python benchmarks/spike_hopper_pingpong.py [--seq-len 131072] [--out results/spike_hopper_pingpong_<device>.json]
"""

from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from common import median, relative_l2, run_metadata, time_ms, write_json  # noqa: E402
from kernel import Config, index_and_inputs  # noqa: E402
from megatron_mtraining.kernels import single_device_plan  # noqa: E402
from megatron_mtraining.kernels.hopper_fwd import vs_attention_fwd_hopper  # noqa: E402
from megatron_mtraining.kernels.triton_fwd import vs_attention_fwd_triton  # noqa: E402

KERNELS = {
    "pingpong": lambda *a: vs_attention_fwd_hopper(*a, rows=128),
    "hopper64": lambda *a: vs_attention_fwd_hopper(*a, rows=64),
    "triton": vs_attention_fwd_triton,
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=131072)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    device = torch.device("cuda")
    cfg = Config(seq_lens=[args.seq_len], block_size=128)
    index, arg_sets = index_and_inputs(cfg, args.seq_len, device)
    plan = single_device_plan(index, args.seq_len)
    scale = 1.0 / math.sqrt(cfg.head_dim)
    inputs = [(q.detach(), k.detach(), v.detach()) for q, k, v, _ in arg_sets]
    outs = {}
    result = dict(meta=run_metadata(device), seq_len=args.seq_len, block_size=128, ms={})
    for name in [*KERNELS, *KERNELS]:  # twice each, interleaved: the forward's samples can be bimodal
        def fwd(q, k, v, kernel=KERNELS[name]):
            out = torch.empty_like(q)
            lse = torch.empty(q.shape[:3], device=device)
            kernel(q, k, v, plan, out, lse, scale, False)
            return out
        outs[name] = fwd(*inputs[0])
        ms = median(time_ms(fwd, inputs, device, 3, args.reps))
        result["ms"].setdefault(name, []).append(ms)
        print(f"{name:9s}: {ms:.3f} ms", flush=True)
    best = {name: min(times) for name, times in result["ms"].items()}
    result["speedup_pingpong_vs_hopper64"] = best["hopper64"] / best["pingpong"]
    result["speedup_pingpong_vs_triton"] = best["triton"] / best["pingpong"]
    result["rel_l2_pingpong_vs_triton"] = relative_l2(outs["pingpong"], outs["triton"])
    result["rel_l2_hopper64_vs_triton"] = relative_l2(outs["hopper64"], outs["triton"])
    print({k: v for k, v in result.items() if k != "meta"})
    if args.out:
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
