"""benchmarks/tile_waste.py: the tiles the 64-row forward computes, counted from the plans."""

import os
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import tile_waste  # noqa: E402

from megatron_mtraining import VSIndex  # noqa: E402
from megatron_mtraining.kernels import single_device_plan  # noqa: E402


@pytest.mark.parametrize("B", [64, 128])
def test_dense_index_computes_the_causal_block_triangle(B):
    n, heads = 1024, 2
    nb = n // B
    tiles = tile_waste.plan_tiles(single_device_plan(VSIndex.dense(1, heads, n, B), n), documents=False)
    assert tiles["slash_tiles"] == heads * nb * (nb + 1) // 2 * (B // 64) ** 2  # 64 x 64 tiles per block pair
    assert tiles["column_tiles"] == 0


def test_columns_fill_64_slots_per_tile():
    n = 512
    vertical = torch.tensor([[[0, 1, 2]]], dtype=torch.int32)  # three sink columns, live for every query block
    index = VSIndex(torch.zeros(1, 1, 1, dtype=torch.int32), torch.ones(1, 1, dtype=torch.int32), vertical,
                    torch.full((1, 1), 3, dtype=torch.int32), 64)
    tiles = tile_waste.plan_tiles(single_device_plan(index, n), documents=False)
    # Every query block reads one column tile of 3 of 64 slots; in the first the diagonal block
    # holds the three columns, and their column word masks them (a computed, inactive tile).
    assert tiles["column_tiles"] == n // 64
    assert abs(tiles["column_slots_used"] - 3 / 64) < 1e-9


def test_analysis_small():
    result = tile_waste.analyse(8192, heads=2)
    for name in ("packed", "unpacked", "unpacked_equal_work"):
        e = result[name]
        assert 0 < e["active_over_computed"] <= 1
        assert e["computed_pairs"] >= e["active_pairs"]
    assert result["items"] == 8192 // 64 * 2
