"""scripts/check_te_equivalence.py's verdicts, on CPU (the runs themselves need GPUs and TE):
the per-iteration differences and the FP8 study's bound relative to its control pair."""

import importlib.util
import os

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts",
                      "check_te_equivalence.py")


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location("check_te_equivalence", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(losses, norms=None):
    norms = norms or [1.0] * len(losses)
    return {"iterations": {i + 1: (loss, norm) for i, (loss, norm) in enumerate(zip(losses, norms))}}


def test_differences_are_relative_per_common_iteration(check):
    d = check.differences(run([10.0, 8.0, 6.0], [2.0, 2.0, 2.0]), run([10.0, 8.08, 6.0, 5.0], [2.0, 1.0, 2.0, 2.0]))
    assert d["iterations"] == [1, 2, 3]
    assert d["loss_rel"] == pytest.approx([0.0, 0.08 / 8.08, 0.0])
    assert d["max_grad_norm_rel"] == pytest.approx(1.0)


def test_fp8_verdict_follows_the_control_drift(check):
    control = {"loss_rel": [1e-3, 5e-3, 1e-2, 4e-3]}
    inside = check.fp8_verdict({"loss_rel": [1e-3, 7e-3, 1.4e-2, 1e-2]}, control, loss_rtol=2e-3, factor=1.5)
    assert inside["inside"] and inside["worst_share_of_bound"] == pytest.approx(7e-3 / 7.5e-3)
    # A drift that outgrows 1.5x the control's at any point fails, even when it later shrinks.
    outside = check.fp8_verdict({"loss_rel": [1e-3, 2e-2, 1e-3, 1e-3]}, control, loss_rtol=2e-3, factor=1.5)
    assert not outside["inside"] and outside["worst_share_of_bound"] > 1
    # The floor: a control that tracks to the last bit does not make every drift a failure.
    still = check.fp8_verdict({"loss_rel": [1e-3, 1.5e-3]}, {"loss_rel": [0.0, 0.0]}, loss_rtol=2e-3, factor=1.5)
    assert still["inside"]


def test_fp8_verdict_fails_on_missing_iterations(check):
    verdict = check.fp8_verdict({"loss_rel": [1e-3]}, {"loss_rel": [1e-3, 1e-3]}, loss_rtol=2e-3, factor=1.5)
    assert not verdict["inside"]
    assert not check.fp8_verdict({"loss_rel": []}, {"loss_rel": []}, loss_rtol=2e-3, factor=1.5)["inside"]


def test_every_study_names_known_runs_and_one_control(check):
    for study, pairs in check.STUDIES.items():
        assert [role for _, _, role in pairs].count("control") == 1, study
        for name, reference, _ in pairs:
            assert name in check.RUNS and reference in check.RUNS
    assert all(flag in check.RUNS["mtraining_te_vs_fp8"] for flag in check.FP8)
    assert not any(flag in check.RUNS["mtraining_te_vs"] for flag in check.FP8)
