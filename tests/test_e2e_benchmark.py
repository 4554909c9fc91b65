"""benchmarks/e2e.py refuses to run without GPUs (megatron.training is CUDA-only)."""

import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_needs_gpus():
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "e2e.py")], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "needs GPUs" in proc.stderr


def test_unknown_run_is_refused_before_anything_starts():
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "e2e.py"), "--runs", "mtraining,cudnn"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "--runs: unknown ['cudnn']" in proc.stderr and "dense_sparse_kernels" in proc.stderr


def test_a_traced_last_iteration_is_refused_before_anything_starts():
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "e2e.py"), "--train-iters", "9",
                           "--profile-iteration", "9"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "at most --train-iters - 1 = 8" in proc.stderr


def test_gpu_time_breakdown_sorts_kernels_into_categories(tmp_path):
    """--profile-iteration's summary of a torch.profiler trace: our kernels (whose names contain
    "attn" and "sm90" too) count as MTraining's, cuDNN's as dense attention, GEMMs, NCCL, the rest;
    CPU events and memcpys are kept apart."""
    import gzip
    import json

    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    from e2e import covered_ms, gpu_time_breakdown

    def kernel(name, ts, dur, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}

    events = [kernel("_vs_attn_fwd_sm90_kernel", 0, 4000), kernel("_dq_sm90_kernel", 4000, 3000),
              kernel("mtraining::(anonymous namespace)::kv_kernel(int const*)", 7000, 10),
              kernel("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 8000, 2000),
              kernel("sm90_xmma_gemm_bf16bf16_bf16f32", 10000, 1500), kernel("nvjet_hsh_128x256", 11500, 500),
              kernel("ncclDevKernel_AllReduce_Sum_bf16", 12000, 700),
              kernel("void at::native::vectorized_elementwise_kernel<4>", 12700, 300),
              kernel("Memcpy DtoD", 13000, 100, cat="gpu_memcpy"),
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 99999},
              # MTraining's profiler ranges on the GPU timeline: summed per name, not counted as kernels
              kernel("mtraining::approximator", 0, 250, cat="gpu_user_annotation"),
              kernel("mtraining::approximator", 9000, 350, cat="gpu_user_annotation"),
              kernel("mtraining::ring forward", 0, 7000, cat="gpu_user_annotation"),
              # the same range again on NCCL's stream, overlapping the compute stream's: its union counts
              kernel("mtraining::ring forward", 1000, 6500, cat="gpu_user_annotation"),
              kernel("ProfilerStep#8", 0, 13100, cat="gpu_user_annotation")]
    path = tmp_path / "rank-0.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    got = gpu_time_breakdown(str(path), top=3)
    assert got["by_category_ms"] == pytest.approx({"mtraining": 7.01, "dense_attention": 2.0, "gemm": 2.0,
                                                   "nccl": 0.7, "other": 0.3, "memcpy_memset": 0.1})
    assert got["gpu_busy_ms"] == pytest.approx(12.11) and got["gpu_span_ms"] == pytest.approx(13.1)
    assert list(got["top_kernels_ms"]) == ["_vs_attn_fwd_sm90_kernel", "_dq_sm90_kernel",
                                           "cudnn_generated_fort_native_sdpa_sm90_flash_fprop"]
    assert got["mtraining_ranges_ms"] == pytest.approx({"mtraining::approximator": 0.6, "mtraining::ring forward": 7.5})
    assert covered_ms([(0, 10), (5, 20), (30, 40), (32, 35)]) == pytest.approx(0.03)


def test_timed_iterations_leave_out_warmup_telemetry_and_profiling():
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import e2e

    times = [9000.0, 5000.0, 950.0, 900.0, 990.0, 910.0, 905.0, 915.0, 895.0, 1000.0, 1500.0, 1400.0]
    log = "[MTraining] iteration 5 | density 0.06\n[MTraining] iteration 10 | density 0.06\n"
    mean, excluded = e2e.timed_iterations(times, log, warmup_iters=3, profile_iteration=11)
    # Iteration 10 is also the profiler's warm-up (tracing on, events dropped): slower on both sides.
    assert excluded == {1: "warm-up", 2: "warm-up", 3: "warm-up", 5: "telemetry", 10: "profiler warm-up",
                        11: "profiled", 12: "trace export"}
    assert mean == pytest.approx((900 + 910 + 905 + 915 + 895) / 5)
    mean, excluded = e2e.timed_iterations(times, "", warmup_iters=3, profile_iteration=7)
    assert excluded == {1: "warm-up", 2: "warm-up", 3: "warm-up", 6: "profiler warm-up", 7: "profiled",
                        8: "trace export"}
    assert mean == pytest.approx((900 + 990 + 895 + 1000 + 1500 + 1400) / 6)
    assert e2e.timed_iterations(times[:3], "", 0, 1)[1] == {1: "profiled", 2: "trace export"}
    assert e2e.timed_iterations(times[:3], "", 3, 0) == (None, {1: "warm-up", 2: "warm-up", 3: "warm-up"})
    # A run that ends on a telemetry iteration never prints its line: the interval leaves it out too.
    ends_on_one = times[:10]
    mean, excluded = e2e.timed_iterations(ends_on_one, log.splitlines()[0], 3, 8, log_interval=5)
    assert excluded == {1: "warm-up", 2: "warm-up", 3: "warm-up", 5: "telemetry", 7: "profiler warm-up",
                        8: "profiled", 9: "trace export", 10: "telemetry"}
    assert mean == pytest.approx((900 + 910) / 2)
    assert e2e.telemetry_interval(["--mtraining", "--mtraining-log-interval", "5"]) == 5
    assert e2e.telemetry_interval(["--cp-comm-type", "p2p"]) == 0
    assert e2e.telemetry_interval(["--mtraining-log-interval", "5", "--mtraining-log-interval=3"]) == 3


def test_transformer_engine_flags():
    import argparse

    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import e2e

    args = argparse.Namespace(num_layers=2, seq_length=4096, transformer_impl="transformer_engine", fp8=True,
                              train_iters=4, vocab_size=512, recompute=False)
    model, training = e2e.model_flags(args), e2e.training_flags(args, 2)
    assert "transformer_engine" in model and "--no-rope-fusion" not in model  # TE's fused RoPE, Megatron's default
    assert training[-len(e2e.FP8_FLAGS):] == e2e.FP8_FLAGS
    args.transformer_impl, args.fp8 = "local", False
    assert "--no-rope-fusion" in e2e.model_flags(args) and not set(e2e.FP8_FLAGS) & set(e2e.training_flags(args, 2))
    with pytest.raises(SystemExit, match="Transformer Engine does not import"):
        e2e.resolve_transformer_impl("transformer_engine", None)
    assert e2e.resolve_transformer_impl("auto", None) == "local"
    assert e2e.resolve_transformer_impl("auto", "2.20.2") == "transformer_engine"
