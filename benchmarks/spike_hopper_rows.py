"""Spike (issue 17, session 12): at B = 128, the Hopper forward with one 128-row program per query
block (two warpgroups sharing every K/V tile: half the bytes per pair) against two 64-row programs.

    python benchmarks/spike_hopper_rows.py [--seq-len 131072] [--out results/spike_hopper_rows_<device>.json]
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
    rows_out = {}
    result = dict(meta=run_metadata(device), seq_len=args.seq_len, block_size=128, rows={})
    for rows in (64, 128, 64, 128):  # twice each, interleaved: the forward's samples are bimodal
        def fwd(q, k, v):
            out = torch.empty_like(q)
            lse = torch.empty(q.shape[:3], device=device)
            vs_attention_fwd_hopper(q, k, v, plan, out, lse, scale, False, rows=rows)
            return out
        rows_out[rows] = fwd(*inputs[0])
        ms = median(time_ms(fwd, inputs, device, 3, args.reps))
        result["rows"].setdefault(str(rows), []).append(ms)
        print(f"rows {rows:3d}: {ms:.3f} ms", flush=True)
    result["rel_l2_128_vs_64"] = relative_l2(rows_out[128], rows_out[64])
    result["bit_identical"] = bool(torch.equal(rows_out[128], rows_out[64]))
    print({k: v for k, v in result.items() if k != "meta"})
    if args.out:
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
