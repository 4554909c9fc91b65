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
