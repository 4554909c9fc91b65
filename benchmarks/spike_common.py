"""What the issue-17 spikes (``spike_fa4.py``, ``spike_tilelang.py``) share: the slash-only index
they hand a candidate, failure recording that lets a spike go on, and the fwd / fwd+bwd timing of
one candidate into the spike's result."""

from __future__ import annotations

import argparse
import math
import traceback
from typing import Callable, Dict

import torch

from common import median, run_metadata, tflops, time_ms, write_json
from kernel import FWD_BWD_FLOP_FACTOR, Config, forward_and_backward, forward_only
from megatron_mtraining.index import VSIndex


def spike_arguments(description: str) -> argparse.ArgumentParser:
    """The options every spike has: the problem's length, repetitions, block sizes, the JSON."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--seq-len", type=int, default=131072)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--block-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[128, 64])
    p.add_argument("--out", default="")
    return p


def spike_start(args, **fields):
    """(device, cfg, softmax scale, result) of a spike on the canonical shape at ``--seq-len``;
    the result holds the run's metadata, ``ms``/``tflops`` for ``measurer`` and ``fields``."""
    device = torch.device("cuda")
    cfg = Config(seq_lens=[args.seq_len], reps=args.reps)
    result = dict(meta=run_metadata(device), seq_len=args.seq_len, block_sizes=args.block_sizes, ms={}, tflops={},
                  **fields)
    return device, cfg, 1.0 / math.sqrt(cfg.head_dim), result


def slash_only(index: VSIndex) -> VSIndex:
    """The index without its columns (same slash offsets, no vertical entries)."""
    return VSIndex(index.slash, index.n_slash, index.vertical, torch.zeros_like(index.n_vertical),
                   index.block_size)


def attempt(result: dict, key: str, fn):
    """fn() stored as result[key]; a failure goes to result[key + '_error'] (and its traceback to
    the log) and the spike goes on."""
    try:
        result[key] = fn()
        return result[key]
    except Exception as exc:  # noqa: BLE001 - a spike records every failure and goes on
        result[key + "_error"] = f"{type(exc).__name__}: {exc}"[:2000]
        traceback.print_exc()
        return None


def measurer(result: Dict, device: torch.device, reps: int, out: str) -> Callable:
    """measure(run_name, attn, arg_sets, flops): median fwd and fwd+bwd ms into result['ms'] and
    their rates on ``flops`` (the forward's) into result['tflops'], printed, and the JSON written
    after each (a call cut short keeps what it measured)."""
    def measure(run_name, attn, sets, flops):
        for kind, wrap, factor in (("fwd", forward_only, 1.0), ("fwdbwd", forward_and_backward, FWD_BWD_FLOP_FACTOR)):
            key = f"{run_name}_{kind}"
            ms = attempt(result["ms"], key, lambda: median(time_ms(wrap(attn), sets, device, 3, reps)))
            if ms is not None:
                result["tflops"][key] = tflops(flops * factor, ms)
            print(f"{key:32s} {ms if ms is None else round(ms, 3)} ms  {result['tflops'].get(key)} TFLOP/s",
                  flush=True)
            if out:
                write_json(out, result)
        torch.cuda.empty_cache()
    return measure
