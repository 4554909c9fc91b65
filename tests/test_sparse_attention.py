"""sparse_attention (every backend) against the reference and a float64 dense-mask oracle."""


import pytest
import torch
import torch.nn.functional as F

from megatron_mtraining import Settings, VSIndex, reference_attention, sparse_attention
from oracle import attention_f64, dense_mask, rel_err

BACKENDS = ["torch", "triton"]  # triton runs in the CPU interpreter when there is no GPU
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def inputs(b, hq, hkv, n, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=g, dtype=torch.float32) for h in (hq, hkv, hkv))
    return [x.to(DEVICE, dtype).requires_grad_() for x in (q, k, v)]


def check_against_oracle(q, k, v, index, backend, tol, settings=None):
    """Forward and all three gradients against the float64 oracle and the fp32 reference."""
    n = q.shape[2]
    mask = dense_mask(index, n).to(DEVICE)
    out = sparse_attention(q, k, v, index.to(DEVICE), backend=backend, settings=settings)
    assert out.dtype == q.dtype and out.shape == q.shape
    expected = attention_f64(q, k, v, mask)
    ref_out, _ = reference_attention(q, k, v, index.to(DEVICE))
    grad = torch.randn_like(expected)
    got = torch.autograd.grad(out, (q, k, v), grad.to(out.dtype))
    want = torch.autograd.grad(expected, (q, k, v), grad)
    assert rel_err(out, expected) < tol, "forward vs float64 oracle"
    assert rel_err(out, ref_out) < tol, "forward vs reference_attention"
    for name, a, e in zip(("dq", "dk", "dv"), got, want):
        assert torch.isfinite(a).all(), name
        assert rel_err(a, e) < tol, f"{name} vs float64 oracle: {rel_err(a, e)}"


def lists_index(slash, vertical, b, h, B, **kw):
    return VSIndex.from_lists([[slash] * h] * b, [[vertical] * h] * b, block_size=B, **kw)


CASES = {
    # name: (slash offsets, vertical columns) with B = 16 and n = 96 (6 blocks)
    "diagonal_only": ([0], []),
    "no_vertical": ([0, 2, 5], []),
    "columns_inside_diagonal_block": ([0], [33, 35, 47]),
    "columns_covered_by_slash": ([0, 1, 3], [3, 17, 20, 50, 90]),
    "sink_and_far_columns": ([0, 1], [0, 1, 2, 3, 60, 61, 95]),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_edge_case_indices(backend, case):
    slash, vertical = CASES[case]
    q, k, v = inputs(1, 2, 1, 96, 32, seed=len(case))
    index = lists_index(slash, vertical, 1, 2, 16)
    check_against_oracle(q, k, v, index, backend, 1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("group", [1, 2, 8])
def test_random_indices_gqa(backend, group):
    hkv = 1 if group == 8 else 2
    hq = hkv * group
    q, k, v = inputs(2, hq, hkv, 128, 32, seed=group)
    index = VSIndex.random(2, hq, 128, 16, max_slash=4, max_vertical=24,
                           generator=torch.Generator().manual_seed(group))
    check_against_oracle(q, k, v, index, backend, 1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size, d", [(64, 64), (64, 128), (128, 64)])
def test_production_block_sizes_and_head_dims(backend, block_size, d):
    n = 3 * block_size
    q, k, v = inputs(1, 2, 1, n, d, seed=d)
    index = VSIndex.random(1, 2, n, block_size, max_slash=3, max_vertical=40,
                           generator=torch.Generator().manual_seed(block_size + d))
    check_against_oracle(q, k, v, index, backend, 1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_blocks_selected_equals_causal_sdpa(backend):
    q, k, v = inputs(2, 4, 2, 128, 32, seed=3)
    index = VSIndex.dense(2, 4, 128, 16, device=DEVICE)
    out = sparse_attention(q, k, v, index, backend=backend)
    expected = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                              is_causal=True)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(expected, (q, k, v), grad)
    assert rel_err(out, expected) < 1e-5
    for a, e in zip(got, want):
        assert rel_err(a, e) < 1e-5


# Bounds per dtype, about 3x the relative errors measured (seeds 11-13: bf16 out 3.2e-3, gradients
# up to 4.2e-3; fp16 out 2.3e-4, gradients up to 4.0e-4; rounding the exact output alone costs
# 1.6e-3 and 2.0e-4): fp16's eight more mantissa bits must show.
HALF_TOLERANCES = {torch.bfloat16: (1e-2, 1.5e-2), torch.float16: (1e-3, 1.5e-3)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_half_precision_against_fp32_reference(dtype):
    q, k, v = inputs(1, 4, 2, 128, 64, dtype=dtype, seed=11)
    index = VSIndex.random(1, 4, 128, 16, max_slash=4, max_vertical=20,
                           generator=torch.Generator().manual_seed(5), device=DEVICE)
    out = sparse_attention(q, k, v, index, backend="triton")
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref, _ = reference_attention(qf, kf, vf, index)
    grad = torch.randn_like(ref)
    got = torch.autograd.grad(out, (q, k, v), grad.to(dtype))
    want = torch.autograd.grad(ref, (qf, kf, vf), grad)
    tol_out, tol_grads = HALF_TOLERANCES[dtype]
    assert rel_err(out, ref) < tol_out
    for name, a, e in zip(("dq", "dk", "dv"), got, want):
        assert rel_err(a, e) < tol_grads, name


@pytest.mark.parametrize("backend", BACKENDS)
def test_lse_matches_reference(backend):
    q, k, v = inputs(1, 2, 2, 64, 32, seed=2)
    index = VSIndex.random(1, 2, 64, 16, max_slash=2, max_vertical=8,
                           generator=torch.Generator().manual_seed(2), device=DEVICE)
    _, lse = sparse_attention(q, k, v, index, backend=backend, return_lse=True)
    _, ref_lse = reference_attention(q, k, v, index)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)


def test_custom_softmax_scale():
    q, k, v = inputs(1, 2, 1, 64, 32, seed=4)
    index = VSIndex.random(1, 2, 64, 16, generator=torch.Generator().manual_seed(4), device=DEVICE)
    out = sparse_attention(q, k, v, index, softmax_scale=0.3, backend="torch")
    ref, _ = reference_attention(q, k, v, index, softmax_scale=0.3)
    assert rel_err(out, ref) < 1e-5
    assert rel_err(out, reference_attention(q, k, v, index)[0]) > 1e-3  # the scale is used


def test_backward_is_deterministic():
    q, k, v = inputs(1, 4, 2, 128, 32, seed=9)
    index = VSIndex.random(1, 4, 128, 16, max_slash=4, max_vertical=40,
                           generator=torch.Generator().manual_seed(9), device=DEVICE)
    grads = []
    for _ in range(2):
        out = sparse_attention(q, k, v, index, backend="triton")
        grads.append(torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------- errors
def _simple(n=64, B=16):
    q, k, v = (torch.randn(1, 2, n, 32) for _ in range(3))
    return q, k, v, VSIndex.from_lists([[[0], [0]]], [[[], []]], block_size=B)


@pytest.mark.parametrize("mutate, message", [
    (lambda q, k, v, i: (q[0], k, v, i), "4-D"),
    (lambda q, k, v, i: (q, k, v[..., :16], i), "same shape"),
    (lambda q, k, v, i: (q, k[:, :, :32], v[:, :, :32], i), "disagree"),
    (lambda q, k, v, i: (q.repeat(1, 3, 1, 1)[:, :3], k, v, i), "multiple of key/value heads"),
    (lambda q, k, v, i: (q.half(), k, v, i), "share a dtype"),
    (lambda q, k, v, i: (q.int(), k.int(), v.int(), i), "not supported"),
    (lambda q, k, v, i: (q[:, :, :56], k[:, :, :56], v[:, :, :56], i), "multiple of block_size"),
    (lambda q, k, v, i: (q, k, v, VSIndex.from_lists([[[0]]], [[[]]], block_size=16)), "query heads"),
])
def test_bad_inputs_raise_clear_errors(mutate, message):
    q, k, v, index = mutate(*_simple())
    with pytest.raises(ValueError, match=message):
        sparse_attention(q, k, v, index, backend="torch")


def test_tokens_before_heads_get_the_expected_layout_named():
    """q/k/v in [batch, tokens, heads, head_dim] (GQA: the "tokens" then differ) and a
    [batch, tokens, ...] q whose "heads" do not match the index: both errors name the layout."""
    q, k, v, index = _simple()
    layout = r"\[batch, heads, tokens, head_dim\]"
    with pytest.raises(ValueError, match=rf"disagree on batch, tokens or head_dim: q, k, v are {layout}"):
        sparse_attention(q.transpose(1, 2), k[:, :1].transpose(1, 2), v[:, :1].transpose(1, 2), index, backend="torch")
    with pytest.raises(ValueError, match=rf"query heads \(q is {layout}\)"):
        sparse_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), index, backend="torch")


def test_bad_backend_name():
    q, k, v, index = _simple()
    with pytest.raises(ValueError, match="backend"):
        sparse_attention(q, k, v, index, backend="flash")


def test_invalid_index_values_rejected_on_cpu():
    q, k, v, index = _simple()
    index.slash[0, 0, 0] = 1  # diagonal missing
    with pytest.raises(ValueError, match="diagonal"):
        sparse_attention(q, k, v, index, backend="torch")


@pytest.mark.parametrize("tile", [16, 32])
def test_triton_tiles_smaller_than_the_block(tile):
    """Index blocks larger than the kernel tiles (as fp32 with block 128 runs on the GPU)."""
    from megatron_mtraining.kernels import triton_common
    tiles = dict(BLOCK_M=tile, BLOCK_N=tile, BLOCK_COL=16, num_warps=4, num_stages=1)
    settings = Settings(kernel_launch={"fwd": tiles, "bwd": tiles})
    assert triton_common.tile_config(64, torch.float32, "bwd", settings.kernel_launch)["BLOCK_M"] == tile
    q, k, v = inputs(1, 4, 2, 192, 32, seed=tile)
    index = VSIndex.random(1, 4, 192, 64, max_slash=3, max_vertical=40,
                           generator=torch.Generator().manual_seed(tile))
    check_against_oracle(q, k, v, index, "triton", 1e-5, settings)


@pytest.mark.parametrize("family", ["fwd", "bwd"])
def test_launch_settings_travel_in_the_calls_settings(family):
    """``Settings.kernel_launch`` reaches the kernels of the call that carries it (a column tile past
    one 64-bit word is refused there, in the forward or the backward), and no other call."""
    q, k, v = inputs(1, 2, 2, 128, 32, seed=3)
    index = VSIndex.random(1, 2, 128, 64, max_slash=2, max_vertical=8, generator=torch.Generator().manual_seed(3))
    wide = Settings(kernel_launch={family: {"BLOCK_COL": 128}})
    with pytest.raises(ValueError, match="must divide 64"):
        sparse_attention(q, k, v, index, backend="triton", settings=wide).sum().backward()
    sparse_attention(q, k, v, index, backend="triton").sum().backward()  # the defaults again
    with pytest.raises(ValueError, match="unknown settings"):
        Settings(kernel_launch={"fwd": {"BLOCK_K": 64}})
    with pytest.raises(ValueError, match="families are 'fwd' and 'bwd'"):
        Settings(kernel_launch={"dq": {"num_warps": 4}})
    assert Settings(kernel_launch={"fwd": {"num_warps": 4}}) == Settings(kernel_launch=(("fwd", (("num_warps", 4),)),))


@pytest.mark.parametrize("group, option", [(4, "MASK_EVERY_TILE"), (2, "COLUMN_PROGRAMS")])
def test_triton_launch_options(group, option):
    """The kernels' launch options compute the same attention and gradients, batch > 1 included:
    MASK_EVERY_TILE (the causal mask on every slash tile instead of the diagonal block's only)
    and COLUMN_PROGRAMS (here as many column-gradient splits as query blocks)."""
    from megatron_mtraining.kernels import triton_common
    value = 10 ** 6 if option == "COLUMN_PROGRAMS" else True  # one split per query block
    settings = Settings(kernel_launch={f: {option: value} for f in ("fwd", "bwd")})
    assert triton_common.tile_config(64, torch.bfloat16, "bwd", settings.kernel_launch)[option] == value
    q, k, v = inputs(2, 4, 4 // group, 128, 32, seed=group)
    index = VSIndex.random(2, 4, 128, 16, max_slash=4, max_vertical=24,
                           generator=torch.Generator().manual_seed(group))
    check_against_oracle(q, k, v, index, "triton", 1e-5, settings)


def test_triton_backend_takes_tensors_beyond_32_bit_offsets():
    """The kernels' offsets are int64 wherever they can pass 2^31: nothing is refused for its size
    (tests/test_gpu.py runs the kernels on such tensors)."""
    from megatron_mtraining.attention import check_qkv
    from megatron_mtraining.kernels import common

    def meta(shape, dims=(0, 1, 2, 3)):  # shapes and strides without memory
        return torch.empty(shape, device="meta", dtype=torch.bfloat16).permute(*dims)

    check_qkv(*(meta((3, h, 2 ** 19, 128)) for h in (16, 2, 2)), backend="triton")  # q: 3 * 2^30 elements
    # [b, heads, s, d] views of Megatron's [s, b, heads, d]: q's token stride is b * heads * d.
    megatron = [meta((2 ** 19, 4, h, 128), (1, 2, 0, 3)) for h in (16, 2, 2)]
    check_qkv(*megatron, backend="triton")
    # The kernels switch to int64 offsets exactly for tensors spanning 2^31 elements or more.
    assert common.int64_offsets(megatron[0]) and common.int64_offsets(meta((3, 16, 2 ** 19, 128)))
    assert not common.int64_offsets(*megatron[1:], meta((2, 16, 2 ** 19, 128)))  # last offset 2^31 - 1
    assert common.max_element_offset(megatron[0]) == megatron[0].numel() - 1


@pytest.mark.parametrize("int64", [False, True])
def test_triton_on_views_of_megatron_layout(monkeypatch, int64):
    """q, k, v as [b, heads, s, d] views of Megatron's [s, b, heads, d], through the kernels' int32
    and int64 offsets (INT64, as for tensors spanning 2^31 elements: tests/test_gpu.py has those)."""
    from megatron_mtraining.kernels import step, triton_fwd
    calls = []
    for caller in (triton_fwd, step):  # the forward's launcher, the backward's host side
        monkeypatch.setattr(caller, "int64_offsets", lambda *tensors: calls.append(tensors) or int64)
    g = torch.Generator().manual_seed(11)
    leaves = [torch.randn(64, 2, h, 32, generator=g).to(DEVICE).requires_grad_() for h in (4, 2, 2)]
    q, k, v = (x.permute(1, 2, 0, 3) for x in leaves)
    index = VSIndex.random(2, 4, 64, 16, max_slash=3, max_vertical=12, generator=torch.Generator().manual_seed(11))
    check_against_oracle(q, k, v, index, "triton", 1e-5)
    assert len(calls) == 2  # the forward and the backward ask for the flag


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b, h, n, d", [(1, 1, 64, 16), (2, 3, 100, 32), (1, 2, 7, 64)])
def test_backward_delta_triton_matches_torch(dtype, b, h, n, d):
    """The backward's delta = rowsum(out * d_out): the Triton kernel (ragged last row tile, head-strided
    views as Megatron hands them over) against the fp32 PyTorch formula."""
    from megatron_mtraining.kernels.step import backward_delta

    g = torch.Generator().manual_seed(n)
    # [n, b, h, d] storage viewed as [b, h, n, d]: neither row nor head stride is the contiguous one.
    out, d_out = (torch.randn(n, b, h, d, generator=g).to(DEVICE, dtype).permute(1, 2, 0, 3) for _ in range(2))
    got = backward_delta("triton", out, d_out)
    want = (out.float() * d_out.float()).sum(-1)
    assert got.dtype == torch.float32 and got.shape == (b, h, n)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert backward_delta("torch", out, d_out).dtype == torch.float32
    assert backward_delta("torch", out.double(), d_out.double()).dtype == torch.float64


@pytest.mark.parametrize("scale", [0.0, -0.125])
def test_triton_rejects_non_positive_softmax_scale(scale):
    """The Triton forward takes the row maximum before scaling (exact only for a positive scale)."""
    q, k, v = inputs(1, 2, 1, 32, 16, seed=1)
    index = VSIndex.dense(1, 2, 32, 16, device=DEVICE)
    with pytest.raises(ValueError, match="softmax_scale must be positive"):
        sparse_attention(q, k, v, index, softmax_scale=scale, backend="triton")


def test_value_checks_switch():
    """The index's and cu_seqlens' values are checked on the CPU always, on a GPU only with
    ``Settings.validate`` (MTRAINING_VALIDATE=1 at start-up; the check synchronises); other values
    of the variable are refused."""
    from megatron_mtraining.config import Settings
    from megatron_mtraining.index import value_checks

    cuda = torch.device("cuda")
    assert value_checks(torch.device("cpu")) and not value_checks(cuda)
    assert value_checks(cuda, Settings.from_env({"MTRAINING_VALIDATE": "1"}).validate)
    assert not value_checks(cuda, Settings.from_env({"MTRAINING_VALIDATE": "0"}).validate)
    with pytest.raises(ValueError, match="MTRAINING_VALIDATE must be 0 or 1"):
        Settings.from_env({"MTRAINING_VALIDATE": "yes"})
