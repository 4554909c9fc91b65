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

    python benchmarks/needle_coverage.py            # -> results/analysis_needle_coverage.json
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import run_metadata, write_json  # noqa: E402

from megatron_mtraining import MTrainingConfig  # noqa: E402
from megatron_mtraining.approx import approximate_index  # noqa: E402
from megatron_mtraining.index import VSIndex  # noqa: E402
from synthetic import synthetic_vs_qk  # noqa: E402

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
RESIDUAL = "residual verticals (prototype), top-p 0.9, last_q 128"
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


def residual_vertical_index(q, k, config: MTrainingConfig, index: VSIndex) -> VSIndex:
    """Prototype of another vertical selection, not in the package: keep ``index``'s slashes and
    choose the verticals by top-p of the mass those slashes leave (exact softmax of the last
    ``last_q`` rows), plus the sink columns. The question it answers: do verticals that only
    have to explain what the slash lines miss keep the needles, and at what density?"""
    _, hq, n, d = q.shape
    L, B, nb = config.last_q, config.block_size, n // config.block_size
    rows, cols = torch.arange(n - L, n), torch.arange(n)
    keys = k[0].repeat_interleave(hq // k.shape[1], 0).double()  # [hq, n, d]
    causal = cols[None, :] <= rows[:, None]
    logits = q[0, :, n - L:].double() @ keys.transpose(1, 2) / math.sqrt(d)
    probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), -1)  # [hq, L, n]
    offset = (rows[:, None] // B - cols[None, :] // B).clamp(0, nb - 1)
    covered = index.slash_bitmap(nb).bool()[0][:, offset] & causal
    residual = (probs * ~covered).sum(1)  # [hq, n]
    ranked, order = residual.sort(-1, descending=True)
    count = (ranked.cumsum(-1) < config.top_p * residual.sum(-1, keepdim=True)).sum(-1) + 1
    capacity = config.max_vertical
    vertical = torch.zeros(1, hq, capacity, dtype=torch.int32)
    n_vertical = torch.zeros(1, hq, dtype=torch.int32)
    for h in range(hq):
        chosen = set(order[h, :int(count[h])].tolist()) | set(range(config.sink_tokens))
        chosen = sorted(chosen)[:capacity]
        vertical[0, h, :len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
        n_vertical[0, h] = len(chosen)
    return VSIndex(index.slash, index.n_slash, vertical, n_vertical, B)


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
    hits = {name: 0 for name in (*VARIANTS, RESIDUAL)}
    density = {name: 0.0 for name in hits}
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
        indexes = {name: approximate_index(q, k, dataclasses.replace(base, **overrides), backend="torch")
                   for name, overrides in VARIANTS.items()}
        indexes[RESIDUAL] = residual_vertical_index(q, k, base, indexes["top-p 0.9, last_q 128"])
        for name, index in indexes.items():
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
    p.add_argument("--out", default=os.path.join(RESULTS_DIR, "analysis_needle_coverage.json"))
    args = p.parse_args(argv)
    # min_vertical 0: the variants below add their own settings to the pure top-p budget
    base = MTrainingConfig(index="vs", top_p=0.9, last_q=128, block_size=64, min_vertical=0)
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
    write_json(args.out, out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
