"""benchmarks/flagship.py without a GPU: the log parsing, the FLOP count, the runs it accepts, and the
planner's prediction of a launcher's own command (its DRY_RUN)."""

import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import flagship  # noqa: E402


def test_parse_log_reads_times_memory_density_and_losses():
    text = "\n".join([
        "[mtraining plan] nvidia-h200 x 2, 65536 tokens: this run ...",
        " [2026-12-05 10:00:00] iteration        1/       4 | consumed samples: 1 | elapsed time per iteration "
        "(ms): 9000.0 | lm loss: 1.200000E+01 |",
        "[Rank 0] (after 1 iterations) memory (MB) | allocated: 6000.0 | max allocated: 61440.0 | reserved: 64000.0 "
        "| max reserved: 65536.0",
        "[Rank 1] (after 1 iterations) memory (MB) | allocated: 6000.0 | max allocated: 62464.0 | reserved: 64000.0 "
        "| max reserved: 66560.0",
        " [2026-12-05 10:00:09] iteration        2/       4 | elapsed time per iteration (ms): 3000.0 | lm loss: "
        "1.100000E+01 |",
        " [2026-12-05 10:00:12] iteration        3/       4 | elapsed time per iteration (ms): 1000.0 | lm loss: "
        "1.000000E+01 |",
        "[MTraining] iteration 3 | density 0.031 | approximator 1.0 ms",
        " [2026-12-05 10:00:13] iteration        4/       4 | elapsed time per iteration (ms): 2000.0 | lm loss: "
        "9.500000E+00 |",
    ])
    r = flagship.parse_log(text, warmup_iters=2)
    assert r["iteration_ms"] == [9000.0, 3000.0, 1000.0, 2000.0]
    assert r["excluded_iterations"] == [1, 2, 3]  # warm-up, and the telemetry iteration
    assert r["mean_iteration_ms"] == 2000.0
    assert r["peak_allocated_gib"] == 61.0 and r["peak_reserved_gib"] == 65.0
    assert r["density"] == 0.031 and r["losses"] == {1: 12.0, 2: 11.0, 3: 10.0, 4: 9.5}
    assert r["planner_line"].startswith("[mtraining plan] nvidia-h200 x 2")


def test_parse_log_of_a_committed_run():
    log = open(os.path.join(REPO, "benchmarks", "results", "logs", "e2e_mtraining_nvidia-h200_4gpu.log")).read()
    r = flagship.parse_log(log)
    assert len(r["iteration_ms"]) == 6 and r["density"] == pytest.approx(0.029)
    assert sorted(r["memory_per_rank"]) == [0, 1, 2, 3]
    assert r["peak_allocated_gib"] == pytest.approx(62631.26 / 1024)


def test_executed_flops_count_recompute_and_active_pairs():
    argv = ["--num-layers", "2", "--hidden-size", "256", "--ffn-hidden-size", "512", "--num-attention-heads", "4",
            "--num-query-groups", "2", "--kv-channels", "64", "--vocab-size", "1000", "--seq-length", "1024"]
    dense = flagship.executed_flops(argv, 1.0)
    sparse = flagship.executed_flops(argv, 0.1)
    pairs = 1024 * 1025 / 2
    assert dense["model"] - sparse["model"] == pytest.approx(2 * 3.5 * 4 * 64 * 4 * pairs * 0.9)
    assert dense["executed"] == dense["model"]
    full = flagship.executed_flops(argv + ["--recompute-granularity", "full", "--recompute-method", "uniform"], 1.0)
    block = flagship.executed_flops(argv + ["--recompute-granularity", "full", "--recompute-method", "block",
                                            "--recompute-num-layers", "1"], 1.0)
    per_layer = (full["executed"] - full["model"]) / 2
    assert block["executed"] - block["model"] == pytest.approx(per_layer)
    assert per_layer == pytest.approx(4 * 64 * 4 * pairs + flagship.shape_of(argv).layer_gemm_flops_per_token()
                                      * 1024 / 3)


def test_runs_are_mtraining_or_te_cp_with_their_own_flags():
    assert flagship.parse_runs(["mtraining", "te_cp+--recompute-method block --recompute-num-layers 4"]) == [
        ("mtraining", []),
        ("te_cp+--recompute-method block --recompute-num-layers 4", ["--recompute-method", "block",
                                                                    "--recompute-num-layers", "4"])]
    with pytest.raises(SystemExit, match="a run is mtraining or te_cp"):
        flagship.parse_runs(["dense"])


def test_the_planner_predicts_a_launchers_own_command(tmp_path):
    tree = tmp_path / "megatron_lm"
    (tree / "megatron" / "training").mkdir(parents=True)
    (tree / "pretrain_gpt.py").write_text("")
    env = dict(os.environ, MEGATRON_LM=str(tree), GPUS_PER_NODE="4", SEQ_LENGTH="262144", TRAIN_ITERS="4", TP="1",
               MTRAINING="1", TRANSFORMER_IMPL="transformer_engine", PYTHON=sys.executable)
    argv = flagship.megatron_argv("pretrain_qwen2.5_3b_512k_mtraining.sh", env, [])
    assert "--mtraining" in argv and argv[argv.index("--context-parallel-size") + 1] == "4"
    p = flagship.predict(argv, "nvidia-h200", 4, 0.03)
    assert p["fits"] and p["tokens_per_s"] > 0 and 50 < p["peak_gib"] < 140
    assert p["recommended"]["configuration"].startswith("mtraining")
    baseline = flagship.predict(flagship.megatron_argv("pretrain_qwen2.5_3b_512k_mtraining.sh",
                                                       {**env, "MTRAINING": "0"}, []), "nvidia-h200", 4, None)
    assert baseline["tokens_per_s"] < p["tokens_per_s"] / 3


def _fake_launch(monkeypatch, seen, save_iterations=()):
    """subprocess.run standing in for a launcher run: it writes a checkpoint where CHECKPOINT_PATH points
    (as Megatron does at the end of training) and logs two iterations."""
    import subprocess

    def fake_run(cmd, env=None, **kwargs):
        if env is None:  # scripts/compare_checkpoints.py
            return subprocess.CompletedProcess(cmd, 0, "equal", "")
        path = env["CHECKPOINT_PATH"]
        for it in save_iterations or (4,):
            os.makedirs(os.path.join(path, f"iter_{it:07d}"), exist_ok=True)
            with open(os.path.join(path, f"iter_{it:07d}", "__0_0.distcp"), "wb") as fh:
                fh.write(b"x" * 1024)
        seen.append(path)
        log = "".join(f" iteration {i:8d}/{4:8d} | elapsed time per iteration (ms): 1000.0 | lm loss: 1.0E+01 |\n"
                      for i in range(1, 5))
        return subprocess.CompletedProcess(cmd, 0, log, "")

    monkeypatch.setattr(flagship.subprocess, "run", fake_run)
    monkeypatch.setattr(flagship, "megatron_argv", lambda launcher, env, extra: [
        "--seq-length", "1024", "--global-batch-size", "1", "--num-layers", "2", "--hidden-size", "256",
        "--ffn-hidden-size", "512", "--num-attention-heads", "4", "--num-query-groups", "2", "--kv-channels", "64",
        "--vocab-size", "1000"])


def test_a_run_leaves_no_checkpoint_behind(tmp_path, monkeypatch):
    """Megatron saves at the end of training whatever --save-interval says, and the launchers pass --save:
    every benchmark run writes a full checkpoint (tens of GB at these sizes), which must not pile up."""
    import argparse

    seen = []
    _fake_launch(monkeypatch, seen)
    args = argparse.Namespace(model="qwen2.5_3b", megatron_lm=str(tmp_path), seq_length=1024, train_iters=4, tp=1,
                              global_batch_size=None, telemetry_interval=5, profile_iteration=0, timeout=60,
                              warmup_iters=2, device_name="NVIDIA H200")
    row = flagship.run_one("mtraining", [], args, 4, str(tmp_path), None)
    assert row["returncode"] == 0 and row["tokens_per_s"] == pytest.approx(1024 / 1.0)
    assert len(seen) == 1 and not os.path.exists(seen[0])


def test_resume_check_cleans_up_its_checkpoints(tmp_path, monkeypatch):
    import argparse

    seen = []
    _fake_launch(monkeypatch, seen, save_iterations=(2, 4))
    args = argparse.Namespace(model="qwen2.5_3b", megatron_lm=str(tmp_path), seq_length=1024, train_iters=4, tp=1,
                              global_batch_size=None, timeout=60)
    result = flagship.resume_check(args, 4, str(tmp_path))
    assert result["losses_equal"] and len(seen) == 2
    assert not any(os.path.exists(path) for path in seen)
    with pytest.raises(SystemExit, match="train-iters >= 2"):
        flagship.resume_check(argparse.Namespace(**{**vars(args), "train_iters": 1}), 4, str(tmp_path))
