"""The Hopper kernels (kernels/hopper_fwd.py, hopper_bwd.py; Gluon, sm_90) against the reference and
the Triton kernels, and the choice between them (kernels/dispatch.py ``forward_kernel``,
``backward_kernel``; the whole table on the CPU: test_dispatch.py).

CPU: the kernels cross-compile for sm_90a in every configuration the dispatcher sends them, without
serialised wgmma; the choice and its errors. GPU (sm_90 only): the forward's out and lse against
the fp32 reference and the Triton forward on random indices (GQA 1/2/8, d 64/128, B 64/128, bf16
and fp16, empty and many columns, every slash offset, one block, no diagonal, packed documents),
ring steps merged through lse, Megatron's strided views; the backward (columns at any B, dQ and
key-block dK/dV at B = 128) against both on the same kinds of index, packed documents, ring steps and strided
views, bit-identical across runs; sparse_attention end to end.
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
from megatron_mtraining.config import Settings
from megatron_mtraining.kernels.dispatch import (backward_kernel, backward_parts, forward_kernel, hopper_device_reason,
                                                 hopper_forward_rows, hopper_unsupported_reason)
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
    assert sorted({e["kernel"] for e in configs.values()}) == ["dkdv", "dkdv_col", "dq", "fwd", "fwd_pp"]
    assert len(configs) == 37
    for name, e in configs.items():
        assert "error" not in e, (name, e.get("error"))
        assert e["ptxas_ok"] and not e["wgmma_serialized"], (name, e)
        assert e["cp_async_16"], (name, e)  # every copy a 16-byte piece
        d = e["config"]["HEAD_DIM"]
        if e["kernel"] == "fwd_pp":
            # Two consumer warpgroups and a producer warpgroup; Q and a ring of three 128-key tiles
            # (224 KB at d 128), in the 227 KB an sm_90 block may have.
            assert e["num_warps"] == 12, (name, e)
            assert e["shared_bytes"] <= (227 if d == 128 else 113) * 1024, (name, e)
            # Per consumer S (d/16) and PV (128/16), each in two places (tile 0 and the loop; the
            # loop and the last tile). A value kept across the loop spills (one store and one load
            # per program).
            assert e["wgmma"] == 4 * (d // 16 + 8), (name, e)
            spill_limit = 64
        else:
            rows = e["config"].get("KEYS", e["config"].get("ROWS", 64))
            assert e["num_warps"] == rows // 16, (name, e)  # a warpgroup per 64 rows
            # 64-row programs: two per SM (<= 113 KB each at d 128); 128-row ones: one (128 KB).
            limit_kb = 113 if rows == 64 else 128
            assert e["shared_bytes"] <= (limit_kb if d == 128 else limit_kb // 2) * 1024, (name, e)
            if e["kernel"] == "fwd":
                # Per tile d/16 wgmma for S and 64/16 for PV, each in two places (tile 0 and the
                # loop; the loop and the last tile). No spills.
                assert e["wgmma"] == 2 * (d // 16 + 4), (name, e)
                spill_limit = 0
            elif e["kernel"] == "dq":
                # Per key tile S and dP (d/16 each) and dQ (64/16), in the loop only.
                assert e["wgmma"] == 2 * (d // 16) + 4, (name, e)
                spill_limit = 64
            else:
                # Per query tile S^T and dP^T (d/16 each), dV and dK (64/16 each), in the loop only.
                # dK, dV and the two score tiles take ~230 of 255 registers at d 128: a few spill
                # (loop-invariant values and list scalars, reloaded from L1), no more.
                assert e["wgmma"] == 2 * (d // 16) + 8, (name, e)
                spill_limit = {"dkdv_col": 128, "dkdv": 192}[e["kernel"]]
        assert (e["spill_bytes"] or 0) <= (spill_limit if d == 128 else 0), (name, e)
        # Spill reloads inside a loop are paid per tile: the column kernel with 16 of them (the
        # program's tile kept across its loop) ran 60% slower than with 9. Today's counts are the
        # limits (the ping-pong forward's worst is its every-option build).
        loop_limit = {"fwd": 0, "dq": 0, "dkdv": 1, "dkdv_col": 10, "fwd_pp": 12}[e["kernel"]]
        assert e["loop_spill_loads"] is not None and e["loop_spill_loads"] <= loop_limit, (name, e)


def _cpu_plan(B=64, n=256):
    index = VSIndex.random(1, 2, n, B, max_slash=3, max_vertical=8, generator=torch.Generator().manual_seed(0))
    return single_device_plan(index, n)


def test_kernel_choice_on_cpu_is_triton_and_hopper_is_refused():
    q = torch.zeros(1, 2, 256, 128, dtype=torch.bfloat16)
    plan = _cpu_plan()
    assert forward_kernel(q, q, q, plan, q) == "triton" and backward_kernel(q, q, q, q, plan) == "triton"
    with pytest.raises(ValueError, match="cannot run this call: not a CUDA device"):
        forward_kernel(q, q, q, plan, q, "hopper")
    with pytest.raises(ValueError, match="backward kernel is set to hopper"):
        backward_kernel(q, q, q, q, plan, "hopper")
    with pytest.raises(ValueError, match="must be one of"):
        forward_kernel(q, q, q, plan, q, "cudnn")


def test_unsupported_reasons():
    ok = torch.zeros(1, 2, 256, 128, dtype=torch.bfloat16)
    assert hopper_unsupported_reason(64, dict(q=ok, k=ok, v=ok, out=ok)) == ""
    assert hopper_unsupported_reason(64, dict(q=ok, k=ok, v=ok, out=ok.float())) == ""  # the ring's fp32 accumulator
    assert "dtype" in hopper_unsupported_reason(64, dict(q=ok.float(), k=ok, v=ok, out=ok))
    odd = torch.zeros(1, 2, 256, 96, dtype=torch.bfloat16)
    assert "head_dim 96" in hopper_unsupported_reason(64, dict(q=odd, k=odd, v=odd, out=odd))
    assert "block size 32" in hopper_unsupported_reason(32, dict(q=ok, k=ok, v=ok, out=ok))
    # Rows that do not start on 16 bytes: a token stride of 132 elements (264 bytes).
    shifted = torch.zeros(1, 2, 256, 132, dtype=torch.bfloat16)[..., :128]
    assert "do's rows are not 16-byte" in hopper_unsupported_reason(64, dict(q=ok, k=ok, v=ok, do=shifted))


# ----------------------------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------------------------


def _forward(kernel, q, k, v, plan, out=None, lse=None, accumulate=False, **options):
    from megatron_mtraining.kernels.hopper_fwd import vs_attention_fwd_hopper
    from megatron_mtraining.kernels.triton_fwd import vs_attention_fwd_triton

    if out is None:
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], device=q.device)
    if kernel == "hopper":
        options.setdefault("rows", hopper_forward_rows(plan.block_size))
    fn = vs_attention_fwd_hopper if kernel == "hopper" else vs_attention_fwd_triton
    fn(q, k, v, plan, out, lse, q.shape[-1] ** -0.5, accumulate, **options)
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
    """Hopper out/lse against the Triton forward (same plan) and the fp32 reference: (out, lse)."""
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
    return got, got_lse


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



@pytest.mark.parametrize("n, d, hq, hkv, dtype, kind, docs", [
    (2048, 128, 4, 2, torch.bfloat16, "random", False),
    (2048, 128, 8, 1, torch.bfloat16, "many_columns", False),  # GQA 8, many 128-column tiles
    (1024, 64, 4, 4, torch.float16, "random", False),  # GQA 1, d 64, fp16
    (1024, 128, 4, 2, torch.bfloat16, "no_columns", False),
    (1024, 128, 4, 2, torch.bfloat16, "dense", False),
    (128, 128, 4, 2, torch.bfloat16, "random", False),  # a single block
    (1024, 128, 4, 2, torch.bfloat16, "no_diagonal", False),
    (2048, 128, 4, 2, torch.bfloat16, "random", True),
    (1024, 64, 4, 2, torch.bfloat16, "many_columns", True),
], ids=lambda x: str(x).replace("torch.", ""))
@pytest.mark.gpu
@needs_hopper
def test_pingpong_forward_at_128_token_blocks(n, d, hq, hkv, dtype, kind, docs):
    """B = 128's Hopper forward (hopper_fwd.py's ping-pong kernel: two ping-ponging warpgroups over
    128-key tiles) against the reference and the Triton forward (``_check``), the 64-row Hopper forward,
    itself run again (the same bits), and, for the ring's merge mode, itself merged twice."""
    B = 128
    g = torch.Generator().manual_seed(n + d + docs)
    q, k, v = (torch.randn(2, h, n, d, generator=g).to("cuda", dtype) for h in (hq, hkv, hkv))
    index = _index(kind, 2, hq, n, B, g).to("cuda")
    cu = torch.tensor([0, 100, 101, 700, n], dtype=torch.int32, device="cuda") if docs else None
    plan = single_device_plan(index, n, documents=as_documents(cu, n, B, q.device))
    got, got_lse = _check(q, k, v, index, plan, cu_seqlens=cu)
    want, want_lse = _forward("hopper", q, k, v, plan, rows=64)
    assert rel_err(got, want) < 2e-3
    finite = torch.isfinite(want_lse)
    torch.testing.assert_close(got_lse[finite], want_lse[finite], rtol=0, atol=1e-3)
    again, again_lse = _forward("hopper", q, k, v, plan)
    assert torch.equal(again, got) and torch.equal(again_lse, got_lse)
    out32, lse2 = got.float(), got_lse.clone()
    _forward("hopper", q, k, v, plan, out32, lse2, accumulate=True)
    assert rel_err(out32, got.float()) < 1e-3
    torch.testing.assert_close(lse2[finite], got_lse[finite] + math.log(2), rtol=0, atol=1e-4)


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



@pytest.mark.parametrize("layout, docs, B", [("striped", False, 64), ("zigzag", False, 64), ("striped", True, 64),
                                             ("zigzag", False, 128), ("striped", True, 128)])
@pytest.mark.gpu
@needs_hopper
def test_ring_steps_merge_into_the_full_result(layout, docs, B):
    """Every (query chunk, key chunk) step of a W = 2 ring, merged through lse into fp32 out."""
    from test_step import striped_blocks, token_rows, zigzag_blocks

    n, d, hq, hkv, world = 2048, 128, 4, 2, 2
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



@pytest.mark.parametrize("B", [64, 128])
@pytest.mark.gpu
@needs_hopper
def test_megatron_strided_views_give_the_same_bits(B):
    """q, k, v, out as [b, h, s, d] views of Megatron's [s, b, h, d]: the same result as compact copies."""
    n, d, hq, hkv, b = 1024, 128, 8, 2, 2
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
    the Triton kernels (``Settings(forward_kernel="triton", ...)``) gives the same output and
    gradients within bf16 rounding."""
    import megatron_mtraining.kernels.hopper_fwd as hopper_fwd

    calls = []
    real = hopper_fwd.vs_attention_fwd_hopper
    monkeypatch.setattr(hopper_fwd, "vs_attention_fwd_hopper", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    n, d, hq, hkv = 2048, 128, 8, 2
    g = torch.Generator().manual_seed(5)
    base = [torch.randn(1, h, n, d, generator=g).to("cuda", torch.bfloat16) for h in (hq, hkv, hkv)]
    index = VSIndex.random(1, hq, n, 64, max_slash=10, max_vertical=100, generator=g).to("cuda")
    grad = torch.randn(1, hq, n, d, generator=g).to("cuda", torch.bfloat16)
    results = []
    for choice in ("auto", "triton"):
        settings = Settings(forward_kernel=choice, backward_kernel=choice)
        q, k, v = (x.clone().requires_grad_() for x in base)
        out = sparse_attention(q, k, v, index, softmax_scale=1 / math.sqrt(d), settings=settings)
        results.append([out, *torch.autograd.grad(out, (q, k, v), grad)])
        assert len(calls) == 1  # the first run's forward only
    for name, a, e in zip(("out", "dq", "dk", "dv"), *results):
        assert rel_err(a, e) < 5e-3, name



@pytest.mark.gpu
@needs_hopper
def test_forcing_hopper_on_an_uncovered_call_is_an_error():
    q = torch.zeros(1, 2, 256, 128, device="cuda")  # fp32
    index = VSIndex.random(1, 2, 256, 64, generator=torch.Generator().manual_seed(0)).to("cuda")
    with pytest.raises(ValueError, match="dtype torch.float32"):
        step_forward("triton", q, q, q, single_device_plan(index, 256), torch.empty_like(q),
                     torch.empty(1, 2, 256, device="cuda"), 0.1, False, settings=Settings(forward_kernel="hopper"))


def _backward(kernels, q, k, v, do, plan, accumulate_dq=True):
    """The backward on ``kernels`` ("hopper" or "triton"): (dq, dk, dv) in fp32 (dq in q's dtype,
    written rather than added, with ``accumulate_dq=False``: the single-step path)."""
    from megatron_mtraining.kernels.step import vs_attention_backward

    out, lse = _forward("triton", q, k, v, plan)
    delta = (do.float() * out.float()).sum(-1)
    dq = torch.zeros(q.shape, device=q.device) if accumulate_dq else torch.empty_like(q)
    dk = torch.zeros(k.shape, device=q.device)
    dv = torch.zeros(k.shape, device=q.device)
    vs_attention_backward(q, k, v, do, lse, delta, plan, dq, dk, dv, q.shape[-1] ** -0.5,
                          backward_parts(kernels, plan.block_size), accumulate_dq=accumulate_dq)
    return dq.float(), dk, dv


def _check_backward(q, k, v, do, index, plan, cu_seqlens=None, accumulate_dq=True):
    """The Hopper backward against the Triton kernels (same plan) and the fp32 reference's
    autograd, bit-identical across two runs (deterministic: one writer per query row and per key
    row, a fixed-order reduction of the column partials)."""
    got = _backward("hopper", q, k, v, do, plan, accumulate_dq)
    again = _backward("hopper", q, k, v, do, plan, accumulate_dq)
    tri = _backward("triton", q, k, v, do, plan, accumulate_dq)
    q32, k32, v32 = (x.float().requires_grad_() for x in (q, k, v))
    ref_out, _ = reference_attention(q32, k32, v32, index, cu_seqlens=cu_seqlens)
    want = torch.autograd.grad(ref_out, (q32, k32, v32), do.float())
    for name, a, b, t, e in zip(("dq", "dk", "dv"), got, again, tri, want):
        assert torch.equal(a, b), name
        assert rel_err(a, t) < 2e-3, name
        assert rel_err(a, e) < 2e-2, name


@pytest.mark.parametrize("n, B, d, hq, hkv, kind, docs, accumulate_dq", [
    (2048, 64, 128, 8, 2, "random", False, True),
    (2048, 64, 128, 8, 2, "random", False, False),  # one step: dq written in bf16
    (2048, 64, 128, 8, 1, "many_columns", False, True),  # GQA 8, several column tiles
    (1024, 64, 64, 4, 4, "random", False, True),  # GQA 1, d 64
    (2048, 128, 128, 4, 2, "many_columns", False, True),
    (1024, 128, 64, 4, 2, "no_columns", False, True),  # B 128: two query tiles per listed block
    (1024, 64, 128, 4, 2, "no_diagonal", False, True),  # the token-level causal test of the columns
    (1024, 64, 128, 4, 2, "random", True, True),
    # B = 128: dQ and key-block dK/dV on the Hopper kernels too (B = 64 runs Triton's).
    (1024, 128, 128, 4, 2, "random", True, True),
    (2048, 128, 128, 8, 2, "random", False, False),  # one step: dq written in bf16
    (1024, 128, 128, 4, 2, "dense", False, True),  # every slash offset: the longest transposed lists
    (1024, 128, 128, 16, 1, "random", False, True),  # GQA 16: the group's heads in two passes of 8
    (1024, 128, 128, 12, 2, "no_columns", False, True),  # GQA 6: one pass with two empty head slots
    (1024, 128, 128, 4, 4, "no_diagonal", False, True),  # GQA 1
    (128, 128, 128, 4, 2, "random", False, True),  # a single block
    (64, 64, 128, 4, 2, "random", False, True),
], ids=lambda x: str(x))
@pytest.mark.gpu
@needs_hopper
def test_backward_matches_reference_and_triton(n, B, d, hq, hkv, kind, docs, accumulate_dq):
    g = torch.Generator().manual_seed(n + d + hq)
    q, k, v, do = (torch.randn(2, h, n, d, generator=g).to("cuda", torch.bfloat16) for h in (hq, hkv, hkv, hq))
    index = _index(kind, 2, hq, n, B, g).to("cuda")
    cu = torch.tensor([0, 100, 101, 700, n], dtype=torch.int32, device="cuda") if docs else None
    plan = single_device_plan(index, n, documents=as_documents(cu, n, B, q.device))
    _check_backward(q, k, v, do, index, plan, cu_seqlens=cu, accumulate_dq=accumulate_dq)


@pytest.mark.parametrize("B", [64, 128])
@pytest.mark.parametrize("lengths", [[1, 63, 64, 200, 1, 695], [8] * 128], ids=["mixed", "tiny"])
@pytest.mark.gpu
@needs_hopper
def test_backward_packed_documents(lengths, B):
    n, d, hq, hkv = 1024, 128, 4, 2
    g = torch.Generator().manual_seed(len(lengths))
    q, k, v, do = (torch.randn(1, h, n, d, generator=g).to("cuda", torch.bfloat16) for h in (hq, hkv, hkv, hq))
    index = VSIndex.random(1, hq, n, B, max_slash=8, max_vertical=300, generator=g).to("cuda")
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    plan = single_device_plan(index, n, documents=as_documents(cu, n, B, q.device))
    _check_backward(q, k, v, do, index, plan, cu_seqlens=cu)


@pytest.mark.parametrize("B", [64, 128])
@pytest.mark.parametrize("layout", ["striped", "zigzag"])
@pytest.mark.gpu
@needs_hopper
def test_ring_step_backward(layout, B):
    """A (query chunk, key chunk) step of a W = 2 ring: another rank's keys, so transposed lists
    that are empty or hold no diagonal, and columns of the other chunk."""
    from test_step import striped_blocks, zigzag_blocks

    n, d, hq, hkv = 2048, 128, 4, 2
    nb = n // B
    blocks = striped_blocks if layout == "striped" else zigzag_blocks
    g = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(1, h, n // 2, d, generator=g).to("cuda", torch.bfloat16) for h in (hq, hkv, hkv, hq))
    index = VSIndex.random(1, hq, n, B, max_slash=8, max_vertical=300, generator=g).to("cuda")
    for q_rank, k_rank in ((1, 0), (0, 1)):
        plan = build_step_plan(index, blocks(nb, 2, q_rank), blocks(nb, 2, k_rank), nb)
        got, tri = _backward("hopper", q, k, v, do, plan), _backward("triton", q, k, v, do, plan)
        for name, a, t in zip(("dq", "dk", "dv"), got, tri):
            assert rel_err(a, t) < 2e-3, (q_rank, k_rank, name)


@pytest.mark.gpu
@needs_hopper
def test_backward_megatron_strided_views_give_the_same_bits():
    """Megatron's [s, b, h, d] tensors as [b, h, s, d] views: the same gradients as compact copies."""
    n, B, d, hq, hkv = 1024, 128, 128, 4, 2
    g = torch.Generator().manual_seed(5)
    views = [torch.randn(n, 2, h, d, generator=g).to("cuda", torch.bfloat16).permute(1, 2, 0, 3)
             for h in (hq, hkv, hkv, hq)]
    index = VSIndex.random(2, hq, n, B, max_slash=8, max_vertical=200, generator=g).to("cuda")
    plan = single_device_plan(index, n)
    got = _backward("hopper", *views, plan)
    want = _backward("hopper", *(x.contiguous() for x in views), plan)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert torch.equal(a, b), name


def test_the_choice_is_logged_once(monkeypatch, caplog):
    import logging

    from megatron_mtraining.kernels import dispatch

    monkeypatch.setattr(dispatch, "_ANNOUNCED", set())
    q = torch.zeros(1, 2, 256, 128, dtype=torch.bfloat16)
    plan = _cpu_plan()
    with caplog.at_level(logging.INFO, logger="megatron_mtraining.kernels.dispatch"):
        for _ in range(3):
            forward_kernel(q, q, q, plan, q)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1, said
    assert said[0].startswith("MTraining: forward on the Triton kernel (the Hopper one does not cover this call: "
                              "not a CUDA device (cpu"), said
