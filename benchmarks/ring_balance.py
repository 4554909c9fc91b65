"""How much can a layout gain? Per-step work of the sparse ring, counted from the index (CPU).

The ring's forward runs W steps; at step s rank r attends its query blocks to the key blocks of
rank (r - s) mod W. This script counts work[r, s] (active (query, key) pairs) from an index for
the striped and the zigzag layouts, and the ring time relative to perfect balance under two
models of time proportional to work:
* pipelined: ranks only wait for their neighbour's K/V, which arrives while they compute, so
  the time is the busiest rank's total, max_r sum_s work / mean_r sum_s work (worker imbalance);
* step-synchronous: every step lasts as long as its slowest rank (a slow link, or hand-overs
  that cannot hide), sum_s max_r work / sum_s mean_r work.
It ignores communication time and per-block overheads, so it bounds what the layout alone can
change in `ring.py`'s sparse zigzag / striped ratio.

Indices: the ring benchmark's synthetic `fixed` index, and indices the approximator builds from
synthetic vertical-slash q/k (`synthetic_vs_qk`) with diffuse to concentrated attention::

    python benchmarks/ring_balance.py     # -> results/analysis_ring_balance.json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import (cu_seqlens_of, document_mix, fixed_packed_index, fixed_vs_index, run_metadata,  # noqa: E402
                    write_json)

from megatron_mtraining import MTrainingConfig  # noqa: E402
from megatron_mtraining.approx import approximate_index  # noqa: E402
from megatron_mtraining.index import VSIndex  # noqa: E402
from megatron_mtraining.layout import local_block_ids  # noqa: E402
from synthetic import synthetic_vs_qk  # noqa: E402

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def block_pairs(index: VSIndex, seq_len: int, cu_seqlens=None) -> torch.Tensor:
    """float64 [nb, nb]: active (query, key) pairs of each (query block, key block), summed over
    the index's heads (batch 0). A selected offset covers its whole block (the diagonal block's
    causal half); otherwise each selected column of the key block adds its B rows. With packed
    documents (``cu_seqlens``) only pairs within one document count."""
    B, nb = index.block_size, seq_len // index.block_size
    if cu_seqlens is not None:
        return packed_block_pairs(index, seq_len, cu_seqlens)
    qb, kb = torch.arange(nb)[:, None], torch.arange(nb)[None, :]
    offset = qb - kb
    causal = offset >= 0
    total = torch.zeros(nb, nb, dtype=torch.float64)
    bitmap = index.slash_bitmap(nb).bool()[0]      # [h, nb]
    columns = index.column_mask(seq_len)[0]        # [h, seq_len]
    for h in range(bitmap.shape[0]):
        by_slash = bitmap[h][offset.clamp(min=0)] & causal
        per_block_columns = columns[h].view(nb, B).sum(-1).double()  # selected columns per key block
        full = torch.where(offset == 0, B * (B + 1) / 2, float(B * B))
        total += torch.where(by_slash, full, torch.where(causal & (offset > 0), per_block_columns[kb] * B, 0.0))
    return total


def packed_block_pairs(index: VSIndex, seq_len: int, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``block_pairs`` with documents, from tokens per (block, document) ``cnt``: a selected block
    pair keeps its same-document pairs (cnt @ cnt.T; the diagonal block cnt (cnt + 1) / 2), and the
    selected columns of a key block reach the queries of their own document only."""
    B, nb = index.block_size, seq_len // index.block_size
    cu = cu_seqlens.long()
    pos = torch.arange(seq_len)
    doc = torch.searchsorted(cu, pos, right=True) - 1
    cnt = torch.zeros(nb, cu.numel() - 1, dtype=torch.float64)
    cnt.index_put_((pos // B, doc), torch.ones(seq_len, dtype=torch.float64), accumulate=True)
    same_doc = cnt @ cnt.T
    same_doc.diagonal().copy_((cnt * (cnt + 1) / 2).sum(-1))
    qb, kb = torch.arange(nb)[:, None], torch.arange(nb)[None, :]
    offset = qb - kb
    causal = offset >= 0
    total = torch.zeros(nb, nb, dtype=torch.float64)
    bitmap = index.slash_bitmap(nb).bool()[0]
    columns = index.column_mask(seq_len)[0]
    for h in range(bitmap.shape[0]):
        by_slash = bitmap[h][offset.clamp(min=0)] & causal
        col_cnt = torch.zeros_like(cnt)                 # selected columns per (key block, document)
        c = columns[h].nonzero().flatten()
        col_cnt.index_put_((c // B, doc[c]), torch.ones(c.numel(), dtype=torch.float64), accumulate=True)
        by_columns = cnt @ col_cnt.T                    # [qb, kb]: column pairs within documents
        total += torch.where(by_slash, same_doc, torch.where(causal & (offset > 0), by_columns, 0.0))
    return total


def step_work(pairs: torch.Tensor, seq_len: int, layout: str, world: int, block_size: int) -> torch.Tensor:
    """[world (rank), world (step)] work of the forward ring."""
    blocks = [local_block_ids(seq_len, layout, world, r, block_size) for r in range(world)]
    work = torch.zeros(world, world, dtype=torch.float64)
    for r in range(world):
        for s in range(world):
            src = (r - s) % world
            work[r, s] = pairs[blocks[r]][:, blocks[src]].sum()
    return work


MODELS = ("pipelined", "step_synchronous")


def balance(work: torch.Tensor) -> dict:
    """Ring time over the perfectly balanced time under each model, and each step's share of the work."""
    return {"pipelined": float(work.sum(1).max() / work.sum(1).mean()),
            "step_synchronous": float(work.max(0).values.sum() / work.mean(0).sum()),
            "step_share_of_work": (work.sum(0) / work.sum()).tolist()}


def indices(seq_len: int, heads: int, kv_heads: int, block: int, density: float, localities, seed: int,
            cu_seqlens=None):
    if cu_seqlens is not None:  # packed: the fixed index at `density` of the document-causal pairs
        yield "fixed, packed documents", fixed_packed_index(1, heads, seq_len, cu_seqlens, block, density, seed=seed)[0]
        return
    yield "fixed (ring.py)", fixed_vs_index(1, heads, seq_len, block, density, seed=seed)
    if seq_len > 65536:  # synthetic q/k of every head at this length would not fit this machine's memory
        return
    cfg = MTrainingConfig(index="vs", top_p=0.9, last_q=64, block_size=block)
    for locality in localities:
        q, k = synthetic_vs_qk(1, heads, kv_heads, seq_len, 64, seed=seed, locality=locality)
        yield f"approximated, locality {locality:g}", approximate_index(q, k, cfg, backend="torch")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-lens", default="65536,524288",
                   help="approximated indices only up to 64K (the fixed one at every length)")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--density", type=float, default=0.05, help="density of the fixed index")
    p.add_argument("--localities", default="1,4,16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--documents", action="store_true",
                   help="pack the benchmark's document mix (common.DOCUMENT_MIX_128K, scaled) into every sequence")
    p.add_argument("--out", default=None, help="default results/analysis_ring_balance[_packed].json")
    args = p.parse_args(argv)
    if args.out is None:
        args.out = os.path.join(RESULTS_DIR, f"analysis_ring_balance{'_packed' if args.documents else ''}.json")
    rows = []
    for seq_len in (int(x) for x in args.seq_lens.split(",")):
        cu = cu_seqlens_of(document_mix(seq_len, args.block_size)) if args.documents else None
        for name, index in indices(seq_len, args.heads, args.kv_heads, args.block_size, args.density,
                                   [float(x) for x in args.localities.split(",") if x], args.seed, cu):
            pairs = block_pairs(index, seq_len, cu)
            row = {"seq_len": seq_len, "index": name, "density": float(index.density(seq_len).mean())}
            if cu is not None:
                row["documents"] = document_mix(seq_len, args.block_size)
            for layout in ("striped", "zigzag"):
                row[layout] = balance(step_work(pairs, seq_len, layout, args.world, args.block_size))
            row["zigzag_over_striped"] = {m: row["zigzag"][m] / row["striped"][m] for m in MODELS}
            rows.append(row)
            print(f"S={seq_len:>6} {name:<28} density {row['density']:.3f} | zigzag / striped: "
                  + ", ".join(f"{m} {row['zigzag_over_striped'][m]:.3f}" for m in MODELS), flush=True)
    out = {"benchmark": "ring_balance", "settings": vars(args), "rows": rows, "meta": run_metadata(torch.device("cpu"))}
    write_json(args.out, out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
