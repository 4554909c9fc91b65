"""GPU-only checks: long sequences in bf16 against an fp32 reference, and no host syncs."""

import pytest
import torch

from megatron_mtraining import VSIndex, sparse_attention
from oracle import rel_err

pytestmark = pytest.mark.gpu


def long_index(b, hq, n, B, seed):
    """Random index with realistic capacity: many slash offsets and columns at long lengths."""
    return VSIndex.random(b, hq, n, B, max_slash=48, max_vertical=512,
                          generator=torch.Generator().manual_seed(seed), device="cuda")


@pytest.mark.parametrize("n, B, d", [(4096, 64, 128), (8192, 128, 128), (8192, 128, 64), (32768, 64, 128), (16384, 64, 64)])
def test_bf16_triton_matches_fp32_reference_at_length(n, B, d):
    g = torch.Generator(device="cuda").manual_seed(n)
    hq, hkv = 8, 2
    q, k, v = (torch.randn(1, h, n, d, device="cuda", generator=g) for h in (hq, hkv, hkv))
    index = long_index(1, hq, n, B, seed=n)
    index.validate(n)
    q16, k16, v16 = (x.bfloat16().requires_grad_() for x in (q, k, v))
    q32, k32, v32 = (x.bfloat16().float().requires_grad_() for x in (q, k, v))
    out = sparse_attention(q16, k16, v16, index, backend="triton")
    ref = sparse_attention(q32, k32, v32, index, backend="torch")  # fp32 path, checked on CPU
    grad = torch.randn_like(ref)
    got = torch.autograd.grad(out, (q16, k16, v16), grad.bfloat16())
    want = torch.autograd.grad(ref, (q32, k32, v32), grad)
    assert rel_err(out, ref) < 1e-2
    for name, a, e in zip(("dq", "dk", "dv"), got, want):
        assert rel_err(a, e) < 2e-2, name


def test_fp32_triton_is_exact_on_gpu():
    n, hq, hkv, d = 2048, 4, 2, 64
    q, k, v = (torch.randn(2, h, n, d, device="cuda", requires_grad=True) for h in (hq, hkv, hkv))
    index = long_index(2, hq, n, 64, seed=3)
    out = sparse_attention(q, k, v, index, backend="triton")
    ref = sparse_attention(q, k, v, index, backend="torch")
    grad = torch.randn_like(ref)
    for a, e in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        assert rel_err(a, e) < 1e-5
    assert rel_err(out, ref) < 1e-5


def test_no_host_synchronisation():
    n, hq, hkv, d = 4096, 8, 2, 128
    q, k, v = (torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for h in (hq, hkv, hkv))
    index = long_index(1, hq, n, 64, seed=5)
    sparse_attention(q, k, v, index).sum().backward()  # compile the kernels first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sparse_attention(q, k, v, index)
        out.backward(torch.ones_like(out))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
