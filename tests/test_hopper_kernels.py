"""The Hopper kernels (kernels/hopper_fwd.py, hopper_bwd.py; Gluon, sm_90) against the reference and
the Triton kernels, and the choice between them (kernels/step.py ``forward_kernel``,
``backward_kernel``).

CPU: the kernels cross-compile for sm_90a in every configuration the dispatcher sends them, without
serialised wgmma; the choice and its errors. GPU (sm_90 only): the forward's out and lse against
the fp32 reference and the Triton forward on random indices (GQA 1/2/8, d 64/128, B 64/128, bf16
and fp16, empty and many columns, every slash offset, one block, no diagonal, packed documents),
ring steps merged through lse, Megatron's strided views; the column gradients (dK, dV) against
both, bit-identical across runs; sparse_attention end to end.
"""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from megatron_mtraining import VSIndex, reference_attention, sparse_attention
from megatron_mtraining.documents import as_documents
from megatron_mtraining.kernels import build_step_plan, single_device_plan, step_forward
from megatron_mtraining.kernels.step import (BACKWARD_KERNEL_ENV, FORWARD_KERNEL_ENV, backward_kernel, forward_kernel,
                                             hopper_device_reason)
from oracle import rel_err

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOPPER = torch.cuda.is_available() and not hopper_device_reason(torch.device("cuda"))
needs_hopper = pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU with Gluon")


# ----------------------------------------------------------------------------------------------
# CPU
# ----------------------------------------------------------------------------------------------


def test_cross_compiles_for_sm90a_without_serialised_wgmma(tmp_path):
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    out = tmp_path / "compile.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tests", "sm90_compile.py"), "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    configs = json.loads(out.read_text())["configs"]
    assert sorted({e["kernel"] for e in configs.values()}) == ["dkdv_col", "fwd"] and len(configs) == 15
    for name, e in configs.items():
        assert "error" not in e, (name, e.get("error"))
        assert e["ptxas_ok"] and not e["wgmma_serialized"], (name, e)
        assert e["num_warps"] == 4 and e["cp_async_16"], (name, e)  # every copy a 16-byte piece
        d = e["config"]["HEAD_DIM"]
        # Two programs per SM (<= 113 KB each at d 128).
        assert e["shared_bytes"] <= (113 if d == 128 else 64) * 1024, (name, e)
        if e["kernel"] == "fwd":
            # Per tile d/16 wgmma for S and 64/16 for PV, each in two places (tile 0 and the
            # loop; the loop and the last tile). No spills.
            assert e["wgmma"] == 2 * (d // 16 + 4) and not e["spills"], (name, e)
        else:
            # Per query tile S^T and dP^T (d/16 each), dV and dK (64/16 each), in the loop only.
            # dK, dV and the two score tiles take ~230 of 255 registers at d 128: a few spill
            # (loop-invariant values, reloaded from L1), no more.
            assert e["wgmma"] == 2 * (d // 16) + 8, (name, e)
            assert (e["spill_bytes"] or 0) <= (128 if d == 128 else 0), (name, e)


def _cpu_plan(B=64, n=256):
    index = VSIndex.random(1, 2, n, B, max_slash=3, max_vertical=8, generator=torch.Generator().manual_seed(0))
    return single_device_plan(index, n)


def test_kernel_choice_on_cpu_is_triton_and_hopper_is_refused(monkeypatch):
    q = torch.zeros(1, 2, 256, 128, dtype=torch.bfloat16)
    plan = _cpu_plan()
    monkeypatch.delenv(FORWARD_KERNEL_ENV, raising=False)
    monkeypatch.delenv(BACKWARD_KERNEL_ENV, raising=False)
    assert forward_kernel(q, q, q, plan, q) == "triton" and backward_kernel(q, q, q, q, plan) == "triton"
    monkeypatch.setenv(FORWARD_KERNEL_ENV, "hopper")
    with pytest.raises(ValueError, match="cannot run this call: not a CUDA device"):
        forward_kernel(q, q, q, plan, q)
    monkeypatch.setenv(BACKWARD_KERNEL_ENV, "hopper")
    with pytest.raises(ValueError, match="MTRAINING_BACKWARD_KERNEL=hopper"):
        backward_kernel(q, q, q, q, plan)
    monkeypatch.setenv(FORWARD_KERNEL_ENV, "cudnn")
    with pytest.raises(ValueError, match="must be one of"):
        forward_kernel(q, q, q, plan, q)


def test_unsupported_reasons():
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from megatron_mtraining.kernels.hopper_common import unsupported_reason

    plan = _cpu_plan()
    ok = torch.zeros(1, 2, 256, 128, dtype=torch.bfloat16)
    assert unsupported_reason(plan, dict(q=ok, k=ok, v=ok, out=ok)) == ""
    assert unsupported_reason(plan, dict(q=ok, k=ok, v=ok, out=ok.float())) == ""  # the ring's fp32 accumulator
    assert "dtype" in unsupported_reason(plan, dict(q=ok.float(), k=ok, v=ok, out=ok))
    odd = torch.zeros(1, 2, 256, 96, dtype=torch.bfloat16)
    assert "head_dim 96" in unsupported_reason(plan, dict(q=odd, k=odd, v=odd, out=odd))
    assert "block size 32" in unsupported_reason(_cpu_plan(B=32), dict(q=ok, k=ok, v=ok, out=ok))
    # Rows that do not start on 16 bytes: a token stride of 132 elements (264 bytes).
    shifted = torch.zeros(1, 2, 256, 132, dtype=torch.bfloat16)[..., :128]
    assert "do's rows are not 16-byte" in unsupported_reason(plan, dict(q=ok, k=ok, v=ok, do=shifted))


# ----------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------


def _forward(kernel, q, k, v, plan, out=None, lse=None, accumulate=False):
    from megatron_mtraining.kernels.hopper_fwd import vs_attention_fwd_hopper
    from megatron_mtraining.kernels.triton_fwd import vs_attention_fwd_triton

    if out is None:
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], device=q.device)
    fn = vs_attention_fwd_hopper if kernel == "hopper" else vs_attention_fwd_triton
    fn(q, k, v, plan, out, lse, q.shape[-1] ** -0.5, accumulate)
    return out, lse


def _index(kind, b, hq, n, B, g):
    if kind == "dense":  # every slash offset: the longest lists
        return VSIndex.dense(b, hq, n, B)
    if kind == "no_columns":
        return VSIndex.random(b, hq, n, B, max_slash=12, max_vertical=0, generator=g)
    if kind == "many_columns":  # several column tiles per block, beyond one 64-bit word
        return VSIndex.random(b, hq, n, B, max_slash=4, max_vertical=n // 2, generator=g)
    index = VSIndex.random(b, hq, n, B, max_slash=12, max_vertical=200, generator=g)
    if kind == "no_diagonal":  # outside the contract (offset 0 missing): the columns' token-level test
        index.slash += 1  # distinct offsets from 1 up (past the last block they select nothing)
    return index


def _check(q, k, v, index, plan, cu_seqlens=None):
    """Hopper out/lse against the Triton forward (same plan) and the fp32 reference."""
    got, got_lse = _forward("hopper", q, k, v, plan)
    tri, tri_lse = _forward("triton", q, k, v, plan)
    ref, ref_lse = reference_attention(q.float(), k.float(), v.float(), index, cu_seqlens=cu_seqlens)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(got_lse), finite)  # rows with no key: lse -inf, out 0
    assert (got[~finite] == 0).all()
    assert rel_err(got, tri) < 2e-3
    assert rel_err(got, ref) < 1e-2
    torch.testing.assert_close(got_lse[finite], ref_lse[finite], rtol=0, atol=2e-2)
    torch.testing.assert_close(got_lse[finite], tri_lse[finite], rtol=0, atol=1e-3)


@pytest.mark.parametrize("n, B, d, hq, hkv, dtype, kind", [
    (2048, 64, 128, 8, 2, torch.bfloat16, "random"),
    (2048, 64, 128, 8, 1, torch.bfloat16, "many_columns"),  # GQA 8
    (1024, 64, 64, 4, 4, torch.float16, "random"),  # GQA 1, d 64, fp16
    (2048, 128, 128, 4, 2, torch.bfloat16, "random"),
    (1024, 128, 64, 4, 2, torch.bfloat16, "many_columns"),
    (1024, 64, 128, 4, 2, torch.bfloat16, "no_columns"),
    (1024, 64, 128, 4, 2, torch.bfloat16, "dense"),
    (64, 64, 128, 4, 2, torch.bfloat16, "random"),  # a single block
    (1024, 64, 128, 4, 2, torch.bfloat16, "no_diagonal"),
], ids=lambda x: str(x).replace("torch.", ""))
@pytest.mark.gpu
@needs_hopper
def test_matches_reference_and_triton(n, B, d, hq, hkv, dtype, kind):
    g = torch.Generator().manual_seed(n + B + d)
    q, k, v = (torch.randn(2, h, n, d, generator=g).to("cuda", dtype) for h in (hq, hkv, hkv))
    index = _index(kind, 2, hq, n, B, g).to("cuda")
    _check(q, k, v, index, single_device_plan(index, n))



@pytest.mark.parametrize("lengths", [
    [1, 63, 64, 200, 1, 695],  # a one-token document, one block exactly, boundaries inside blocks
    [1024],  # one document: the unpacked result
    [8] * 128,  # many tiny documents
], ids=["mixed", "one", "tiny"])
@pytest.mark.gpu
@needs_hopper
def test_packed_documents(lengths):
    n, B, d, hq, hkv = 1024, 64, 128, 4, 2
    g = torch.Generator().manual_seed(len(lengths))
    q, k, v = (torch.randn(1, h, n, d, generator=g).to("cuda", torch.bfloat16) for h in (hq, hkv, hkv))
    index = VSIndex.random(1, hq, n, B, max_slash=8, max_vertical=300, generator=g).to("cuda")
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    plan = single_device_plan(index, n, documents=as_documents(cu, n, B, q.device))
    _check(q, k, v, index, plan, cu_seqlens=cu)
    if len(lengths) == 1:  # one document equals no documents, bit for bit
        assert torch.equal(_forward("hopper", q, k, v, plan)[0], _forward("hopper", q, k, v,
                                                                           single_device_plan(index, n))[0])



@pytest.mark.parametrize("layout, docs", [("striped", False), ("zigzag", False), ("striped", True)])
@pytest.mark.gpu
@needs_hopper
def test_ring_steps_merge_into_the_full_result(layout, docs):
    """Every (query chunk, key chunk) step of a W = 2 ring, merged through lse into fp32 out."""
    from test_step import striped_blocks, token_rows, zigzag_blocks

    n, B, d, hq, hkv, world = 2048, 64, 128, 4, 2, 2
    nb = n // B
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, h, n, d, generator=g).to("cuda", torch.bfloat16) for h in (hq, hkv, hkv))
    index = VSIndex.random(1, hq, n, B, max_slash=10, max_vertical=150, generator=g).to("cuda")
    cu = torch.tensor([0, 300, 301, 1100, 2048], dtype=torch.int32, device="cuda") if docs else None
    documents = as_documents(cu, n, B, q.device)
    ref, ref_lse = reference_attention(q.float(), k.float(), v.float(), index, cu_seqlens=cu)
    chunks = [(striped_blocks if layout == "striped" else zigzag_blocks)(nb, world, r) for r in range(world)]
    rows = [token_rows(c, B).cuda() for c in chunks]
    for r in range(world):
        results = []
        for kernel in ("hopper", "triton"):
            out = torch.zeros(1, hq, len(rows[r]), d, device="cuda")
            lse = torch.full((1, hq, len(rows[r])), float("-inf"), device="cuda")
            for step in range(world):
                s = (r - step) % world
                plan = build_step_plan(index, chunks[r], chunks[s], nb, documents=documents)
                _forward(kernel, q[:, :, rows[r]], k[:, :, rows[s]], v[:, :, rows[s]], plan, out, lse,
                         accumulate=True)
            results.append((out, lse))
        (out, lse), (tri, tri_lse) = results
        assert rel_err(out, ref[:, :, rows[r]]) < 1e-2
        assert rel_err(out, tri) < 2e-3
        torch.testing.assert_close(lse, ref_lse[:, :, rows[r]], rtol=0, atol=2e-2)



@pytest.mark.gpu
@needs_hopper
def test_megatron_strided_views_give_the_same_bits():
    """q, k, v, out as [b, h, s, d] views of Megatron's [s, b, h, d]: the same result as compact copies."""
    n, B, d, hq, hkv, b = 1024, 64, 128, 8, 2, 2
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(n, b, h, d, generator=g).to("cuda", torch.bfloat16).permute(1, 2, 0, 3)
               for h in (hq, hkv, hkv))
    index = VSIndex.random(b, hq, n, B, max_slash=8, max_vertical=100, generator=g).to("cuda")
    plan = single_device_plan(index, n)
    out = torch.empty(n, b, hq, d, device="cuda", dtype=torch.bfloat16).permute(1, 2, 0, 3)
    lse = torch.empty(b, hq, n, device="cuda")
    assert forward_kernel(q, k, v, plan, out) == "hopper"
    _forward("hopper", q, k, v, plan, out, lse)
    want, want_lse = _forward("hopper", *(x.contiguous() for x in (q, k, v)), plan)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)



@pytest.mark.gpu
@needs_hopper
def test_sparse_attention_takes_the_hopper_forward(monkeypatch):
    """The default path on an sm_90 GPU runs the Hopper forward (and Triton's backward); forcing
    MTRAINING_FORWARD_KERNEL=triton gives the same output and gradients within bf16 rounding."""
    import megatron_mtraining.kernels.hopper_fwd as hopper_fwd

    calls = []
    real = hopper_fwd.vs_attention_fwd_hopper
    monkeypatch.setattr(hopper_fwd, "vs_attention_fwd_hopper", lambda *a: calls.append(1) or real(*a))
    n, d, hq, hkv = 2048, 128, 8, 2
    g = torch.Generator().manual_seed(5)
    base = [torch.randn(1, h, n, d, generator=g).to("cuda", torch.bfloat16) for h in (hq, hkv, hkv)]
    index = VSIndex.random(1, hq, n, 64, max_slash=10, max_vertical=100, generator=g).to("cuda")
    grad = torch.randn(1, hq, n, d, generator=g).to("cuda", torch.bfloat16)
    results = []
    for choice in ("auto", "triton"):
        monkeypatch.setenv(FORWARD_KERNEL_ENV, choice)
        monkeypatch.setenv(BACKWARD_KERNEL_ENV, choice)
        q, k, v = (x.clone().requires_grad_() for x in base)
        out = sparse_attention(q, k, v, index, softmax_scale=1 / math.sqrt(d))
        results.append([out, *torch.autograd.grad(out, (q, k, v), grad)])
        assert len(calls) == 1  # the first run's forward only
    for name, a, e in zip(("out", "dq", "dk", "dv"), *results):
        assert rel_err(a, e) < 5e-3, name



@pytest.mark.gpu
@needs_hopper
def test_forcing_hopper_on_an_uncovered_call_is_an_error(monkeypatch):
    monkeypatch.setenv(FORWARD_KERNEL_ENV, "hopper")
    q = torch.zeros(1, 2, 256, 128, device="cuda")  # fp32
    index = VSIndex.random(1, 2, 256, 64, generator=torch.Generator().manual_seed(0)).to("cuda")
    with pytest.raises(ValueError, match="dtype torch.float32"):
        step_forward("triton", q, q, q, single_device_plan(index, 256), torch.empty_like(q),
                     torch.empty(1, 2, 256, device="cuda"), 0.1, False)


def _backward(column_kernel, q, k, v, do, plan):
    """Triton's backward with its column gradients from ``column_kernel``: (dq, dk, dv) in fp32."""
    from megatron_mtraining.kernels.triton_bwd import vs_attention_bwd_triton

    out, lse = _forward("triton", q, k, v, plan)
    delta = (do.float() * out.float()).sum(-1)
    dq = torch.zeros(q.shape, device=q.device)
    dk = torch.zeros(k.shape, device=q.device)
    dv = torch.zeros(k.shape, device=q.device)
    vs_attention_bwd_triton(q, k, v, do, lse, delta, plan, dq, dk, dv, q.shape[-1] ** -0.5,
                            column_kernel=column_kernel)
    return dq, dk, dv


@pytest.mark.parametrize("n, B, d, hq, hkv, kind, docs", [
    (2048, 64, 128, 8, 2, "random", False),
    (2048, 64, 128, 8, 1, "many_columns", False),  # GQA 8, several column tiles
    (1024, 64, 64, 4, 4, "random", False),  # GQA 1, d 64
    (2048, 128, 128, 4, 2, "many_columns", False),
    (1024, 64, 128, 4, 2, "no_diagonal", False),  # the token-level causal test of the columns
    (1024, 64, 128, 4, 2, "random", True),
], ids=lambda x: str(x))
@pytest.mark.gpu
@needs_hopper
def test_column_gradients_match_reference_and_triton(n, B, d, hq, hkv, kind, docs):
    g = torch.Generator().manual_seed(n + d + hq)
    q, k, v, do = (torch.randn(2, h, n, d, generator=g).to("cuda", torch.bfloat16) for h in (hq, hkv, hkv, hq))
    index = _index(kind, 2, hq, n, B, g).to("cuda")
    cu = torch.tensor([0, 100, 101, 700, n], dtype=torch.int32, device="cuda") if docs else None
    plan = single_device_plan(index, n, documents=as_documents(cu, n, B, q.device))
    assert plan.cols.shape[-1] > 0
    got = _backward("hopper", q, k, v, do, plan)
    again = _backward("hopper", q, k, v, do, plan)
    tri = _backward("triton", q, k, v, do, plan)
    q32, k32, v32 = (x.float().requires_grad_() for x in (q, k, v))
    ref_out, _ = reference_attention(q32, k32, v32, index, cu_seqlens=cu)
    want = torch.autograd.grad(ref_out, (q32, k32, v32), do.float())
    for name, a, b, t, e in zip(("dq", "dk", "dv"), got, again, tri, want):
        assert torch.equal(a, b), name  # deterministic: a fixed-order reduction, no atomics
        assert rel_err(a, t) < 2e-3, name
        assert rel_err(a, e) < 2e-2, name


@pytest.mark.gpu
@needs_hopper
def test_ring_step_column_gradients():
    """A (query chunk, key chunk) step of a striped W = 2 ring: columns of another rank's chunk."""
    from test_step import striped_blocks

    n, B, d, hq, hkv = 2048, 64, 128, 4, 2
    nb = n // B
    g = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(1, h, n // 2, d, generator=g).to("cuda", torch.bfloat16) for h in (hq, hkv, hkv, hq))
    index = VSIndex.random(1, hq, n, B, max_slash=8, max_vertical=300, generator=g).to("cuda")
    plan = build_step_plan(index, striped_blocks(nb, 2, 1), striped_blocks(nb, 2, 0), nb)
    assert plan.cols.shape[-1] > 0
    got, tri = _backward("hopper", q, k, v, do, plan), _backward("triton", q, k, v, do, plan)
    for name, a, t in zip(("dq", "dk", "dv"), got, tri):
        assert rel_err(a, t) < 2e-3, name


def test_the_choice_is_logged_once(monkeypatch, caplog):
    import logging

    from megatron_mtraining.kernels import step

    monkeypatch.delenv(FORWARD_KERNEL_ENV, raising=False)
    monkeypatch.setattr(step, "_ANNOUNCED", set())
    q = torch.zeros(1, 2, 256, 128, dtype=torch.bfloat16)
    plan = _cpu_plan()
    with caplog.at_level(logging.INFO, logger="megatron_mtraining.kernels.step"):
        for _ in range(3):
            forward_kernel(q, q, q, plan, q)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1, said
    assert said[0].startswith("MTraining: forward on the Triton kernel (the Hopper one does not cover this call: "
                              "not a CUDA device (cpu"), said
