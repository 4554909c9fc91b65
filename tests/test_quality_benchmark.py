"""benchmarks/quality.py end to end at toy scale on the CPU: both trainings, the merge, and the
summary keys the issue asks for (the real run is on GPUs, see scripts/gpu_quality.sh)."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOY = ["--phases", "256:3,512:1", "--tokens-per-iteration", "512", "--num-layers", "1", "--hidden-size", "64",
       "--num-attention-heads", "2", "--num-query-groups", "1", "--vocab-size", "128", "--eval-lengths", "512",
       "--eval-depths", "0.1,0.9", "--eval-probes", "1", "--held-out", "1", "--last-q", "64", "--warmup", "1",
       "--log-interval", "2"]


def run(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "quality.py"), *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def test_quality_pipeline_at_toy_scale(tmp_path):
    dense, sparse, merged = (str(tmp_path / name) for name in ("d.json", "m.json", "quality.json"))
    run("--run", "dense", "--out", dense, *TOY)
    run("--run", "mtraining", "--out", sparse, *TOY)
    out = run("--merge", dense, sparse, "--out", merged)
    assert "final_loss_gap" in out
    with open(merged) as f:
        result = json.load(f)
    s = result["summary"]
    for key in ("final_loss_gap", "retrieval_accuracy_gap", "mean_density", "dense_retrieval_accuracy",
                "retrieval_chance"):
        assert isinstance(s[key], float), key
    assert s["longest_context"] == 512 and 0 < s["mean_density"] <= 1
    d, m = result["dense"], result["mtraining"]
    # Same seed and data: the first training losses are identical (same weights, dense vs sparse
    # attention differ only once the index is sparse, which 256 tokens with these budgets are not).
    assert d["loss_curve"][0]["loss"] == pytest.approx(m["loss_curve"][0]["loss"], rel=1e-4)
    assert [r["iteration"] for r in d["loss_curve"]] == [1, 2, 4]
    assert all(x == 1.0 for r in d["density_log"] for x in r["density_per_layer"])  # dense index
    grid = m["retrieval_sparse_inference"]
    assert grid["lengths"] == [512] and grid["depths"] == [0.1, 0.9] and len(grid["accuracy"][0]) == 2
    # Both models are also read under MTraining's index, with the needle coverage of each layer.
    assert isinstance(s["dense_retrieval_accuracy_sparse_inference"], float)
    for run_name in ("dense", "mtraining"):
        per_layer = s["needle_coverage_per_layer"][run_name]["512"]
        assert len(per_layer) == 1 and all(0.0 <= x <= 1.0 for x in per_layer)
    with pytest.raises(AssertionError):
        run("--merge", sparse, dense, "--out", merged)  # order is checked


@pytest.mark.parametrize("argv, message", [
    ([], "exactly one of --run and --merge"),
    (["--run", "dense", "--phases", "4096"], "SEQ_LEN:ITERATIONS"),
    (["--run", "dense", "--phases", "4096:0"], "must be positive"),
    (["--run", "dense", "--answer-loss-weight", "0"], "--answer-loss-weight must be positive"),
])
def test_bad_command_lines_fail_with_a_message(argv, message):
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "quality.py"), *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr


def test_answer_mask_and_weighted_training_loss():
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import torch

    import quality
    from corpus import make_batch

    args = quality.parse_args(["--run", "dense", "--vocab-size", "128"])
    cfg = quality.corpus_config(args, 256)
    tokens, _, target_mask = make_batch(cfg, [0, 1])
    answers = quality.answer_label_mask(cfg, torch.device("cpu"))
    # Column p of the per-token loss predicts tokens[:, p + 1]: the mask is target_mask shifted by one.
    assert answers.shape == (256,) and torch.equal(answers, target_mask[0, 1:]) and torch.equal(answers, target_mask[1, 1:])
    assert int(answers.sum()) == cfg.num_queries * cfg.value_len
    per_token = torch.rand(2, 256)
    assert quality.training_loss(per_token, answers, 1.0) == per_token.mean()
    w = 1 + 9 * answers.float()
    expected = (per_token * w).sum() / (2 * w.sum())
    torch.testing.assert_close(quality.training_loss(per_token, answers, 10.0), expected)


def test_default_recipe_builds_every_phase_and_eval_length():
    """The GPU defaults (scripts/gpu_quality.sh uses the same flags): each phase's and each
    evaluation length's corpus is valid and generates (a configuration that uses up the key space
    once made generation loop forever on the GPU)."""
    import time

    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import quality

    from corpus import make_needle_probe, make_sequence

    args = quality.parse_args(["--run", "dense"])
    lengths = [s for s, _ in quality.phases(args.phases)] + [int(x) for x in args.eval_lengths.split(",")]
    start = time.time()
    for seq_len in lengths:
        cfg = quality.corpus_config(args, seq_len)
        assert make_sequence(cfg, 0).tokens.numel() == seq_len + 1
        make_needle_probe(cfg, 0, 0.5)
    assert time.time() - start < 30
    # The script's flags are the defaults (plus its wall-clock guard).
    import re
    script = open(os.path.join(REPO, "scripts", "gpu_quality.sh")).read()
    flags = re.search(r"FLAGS=\$\{QUALITY_FLAGS:-(.*)\}", script).group(1).split()
    from_script = vars(quality.parse_args(["--run", "dense"] + flags))
    assert {k: v for k, v in from_script.items() if k != "max_train_seconds"} == \
        {k: v for k, v in vars(args).items() if k != "max_train_seconds"}


@pytest.mark.parametrize("needle_format", ["fact", "pair"])
def test_needle_column_holds_the_answer(needle_format):
    """needle_column (where the needle coverage looks) points at the probe's fact token, or at the
    first value token of a pair needle: the token that the answer is copied from."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import quality

    from corpus import make_needle_probe

    args = quality.parse_args(["--run", "dense", "--needle-format", needle_format, "--key-len", "1",
                               "--value-len", "1"])
    cfg = quality.corpus_config(args, 1024)
    for depth in (0.0, 0.4, 0.95):
        probe = make_needle_probe(cfg, 5, depth)
        column = quality.needle_column(cfg, probe.tokens)
        answer = int(probe.tokens[probe.target_positions[0]])
        held = int(probe.tokens[column])
        if needle_format == "pair":
            assert held == answer
        else:  # the fact token of (key, answer): facts follow the keys and values, key-major
            a = cfg.fact_alphabet
            assert (held - cfg.symbol_start - 2 * a) % a == answer - cfg.symbol_start - a
        assert abs(column / cfg.seq_len - depth) < 0.01
