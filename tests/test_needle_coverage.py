"""benchmarks/needle_coverage.py: the steering reaches the asked attention share, and the
script's sweep runs and writes its JSON (tiny sizes, CPU)."""

import json
import math
import os
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import needle_coverage  # noqa: E402
from synthetic import synthetic_vs_qk  # noqa: E402


@pytest.mark.parametrize("share", [0.01, 0.3, 0.9])
def test_steer_gives_the_needle_its_share(share):
    n, d = 2048, 32
    q, k = synthetic_vs_qk(1, 1, 1, n, d, seed=3, locality=4)
    row = n - 7
    needle = needle_coverage.pick_needle(k[0, 0], row, torch.Generator().manual_seed(0))
    steered = needle_coverage.steer(q[0, 0, row], k[0, 0], row, needle, share, 1 / math.sqrt(d))
    probs = torch.softmax(steered.double() @ k[0, 0, :row + 1].double().T / math.sqrt(d), -1)
    assert probs[needle].item() == pytest.approx(share, rel=1e-3)


def test_sweep_writes_coverage_and_a_vertical_floor_never_loses_a_needle(tmp_path):
    out = tmp_path / "nc.json"
    needle_coverage.main(["--seq-lens", "2048", "--localities", "1,8", "--shares", "0.05,0.8", "--seeds", "1",
                          "--group", "2", "--head-dim", "32", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 4
    for r in rows:
        cov = r["coverage"]
        assert set(cov) == {*needle_coverage.VARIANTS, needle_coverage.RESIDUAL}
        assert all(0 <= x <= 1 for x in cov.values())
        # min_vertical only adds columns to the same top-p selection
        assert cov["top-p 0.9, last_q 128, min_vertical 256"] >= cov["top-p 0.9, last_q 128"]
        assert all(0 < x <= 1 for x in r["density"].values())
