"""Dense per-step attention with lse (the dense context-parallel baseline's kernel).

CPU runs the explicit fp32 "torch" implementation; the GPU tests run cuDNN and flash in bf16
against fp32 references. The split-keys tests check the ring property: partial forwards merged
by log-sum-exp, and per-chunk backwards fed the MERGED out/lse, give the full gradients.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_mtraining.kernels.dense_kernels import dense_attention_backward, dense_attention_forward
from megatron_mtraining.kernels.dispatch import dense_impls_available as available_impls
from oracle import rel_err

GPU_IMPLS = ("cudnn", "flash")


def make(b, hq, hkv, nq, nk, d, seed, device="cpu", dtype=torch.float32):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(b, hq, nq, d, generator=g, device=device)
    k = torch.randn(b, hkv, nk, d, generator=g, device=device)
    v = torch.randn(b, hkv, nk, d, generator=g, device=device)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def expand(x, hq):
    return x.repeat_interleave(hq // x.shape[1], dim=1)


def sdpa(q, k, v, causal, scale, mask=None):
    """The reference: PyTorch SDPA with K/V expanded to the query heads (mask: True = keep).
    Called in float64, so the fp32 kernels are measured against exact-ish values."""
    hq = q.shape[1]
    return F.scaled_dot_product_attention(q, expand(k, hq), expand(v, hq), attn_mask=mask,
                                          is_causal=causal, scale=scale)


def ref_lse(q, k, causal, scale):
    s = torch.matmul(q.double(), expand(k, q.shape[1]).double().transpose(-1, -2)) * scale
    if causal:
        n = q.shape[2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.logsumexp(s, dim=-1)


def ref_grads(q, k, v, do, causal, scale, mask=None):
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    out = sdpa(q, k, v, causal, scale, mask)
    return torch.autograd.grad(out, (q, k, v), do.double())


def merge(o1, l1, o2, l2):
    """Log-sum-exp merge of two partial attentions over disjoint key sets (fp32)."""
    lse = torch.logaddexp(l1, l2)
    out = torch.exp(l1 - lse).unsqueeze(-1) * o1.float() + torch.exp(l2 - lse).unsqueeze(-1) * o2.float()
    return out, lse


# (b, hq, hkv, nq, nk, d, causal): GQA ratios 1 and 4; nq != nk only without the causal mask.
SHAPES = [
    (2, 4, 4, 33, 33, 16, True),
    (2, 4, 4, 33, 33, 16, False),
    (1, 8, 2, 40, 40, 32, True),
    (1, 8, 2, 24, 57, 32, False),
    (2, 4, 4, 50, 17, 16, False),
]


def test_available_impls_cpu():
    assert available_impls("cpu") == ["torch"]


@pytest.mark.parametrize("impl", ["torch", "auto"])
@pytest.mark.parametrize("b, hq, hkv, nq, nk, d, causal", SHAPES)
def test_forward_matches_sdpa(impl, b, hq, hkv, nq, nk, d, causal):
    q, k, v = make(b, hq, hkv, nq, nk, d, seed=nq * nk)
    scale = 1 / math.sqrt(d)
    out, lse = dense_attention_forward(q, k, v, causal, scale, impl=impl)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (b, hq, nq)
    assert rel_err(out, sdpa(q.double(), k.double(), v.double(), causal, scale)) < 1e-5
    assert rel_err(lse, ref_lse(q, k, causal, scale)) < 1e-6


@pytest.mark.parametrize("b, hq, hkv, nq, nk, d, causal", SHAPES)
def test_backward_matches_autograd(b, hq, hkv, nq, nk, d, causal):
    q, k, v = make(b, hq, hkv, nq, nk, d, seed=nq + nk)
    do = torch.randn(b, hq, nq, d, generator=torch.Generator().manual_seed(7))
    scale = 0.3  # not 1/sqrt(d): the scale must reach every gradient
    out, lse = dense_attention_forward(q, k, v, causal, scale, impl="torch")
    got = dense_attention_backward(do, q, k, v, out, lse, causal, scale, impl="torch")
    want = ref_grads(q, k, v, do, causal, scale)
    for name, a, e, x in zip(("dq", "dk", "dv"), got, want, (q, k, v)):
        assert a.dtype == torch.float32 and a.shape == x.shape, name
        assert rel_err(a, e) < 1e-5, name


def backward_f64(do, q, k, v, out, lse, causal, scale):
    """The attention backward's formulas in float64 from the given ``out`` and ``lse`` (so the
    rounding of a bf16 ``out`` is the same on both sides): dV = P^T dO, dS = P (dO V^T - rowsum(dO out)),
    dQ = dS K scale, dK = dS^T Q scale, K/V gradients summed over each GQA group."""
    hq, hkv = q.shape[1], k.shape[1]
    qd, kd, vd, dod = q.double(), expand(k, hq).double(), expand(v, hq).double(), do.double()
    s = qd @ kd.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).triu(1), float("-inf"))
    p = torch.exp(s - lse.double()[..., None])
    ds = p * (dod @ vd.transpose(-1, -2) - (dod * out.double()).sum(-1, keepdim=True))

    def fold(x):
        return x.view(x.shape[0], hkv, hq // hkv, *x.shape[2:]).sum(2)
    return ds @ kd * scale, fold(ds.transpose(-1, -2) @ qd * scale), fold(p.transpose(-1, -2) @ dod)


def test_bf16_inputs_on_cpu_compute_in_fp32():
    """bf16 in, fp32 arithmetic: the output is the exact attention rounded once to bf16 (measured:
    every element; bf16 arithmetic matches 68-72% of them), lse and the gradients are fp32-accurate
    (measured 3e-8 and 1.6e-7 against float64; bf16 arithmetic gives 2e-3 and 5e-3 to 8e-3)."""
    q, k, v = make(1, 4, 2, 32, 32, 16, seed=3, dtype=torch.bfloat16)
    out, lse = dense_attention_forward(q, k, v, True, 0.25, impl="torch")
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    exact = sdpa(q.double(), k.double(), v.double(), True, 0.25)
    assert (out == exact.to(torch.bfloat16)).float().mean().item() >= 0.99
    assert rel_err(lse, ref_lse(q, k, True, 0.25)) < 1e-6
    do = torch.randn_like(q)
    got = dense_attention_backward(do, q, k, v, out, lse, True, 0.25, impl="torch")
    for name, a, e in zip(("dq", "dk", "dv"), got, backward_f64(do, q, k, v, out, lse, True, 0.25)):
        assert a.dtype == torch.float32, name
        assert rel_err(a, e) < 1e-5, name


def split_keys_check(q, k, v, do, scale, impl, tol, cut):
    """Keys in two chunks: merged forward == full forward, and per-chunk backward with the merged
    out/lse sums (dq) / concatenates (dk, dv) to the full gradients."""
    parts = [(k[:, :, :cut], v[:, :, :cut]), (k[:, :, cut:], v[:, :, cut:])]
    fwd = [dense_attention_forward(q, kc, vc, False, scale, impl=impl) for kc, vc in parts]
    out, lse = merge(*fwd[0], *fwd[1])
    assert rel_err(out, sdpa(q.double(), k.double(), v.double(), False, scale)) < tol
    assert rel_err(lse, ref_lse(q, k, False, scale)) < tol / 10
    out = out.to(q.dtype)
    grads = [dense_attention_backward(do, q, kc, vc, out, lse, False, scale, impl=impl) for kc, vc in parts]
    dq = grads[0][0] + grads[1][0]
    dk = torch.cat([grads[0][1], grads[1][1]], dim=2)
    dv = torch.cat([grads[0][2], grads[1][2]], dim=2)
    want = ref_grads(q, k, v, do, False, scale)
    for name, a, e in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        assert rel_err(a, e) < tol, name


def causal_ring_check(q, k, v, do, scale, impl, tol):
    """One ring rank's view of a causal sequence: its queries (the second half) see the first half
    of the keys fully (a non-causal step) and their own half causally (the diagonal step)."""
    n = q.shape[2]
    h = n // 2
    qh, doh = q[:, :, h:], do[:, :, h:]
    steps = [(k[:, :, :h], v[:, :, :h], False), (k[:, :, h:], v[:, :, h:], True)]
    fwd = [dense_attention_forward(qh, kc, vc, c, scale, impl=impl) for kc, vc, c in steps]
    out, lse = merge(*fwd[0], *fwd[1])
    keep = torch.ones(n - h, n, dtype=torch.bool, device=q.device).tril(h)  # query h+i sees keys 0..h+i
    assert rel_err(out, sdpa(qh.double(), k.double(), v.double(), False, scale, keep)) < tol
    out = out.to(q.dtype)
    grads = [dense_attention_backward(doh, qh, kc, vc, out, lse, c, scale, impl=impl) for kc, vc, c in steps]
    dq = grads[0][0] + grads[1][0]
    dk = torch.cat([grads[0][1], grads[1][1]], dim=2)
    dv = torch.cat([grads[0][2], grads[1][2]], dim=2)
    want = ref_grads(qh, k, v, doh, False, scale, keep)
    for name, a, e in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        assert rel_err(a, e) < tol, name


@pytest.mark.parametrize("hq, hkv, cut", [(4, 4, 20), (8, 2, 31)])
def test_split_keys_ring_property(hq, hkv, cut):
    q, k, v = make(2, hq, hkv, 37, 52, 16, seed=cut)
    do = torch.randn(2, hq, 37, 16, generator=torch.Generator().manual_seed(cut))
    split_keys_check(q, k, v, do, 1 / 4, "torch", 1e-5, cut)


@pytest.mark.parametrize("hq, hkv", [(4, 4), (8, 2)])
def test_causal_ring_step_merge(hq, hkv):
    q, k, v = make(1, hq, hkv, 48, 48, 16, seed=hq)
    do = torch.randn_like(q)
    causal_ring_check(q, k, v, do, 1 / 4, "torch", 1e-5)


def test_bad_impl_and_causal_shape_rejected():
    q, k, v = make(1, 2, 2, 8, 12, 16, seed=0)
    with pytest.raises(ValueError, match="impl must be one of"):
        dense_attention_forward(q, k, v, False, 1.0, impl="nope")
    with pytest.raises(AssertionError):
        dense_attention_forward(q, k, v, True, 1.0, impl="torch")


def test_a_cudnn_failure_falls_back_for_its_own_call_only(monkeypatch):
    """Under "auto", cuDNN that raises in a ring call's first step is not tried again in that
    call (its other steps, its backward), and a later call tries it again."""
    from megatron_mtraining.kernels import dense_kernels
    from megatron_mtraining.ring.dense import DenseZigzagSteps
    tried = []

    def cudnn(*args):
        tried.append("cudnn")
        raise RuntimeError("cuDNN: no valid execution plan")

    def flash(kind):
        def run(*args):
            tried.append("flash")
            return getattr(dense_kernels, f"_torch_{kind}")(*args)
        return run

    monkeypatch.setattr(dense_kernels, "dense_impl", lambda impl, q, cudnn_failed=False:
                        "flash" if cudnn_failed else "cudnn")
    monkeypatch.setattr(dense_kernels, "_cudnn_forward", cudnn)
    monkeypatch.setattr(dense_kernels, "_cudnn_backward", cudnn)
    monkeypatch.setattr(dense_kernels, "_flash_forward", flash("forward"))
    monkeypatch.setattr(dense_kernels, "_flash_backward", flash("backward"))
    q, k, v = make(1, 2, 2, 16, 16, 8, seed=0)
    out, lse = torch.zeros_like(q, dtype=torch.float32), torch.full(q.shape[:3], float("-inf"))
    for _ in range(2):  # two calls
        steps = DenseZigzagSteps(1, 0.25, "auto")
        steps.forward(q, k, v, 1, out, lse)
        steps.forward(q, k, v, 0, out, lse)
        grads = [torch.zeros_like(x, dtype=torch.float32) for x in (q, k, v)]
        steps.backward_keys(q, k, v, torch.ones_like(q), out, lse, None, 0, *grads)
    assert tried == ["cudnn", "flash", "flash", "flash"] * 2
    with pytest.raises(RuntimeError, match="no valid execution plan"):  # asked for by name: no fallback
        dense_attention_forward(q, k, v, True, 0.25, impl="cudnn")


# ------------------------------------------------------------------------------------------ GPU


def gpu_inputs(b, hq, hkv, nq, nk, d, seed):
    q, k, v = make(b, hq, hkv, nq, nk, d, seed, device="cuda")
    do = torch.randn(b, hq, nq, d, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed + 1))
    # The float64 references use the bf16-rounded inputs, so only kernel rounding is measured.
    return tuple(x.bfloat16() for x in (q, k, v, do))


@pytest.mark.gpu
def test_gpu_impls_available():
    impls = available_impls("cuda")
    assert "torch" in impls and ("cudnn" in impls or "flash" in impls), impls


@pytest.mark.gpu
@pytest.mark.parametrize("impl", GPU_IMPLS + ("auto",))
@pytest.mark.parametrize("b, hq, hkv, nq, nk, d, causal", [
    (2, 8, 8, 1024, 1024, 128, True),
    (1, 16, 4, 2048, 2048, 128, True),
    (1, 16, 4, 1024, 3072, 64, False),
    (2, 8, 2, 1536, 512, 128, False),
])
def test_gpu_bf16_forward_backward(impl, b, hq, hkv, nq, nk, d, causal):
    if impl != "auto" and impl not in available_impls("cuda"):
        pytest.skip(f"{impl} not available")
    q, k, v, do = gpu_inputs(b, hq, hkv, nq, nk, d, seed=nq + nk + hq)
    scale = 1 / math.sqrt(d)
    out, lse = dense_attention_forward(q, k, v, causal, scale, impl=impl)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (b, hq, nq)
    assert rel_err(out, sdpa(q.double(), k.double(), v.double(), causal, scale)) < 1e-2
    assert rel_err(lse, ref_lse(q, k, causal, scale)) < 1e-3
    got = dense_attention_backward(do, q, k, v, out, lse, causal, scale, impl=impl)
    want = ref_grads(q, k, v, do, causal, scale)
    for name, a, e, x in zip(("dq", "dk", "dv"), got, want, (q, k, v)):
        assert a.dtype == torch.float32 and a.shape == x.shape, name
        assert rel_err(a, e) < 2e-2, name


@pytest.mark.gpu
@pytest.mark.parametrize("impl", GPU_IMPLS)
@pytest.mark.parametrize("hq, hkv", [(8, 8), (16, 4)])
def test_gpu_bf16_split_keys_ring_property(impl, hq, hkv):
    if impl not in available_impls("cuda"):
        pytest.skip(f"{impl} not available")
    q, k, v, do = gpu_inputs(1, hq, hkv, 1024, 2048, 128, seed=hq)
    split_keys_check(q, k, v, do, 1 / math.sqrt(128), impl, 2e-2, cut=768)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", GPU_IMPLS)
def test_gpu_bf16_causal_ring_step_merge(impl):
    if impl not in available_impls("cuda"):
        pytest.skip(f"{impl} not available")
    q, k, v, do = gpu_inputs(1, 16, 4, 2048, 2048, 128, seed=11)
    causal_ring_check(q, k, v, do, 1 / math.sqrt(128), impl, 2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", GPU_IMPLS + ("auto",))
def test_gpu_no_host_synchronisation(impl):
    if impl != "auto" and impl not in available_impls("cuda"):
        pytest.skip(f"{impl} not available")
    q, k, v, do = gpu_inputs(1, 16, 4, 2048, 2048, 128, seed=5)
    scale = 1 / math.sqrt(128)
    for causal in (True, False):  # build/compile every graph first
        out, lse = dense_attention_forward(q, k, v, causal, scale, impl=impl)
        dense_attention_backward(do, q, k, v, out, lse, causal, scale, impl=impl)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for causal in (True, False):
            out, lse = dense_attention_forward(q, k, v, causal, scale, impl=impl)
            dense_attention_backward(do, q, k, v, out, lse, causal, scale, impl=impl)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
