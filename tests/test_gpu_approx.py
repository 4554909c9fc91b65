"""Approximator on the GPU: long bf16 inputs, no host synchronisation, same index as fp32 on the CPU."""

import os
import subprocess
import sys

import pytest
import torch

from megatron_mtraining import MTrainingConfig, approximate_index
from synthetic import synthetic_vs_qk

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("n", [32768, 131072])
def test_bf16_long_sequence_index(n):
    cfg = MTrainingConfig(top_p=0.9)
    q, k = synthetic_vs_qk(1, 16, 2, n, 128, seed=1, device="cuda", dtype=torch.bfloat16)
    approximate_index(q, k, cfg)  # warm-up: caches the layout positions on the device
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        index = approximate_index(q, k, cfg)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    index.validate(n)
    assert torch.all(index.slash[..., 0] == 0)
    # The same bf16 values in fp32 on the CPU select (nearly) the same entries: only near-ties
    # may flip between the two summation orders.
    cpu = approximate_index(q.float().cpu(), k.float().cpu(), cfg)
    for b in range(1):
        for h in range(16):
            got = set(index.vertical[b, h, :int(index.n_vertical[b, h])].tolist())
            want = set(cpu.vertical[b, h, :int(cpu.n_vertical[b, h])].tolist())
            assert len(got & want) >= 0.95 * max(len(got), len(want))
            got_s = set(index.slash[b, h, :int(index.n_slash[b, h])].tolist())
            want_s = set(cpu.slash[b, h, :int(cpu.n_slash[b, h])].tolist())
            assert len(got_s & want_s) >= 0.9 * max(len(got_s), len(want_s))


def test_repeated_calls_give_the_same_index_bit_for_bit():
    """Activation recompute rebuilds the index: it must not depend on float atomics' order."""
    cfg = MTrainingConfig(top_p=0.9, last_q=128)
    q, k = synthetic_vs_qk(1, 16, 2, 65536, 128, seed=2, device="cuda", dtype=torch.bfloat16)
    first = approximate_index(q, k, cfg)
    for _ in range(3):
        again = approximate_index(q, k, cfg)
        for name in ("slash", "n_slash", "vertical", "n_vertical"):
            assert torch.equal(getattr(first, name), getattr(again, name)), name


@pytest.mark.parametrize("gpus", [2, 4])
def test_distributed_index_on_gpus(gpus):
    """tests/approx_gpu_worker.py under torchrun: 32K-128K tokens per rank, both layouts, NCCL."""
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs, found {torch.cuda.device_count()}")
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "approx_gpu_worker.py")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}",
                           worker], capture_output=True, text=True, timeout=900)
    print(proc.stdout[-6000:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("-> ok") == 3 * gpus
