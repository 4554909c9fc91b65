"""benchmarks/document_costs.py: the per-offset and per-column shares of document-causal pairs,
against the reference mask (kernels.reference.vs_mask) counted pair by pair."""

import json
import os
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import document_costs  # noqa: E402

from megatron_mtraining import VSIndex  # noqa: E402
from megatron_mtraining.kernels.reference import vs_mask  # noqa: E402


@pytest.mark.parametrize("lengths", [[1024], [300, 64, 1, 659], [64] * 16, [1, 1, 1022]])
def test_shares_match_the_reference_mask(lengths):
    B, n = 64, sum(lengths)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    pos = torch.arange(n)
    doc = torch.searchsorted(cu.long(), pos, right=True) - 1
    pairs = sum(L * (L + 1) / 2 for L in lengths)

    def share(slash, vertical):
        index = VSIndex.from_lists([[slash]], [[vertical]], block_size=B)
        return vs_mask(index, pos, pos, n // B, cu).sum().item() / pairs

    got = document_costs.offset_and_column_shares(lengths, B)
    assert got["diagonal"] == pytest.approx(share([0], []))
    offsets = [share([d], []) for d in document_costs.OFFSETS]  # offsets beyond the sequence keep nothing
    assert got["offset"] == pytest.approx(sum(offsets) / len(offsets))
    columns = torch.linspace(0, n - 1, document_costs.COLUMNS).long()
    # A column adds the queries of its document in later blocks (its own block is the diagonal's).
    reach = (cu.long()[doc[columns] + 1] - (columns // B + 1) * B).clamp(min=0).double()
    assert got["column"] == pytest.approx(float(reach.mean()) / pairs)
    added = [share([0], [int(c)]) - share([0], []) for c in columns]
    assert got["column"] == pytest.approx(sum(added) / len(added))


@pytest.mark.parametrize("length, count", [(16384, 1), (4096, 4), (1024, 16)])
def test_an_offset_costs_about_two_over_the_blocks_of_a_document(length, count):
    """Block-aligned documents of Lb blocks: offset d keeps (Lb - d) B^2 pairs of each document's
    L (L + 1) / 2, the same share in each, so about 2 / Lb: four times dearer at a quarter length."""
    B = 64
    blocks = length // B
    want = [max(blocks - d, 0) * B * B / (length * (length + 1) / 2) for d in document_costs.OFFSETS]
    got = document_costs.offset_and_column_shares([length] * count, B)
    assert got["offset"] == pytest.approx(sum(want) / len(want))
    assert got["diagonal"] == pytest.approx(blocks * B * (B + 1) / 2 / (length * (length + 1) / 2))


def test_projection_inverts_the_linear_model(tmp_path):
    """A quality run whose density is diagonal + 10 offsets + its columns implies 10 offsets, and
    projects to the same index on the ProLong mix."""
    rows = [{"documents": "unpacked", "seq_len": 32768, "share_per_diagonal": 0.002, "share_per_offset": 0.004,
             "share_per_column": 3e-5},
            {"documents": "prolong_mix", "seq_len": 131072, "share_per_diagonal": 0.0021, "share_per_offset": 0.0040,
             "share_per_column": 7e-6}]
    density = 0.002 + 10 * 0.004 + 256 * 3e-5
    with open(tmp_path / "quality.json", "w") as f:
        json.dump({"summary": {"mean_density": density, "longest_context": 32768},
                   "mtraining": {"settings": {"min_vertical": 256}}}, f)
    (got,) = document_costs.projections(rows, str(tmp_path))  # quality_packed.json absent: skipped
    assert got["implied_offsets_per_head"] == pytest.approx(10)
    assert got["projected_density_prolong_mix_128k"] == pytest.approx(0.0021 + 10 * 0.004 + 256 * 7e-6)
