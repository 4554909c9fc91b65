"""reference_attention itself: against the float64 oracle and SDPA, with explicit positions."""

import torch
import torch.nn.functional as F

from megatron_mtraining import VSIndex, reference_attention
from megatron_mtraining.kernels.torch_step import merge_partials
from oracle import attention_f64, dense_mask, rel_err


def test_reference_matches_oracle_with_gradients():
    g = torch.Generator().manual_seed(0)
    index = VSIndex.random(2, 4, 80, 16, max_slash=3, max_vertical=10, generator=g)
    q, k, v = (torch.randn(2, h, 80, 16, generator=g, requires_grad=True) for h in (4, 2, 2))
    out, lse = reference_attention(q, k, v, index)
    expected = attention_f64(q, k, v, dense_mask(index, 80))
    assert rel_err(out, expected) < 1e-6
    grad = torch.randn_like(out)
    for a, e in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(expected, (q, k, v), grad)):
        assert rel_err(a, e) < 1e-6
    assert lse.dtype == torch.float32 and torch.isfinite(lse).all()


def test_dense_index_is_causal_attention():
    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    out, _ = reference_attention(q, k, v, VSIndex.dense(1, 2, 64, 16))
    assert rel_err(out, F.scaled_dot_product_attention(q, k, v, is_causal=True)) < 1e-6


def test_explicit_positions_cover_chunk_pairs():
    """Splitting keys into two chunks at arbitrary positions and merging by lse gives the full result."""
    g = torch.Generator().manual_seed(1)
    n, B = 64, 16
    index = VSIndex.random(1, 2, n, B, max_slash=3, max_vertical=12, generator=g)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g) for _ in range(3))
    full, full_lse = reference_attention(q, k, v, index)
    q_pos = torch.tensor([16, 17, 18, 19] + list(range(48, 64)))   # any query subset
    k_a = torch.arange(0, 32)                                        # key chunk A
    k_b = torch.arange(32, 64)                                       # key chunk B
    out_a, lse_a = reference_attention(q[:, :, q_pos], k[:, :, k_a], v[:, :, k_a], index, q_pos, k_a,
                                       num_blocks=n // B)
    out_b, lse_b = reference_attention(q[:, :, q_pos], k[:, :, k_b], v[:, :, k_b], index, q_pos, k_b,
                                       num_blocks=n // B)
    assert torch.isinf(lse_b[:, :, :4]).all()  # queries 16..19 see nothing in keys 32..63
    merged, merged_lse = merge_partials(out_a, lse_a, out_b, lse_b)
    assert rel_err(merged, full[:, :, q_pos]) < 1e-6
    torch.testing.assert_close(merged_lse, full_lse[:, :, q_pos])
