"""The ring at small work per GPU, on the CPU: benchmarks/ring.py's weak-scaling mode and per-step
timeline (smoke run, gloo), make_tables.py's weak-scaling figures, and the ring's per-step paths
(plans built step by step, in-place dK/dV merge, ``MTRAINING_RING_ONE_BUFFER``) against the
default path and the single-device reference."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from dist_utils import run_distributed
from megatron_mtraining import VSIndex, sparse_attention
from megatron_mtraining.layout import gather_sequence, shard_sequence
from oracle import rel_err

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import make_tables  # noqa: E402

B = 16
ONE_BUFFER = "MTRAINING_RING_ONE_BUFFER"


# ----------------------------------------------------------------------------- make_tables


def _ring_file(commit, world, times, one_buffer=False, active=None):
    """A ring result: {seq_len: sparse striped fwd+bwd ms}; ``active``: {seq_len: active pairs}."""
    runs = [{"seq_len": n, "world_size": world, "tokens_per_rank": n // world,
             "index": {"active_pairs": (active or {}).get(n)},
             "variants": {"sparse_striped": {"fwdbwd_ms": ms}}} for n, ms in times.items()]
    config = {"ring_one_buffer": True} if one_buffer else {}
    return {"meta": {"device": "GPU", "commit": commit}, "config": config, "runs": runs}


def test_weak_scaling_divides_out_the_causal_work():
    T, K = 32768, 1024
    results = [("r/1gpu.json", _ring_file("aaaaaaa", 1, {T: 100.0, 512 * K: 600.0},
                                          active={T: 1000.0})),
               ("r/4gpu.json", _ring_file("aaaaaaa", 4, {4 * T: 440.0, 512 * K: 160.0},
                                          active={4 * T: 16000.0})),
               # The A/B switch's run, faster: neither a weak nor a strong figure may come from it.
               ("r/4gpu_ab.json", _ring_file("aaaaaaa", 4, {4 * T: 300.0, 512 * K: 100.0}, one_buffer=True)),
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
    assert "K/V as one buffer" in make_tables.render_ring(results)


# ----------------------------------------------------------------------------- benchmarks/ring.py


def test_ring_benchmark_weak_scaling_smoke(tmp_path):
    """Two CPU ranks, 64 and 128 tokens per rank, plus a fixed length: every length runs, the
    scaling record lists the tokens per GPU, the timeline holds every kind of step time."""
    out = tmp_path / "ring.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(REPO, "benchmarks", "ring.py"), "--smoke", "--tokens-per-gpu", "64,128", "--seq-lens", "512",
           "--variants", "sparse_striped,dense_zigzag", "--no-fwd", "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [r["seq_len"] for r in result["runs"]] == [128, 256, 512]
    assert [r["tokens_per_rank"] for r in result["runs"]] == [64, 128, 256]
    assert result["config"]["tokens_per_gpu"] == [64, 128] and result["config"]["ring_one_buffer"] is False
    assert result["scaling"]["tokens_per_gpu"] == [64, 128] and len(result["scaling"]["points"]) == 6
    steps = result["runs"][0]["variants"]["sparse_striped"]["steps"]
    for phase in ("forward", "backward", "fwd_bwd"):
        assert set(steps["timeline"][phase]) == {"compute_ms", "wait_ms", "plan_ms", "merge_ms"}
    # Two ranks, two steps: a plan per forward step, a merge on the backward's second step.
    assert [len(row) for row in steps["forward"]["plan_ms"]] == [2, 2]
    assert all(row[0] == 0.0 and row[1] > 0.0 for row in steps["backward"]["merge_ms"])
    assert steps["timeline"]["forward"]["merge_ms"]["max"] == 0.0
    assert steps["timeline"]["fwd_bwd"]["compute_ms"]["mean"] > 0.0
    # The dense ring builds no plans: zeros, not a missing key.
    dense = result["runs"][0]["variants"]["dense_zigzag"]["steps"]
    assert dense["timeline"]["forward"]["plan_ms"]["max"] == 0.0
    assert "plan / merge ms" in proc.stdout


def test_ring_benchmark_rejects_bad_lengths():
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import ring as ring_benchmark

    args = ring_benchmark.parse_args(["--tokens-per-gpu", "32768,0"])
    with pytest.raises(SystemExit, match="--tokens-per-gpu"):
        ring_benchmark.make_config(args, 4)
    args = ring_benchmark.parse_args(["--tokens-per-gpu", "16384,32768", "--seq-lens", "131072"])
    assert ring_benchmark.make_config(args, 4).seq_lens == [65536, 131072]
    assert ring_benchmark.make_config(ring_benchmark.parse_args([]), 4).seq_lens == [262144, 524288]


# ----------------------------------------------------------------------------- the ring's paths

CASES = {  # name: (layout, global length, inner_size, q heads, kv heads, dense ring)
    "striped-flat": ("striped", 128, None, 4, 2, False),
    "zigzag-flat": ("zigzag", 256, None, 4, 1, False),
    "striped-hier2": ("striped", 128, 2, 4, 2, False),
    "dense-zigzag": ("zigzag", 256, None, 4, 2, True),
}


def _inputs(seq_len, hq, hkv, seed=3):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, hq, seq_len, 16, generator=g)
    k, v = (torch.randn(2, hkv, seq_len, 16, generator=g) for _ in range(2))
    grad = torch.randn(2, hq, seq_len, 16, generator=g)
    index = VSIndex.random(2, hq, seq_len, B, max_slash=5, max_vertical=24, generator=g)
    return q, k, v, grad, index


def _paths_worker(rank: int, world_size: int) -> dict:
    """Every case under both settings of the switch: local out/dq/dk/dv, the tensors per exchange."""
    from megatron_mtraining import dense_ring_attention, sparse_ring_attention
    from megatron_mtraining.ring import comm

    sent = []
    exchange = comm.Ring.exchange

    def counting(self, tensors, context=None):
        if self.size > 1:
            sent.append(len(tensors))
        return exchange(self, tensors, context)

    comm.Ring.exchange = counting
    results = {}
    for setting in ("0", "1"):
        os.environ[ONE_BUFFER] = setting
        for name, (layout, n, inner, hq, hkv, dense) in CASES.items():
            q, k, v, grad, index = _inputs(n, hq, hkv)

            def shard(x):
                return shard_sequence(x, 2, layout, world_size, rank, B)

            q, k, v = (shard(x).requires_grad_() for x in (q, k, v))
            del sent[:]
            if dense:
                out = dense_ring_attention(q, k, v, layout=layout, inner_size=inner, impl="torch")
            else:
                out = sparse_ring_attention(q, k, v, index, layout=layout, inner_size=inner, backend="torch")
            dq, dk, dv = torch.autograd.grad(out, (q, k, v), shard(grad))
            results[(setting, name)] = {"out": out, "dq": dq, "dk": dk, "dv": dv, "sent": sorted(set(sent))}
    os.environ.pop(ONE_BUFFER)
    return results


@pytest.fixture(scope="module")
def path_results():
    return run_distributed(_paths_worker, 4, timeout=240)


@pytest.mark.parametrize("name", sorted(CASES))
def test_one_buffer_is_bitwise_the_default_path(path_results, name):
    layout, n, _, hq, hkv, dense = CASES[name]
    for rank, per_rank in enumerate(path_results):
        two, one = per_rank[("0", name)], per_rank[("1", name)]
        assert (two["sent"], one["sent"]) == ([2], [1]), f"rank {rank}: tensors per hop {two['sent']}, {one['sent']}"
        for what in ("out", "dq", "dk", "dv"):
            assert torch.equal(two[what], one[what]), f"{name}: rank {rank} {what} differs with {ONE_BUFFER}=1"
    if dense:
        return
    # And both equal the single-device attention (the plans are built step by step now).
    q, k, v, grad, index = _inputs(n, hq, hkv)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    want_out = sparse_attention(q, k, v, index, backend="torch")
    want = dict(zip(("out", "dq", "dk", "dv"), (want_out,) + torch.autograd.grad(want_out, (q, k, v), grad)))
    for what, ref in want.items():
        got = gather_sequence([r[("1", name)][what] for r in path_results], 2, layout, B)
        assert rel_err(got, ref.detach()) < 1e-5, f"{name}: {what}"


def _mismatch_worker(rank: int, world_size: int) -> list:
    """Ranks that disagree on the switch, then a bad value on one rank: every rank raises."""
    from megatron_mtraining import sparse_ring_attention

    q, k, v, _, index = _inputs(64, 4, 2)
    q, k, v = (shard_sequence(x, 2, "striped", world_size, rank, B) for x in (q, k, v))
    outcomes = []
    for values in (("1", "0"), ("0", "yes")):
        os.environ[ONE_BUFFER] = values[rank]
        try:
            sparse_ring_attention(q, k, v, index, backend="torch")
            outcomes.append(("no error", ""))
        except Exception as err:  # noqa: BLE001 (checked in the parent)
            outcomes.append((type(err).__name__, str(err)))
    os.environ.pop(ONE_BUFFER)
    return outcomes


def test_ranks_that_differ_on_the_switch_all_raise():
    per_rank = run_distributed(_mismatch_worker, 2, timeout=120)
    for rank in (0, 1):
        kind, message = per_rank[rank][0]
        assert kind == "RingAgreementError" and ONE_BUFFER in message, (rank, kind, message)
    assert per_rank[1][1][0] == "ValueError" and "'yes'" in per_rank[1][1][1]
    assert per_rank[0][1][0] == "RingAgreementError", per_rank[0][1]


# ----------------------------------------------------------------------------- scripts/gpu_ring_scaling.sh


def test_gpu_script_dry_run_lists_every_call(tmp_path):
    env = dict(os.environ, DRY_RUN="1", OUT=str(tmp_path / "out"), NGPU="4")
    proc = subprocess.run(["bash", os.path.join(REPO, "scripts", "gpu_ring_scaling.sh")], capture_output=True,
                          text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert "tests/ring_gpu_worker.py" in lines[0] and "--nproc_per_node 4" in lines[0]  # the check comes first
    calls = lines[1:]
    assert [c.split("--nproc_per_node ")[1].split()[0] for c in calls] == ["1", "2", "4", "4"]
    assert all("--seq-lens 524288 --tokens-per-gpu 16384,32768,131072" in c for c in calls)
    assert [c.split()[1] for c in calls] == ["MTRAINING_RING_ONE_BUFFER=0"] * 3 + ["MTRAINING_RING_ONE_BUFFER=1"]
    assert calls[-1].split("--out ")[1].split()[0].endswith("ring_gpu_4gpu_onebuffer.json")


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
    assert names == ["gpu.txt", "ring_gpu_1gpu_scaling.json", "ring_gpu_2gpu_onebuffer.json",
                     "ring_gpu_2gpu_scaling.json", "ring_scaling_logs.tgz"], names
    onebuffer = json.loads((out / "ring_gpu_2gpu_onebuffer.json").read_text())
    assert onebuffer["config"]["ring_one_buffer"] is True
    table = proc.stdout.split("Weak scaling")[1]
    weak_rows = [line for line in table.splitlines() if line.startswith("| cpu")]
    assert [row.split(" | ")[2] for row in weak_rows] == ["64", "128"]  # T per GPU, paired with the 1-CPU runs
    assert "| 2 | 512 | 256 | one buffer |" in proc.stdout
