"""kernels/relayout.py: the layer's [s, b, h, d] <-> [b, h, s, d] copies, bit for bit PyTorch's
permute + contiguous, forward and gradients (the row-copy kernel under Triton's interpreter on a
CPU, compiled on a GPU)."""

import pytest
import torch

from conftest import requires_gpu
from megatron_mtraining.kernels import relayout

# (s, b, h, d): ragged s (not a multiple of the 64 rows a program copies), d not a power of two.
SHAPES = [(70, 1, 3, 16), (64, 2, 2, 32), (130, 2, 1, 24)]
ON_CPU = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter test; the GPU runs the compiled one")


def _sbhd(shape, dtype, device, seed):
    """Megatron's q as the layer sees it: a [s, b, h, d] view of a larger (QKV-like) tensor."""
    s, b, h, d = shape
    g = torch.Generator().manual_seed(seed)
    mixed = torch.randn(s, b, h, 3 * d, generator=g).to(device, dtype)
    return mixed[..., d:2 * d]  # strided rows, last dim contiguous


def _check_functions(heads_major_fn, sequence_major_fn, device, dtype):
    for i, shape in enumerate(SHAPES):
        x = _sbhd(shape, dtype, device, i).requires_grad_()
        y = heads_major_fn(x)
        assert y.is_contiguous() and torch.equal(y, x.permute(1, 2, 0, 3))
        z = sequence_major_fn(y * 1)  # a new [b, h, s, d] tensor
        assert z.is_contiguous() and torch.equal(z, x)
        g = torch.Generator().manual_seed(100 + i)
        grad = torch.randn(z.shape, generator=g).to(device, dtype)
        (got,) = torch.autograd.grad(z, x, grad)
        assert torch.equal(got, grad)  # through both copies' backward: the identity
        grad_y = torch.randn(y.shape, generator=g).to(device, dtype)
        (got,) = torch.autograd.grad(heads_major_fn(x), x, grad_y)
        assert torch.equal(got, grad_y.permute(2, 0, 1, 3))


@ON_CPU
def test_row_copy_kernel_is_the_permuted_copy():
    for i, shape in enumerate(SHAPES):
        x = _sbhd(shape, torch.float32, "cpu", i).permute(1, 2, 0, 3)  # [b, h, s, d] view
        assert torch.equal(relayout.copy_rows(x), x.contiguous())
        back = torch.full((shape[0], shape[1], shape[2], shape[3]), float("nan"))  # every element written
        relayout.copy_rows(x.contiguous(), back.permute(1, 2, 0, 3))
        assert torch.equal(back, x.permute(2, 0, 1, 3))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_gpu)])
def test_row_copy_with_the_poison_flag(device):
    """``nan_if`` (``agreement.poison``): False copies (casts) exactly, True writes NaN everywhere;
    the flag is read by the kernel (under the interpreter on a CPU)."""
    x = _sbhd(SHAPES[0], torch.float32, device, 5).permute(1, 2, 0, 3)
    for dtype in (torch.float32, torch.float16):
        good = relayout.copy_rows(x, torch.empty(x.shape, dtype=dtype, device=device),
                                  nan_if=torch.tensor(False, device=device))
        assert torch.equal(good, x.to(dtype))
        bad = relayout.copy_rows(x, torch.zeros(x.shape, dtype=dtype, device=device),
                                 nan_if=torch.tensor(True, device=device))
        assert bool(torch.isnan(bad).all())


@ON_CPU
def test_autograd_functions_under_the_interpreter():
    _check_functions(relayout._HeadsMajor.apply, relayout._SequenceMajor.apply, "cpu", torch.float32)
    # A gradient whose last dim is not contiguous is made so first.
    y = torch.randn(2, 3, 70, 16).requires_grad_()
    grad = torch.randn(70, 2, 16, 3).transpose(-1, -2)  # [s, b, h, d], last-dim stride 3
    (got,) = torch.autograd.grad(relayout._SequenceMajor.apply(y), y, grad)
    assert torch.equal(got, grad.permute(1, 2, 0, 3))


def test_sequence_major_is_a_view_where_the_memory_already_is_so():
    sbhd = torch.randn(70, 2, 3, 16)
    x = sbhd.permute(1, 2, 0, 3)  # [b, h, s, d] view of sequence-major memory (as SDPA's output can be)
    out = relayout.sequence_major(x)
    assert out.data_ptr() == sbhd.data_ptr() and torch.equal(out, sbhd)


def test_cpu_tensors_take_pytorchs_copy():
    _check_functions(relayout.heads_major, relayout.sequence_major, "cpu", torch.float32)


def test_copy_rows_refuses_what_it_cannot_copy():
    x = torch.zeros(1, 2, 8, 4)
    with pytest.raises(ValueError, match="contiguous last dim"):
        relayout.copy_rows(x.transpose(-1, -2))
    with pytest.raises(ValueError, match="does not fit"):
        relayout.copy_rows(x, torch.zeros(1, 2, 8, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="does not fit"):
        relayout.copy_rows(x, torch.zeros(1, 2, 4, 8))
    with pytest.raises(ValueError, match="does not fit"):
        relayout.copy_rows(x, torch.zeros(1, 2, 8, 4, device="meta"))


def test_copy_rows_refuses_a_poison_flag_it_cannot_read():
    x = torch.zeros(1, 2, 8, 4)
    with pytest.raises(ValueError, match="nan_if must be one element"):
        relayout.copy_rows(x, nan_if=torch.zeros(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="nan_if must be one element"):
        relayout.copy_rows(x, nan_if=torch.zeros((), dtype=torch.bool, device="meta"))


def test_sequence_major_gradients_need_no_copy_to_reach_megatrons_layout():
    """The ring's gradient buffers: [b, h, s, d] in shape, [s, b, h, d] in memory, so the permute back
    to Megatron's layout is contiguous; ``copy_into`` fills one (casting) from any layout."""
    x = torch.randn(2, 3, 70, 16, dtype=torch.float64)
    out = relayout.sequence_major_empty(x.shape, torch.float32, "cpu")
    assert out.shape == x.shape and out.permute(2, 0, 1, 3).is_contiguous()
    assert relayout.copy_into(x, out) is out and torch.equal(out, x.float())


@requires_gpu
@pytest.mark.gpu
def test_row_copy_on_the_gpu():
    _check_functions(relayout.heads_major, relayout.sequence_major, "cuda", torch.bfloat16)
    x = _sbhd((131, 2, 4, 128), torch.bfloat16, "cuda", 9)
    assert relayout.row_copy_applies(x)
    assert torch.equal(relayout.heads_major(x), x.permute(1, 2, 0, 3).contiguous())
    many = _sbhd((3, 2, 40000, 16), torch.bfloat16, "cuda", 10)  # b x h = 80000 programs' rows: past 65535
    assert torch.equal(relayout.heads_major(many), many.permute(1, 2, 0, 3).contiguous())
    wide = torch.randn(2, 4, 131, 128, device="cuda")  # the ring's fp32 dQ sums, cast into Megatron's layout
    into = relayout.copy_into(wide, relayout.sequence_major_empty(wide.shape, torch.bfloat16, "cuda"))
    assert into.permute(2, 0, 1, 3).is_contiguous() and torch.equal(into, wide.bfloat16())
