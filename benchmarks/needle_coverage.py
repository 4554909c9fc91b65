"""Does MTraining's index keep a needle that only a few of the scoring queries retrieve?

The quality run (issue 7) found MTraining retrieving worse than dense once the index gets sparse.
The hypothesis: the vertical statistic sums the attention of the last ``last_q`` queries; when
only a few of them retrieve (6 query keys in a 24-token query block) and the rest attend
locally, the local columns hold most of the vertical mass and the top-p cut drops the needle.

This script tests that on synthetic vertical-slash q/k (``synthetic_vs_qk``: RoPE locality,
outlier keys, a sink). Six rows in the sequence's last 24 positions get their query moved
towards one needle key each, by just enough that the needle takes ``share`` of that row's
attention (bisection on the exact row softmax). Then the approximator builds the index and we
count the (row, needle) pairs it covers, in at least one query head of the row's KV group, for
several configurations. CPU is fine (PyTorch statistics)::

    python benchmarks/needle_coverage.py            # -> results/needle_coverage.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import json_ready, run_metadata  # noqa: E402

from megatron_mtraining import MTrainingConfig  # noqa: E402
from megatron_mtraining.approx import approximate_index  # noqa: E402
from megatron_mtraining.synthetic import synthetic_vs_qk  # noqa: E402

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
VARIANTS = {  # name -> MTrainingConfig overrides (on top of the quality benchmark's settings)
    "top-p 0.9, last_q 128": {},
    "top-p 0.9, last_q 32": dict(last_q=32),
    "top-p 0.9, last_q 128, min_vertical 256": dict(min_vertical=256),
    "top-p 0.95, last_q 128": dict(top_p=0.95),
}


def retrieval_rows(n: int, queries: int = 6, query_len: int = 4):
    """The rows that predict the answers of a query block ending the sequence (as in the corpus)."""
    start = n - queries * query_len
    return [start + i * query_len + 1 for i in range(queries)]


def steer(q_row: torch.Tensor, k: torch.Tensor, row: int, needle: int, share: float, scale: float) -> torch.Tensor:
    """``q_row + c * unit(k[needle])`` with c such that the needle holds ``share`` of the row's
    causal softmax (bisection: the share grows with c)."""
    keys = k[:row + 1].double()
    direction = keys[needle] / keys[needle].norm()

    def needle_share(c):
        logits = (q_row.double() + c * direction) @ keys.T * scale
        return torch.softmax(logits, -1)[needle].item()

    if needle_share(0.0) >= share:
        raise ValueError(f"row {row} already gives needle {needle} more than {share} of its attention")
    lo, hi = 0.0, 1.0
    while needle_share(hi) < share:  # reachable: the needle is the keys' extreme in its direction
        hi *= 2
        if hi > 1e6:
            raise RuntimeError(f"row {row}: needle {needle} cannot reach share {share}")
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if needle_share(mid) < share else (lo, mid)
    return (q_row.double() + hi * direction).to(q_row.dtype)


def pick_needle(keys: torch.Tensor, row: int, g: torch.Generator) -> int:
    """A random key before ``row - 256`` that is the extreme of the keys up to ``row`` in its own
    direction, so that moving a query towards it can give it any share of the attention."""
    if row <= 320:
        raise ValueError(f"row {row}: needles are drawn from [64, row - 256)")
    for _ in range(1000):
        j = int(torch.randint(64, row - 256, (1,), generator=g))
        if int((keys[:row + 1] @ keys[j]).argmax()) == j:
            return j
    raise RuntimeError(f"no extreme key found before row {row}")


def coverage(n: int, share: float, seeds: int, group: int, head_dim: int, locality: float, base: MTrainingConfig):
    hits = {name: 0 for name in VARIANTS}
    density = {name: 0.0 for name in VARIANTS}
    total = 0
    scale = 1.0 / math.sqrt(head_dim)
    for seed in range(seeds):
        q, k = synthetic_vs_qk(1, group, 1, n, head_dim, seed=seed, locality=locality)
        g = torch.Generator().manual_seed(1000 + seed)
        rows = retrieval_rows(n)
        needles = [pick_needle(k[0, 0], row, g) for row in rows]
        for row, needle in zip(rows, needles):
            for h in range(group):  # every query head of the group retrieves
                q[0, h, row] = steer(q[0, h, row], k[0, 0], row, needle, share, scale)
        for name, overrides in VARIANTS.items():
            index = approximate_index(q, k, dataclasses.replace(base, **overrides), backend="torch")
            covered = index.covers(torch.tensor(rows), torch.tensor(needles), n)[0]  # [heads, rows]
            hits[name] += int(covered.any(0).sum())
            density[name] += float(index.density(n).mean()) / seeds
        total += len(rows)
    return {name: h / total for name, h in hits.items()}, density


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-lens", default="4096,32768")
    p.add_argument("--shares", default="0.01,0.05,0.2,0.8",
                   help="the needle's share of each retrieving row's attention")
    p.add_argument("--localities", default="1,4,16",
                   help="synthetic_vs_qk locality: how much of each row's attention stays near the diagonal")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--group", type=int, default=4, help="query heads per KV head")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--out", default=os.path.join(RESULTS_DIR, "needle_coverage.json"))
    args = p.parse_args(argv)
    base = MTrainingConfig(index="vs", top_p=0.9, last_q=128, block_size=64)
    rows = []
    for n in (int(x) for x in args.seq_lens.split(",")):
        for locality in (float(x) for x in args.localities.split(",")):
            for share in (float(x) for x in args.shares.split(",")):
                result, density = coverage(n, share, args.seeds, args.group, args.head_dim, locality, base)
                rows.append({"seq_len": n, "locality": locality, "share": share, "coverage": result,
                             "density": density})
                print(f"S={n:>6} locality={locality:g} share={share:.2f} coverage (density) "
                      + " | ".join(f"{k}: {v:.2f} ({density[k]:.3f})" for k, v in result.items()), flush=True)
    out = {"benchmark": "needle_coverage", "settings": vars(args), "rows": rows,
           "meta": run_metadata(torch.device("cpu"))}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(json_ready(out), f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
