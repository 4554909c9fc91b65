"""benchmarks/quality.py end to end at toy scale on the CPU: the four trainings (dense,
MTraining's vertical-slash index, MoBA and XAttention), the merge of two to four of them, and the
summary keys the issue asks for (the real run is on GPUs, see scripts/gpu_quality.sh)."""

import json
import math
import os
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
TOY = ["--phases", "256:3,512:1", "--tokens-per-iteration", "512", "--num-layers", "1", "--hidden-size", "64",
       "--num-attention-heads", "2", "--num-query-groups", "1", "--vocab-size", "128", "--eval-lengths", "512",
       "--eval-depths", "0.1,0.9", "--eval-probes", "1", "--held-out", "1", "--last-q", "64", "--warmup", "1",
       "--log-interval", "2"]
# The block-sparse runs' flags: MoBA blocks of 2 index blocks, top-2 (dense at 256 tokens, sparse at
# 512); XAttention at half of each query block's score mass (sparse at both lengths).
RUN_FLAGS = {"dense": [], "mtraining": [], "moba": ["--moba-block-size", "128", "--moba-top-k", "2"],
             "xattn": ["--xattn-stride", "8", "--xattn-threshold", "0.5"]}

# Runs quality.py with a spy on the indexer of every attention layer (approximate_index as the
# indexer calls it): [index kind of its config, tokens, index type] per call, written to SPY_OUT.
SPY = """
import json, os, runpy, sys
sys.argv = [sys.argv[1]] + sys.argv[2:]
from megatron_mtraining.integration import indexer
seen, real = [], indexer.approximate_index
def spy(q, k, config, **kwargs):
    index = real(q, k, config, **kwargs)
    seen.append([config.index, q.shape[2], type(index).__name__])
    return index
indexer.approximate_index = spy
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    json.dump(seen, open(os.environ["SPY_OUT"], "w"))
"""


def run_process(*args, spy_out=None):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    script = os.path.join(REPO, "benchmarks", "quality.py")
    command = [sys.executable, script, *args]
    if spy_out is not None:
        env["SPY_OUT"] = spy_out
        command = [sys.executable, "-c", SPY, script, *args]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def run(*args, spy_out=None):
    proc = run_process(*args, spy_out=spy_out)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


@pytest.fixture(scope="module")
def toy_runs(tmp_path_factory):
    """{run: (result path, spy records)}: the four toy trainings, once for the module (~5 s each)."""
    folder = tmp_path_factory.mktemp("quality")
    runs = {}
    for name, flags in RUN_FLAGS.items():
        out, spy = str(folder / f"{name}.json"), str(folder / f"{name}_spy.json")
        run("--run", name, "--out", out, *TOY, *flags, spy_out=spy)
        with open(spy) as f:
            runs[name] = (out, json.load(f))
    return runs


def load(path):
    with open(path) as f:
        return json.load(f)


def test_quality_pipeline_at_toy_scale(toy_runs, tmp_path):
    (dense, _), (sparse, _) = toy_runs["dense"], toy_runs["mtraining"]
    merged = str(tmp_path / "quality.json")
    out = run("--merge", dense, sparse, "--out", merged)
    assert "final_loss_gap" in out
    result = load(merged)
    s = result["summary"]
    for key in ("final_loss_gap", "retrieval_accuracy_gap", "mean_density", "dense_retrieval_accuracy",
                "retrieval_chance"):
        assert isinstance(s[key], float), key
    assert s["longest_context"] == 512 and 0 < s["mean_density"] <= 1
    # The two-run layout: nothing of the block-sparse runs.
    assert set(result) == {"benchmark", "summary", "dense", "mtraining"}
    assert "runs" not in s and not [key for key in s if key.startswith(("moba", "xattn"))]
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
    assert d["sparse_inference_index"] == m["sparse_inference_index"] == "vs"
    for run_name in ("dense", "mtraining"):
        per_layer = s["needle_coverage_per_layer"][run_name]["512"]
        assert len(per_layer) == 1 and all(0.0 <= x <= 1.0 for x in per_layer)
    with pytest.raises(AssertionError):
        run("--merge", sparse, dense, "--out", merged)  # order is checked


def indexer_calls(kinds):
    """The spy's index kinds with consecutive repeats counted: [[kind, calls], ...]."""
    out = []
    for kind in kinds:
        if out and out[-1][0] == kind:
            out[-1][1] += 1
        else:
            out.append([kind, 1])
    return out


@pytest.mark.parametrize("name", ["moba", "xattn"])
def test_block_sparse_run_trains_and_evaluates_with_its_own_index(toy_runs, name):
    """Training (4 iterations, one layer) builds the run's own BlockIndex at every forward; the
    evaluation reads the model with dense attention (the held-out sequence, its loss by position and
    2 probes), then with its own index again, not MTraining's."""
    path, seen = toy_runs[name]
    result = load(path)
    assert result["run"] == name and result["sparse_inference_index"] == name
    assert indexer_calls(kind for kind, _, _ in seen) == [[name, 4], ["dense", 4], [name, 3]]
    assert [(n, kind) for index, n, kind in seen if index == name] == \
        [(256, "BlockIndex")] * 3 + [(512, "BlockIndex")] * 4
    # The dense run's sparse evaluation is MTraining's index.
    assert indexer_calls(kind for kind, _, _ in toy_runs["dense"][1]) == [["dense", 8], ["vs", 2]]
    densities = {r["seq_len"]: r["density_per_layer"][0] for r in result["density_log"]}
    if name == "moba":
        from common import moba_density

        # Whatever the gate picks, top-2 of 2 MoBA blocks is dense, of 4 it keeps a fixed share.
        assert densities[256] == pytest.approx(1.0)
        assert densities[512] == pytest.approx(moba_density(512, 64, 128, 2)) and densities[512] < 0.7
        dense = load(toy_runs["dense"][0])
        assert result["loss_curve"][0]["loss"] == pytest.approx(dense["loss_curve"][0]["loss"], rel=1e-4)
    else:
        assert all(0.0 < d < 1.0 for d in densities.values())
        assert result["settings"]["xattn_threshold"] == 0.5 and result["settings"]["xattn_stride"] == 8
    sparse_loss = result["held_out_loss_by_length_sparse_inference"]["512"]
    assert math.isfinite(sparse_loss) and sparse_loss != result["held_out_loss_by_length"]["512"]
    per_layer = result["retrieval_sparse_inference"]["needle_coverage_per_layer"]["512"]
    assert len(per_layer) == 1 and all(0.0 <= x <= 1.0 for x in per_layer)


def test_merge_of_every_run(toy_runs, tmp_path):
    """dense, mtraining, moba and xattn merge into one result: MTraining's keys as in the two-run
    merge, each block-sparse run's held-out loss, retrieval and densities under its own name."""
    paths = {name: path for name, (path, _) in toy_runs.items()}
    two, four = str(tmp_path / "two.json"), str(tmp_path / "four.json")
    run("--merge", paths["dense"], paths["mtraining"], "--out", two)
    out = run("--merge", paths["dense"], paths["mtraining"], paths["moba"], paths["xattn"], "--out", four)
    assert "moba_held_out_loss" in out and "xattn_mean_density" in out
    result, s = load(four), load(four)["summary"]
    assert set(result) == {"benchmark", "summary", "dense", "mtraining", "moba", "xattn"}
    assert s["runs"] == ["dense", "mtraining", "moba", "xattn"]
    legacy = load(two)["summary"]
    for key, value in legacy.items():  # the two-run keys keep their values; the per-run ones gain runs
        assert (s[key] == value if not isinstance(value, dict) or key == "targets"
                else {run: s[key][run] for run in value} == value), key
    for name in ("moba", "xattn"):
        run_result = load(paths[name])
        assert result[name] == run_result
        assert s[f"{name}_held_out_loss"] == run_result["held_out_loss_by_length"]["512"]
        assert s[f"{name}_held_out_answer_loss"] == run_result["held_out_answer_loss_by_length"]["512"]
        assert s[f"{name}_retrieval_accuracy"] == run_result["retrieval_dense_inference"]["mean"]
        assert s[f"{name}_retrieval_accuracy_sparse_inference"] == run_result["retrieval_sparse_inference"]["mean"]
        final = [r for r in run_result["density_log"] if r["seq_len"] == 512][-1]["density_per_layer"]
        assert s[f"{name}_density_per_layer"] == final and s[f"{name}_mean_density"] == pytest.approx(final[0])
        # The JSON keeps 6 significant digits of every float.
        assert s[f"{name}_final_loss_gap"] == pytest.approx(
            (s[f"{name}_held_out_loss"] - s["dense_held_out_loss"]) / s["dense_held_out_loss"], abs=1e-6)
        assert s[f"{name}_retrieval_accuracy_gap"] == pytest.approx(
            100 * (s["dense_retrieval_accuracy"] - s[f"{name}_retrieval_accuracy"]), abs=1e-4)
    from common import moba_density

    assert s["moba_mean_density"] == pytest.approx(moba_density(512, 64, 128, 2))
    assert 0 < s["xattn_mean_density"] < 1
    for key in ("train_seconds", "stopped_at_iteration", "needle_coverage_per_layer"):
        assert set(s[key]) == {"dense", "mtraining", "moba", "xattn"}, key

    # Three runs without MTraining, the sparse ones in any order: no MTraining keys; --out required.
    three = str(tmp_path / "three.json")
    run("--merge", paths["dense"], paths["xattn"], paths["moba"], "--out", three)
    s3 = load(three)["summary"]
    assert s3["runs"] == ["dense", "moba", "xattn"]
    assert "final_loss_gap" not in s3 and "mtraining_held_out_loss" not in s3 and "mean_density" not in s3
    assert s3["moba_held_out_loss"] == s["moba_held_out_loss"] and s3["xattn_mean_density"] == s["xattn_mean_density"]
    proc = run_process("--merge", paths["dense"], paths["moba"])
    assert proc.returncode != 0 and "needs --out" in proc.stderr
    proc = run_process("--merge", paths["dense"], paths["moba"], paths["moba"], "--out", three)
    assert proc.returncode != 0 and "each once" in proc.stderr
    other = dict(load(paths["moba"]))
    other["settings"] = dict(other["settings"], phases="256:3,512:2")
    with open(tmp_path / "other.json", "w") as f:
        json.dump(other, f)
    proc = run_process("--merge", paths["dense"], str(tmp_path / "other.json"), "--out", three)
    assert proc.returncode != 0 and "--phases differ" in proc.stderr


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


@pytest.mark.parametrize("argv, message", [
    (["--merge", "dense.json"], "--merge takes 2 to 4 results"),
    (["--merge"] + ["r.json"] * 5, "--merge takes 2 to 4 results"),
    (["--run", "mtraining", "--phases", "96:1"], "--block-size 64 must divide every --phases and --eval-lengths"),
    (["--run", "dense", "--eval-lengths", "4096,5000"], "it does not divide 5000"),
    (["--run", "moba", "--moba-block-size", "96"], "--moba-block-size must be a positive multiple of --block-size"),
    (["--run", "moba", "--moba-top-k", "0"], "--moba-top-k must be >= 1"),
    # 384 tokens are one and a half MoBA blocks of 256 (128, shorter than one block, is fine).
    (["--run", "moba", "--moba-block-size", "256", "--phases", "128:1,384:1", "--eval-lengths", "384"],
     "--moba-block-size 256 must divide every --phases and --eval-lengths length longer than one MoBA block; "
     "it does not divide 384"),
    (["--run", "xattn", "--xattn-block-size", "32"], "--xattn-block-size must be one of (64, 128)"),
    (["--run", "xattn", "--xattn-block-size", "128", "--phases", "192:1", "--eval-lengths", "192"],
     "--xattn-block-size 128 must divide every --phases and --eval-lengths length; it does not divide 192"),
    (["--run", "xattn", "--xattn-stride", "3"], "--xattn-stride must be a power of two dividing --xattn-block-size"),
    (["--run", "xattn", "--xattn-stride", "128"], "--xattn-stride must be a power of two dividing"),
    (["--run", "xattn", "--xattn-threshold", "0"], "--xattn-threshold must be in (0, 1]"),
])
def test_bad_block_sparse_flags_fail_at_parsing(argv, message, capsys):
    import quality

    with pytest.raises(SystemExit) as exit_info:
        quality.parse_args(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_block_sparse_flags_reach_the_config():
    """Each run's MTrainingConfig: its own index and flags; the other runs keep the config's
    defaults (so an xattn flag cannot fail the moba run)."""
    import quality
    from megatron_mtraining import MTrainingConfig

    flags = ["--moba-block-size", "128", "--moba-top-k", "3", "--xattn-block-size", "128", "--xattn-stride", "32",
             "--xattn-threshold", "0.7", "--phases", "256:1,1024:1", "--eval-lengths", "1024"]
    defaults = MTrainingConfig()
    configs = {run: quality.mtraining_config(quality.parse_args(["--run", run] + flags), run)
               for run in quality.RUNS}
    assert {run: c.index for run, c in configs.items()} == {"dense": "dense", "mtraining": "vs", "moba": "moba",
                                                           "xattn": "xattn"}
    moba, xattn = configs["moba"], configs["xattn"]
    assert (moba.block_size, moba.moba_block_size, moba.moba_top_k) == (64, 128, 3)
    assert (xattn.block_size, xattn.xattn_stride, xattn.xattn_threshold) == (128, 32, 0.7)
    assert (moba.xattn_stride, xattn.moba_top_k, configs["mtraining"].block_size) == (defaults.xattn_stride,
                                                                                       defaults.moba_top_k, 64)
    args = quality.parse_args(["--run", "moba"])
    assert (args.moba_block_size, args.moba_top_k, args.xattn_block_size, args.xattn_stride, args.xattn_threshold) \
        == (defaults.moba_block_size, defaults.moba_top_k, defaults.block_size, defaults.xattn_stride,
            defaults.xattn_threshold)


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


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_the_gpu_script_block_pattern_flags_fit_its_schedules(packed):
    """PATTERNS=1 in scripts/gpu_quality.sh: its MoBA and XAttention flags pass quality.py's checks on
    the default schedules (block sizes that divide every phase and evaluation length) and make MoBA
    sparse at the longest phase; XAttention is left out of the packed runs, which it refuses."""
    import re

    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import quality

    script = open(os.path.join(REPO, "scripts", "gpu_quality.sh")).read()
    flags = re.search(r"BLOCK_PATTERN_FLAGS=\$\{BLOCK_PATTERN_FLAGS:-(.*)\}", script).group(1).split()
    base = ["--packed"] if packed else []
    runs = ("moba",) if packed else ("moba", "xattn")
    for run in runs:
        args = quality.parse_args(["--run", run] + base + flags)
        longest = max(s for s, _ in quality.phases(args.phases))
        assert args.moba_top_k * args.moba_block_size < longest
    assert ('RUNS=${RUNS:-dense mtraining moba}' in script) and ('RUNS=${RUNS:-dense mtraining moba xattn}' in script)
    if packed:
        with pytest.raises(SystemExit):
            quality.parse_args(["--run", "xattn"] + base + flags)


def test_context_extension_from_one_dense_base(tmp_path):
    """The paper's protocol in miniature: a dense base at 128 tokens, extended 8x to 1024 tokens from
    that same base with dense attention and with MTraining on the same tokens; the merge names the
    base and compares loss by position. A run from another base, or of another shape, is refused."""
    small = [f for f in TOY]
    phases_at = small.index("--phases") + 1
    base, other = str(tmp_path / "base.pt"), str(tmp_path / "other.pt")
    run("--run", "dense", "--out", str(tmp_path / "base.json"), "--save-model", base,
        *(small[:phases_at] + ["128:3"] + small[phases_at + 1:]), "--eval-lengths", "128")
    extended = small[:phases_at] + ["1024:1"] + small[phases_at + 1:] + ["--eval-lengths", "1024"]
    for name in ("dense", "mtraining"):
        run("--run", name, "--out", str(tmp_path / f"{name}.json"), "--init-from", base, *extended)
    run("--run", "dense", "--out", str(tmp_path / "fresh.json"), *extended)
    fresh = load(str(tmp_path / "fresh.json"))["loss_curve"][0]["loss"]  # the seed's weights at 1024 tokens
    dense, mt = load(str(tmp_path / "dense.json")), load(str(tmp_path / "mtraining.json"))
    for result in (dense, mt):
        assert result["extended_from"]["path"] == base and result["extended_from"]["phases"] == "128:3"
        assert result["trained_length"] == 1024
        spans = result["held_out_loss_by_position"]
        assert [(b["start"], b["end"]) for b in spans] == [(128 * i, 128 * (i + 1)) for i in range(8)]
        assert all(math.isfinite(b["loss"]) for b in spans)
    assert abs(dense["loss_curve"][0]["loss"] - fresh) > 1e-3  # the base's weights, not the seed's
    assert load(str(tmp_path / "fresh.json"))["extended_from"] is None
    merged = str(tmp_path / "merged.json")
    run("--merge", str(tmp_path / "dense.json"), str(tmp_path / "mtraining.json"), "--out", merged)
    summary = load(merged)["summary"]
    assert summary["extended_from"]["path"] == base and set(summary["held_out_loss_by_position"]) == {"dense", "mtraining"}
    assert "final_loss_gap" in summary and summary["longest_context"] == 1024
    run("--run", "dense", "--out", str(tmp_path / "other.json"), "--save-model", other,
        *(small[:phases_at] + ["128:1"] + small[phases_at + 1:]), "--eval-lengths", "128")
    run("--run", "mtraining", "--out", str(tmp_path / "mt_other.json"), "--init-from", other, *extended)
    proc = run_process("--merge", str(tmp_path / "dense.json"), str(tmp_path / "mt_other.json"), "--out", merged)
    assert proc.returncode != 0 and "start from different weights" in proc.stderr
    proc = run_process("--run", "dense", "--init-from", base, *extended, "--hidden-size", "128")
    assert proc.returncode != 0 and "--hidden-size 128 (the base: 64)" in proc.stderr


def test_the_gpu_script_extension_flags_parse_and_extend_16x():
    """EXTEND=1 in scripts/gpu_quality.sh: the base and the extension phases pass quality.py's
    parsing with the recipe's flags, and the extension is 16x the base's longest length."""
    import re

    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import quality

    script = open(os.path.join(REPO, "scripts", "gpu_quality.sh")).read()
    flags = re.search(r"FLAGS=\$\{QUALITY_FLAGS:-(.*)\}", script).group(1).split()
    base = re.search(r"BASE_PHASES=\$\{BASE_PHASES:-(.*)\}", script).group(1)
    extend = re.search(r"EXTEND_PHASES=\$\{EXTEND_PHASES:-(.*)\}", script).group(1)
    extra = re.search(r'EXTEND_FLAGS="(.*)"', script).group(1).split()
    base_args = quality.parse_args(["--run", "dense"] + flags + ["--phases", base, "--save-model", "b.pt"])
    ext_args = quality.parse_args(["--run", "mtraining"] + flags + ["--phases", extend] + extra + ["--init-from", "b.pt"])
    longest_base = max(s for s, _ in quality.phases(base_args.phases))
    longest_ext = max(s for s, _ in quality.phases(ext_args.phases))
    assert longest_ext == 16 * longest_base
    assert max(int(x) for x in ext_args.eval_lengths.split(",")) == longest_ext
