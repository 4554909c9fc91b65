"""The ring at small work per GPU, on the CPU: benchmarks/ring.py's weak-scaling mode and per-step
timeline (smoke run, gloo), make_tables.py's weak-scaling figures, and scripts/gpu_ring_scaling.sh
(its dry run, and its shell logic end to end on CPU ranks). The ring's results against the
single-device reference are tests/test_ring.py's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import make_tables  # noqa: E402


# ----------------------------------------------------------------------------- make_tables


def _ring_file(commit, world, times, active=None):
    """A ring result: {seq_len: sparse striped fwd+bwd ms}; ``active``: {seq_len: active pairs}."""
    runs = [{"seq_len": n, "world_size": world, "tokens_per_rank": n // world,
             "index": {"active_pairs": (active or {}).get(n)},
             "variants": {"sparse_striped": {"fwdbwd_ms": ms}}} for n, ms in times.items()]
    return {"meta": {"device": "GPU", "commit": commit}, "config": {}, "runs": runs}


def test_weak_scaling_divides_out_the_causal_work():
    T, K = 32768, 1024
    results = [("r/1gpu.json", _ring_file("aaaaaaa", 1, {T: 100.0, 512 * K: 600.0},
                                          active={T: 1000.0})),
               ("r/4gpu.json", _ring_file("aaaaaaa", 4, {4 * T: 440.0, 512 * K: 160.0},
                                          active={4 * T: 16000.0})),
               ("r/2gpu_old.json", _ring_file("bbbbbbb", 2, {2 * T: 100.0}))]  # no 1-GPU run of its commit
    # An earlier file with the dense baseline: the scaling files (sparse only) keep its speedup.
    with_dense = _ring_file("ccccccc", 4, {512 * K: 170.0})
    with_dense["runs"][0]["variants"]["sparse_striped"]["speedup"] = {"vs_best_dense": 9.0}
    results.insert(0, ("r/0_4gpu_all.json", with_dense))
    ratio = (4 * T + 1) / (T + 1)
    assert make_tables.causal_work_ratio(T, 4) == ratio and 3.99 < ratio < 4.0
    points = make_tables.weak_scaling_points(results)
    assert [(p["tokens_per_gpu"], p["world_size"]) for p in points] == [(T, 4)]
    assert points[0]["efficiency"] == pytest.approx(100.0 * ratio / 440.0)
    assert points[0]["active_work_ratio"] == pytest.approx(16000.0 / (4 * 1000.0))
    summary = make_tables.summarise({"ring": results})
    assert summary["ring_weak_scaling_32k_per_gpu_4gpu"] == pytest.approx(100.0 * ratio / 440.0)
    assert summary["details"]["ring_weak_scaling_32k_per_gpu_4gpu"]["target"] == ">= 0.85"
    assert summary["ring_strong_scaling_4gpu"] == pytest.approx(600.0 / (4 * 160.0))
    assert summary["ring_speedup_vs_dense_512k_4gpu"] == 9.0
    table = make_tables.weak_scaling_table(results)
    assert "| GPU | aaaaaaa | 32K | sparse ring, striped | 4 | 100.00 | 440.00 | 4.000 | 4.000 | 0.91 |" in table


# ----------------------------------------------------------------------------- benchmarks/ring.py


def test_ring_benchmark_weak_scaling_smoke(tmp_path):
    """Two CPU ranks, 64 and 128 tokens per rank, plus a fixed length: every length runs, the
    scaling record lists the tokens per GPU, the timeline holds every kind of step time."""
    out = tmp_path / "ring.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(REPO, "benchmarks", "ring.py"), "--smoke", "--tokens-per-gpu", "64,128", "--seq-lens", "512",
           "--variants", "sparse_striped,dense_zigzag", "--no-fwd", "--kernel-profile", "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [r["seq_len"] for r in result["runs"]] == [128, 256, 512]
    assert [r["tokens_per_rank"] for r in result["runs"]] == [64, 128, 256]
    assert result["config"]["tokens_per_gpu"] == [64, 128]
    assert result["scaling"]["tokens_per_gpu"] == [64, 128] and len(result["scaling"]["points"]) == 6
    steps = result["runs"][0]["variants"]["sparse_striped"]["steps"]
    for phase in ("forward", "backward", "fwd_bwd"):
        assert set(steps["timeline"][phase]) == {"compute_ms", "wait_ms", "plan_ms", "merge_ms"}
    # Two ranks, two steps: a plan per forward step, a merge on the backward's second step.
    assert [len(row) for row in steps["forward"]["plan_ms"]] == [2, 2]
    assert all(row[0] == 0.0 and row[1] > 0.0 for row in steps["backward"]["merge_ms"])
    assert steps["timeline"]["forward"]["merge_ms"]["max"] == 0.0
    assert steps["timeline"]["fwd_bwd"]["compute_ms"]["mean"] > 0.0
    # --kernel-profile: rank 0's profiled fwd+bwd (CPU operators here; GPU kernels on a GPU).
    profiled = result["runs"][0]["variants"]["sparse_striped"]["kernel_profile"]
    assert profiled["rank"] == 0 and profiled["what"].startswith("CPU") and profiled["total_ms"] > 0
    assert 0 < len(profiled["top_ms"]) <= 25 and sum(profiled["top_ms"].values()) <= profiled["total_ms"] + 1e-6
    # The dense ring builds no plans: zeros, not a missing key.
    dense = result["runs"][0]["variants"]["dense_zigzag"]["steps"]
    assert dense["timeline"]["forward"]["plan_ms"]["max"] == 0.0
    assert "plan / merge ms" in proc.stdout


def test_ring_benchmark_moba_variant_smoke(tmp_path):
    """--variants ...,sparse_moba: the MoBA-pattern BlockIndex runs on the striped ring beside the dense
    ring, the same on both ranks, with a speedup and the per-step imbalance figures."""
    out = tmp_path / "ring.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(REPO, "benchmarks", "ring.py"), "--smoke", "--variants", "dense_zigzag,sparse_moba",
           "--no-fwd", "--moba-top-k", "3", "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads(out.read_text())["runs"][0]
    made, moba = run["moba_index"], run["variants"]["sparse_moba"]
    assert made["same_on_all_ranks"] and made["moba_top_k"] == 3 and made["moba_block_size"] == 64
    assert "errors" not in moba and moba["fwdbwd_ms"] > 0 and moba["speedup"]["vs_best_dense"] > 0
    assert moba["steps"]["fwd_bwd"]["imbalance"]["worker_imbalance"] >= 1.0
    assert "sparse_moba" in proc.stdout


def test_ring_benchmark_rejects_bad_lengths():
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import ring as ring_benchmark

    args = ring_benchmark.parse_args(["--tokens-per-gpu", "32768,0"])
    with pytest.raises(SystemExit, match="--tokens-per-gpu"):
        ring_benchmark.make_config(args, 4)
    args = ring_benchmark.parse_args(["--tokens-per-gpu", "16384,32768", "--seq-lens", "131072"])
    assert ring_benchmark.make_config(args, 4).seq_lens == [65536, 131072]
    assert ring_benchmark.make_config(ring_benchmark.parse_args([]), 4).seq_lens == [262144, 524288]
    assert "sparse_moba" not in ring_benchmark.make_config(ring_benchmark.parse_args([]), 4).variants
    with pytest.raises(SystemExit, match="multiple of --block-size"):
        ring_benchmark.make_config(ring_benchmark.parse_args(["--moba-block-size", "100"]), 4)


# ----------------------------------------------------------------------------- scripts/gpu_ring_scaling.sh


def test_gpu_script_dry_run_lists_every_call(tmp_path):
    env = dict(os.environ, DRY_RUN="1", OUT=str(tmp_path / "out"), NGPU="4")
    proc = subprocess.run(["bash", os.path.join(REPO, "scripts", "gpu_ring_scaling.sh")], capture_output=True,
                          text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert "tests/ring_gpu_worker.py" in lines[0] and "--nproc_per_node 4" in lines[0]  # the check comes first
    calls = lines[1:]
    assert [c.split("--nproc_per_node ")[1].split()[0] for c in calls] == ["1", "2", "4"]
    assert all("--seq-lens 524288 --tokens-per-gpu 16384,32768,131072" in c for c in calls)
    assert [c.split("--out ")[1].split()[0].rsplit("/", 1)[1] for c in calls] == [
        "ring_gpu_1gpu_scaling.json", "ring_gpu_2gpu_scaling.json", "ring_gpu_4gpu_scaling.json"]


def test_gpu_script_runs_on_the_cpu(tmp_path):
    """The script end to end on two CPU ranks (gloo, --smoke shapes) in a scratch tree whose .venv
    is this interpreter: every call writes its JSON and the last table pairs them."""
    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True)
    for name in ("gpu_common.sh", "gpu_ring_scaling.sh"):
        (tree / "scripts" / name).write_text(open(os.path.join(REPO, "scripts", name)).read())
    for name in ("benchmarks", "megatron_mtraining"):
        (tree / name).symlink_to(os.path.join(REPO, name))
    (tree / ".venv" / "bin").mkdir(parents=True)
    (tree / ".venv" / "bin" / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (tree / ".venv" / "bin" / "python").chmod(0o755)
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), REUSE_VENV="1", NGPU="2", WORLDS="1 2 4", STRONG_SEQ_LEN="512",
               TOKENS_PER_GPU="64,128", BENCH_ARGS="--smoke", OMP_NUM_THREADS="1", GIT_COMMIT="abc1234",
               CHECK="0")  # the ring check needs GPUs
    proc = subprocess.run(["bash", str(tree / "scripts" / "gpu_ring_scaling.sh")], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "skipping 4 GPUs: this machine has 2" in proc.stdout
    names = sorted(p.name for p in out.iterdir())
    assert names == ["gpu.txt", "ring_gpu_1gpu_scaling.json", "ring_gpu_2gpu_scaling.json",
                     "ring_scaling_logs.tgz"], names
    table = proc.stdout.split("Weak scaling")[1]
    weak_rows = [line for line in table.splitlines() if line.startswith("| cpu")]
    assert [row.split(" | ")[2] for row in weak_rows] == ["64", "128"]  # T per GPU, paired with the 1-CPU runs
    # The per-run timeline: one row per (W, S), its fwd+bwd time and step breakdown filled in.
    timeline = [line for line in proc.stdout.splitlines() if line.startswith("| 2 | 512 | 256 |")]
    assert len(timeline) == 1, proc.stdout[-2000:]
    assert float(timeline[0].split(" | ")[3]) > 0.0
