"""benchmarks/make_tables.py: the quality table names each result's MTraining index settings and
its own plots (a variant run, e.g. --min-vertical 0, renders beside the default one), and the
needle coverage per layer at the longest probed length."""

import copy
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import make_tables  # noqa: E402


def test_quality_variant_renders_beside_the_default():
    path = os.path.join("benchmarks", "results", "quality.json")
    with open(os.path.join(REPO, path)) as f:
        default = json.load(f)
    variant = copy.deepcopy(default)
    variant["mtraining"]["settings"]["min_vertical"] = 0
    variant["summary"]["needle_coverage_per_layer"]["mtraining"]["32768"] = [0.5, 0.0, 0.25, 1.0]
    variant["summary"]["retrieval_accuracy_gap"] = 1.5
    text = make_tables.render_quality([(path, default), ("benchmarks/results/quality_minv.json", variant)])
    assert text.count("| held-out LM loss |") == 2
    assert "min_vertical 0" in text and "min_vertical 256" in text
    assert "`benchmarks/results/quality_minv_loss.png`" in text and "1.5 points" in text
    # The dense run's own index settings are named where they differ from the variant's.
    assert "the dense model under MTraining's index: top-p 0.9, last_q 128, min_vertical 0" in text
    coverage = [line for line in text.splitlines() if line.startswith("| needle coverage by the index at 32K")]
    assert len(coverage) == 2 and coverage[1].split("|")[3].strip() == "0.50 / 0.00 / 0.25 / 1.00"
