"""The fused dQ schedule (``MTRAINING_DQ_SCHEDULE=fused``, ``kernels/triton_bwd.py``): the key-block
kernel adds each tile's dS K into fp32 dQ in a fixed order, behind per-(head, query block) turn
counters, instead of the dQ kernel recomputing S and dP. (``atomic``: the same adds, unordered.)

On the CPU the Triton kernels run in the interpreter, one program after another in launch order;
there every add must find its turn already come (a wrong turn count raises instead of hanging, as
it would on a GPU), so these tests check the order itself as well as the numbers: forward and all
three gradients against the float64 oracle, with and without documents, GQA 1/2/8, one key tile
per index block and two (B = 128), ring steps of both layouts against the PyTorch step, and dQ
bit-identical from run to run. On the GPU (``-m gpu``) the same against the split schedule.
"""

from __future__ import annotations

import pytest
import torch

from dist_utils import interpreter_works
from megatron_mtraining import VSIndex, sparse_attention
from megatron_mtraining.kernels import triton_bwd
from megatron_mtraining.kernels.plan import build_step_plan
from megatron_mtraining.kernels.step import backward_delta, step_backward, step_forward
from megatron_mtraining.layout import local_block_ids
from oracle import attention_f64, dense_mask, rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not interpreter_works() and DEVICE == "cpu",
                                reason="Triton's interpreter needs numpy < 2.4")


@pytest.fixture
def fused(monkeypatch):
    monkeypatch.setenv(triton_bwd.DQ_SCHEDULE_ENV, "fused")


def inputs(b, hq, hkv, n, d, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=g).to(DEVICE, dtype).requires_grad_() for h in (hq, hkv, hkv)]


def gradients(q, k, v, index, cu_seqlens=None, seed=7):
    out = sparse_attention(q, k, v, index, backend="triton", cu_seqlens=cu_seqlens)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out)
    return (out, *torch.autograd.grad(out, (q, k, v), grad)), grad


def check_against_oracle(q, k, v, index, cu_seqlens=None, tol=2e-5):
    (out, *got), grad = gradients(q, k, v, index, cu_seqlens)
    cu = None if cu_seqlens is None else cu_seqlens.tolist()
    expected = attention_f64(q, k, v, dense_mask(index, q.shape[2], cu_seqlens=cu).to(q.device))
    want = torch.autograd.grad(expected, (q, k, v), grad.to(expected.dtype))
    assert rel_err(out, expected) < tol, "forward"
    for name, a, e in zip(("dq", "dk", "dv"), got, want):
        assert torch.isfinite(a).all(), name
        assert rel_err(a, e) < tol, f"{name}: {rel_err(a, e)}"
    return got


@pytest.mark.parametrize("group", [1, 2, 8])
@pytest.mark.parametrize("block", [16, 128])
def test_fused_dq_matches_the_oracle(fused, group, block):
    """B = 16: one key tile per block; B = 128 (fp32 tiles of 64): two tiles of one block add in turn."""
    hkv = 1 if group == 8 else 2
    n = 6 * block if block == 16 else 3 * block
    q, k, v = inputs(1, hkv * group, hkv, n, 32, seed=group + block)
    index = VSIndex.random(1, hkv * group, n, block, max_slash=4, max_vertical=24,
                           generator=torch.Generator().manual_seed(group))
    check_against_oracle(q, k, v, index.to(DEVICE))


@pytest.mark.parametrize("case", ["diagonal_only", "dense", "no_columns", "batch_two"])
def test_fused_dq_edge_indices(fused, case):
    n, B = 128, 16
    b = 2 if case == "batch_two" else 1
    q, k, v = inputs(b, 4, 2, n, 16, seed=len(case))
    if case == "diagonal_only":
        index = VSIndex.from_lists([[[0]] * 4], [[[]] * 4], block_size=B)
    elif case == "dense":
        index = VSIndex.dense(b, 4, n, B)
    elif case == "no_columns":
        index = VSIndex.from_lists([[[0, 1, 5, 7]] * 4], [[[]] * 4], block_size=B)
    else:
        index = VSIndex.random(b, 4, n, B, max_slash=5, max_vertical=12, generator=torch.Generator().manual_seed(3))
    check_against_oracle(q, k, v, index.to(DEVICE))


@pytest.mark.parametrize("ends", [[0, 1, 37, 64, 80, 81, 150, 192], [0, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 192]])
def test_fused_dq_with_documents(fused, ends):
    """Key blocks of earlier documents leave both lists: the turn counts skip them too."""
    q, k, v = inputs(1, 4, 2, 192, 16, seed=len(ends))
    index = VSIndex.random(1, 4, 192, 16, max_slash=6, max_vertical=20, generator=torch.Generator().manual_seed(2))
    check_against_oracle(q, k, v, index.to(DEVICE), torch.tensor(ends, dtype=torch.int32, device=DEVICE))


def test_fused_dq_is_deterministic_and_equals_the_split_schedule(monkeypatch):
    q, k, v = inputs(1, 4, 2, 192, 32, seed=5)
    index = VSIndex.random(1, 4, 192, 16, max_slash=6, max_vertical=20,
                           generator=torch.Generator().manual_seed(5)).to(DEVICE)
    split, _ = gradients(q, k, v, index)
    monkeypatch.setenv(triton_bwd.DQ_SCHEDULE_ENV, "fused")
    first, _ = gradients(q, k, v, index)
    second, _ = gradients(q, k, v, index)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    assert torch.equal(first[0], split[0]) and torch.equal(first[2], split[2])  # out and dK: the same kernels
    assert torch.equal(first[3], split[3])  # dV
    assert rel_err(first[1], split[1]) < 1e-5  # dQ: the same terms, added in another order


@pytest.mark.parametrize("group", [1, 8])
@pytest.mark.parametrize("block", [16, 128])
def test_atomic_dq_matches_the_oracle(monkeypatch, group, block):
    """The unordered variant (``atomic``): the same terms, added by fp32 atomics."""
    monkeypatch.setenv(triton_bwd.DQ_SCHEDULE_ENV, "atomic")
    hkv = 1 if group == 8 else 2
    n = 6 * block if block == 16 else 3 * block
    q, k, v = inputs(1, hkv * group, hkv, n, 32, seed=group + block + 1)
    index = VSIndex.random(1, hkv * group, n, block, max_slash=4, max_vertical=24,
                           generator=torch.Generator().manual_seed(group + 1))
    check_against_oracle(q, k, v, index.to(DEVICE))
    check_against_oracle(q, k, v, index.to(DEVICE), torch.tensor([0, 5, n // 2, n], dtype=torch.int32,
                                                                  device=DEVICE))


@pytest.mark.parametrize("layout", ["striped", "zigzag"])
def test_fused_dq_ring_steps_match_the_torch_step(fused, layout):
    """Every (query chunk, key chunk) step of a W = 3 ring, added into fp32 dq as the ring does
    (the dQ kernel's columns first, then the ordered slash adds): equal to the PyTorch step."""
    n, B, W = 288, 16, 3
    q, k, v = (x.detach() for x in inputs(1, 4, 2, n, 16, seed=9))
    index = VSIndex.random(1, 4, n, B, max_slash=6, max_vertical=20,
                           generator=torch.Generator().manual_seed(9)).to(DEVICE)
    nb = n // B
    blocks = [local_block_ids(n, layout, W, r, B).to(DEVICE) for r in range(W)]
    rows = [torch.cat([torch.arange(i * B, (i + 1) * B) for i in ids.tolist()]).to(DEVICE) for ids in blocks]
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q)
    for qr in range(W):
        for kr in range(W):
            plan = build_step_plan(index, blocks[qr], blocks[kr], nb)
            qs, dos = q[:, :, rows[qr]], do[:, :, rows[qr]]
            ks, vs = k[:, :, rows[kr]], v[:, :, rows[kr]]
            out = torch.zeros_like(qs)
            lse = torch.full(qs.shape[:-1], float("-inf"), device=DEVICE)
            step_forward("torch", qs, ks, vs, plan, out, lse, 0.25, accumulate=True)
            delta = backward_delta("torch", out, dos)
            grads = {}
            for backend in ("torch", "triton"):
                dq, dk, dv = (torch.zeros_like(x) for x in (qs, ks, vs))
                dq += 1.0  # an earlier step's sum: the ordered adds go on top of it
                step_backward(backend, qs, ks, vs, dos, lse, delta, plan, dq, dk, dv, 0.25)
                grads[backend] = (dq, dk, dv)
            for name, a, e in zip(("dq", "dk", "dv"), grads["triton"], grads["torch"]):
                assert rel_err(a, e) < 2e-5, (layout, qr, kr, name)


def test_dq_schedule_is_validated(monkeypatch, caplog):
    monkeypatch.delenv(triton_bwd.DQ_SCHEDULE_ENV, raising=False)
    assert triton_bwd.dq_schedule() == "split"
    monkeypatch.setenv(triton_bwd.DQ_SCHEDULE_ENV, "fused")
    assert triton_bwd.dq_schedule() == "fused"
    monkeypatch.setattr(triton_bwd, "_WARNED_ATOMIC", [])
    monkeypatch.setenv(triton_bwd.DQ_SCHEDULE_ENV, "atomic")
    with caplog.at_level("WARNING", logger=triton_bwd.__name__):
        assert triton_bwd.dq_schedule() == "atomic" and triton_bwd.dq_schedule() == "atomic"
    assert sum("not deterministic" in r.getMessage() for r in caplog.records) == 1  # said once
    monkeypatch.setenv(triton_bwd.DQ_SCHEDULE_ENV, "ordered")
    with pytest.raises(ValueError, match="MTRAINING_DQ_SCHEDULE='ordered': must be one of split, fused, atomic"):
        triton_bwd.dq_schedule()


def test_fused_dq_needs_an_fp32_sum(fused):
    q, k, v = (x.detach() for x in inputs(1, 2, 1, 64, 16, seed=0))
    index = VSIndex.dense(1, 2, 64, 16).to(DEVICE)
    plan = build_step_plan(index, torch.arange(4), torch.arange(4), 4)
    lse = torch.zeros(q.shape[:-1], device=DEVICE)
    dq = torch.empty_like(q)
    with pytest.raises(ValueError, match="MTRAINING_DQ_SCHEDULE=fused adds into an fp32 dq"):
        triton_bwd.vs_attention_bwd_triton(q, k, v, q, lse, lse, plan, dq, torch.zeros_like(k),
                                           torch.zeros_like(v), 0.25, accumulate_dq=False)


@pytest.mark.gpu
@pytest.mark.parametrize("block,hq,hkv,d", [(64, 16, 2, 128), (128, 16, 2, 128), (128, 32, 2, 128), (128, 4, 4, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_fused_dq_matches_split(monkeypatch, block, hq, hkv, d, dtype):
    """On the GPU the turns are real waits across SMs: the fused schedule's gradients equal the
    split schedule's (within the dtype's rounding) and are bit-identical across runs; 8K tokens,
    documents, GQA 8, 16 (the Hopper key-block kernel's two passes of 8 heads) and 1. On sm_90 at
    B = 128 this runs the Hopper key-block kernel's fused variant. The atomic schedule's gradients
    equal them within rounding too."""
    n = 8192
    q, k, v = inputs(1, hq, hkv, n, d, seed=block + hq, dtype=dtype)
    index = VSIndex.random(1, hq, n, block, max_slash=24, max_vertical=512,
                           generator=torch.Generator().manual_seed(block + hq)).to(DEVICE)
    cu = torch.tensor([0, 100, 3000, 3001, 6000, n], dtype=torch.int32, device=DEVICE)
    monkeypatch.setenv(triton_bwd.DQ_SCHEDULE_ENV, "split")
    split, _ = gradients(q, k, v, index, cu)
    monkeypatch.setenv(triton_bwd.DQ_SCHEDULE_ENV, "fused")
    first, _ = gradients(q, k, v, index, cu)
    second, _ = gradients(q, k, v, index, cu)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    for name, a, e in zip(("out", "dq", "dk", "dv"), first, split):
        assert rel_err(a.float(), e.float()) < 1e-2, name
    monkeypatch.setenv(triton_bwd.DQ_SCHEDULE_ENV, "atomic")
    unordered, _ = gradients(q, k, v, index, cu)
    for name, a, e in zip(("out", "dq", "dk", "dv"), unordered, split):
        assert rel_err(a.float(), e.float()) < 1e-2, ("atomic", name)


def test_fused_dq_compiles_for_sm90a_with_its_memory_order(tmp_path):
    """Triton's key-block kernel cross-compiled for sm_90a (no GPU needed; the interpreter cannot
    show the memory order): fused, each turn is an acquire load and the hand-over a release add,
    the only atomic, and dQ is read past L1; atomic, fp32 atomics only; split, no atomic at all.
    ptxas accepts every variant without serialising wgmma; at B = 64 the fused kernels' spills
    stay small (8 warps)."""
    import json
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, os.path.join(repo, "tests", "sm90_compile.py"), "--triton-dkdv", "--out",
                           str(tmp_path / "compile.json")], cwd=repo, capture_output=True, text=True, timeout=600,
                          env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    configs = json.loads((tmp_path / "compile.json").read_text())["configs"]
    assert len(configs) == 8
    for e in configs:
        assert e["ptxas_ok"] and not e["wgmma_serialized"], e
        if e["schedule"] == "fused":
            assert e["acquire_loads"] >= 1 and e["release_adds"] == 1 and e["atomics"] == 1, e
            assert e["turn_in_order"], e  # acquire, dQ read and written, barrier, release (IR order)
            assert e["cg_loads"] >= 1 and e["float_atomics"] == 0 and e["num_warps"] == 8, e
            assert e["cg_loads_16"] == e["cg_loads"], e  # 16 bytes each: the turn's zero kept them aligned
        elif e["schedule"] == "atomic":
            assert e["float_atomics"] >= 1 and e["atomics"] == e["float_atomics"], e
            assert e["acquire_loads"] == 0 and e["cg_loads"] == 0 and e["num_warps"] == 8, e
        else:
            assert e["acquire_loads"] == 0 and e["atomics"] == 0 and e["cg_loads"] == 0, e
        if e["schedule"] != "split" and e["block"] == 64:
            assert e["spill_bytes"] is None or e["spill_bytes"] <= 512, e


def test_pingpong_backward_has_no_fused_dq(monkeypatch):
    """MTRAINING_BACKWARD_SCHEDULE=pingpong with a fused dQ schedule: a clear error before any launch."""
    from megatron_mtraining.kernels.hopper_bwd import SCHEDULE_ENV, block_gradients_hopper

    monkeypatch.setenv(SCHEDULE_ENV, "pingpong")
    q = torch.zeros(1, 2, 256, 64)
    index = VSIndex.dense(1, 2, 256, 128)
    plan = build_step_plan(index, torch.arange(2), torch.arange(2), 2)
    with pytest.raises(ValueError, match="pingpong has no fused dQ .MTRAINING_DQ_SCHEDULE=fused.: unset one"):
        block_gradients_hopper(q, q[:, :1], q[:, :1], q, None, None, q[:, :1], q[:, :1], plan, None, None, False, False,
                               (), 1.0, 1.0, dq=q, dq_schedule="fused")


@pytest.mark.gpu
@pytest.mark.parametrize("block,kernel", [(64, "auto"), (128, "auto"), (128, "triton")])
@pytest.mark.parametrize("schedule", ["fused", "atomic"])
def test_gpu_fused_dq_sums_every_term(monkeypatch, block, kernel, schedule):
    """The fp32 dQ sums of one backward step, fused against split, per (head, 64-row tile): the
    same terms in another order, so ~1e-6 apart; one lost or doubled (query block, key block) add
    would be ~1e-2 in its tile, where the whole-tensor comparison above could miss it. B = 128
    runs the Hopper key-block kernel on sm_90 ("auto") and Triton's ("triton")."""
    from megatron_mtraining.kernels.plan import single_device_plan
    from megatron_mtraining.kernels.step import BACKWARD_KERNEL_ENV

    monkeypatch.setenv(BACKWARD_KERNEL_ENV, kernel)
    n, hq, hkv, d = 8192, 16, 2, 128
    q, k, v, do = (x.detach() for x in inputs(1, hq, hkv, n, d, seed=block, dtype=torch.bfloat16)
                   + [inputs(1, hq, hkv, n, d, seed=block + 1, dtype=torch.bfloat16)[0]])
    index = VSIndex.random(1, hq, n, block, max_slash=24, max_vertical=512,
                           generator=torch.Generator().manual_seed(block)).to(DEVICE)
    plan = single_device_plan(index, n)
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"), device=DEVICE)
    step_forward("triton", q, k, v, plan, out, lse, d ** -0.5, accumulate=False)
    delta = backward_delta("triton", out, do)
    sums = {}
    for name in ("split", schedule):
        monkeypatch.setenv(triton_bwd.DQ_SCHEDULE_ENV, name)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=DEVICE)
        dk, dv = (torch.zeros(x.shape, dtype=torch.float32, device=DEVICE) for x in (k, v))
        step_backward("triton", q, k, v, do, lse, delta, plan, dq, dk, dv, d ** -0.5)
        sums[name] = dq.view(hq, n // 64, 64 * d)
    diff = (sums[schedule] - sums["split"]).norm(dim=-1) / sums["split"].norm(dim=-1).clamp_min(1e-20)
    assert diff.max().item() < 1e-4, diff.max().item()
