"""How many of the pairs the forward computes are active, packed against unpacked (issue 16, CPU).

The kernels compute whole 64 x 64 tiles: every slash key block of a query block, and the plan's
columns in 64-column slots. A tile's inactive pairs (the causal half of the diagonal, the other
documents' keys in a block that straddles a boundary, the empty slots of a query block's last
column tile) cost as much as active ones. Per run of packed.py (the 128K mix at 5% of document
pairs; unpacked at 5% of causal pairs; unpacked with the packed run's active pairs), from the plans
the kernels get: tiles per work item (64 query rows x head), computed and active pairs.

    python benchmarks/tile_waste.py [--seq-len 131072] [--out results/analysis_tile_waste.json]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import (cu_seqlens_of, describe_index, document_mix, fixed_packed_index, fixed_vs_index,  # noqa: E402
                    write_json)

from megatron_mtraining.documents import as_documents  # noqa: E402
from megatron_mtraining.kernels import single_device_plan  # noqa: E402

TILE = 64


def plan_tiles(plan, documents: bool) -> dict:
    """Slash and column tiles the 64-row forward computes over a single-device plan: each of a
    query block's B/64 row programs reads B/64 tiles per slash key block and its columns."""
    rows = plan.block_size // TILE
    slash = int(plan.kv_count.long().sum()) * rows * rows
    limit = plan.col_limit.long()
    start = (plan.col_start.long() // TILE) * TILE if documents else torch.zeros_like(limit)
    slots = (limit - start).clamp(min=0)
    columns = int(((slots + TILE - 1) // TILE).sum()) * rows
    return {"slash_tiles": slash, "column_tiles": columns,
            "column_slots_used": float(slots.sum()) * rows / max(1, columns * TILE)}


def analyse(seq_len: int, heads: int = 16, block_size: int = 64, density: float = 0.05) -> dict:
    lengths = document_mix(seq_len, block_size)
    cu = cu_seqlens_of(lengths)
    packed_index, pairs, _ = fixed_packed_index(1, heads, seq_len, cu, block_size, density, None, 0)
    packed_active = float(pairs.sum())
    causal = seq_len * (seq_len + 1) / 2
    runs = {
        "packed": (packed_index, as_documents(cu, seq_len, block_size, torch.device("cpu")), packed_active),
        "unpacked": (fixed_vs_index(1, heads, seq_len, block_size, density, None, 0), None, None),
        "unpacked_equal_work": (fixed_vs_index(1, heads, seq_len, block_size, float(pairs.mean()) / causal, None, 0),
                                None, None),
    }
    items = seq_len // TILE * heads
    out = {"seq_len": seq_len, "heads": heads, "block_size": block_size, "documents": lengths, "items": items}
    for name, (index, documents, active) in runs.items():
        if active is None:
            active = describe_index(index, seq_len)["active_pairs"]
        entry = plan_tiles(single_device_plan(index, seq_len, documents=documents), documents is not None)
        tiles = entry["slash_tiles"] + entry["column_tiles"]
        entry.update(tiles_per_item=tiles / items, computed_pairs=tiles * TILE * TILE, active_pairs=active,
                     active_over_computed=active / (tiles * TILE * TILE))
        out[name] = entry
    out["computed_per_active_packed_over_unpacked"] = (out["unpacked"]["active_over_computed"]
                                                       / out["packed"]["active_over_computed"])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=131072)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    result = analyse(args.seq_len, args.heads, args.block_size)
    for name in ("packed", "unpacked", "unpacked_equal_work"):
        e = result[name]
        print(f"{name:20s} tiles/item {e['tiles_per_item']:6.2f}  active/computed {e['active_over_computed']:.3f}  "
              f"column slots used {e['column_slots_used']:.2f}")
    print(f"computed pairs per active pair, packed over unpacked: {result['computed_per_active_packed_over_unpacked']:.3f}")
    if args.out:
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
