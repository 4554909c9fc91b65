"""The tests' faster Triton interpreter (tests/triton_interpreter.py) computes what Triton's own does:
the kernels' outputs and gradients, bitwise, against a process that runs the interpreter unpatched."""

import os
import subprocess
import sys

import pytest
import torch

import triton_interpreter

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Forward and backward (with and without documents) and the approximator's statistics, small shapes.
_KERNELS = r'''
import sys
import torch
from megatron_mtraining import MTrainingConfig, VSIndex, sparse_attention
from megatron_mtraining.approx import vs_statistics

results = []
for cu in (None, [0, 1, 37, 64, 80, 96]):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, 96, 16, generator=g).requires_grad_() for h in (4, 2, 2))
    index = VSIndex.random(1, 4, 96, 16, max_slash=3, max_vertical=20, generator=g)
    cu_seqlens = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    out = sparse_attention(q, k, v, index, backend="triton", cu_seqlens=cu_seqlens)
    results += [out.detach(), *torch.autograd.grad(out, (q, k, v), torch.randn(out.shape, generator=g))]
cfg = MTrainingConfig(block_size=64, top_p=0.9, last_q=24, max_vertical=16, max_slash=4, min_vertical=2)
object.__setattr__(cfg, "block_size", 16)
g = torch.Generator().manual_seed(4)
q, k = torch.randn(1, 2, 128, 16, generator=g), torch.randn(1, 1, 128, 16, generator=g)
results += [x for x in vs_statistics(q, k, cfg, backend="triton") if torch.is_tensor(x)]
torch.save(results, sys.argv[1])
'''


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs in-process only without a GPU")
def test_patched_interpreter_is_bitwise_the_unpatched_one(tmp_path):
    script = tmp_path / "kernels.py"
    script.write_text(_KERNELS)
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    plain = subprocess.run([sys.executable, str(script), str(tmp_path / "plain.pt")], env=env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0, plain.stderr[-3000:]
    triton_interpreter.install()  # this process: patched by conftest.py already (install is idempotent)
    saved_argv = sys.argv
    try:
        sys.argv = [str(script), str(tmp_path / "patched.pt")]
        exec(compile(_KERNELS, str(script), "exec"), {"__name__": "kernels"})
    finally:
        sys.argv = saved_argv
    want, got = torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "patched.pt")
    assert len(want) == len(got) == 2 * 4 + 3  # per call: out, dq, dk, dv; the statistics: 3 tensors
    for i, (a, b) in enumerate(zip(want, got)):
        assert a.dtype == b.dtype and torch.equal(a, b), i
