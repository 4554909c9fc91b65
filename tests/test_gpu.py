"""GPU-only checks: long sequences in bf16 against an fp32 reference, and no host syncs."""

import pytest
import torch

from megatron_mtraining import BlockIndex, VSIndex, sparse_attention
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


@pytest.mark.parametrize("kind", ["vertical-slash", "block"])
def test_no_host_synchronisation(kind):
    n, hq, hkv, d = 4096, 8, 2, 128
    q, k, v = (torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for h in (hq, hkv, hkv))
    index = (long_index(1, hq, n, 64, seed=5) if kind == "vertical-slash" else
             BlockIndex.random(1, hq, n, 64, density=0.2, generator=torch.Generator().manual_seed(1), device="cuda"))
    sparse_attention(q, k, v, index).sum().backward()  # compile the kernels first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sparse_attention(q, k, v, index)
        out.backward(torch.ones_like(out))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_mtraining_validate_checks_gpu_indices():
    """On a GPU the index's values are not checked (it would synchronise), so a duplicate slash
    offset silently counts its pairs twice; ``Settings.validate`` (MTRAINING_VALIDATE=1) turns the
    check on (and the cu_seqlens check), with a clear error."""
    from megatron_mtraining.config import Settings

    n, hq, hkv, d = 1024, 2, 1, 64
    q, k, v = (torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16) for h in (hq, hkv, hkv))
    slash = torch.tensor([[[0, 1, 1], [0, 2, 3]]], dtype=torch.int32, device="cuda")  # head 0: offset 1 twice
    vertical = torch.zeros(1, hq, 1, dtype=torch.int32, device="cuda")
    index = VSIndex(slash, torch.full((1, hq), 3, dtype=torch.int32, device="cuda"), vertical,
                    torch.zeros(1, hq, dtype=torch.int32, device="cuda"), 64)
    sparse_attention(q, k, v, index, settings=Settings())  # unchecked: runs
    checked = Settings.from_env({"MTRAINING_VALIDATE": "1"})
    with pytest.raises(ValueError, match="ascending|duplicate|unique"):
        sparse_attention(q, k, v, index, settings=checked)
    good = VSIndex.dense(1, hq, n, 64).to("cuda")
    bad_cu = torch.tensor([0, 512, 512, n], dtype=torch.int32, device="cuda")  # an empty document
    with pytest.raises(ValueError, match="strictly increasing"):
        sparse_attention(q, k, v, good, cu_seqlens=bad_cu, settings=checked)


def _views(shapes, dtype, layout, big):
    """Tensors of the given [b, h, n(, d)] shapes as views of one buffer, with element offsets past
    2^31: "token" gives them the token stride ``big`` (Megatron's [s, b, heads, d] with long rows),
    each in its own columns; "head" the (batch, head) stride ``big``, each at its own offset in a slot."""
    specs, used = [], 0
    for shape in shapes:
        b, h, n = shape[:3]
        d = shape[3] if len(shape) == 4 else 1
        assert layout == "head" or len(shape) == 4, "the lse's tokens are contiguous"
        strides = (h * d, d, big, 1) if layout == "token" else (h * big, big, d, 1)
        specs.append((shape, strides[:len(shape)], used))
        used += b * h * d if layout == "token" else n * d
    assert used <= big
    size = max(off + sum((s - 1) * st for s, st in zip(shape, strides)) + 1 for shape, strides, off in specs)
    buf = torch.empty(size, dtype=dtype, device="cuda")
    return [buf.as_strided(shape, strides, off) for shape, strides, off in specs]


@pytest.mark.parametrize("layout, n, big", [
    ("token", 256, 12_582_912),  # token offsets past 2^31
    ("token", 128, 34_603_008),  # and one 64-token tile spanning 2^31
    ("head", 128, 716_000_000),  # (batch, head) offsets past 2^31, for k/v as a sum of two
])
def test_element_offsets_beyond_2_31(layout, n, big):
    """A forward step (written, then merged into) and a backward step with every tensor a view
    whose element offsets pass 2^31 give the same bits as on compact copies (up to 30 GB)."""
    from megatron_mtraining.kernels import single_device_plan, step_backward, step_forward
    from megatron_mtraining.kernels.common import int64_offsets

    b, hq, hkv, d, B = 2, 4, 2, 64, 64
    scale = d ** -0.5
    gen = torch.Generator(device="cuda").manual_seed(n)
    in_shapes = [(b, hq, n, d), (b, hkv, n, d), (b, hkv, n, d), (b, hq, n, d)]  # q, k, v, do
    out_shapes = [(b, hq, n, d), (b, hq, n, d), (b, hkv, n, d), (b, hkv, n, d), (b, hq, n), (b, hq, n)]
    compact_in = [torch.randn(s, device="cuda", generator=gen).bfloat16() for s in in_shapes]
    big_in = _views(in_shapes, torch.bfloat16, layout, big)
    for x, c in zip(big_in, compact_in):
        x.copy_(c)
    big_out = _views(out_shapes[:4 if layout == "token" else 6], torch.float32, layout, big)
    big_out += [torch.empty(s, device="cuda") for s in out_shapes[len(big_out):]]  # out, dq, dk, dv, lse, delta
    assert int64_offsets(*big_in, *big_out)  # some offset passes 2^31: the kernels go int64

    for max_vertical in (0, 24):
        index = VSIndex.random(b, hq, n, B, max_slash=3, max_vertical=max_vertical,
                               generator=torch.Generator().manual_seed(max_vertical), device="cuda")
        plan = single_device_plan(index, n)
        results = []
        for (q, k, v, do), (out, dq, dk, dv, lse, delta) in (
                (compact_in, [torch.empty(s, device="cuda") for s in out_shapes]), (big_in, big_out)):
            if max_vertical:  # the column gradients are scattered into contiguous dk, dv
                assert plan.cols.shape[-1] > 0
                dk, dv = (torch.empty(x.shape, device="cuda") for x in (dk, dv))
            step_forward("triton", q, k, v, plan, out, lse, scale, accumulate=False)
            step_forward("triton", q, k, v, plan, out, lse, scale, accumulate=True)
            delta.copy_((do.float() * out).sum(-1))
            for grad in (dq, dk, dv):
                grad.zero_()
            step_backward("triton", q, k, v, do, lse, delta, plan, dq, dk, dv, scale)
            results.append([x.clone() for x in (out, lse, dq, dk, dv)])
        for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), results[1], results[0]):
            assert want.abs().sum() > 0 and torch.isfinite(want).all(), name
            assert torch.equal(got, want), name
    del big_in, big_out
    torch.cuda.empty_cache()
