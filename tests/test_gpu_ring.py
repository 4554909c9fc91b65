"""Multi-GPU ring checks (NCCL, bf16, torchrun): run tests/ring_gpu_worker.py on 2 and 4 GPUs."""

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ring_gpu_worker.py")


@pytest.mark.parametrize("gpus", [2, 4])
def test_ring_on_gpus(gpus):
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs, found {torch.cuda.device_count()}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}", WORKER]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    print(proc.stdout[-6000:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("-> ok") >= gpus * 2
