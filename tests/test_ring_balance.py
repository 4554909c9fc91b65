"""benchmarks/ring_balance.py: the block-level pair counts agree with VSIndex.density, every
layout distributes the same work, and the script writes its JSON (CPU, small sizes)."""

import json
import os
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import ring_balance  # noqa: E402
from megatron_mtraining import VSIndex  # noqa: E402


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pair_counts_match_density_and_layouts_share_them(seed):
    n, B = 1024, 16
    index = VSIndex.random(1, 3, n, B, max_slash=6, max_vertical=40, generator=torch.Generator().manual_seed(seed))
    pairs = ring_balance.block_pairs(index, n)
    expected = float(index.density(n).double().sum()) * n * (n + 1) / 2
    assert float(pairs.sum()) == pytest.approx(expected, rel=1e-6)  # density is fp32
    for layout in ("striped", "zigzag"):
        work = ring_balance.step_work(pairs, n, layout, 4, B)
        assert float(work.sum()) == float(pairs.sum())
        b = ring_balance.balance(work)
        assert b["pipelined"] >= 1 and b["step_synchronous"] >= b["pipelined"] - 1e-12


def test_script_writes_rows(tmp_path):
    out = tmp_path / "rb.json"
    ring_balance.main(["--seq-lens", "2048", "--heads", "2", "--kv-heads", "1", "--localities", "1",
                       "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["index"] for r in rows] == ["fixed (ring.py)", "approximated, locality 1"]
    assert all(set(r["zigzag_over_striped"]) == set(ring_balance.MODELS) for r in rows)
