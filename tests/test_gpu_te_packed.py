"""Packed documents on Transformer Engine layers over CP = 2 and 4 against TE's own THD attention:
tests/te_packed_gpu_worker.py under torchrun on 2 and 4 GPUs (each skipped without enough GPUs or without TE)."""

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "te_packed_gpu_worker.py")


@pytest.mark.parametrize("cp", [2, 4])
def test_packed_documents_on_te_layers(cp):
    if torch.cuda.device_count() < cp:
        pytest.skip(f"needs {cp} GPUs, found {torch.cuda.device_count()}")
    pytest.importorskip("transformer_engine.pytorch")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={cp}", WORKER]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    print(proc.stdout[-6000:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.stdout.count("-> ok") == 2
