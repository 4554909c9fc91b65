"""benchmarks/timeline.py: busy and idle time of a kernel timeline, and its split into calls."""

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import timeline  # noqa: E402


def test_overlapping_kernels_count_once_and_gaps_are_named():
    spans = [(0, 10, "a"), (5, 20, "b"), (30, 40, "c"), (41, 50, "d")]
    got = timeline.analyse_call(spans)
    assert got["span_ms"] == 50 / 1e3
    assert got["busy_ms"] == (20 + 10 + 9) / 1e3
    assert abs(got["idle_ms"] - 11 / 1e3) < 1e-12
    assert got["largest_gaps_us"][0] == (10, "b", "c")  # after b (the latest end), before c
    assert got["largest_gaps_us"][1] == (1, "c", "d")


def test_stretches_are_cut_at_long_gaps():
    spans = [(0, 10, "a"), (12, 20, "b"), (100, 110, "c"), (105, 200, "d"), (260, 270, "e")]
    runs = timeline.split_at_gaps(spans, 50)
    assert [[s[2] for s in r] for r in runs] == [["a", "b"], ["c", "d"], ["e"]]
