"""What one slash offset and one vertical column cost, as a share of the document-causal pairs,
on the packed layouts we train and benchmark on (the packed density question).

A slash offset ``delta`` keeps, in every document, about one key block per query block: about
``B * L`` pairs of a document's ``L (L + 1) / 2``, so its share of the pairs grows as documents
get shorter (about ``2 / L_blocks`` for one document). An index that selects the same offsets
therefore has a density that depends on the documents, not only on the model. This script counts
the shares exactly (``common.packed_active_pairs``, the function of docs/design.md §1 with
documents, no S x S tensor) for:

* one unbroken sequence (the unpacked quality run, 32K; the kernel benchmark, 128K);
* the packed quality run's layouts (3-8 random documents per 32K sequence, several layouts);
* the ProLong-like benchmark mix (``PROLONG_MIX``) at 32K and at its own 128K;

and derives ``offsets_within_10_percent``: how many off-diagonal offsets (beside the diagonal)
fit in a density of 0.10. Then, from the measured quality runs (``results/quality.json``,
unpacked; ``results/quality_packed.json``, 3-8 documents), the number of offsets per head their
final density implies (its diagonal and ``min_vertical`` columns taken off), and the density that
index would have on the ProLong mix at 128K. CPU only, about a minute::

    python benchmarks/document_costs.py    # -> results/analysis_document_costs.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List, Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import cu_seqlens_of, document_causal_pairs, packed_active_pairs, run_metadata, write_json  # noqa: E402

from megatron_mtraining import VSIndex  # noqa: E402
from corpus import PROLONG_MIX, PackedConfig, packed_document_lengths  # noqa: E402

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
OFFSETS = (1, 2, 4, 8, 16, 32)  # off-diagonal offsets (blocks back) whose shares are averaged
COLUMNS = 61  # vertical columns sampled, evenly spread over the sequence (a prime: not block-aligned)


def offset_and_column_shares(lengths: Sequence[int], block_size: int = 64) -> Dict[str, float]:
    """Shares of the document-causal pairs: ``diagonal`` (offset 0), ``offset`` (the mean over
    ``OFFSETS``), ``column`` (what one vertical column adds to the diagonal, which every index
    holds: its document's queries in later blocks; mean over positions)."""
    seq_len = int(sum(lengths))
    cu = cu_seqlens_of(lengths)
    offsets = [0, *OFFSETS]
    columns = torch.linspace(0, seq_len - 1, COLUMNS).long().tolist()
    # One head per offset (slash only), then one head per sampled column (with the diagonal).
    slash = [[[d] for d in offsets] + [[0] for _ in columns]]
    vertical = [[[] for _ in offsets] + [[c] for c in columns]]
    index = VSIndex.from_lists(slash, vertical, block_size=block_size)
    shares = (packed_active_pairs(index, cu, seq_len)[0] / document_causal_pairs(lengths)).tolist()
    return {"diagonal": shares[0], "offset": sum(shares[1:len(offsets)]) / len(OFFSETS),
            "column": sum(shares[len(offsets):]) / len(columns) - shares[0]}


def layouts(name: str, seq_len: int, count: int) -> List[List[int]]:
    """The document lengths of ``count`` sequences of one kind."""
    if name == "unpacked":
        return [[seq_len]]
    mix = PROLONG_MIX if name == "prolong_mix" else ()
    cfg = PackedConfig(vocab_size=2048, seq_len=seq_len, min_documents=3, max_documents=8, document_mix=mix)
    return [packed_document_lengths(cfg, i).tolist() for i in range(1 if mix else count)]


def analyse(seq_len: int, kind: str, block_size: int, count: int) -> Dict:
    rows = [offset_and_column_shares(lengths, block_size) for lengths in layouts(kind, seq_len, count)]
    mean = {key: sum(r[key] for r in rows) / len(rows) for key in rows[0]}
    return {"documents": kind, "seq_len": seq_len, "layouts": len(rows), "block_size": block_size,
            "share_per_diagonal": mean["diagonal"], "share_per_offset": mean["offset"],
            "share_per_column": mean["column"],
            "offsets_within_10_percent": (0.10 - mean["diagonal"]) / mean["offset"]}


CASES = (("unpacked", 32768), ("random_3_8", 32768), ("prolong_mix", 32768), ("unpacked", 131072),
         ("prolong_mix", 131072))


QUALITY_RUNS = (("quality.json", "unpacked"), ("quality_packed.json", "random_3_8"))


def projections(rows: List[Dict], results_dir: str) -> List[Dict]:
    """Offsets per head implied by each measured quality run's density at 32K, and that index's
    density on the ProLong mix at 128K (same offsets, same columns)."""
    by_kind = {(r["documents"], r["seq_len"]): r for r in rows}
    target = by_kind[("prolong_mix", 131072)]
    out = []
    for name, kind in QUALITY_RUNS:
        path = os.path.join(results_dir, name)
        if not os.path.exists(path):
            continue
        with open(path) as f:
            run = json.load(f)
        density = run["summary"]["mean_density"]
        columns = run["mtraining"]["settings"].get("min_vertical", 0)
        at = by_kind[(kind, run["summary"]["longest_context"])]
        offsets = (density - at["share_per_diagonal"] - columns * at["share_per_column"]) / at["share_per_offset"]
        out.append({"quality_run": name, "documents": kind, "measured_density": density, "min_vertical": columns,
                    "implied_offsets_per_head": offsets,
                    "projected_density_prolong_mix_128k": target["share_per_diagonal"]
                    + offsets * target["share_per_offset"] + columns * target["share_per_column"]})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--layouts", type=int, default=8, help="random layouts averaged for the packed quality run's kind")
    p.add_argument("--out", default=os.path.join(RESULTS_DIR, "analysis_document_costs.json"))
    args = p.parse_args(argv)
    rows = [analyse(seq_len, kind, args.block_size, args.layouts) for kind, seq_len in CASES]
    print(f"{'documents':12s} {'tokens':>7s} {'diagonal':>9s} {'offset':>8s} {'column':>9s} {'offsets<=0.10':>14s}")
    for r in rows:
        print(f"{r['documents']:12s} {r['seq_len']:7d} {r['share_per_diagonal']:9.4%} {r['share_per_offset']:8.4%} "
              f"{r['share_per_column']:9.5%} {r['offsets_within_10_percent']:14.1f}")
    projected = projections(rows, RESULTS_DIR)
    for r in projected:
        print(f"{r['quality_run']}: density {r['measured_density']:.3f} = ~{r['implied_offsets_per_head']:.1f} offsets "
              f"per head -> {r['projected_density_prolong_mix_128k']:.3f} on the ProLong mix at 128K")
    write_json(args.out, {"benchmark": "document_costs", "meta": run_metadata(torch.device("cpu")),
                          "config": vars(args) | {"offsets": OFFSETS, "columns": COLUMNS},
                          "rows": rows, "projections": projected})
    return 0


if __name__ == "__main__":
    sys.exit(main())
