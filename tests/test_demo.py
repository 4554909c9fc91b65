"""The main job end to end: `make demo`'s training run, short, on 2 CPU processes (gloo)."""

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU (gloo) variant; GPU machines run `make demo`")
def test_demo_trains_with_context_parallel_2():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(ROOT, "examples", "demo", "demo.py"), "--iterations", "15", "--seq-length", "512", "--log-interval", "5"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "[demo] loss" in out and ": OK" in out, out[-4000:]
    assert "context parallel 2 (gloo)" in out
