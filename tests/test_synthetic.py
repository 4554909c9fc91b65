"""Synthetic vertical-slash q/k and the recall measurement (benchmarks/synthetic.py)."""

import math

import pytest
import torch

from megatron_mtraining.index import VSIndex
from synthetic import apply_rope, attention_recall, oracle_index, synthetic_vs_qk


def test_shapes_dtype_device_and_determinism():
    q, k = synthetic_vs_qk(2, 4, 2, 256, 32, seed=3)
    assert q.shape == (2, 4, 256, 32) and k.shape == (2, 2, 256, 32)
    assert q.dtype == k.dtype == torch.float32 and q.device.type == "cpu"
    q2, k2 = synthetic_vs_qk(2, 4, 2, 256, 32, seed=3)
    assert torch.equal(q, q2) and torch.equal(k, k2)
    q3, _ = synthetic_vs_qk(2, 4, 2, 256, 32, seed=4)
    assert not torch.equal(q, q3)
    qb, kb = synthetic_vs_qk(2, 4, 2, 256, 32, seed=3, dtype=torch.bfloat16, device="cpu")
    assert qb.dtype == kb.dtype == torch.bfloat16
    torch.testing.assert_close(qb.float(), q, rtol=1e-2, atol=1e-2)
    assert torch.isfinite(q).all() and torch.isfinite(k).all()
    with pytest.raises(ValueError):
        synthetic_vs_qk(1, 3, 2, 64, 32)


def test_rope_is_relative():
    # Rotate-half RoPE: <R(n) x, R(m) y> depends only on n - m.
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(2, 1, 32, generator=g, dtype=torch.float64)
    a = (apply_rope(x, torch.tensor([5])) * apply_rope(y, torch.tensor([2]))).sum()
    b = (apply_rope(x, torch.tensor([103])) * apply_rope(y, torch.tensor([100]))).sum()
    torch.testing.assert_close(a, b)


def _dense_probs64(q, k):
    n, d = q.shape[2], q.shape[3]
    kf = k.double().repeat_interleave(q.shape[1] // k.shape[1], 1)
    s = q.double() @ kf.transpose(-1, -2) / math.sqrt(d)
    s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return s.softmax(-1)


def test_recall_dense_index_is_one():
    q, k = synthetic_vs_qk(1, 4, 2, 256, 32, seed=1)
    r = attention_recall(q, k, VSIndex.dense(1, 4, 256, 64), query_chunk=96)
    torch.testing.assert_close(r["recall"], torch.ones(1, 4), atol=1e-5, rtol=0)
    torch.testing.assert_close(r["density"], torch.ones(1, 4), atol=1e-6, rtol=0)
    assert abs(r["mean_recall"] - 1) < 1e-5 and abs(r["mean_density"] - 1) < 1e-6


@pytest.mark.parametrize("chunk", [16, 40, 1000])
def test_recall_matches_float64_masked_softmax(chunk):
    b, hq, hkv, n, d, B = 2, 4, 2, 128, 16, 16
    q, k = synthetic_vs_qk(b, hq, hkv, n, d, seed=2)
    p = _dense_probs64(q, k)
    pos = torch.arange(n)
    # Diagonal blocks only.
    diag = VSIndex.from_lists([[[0]] * hq] * b, [[[]] * hq] * b, block_size=B)
    expected = (p * (pos[:, None] // B == pos[None, :] // B)).sum(-1).mean(-1)
    r = attention_recall(q, k, diag, query_chunk=chunk)
    torch.testing.assert_close(r["recall"].double(), expected, atol=1e-5, rtol=0)
    # A random index with slashes and columns, mask built directly from the definition.
    idx = VSIndex.random(b, hq, n, B, max_slash=4, max_vertical=12, generator=torch.Generator().manual_seed(5))
    expected = torch.zeros(b, hq, dtype=torch.float64)
    for i in range(b):
        for h in range(hq):
            offs = set(idx.slash[i, h, : idx.n_slash[i, h]].tolist())
            cols = set(idx.vertical[i, h, : idx.n_vertical[i, h]].tolist())
            m = torch.tensor([[mm <= nn and (nn // B - mm // B in offs or mm in cols) for mm in range(n)]
                              for nn in range(n)])
            expected[i, h] = (p[i, h] * m).sum(-1).mean()
    r = attention_recall(q, k, idx, query_chunk=chunk)
    torch.testing.assert_close(r["recall"].double(), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(r["density"], idx.density(n))


def _random_index_at(density, b, h, n, B, seed):
    """Diagonal plus random slash offsets and random columns, grown until ``density`` is reached."""
    g = torch.Generator().manual_seed(seed)
    nb = n // B
    slash, vert = [], []
    for _ in range(b):
        srow, vrow = [], []
        for _ in range(h):
            offs = (torch.randperm(nb - 1, generator=g) + 1).tolist()
            cols = torch.randperm(n, generator=g).tolist()
            s, v = [0], []
            while VSIndex.from_lists([[s]], [[v]], B).density(n).item() < density:
                if torch.rand(1, generator=g).item() < 0.5 and offs:
                    s = sorted(s + [offs.pop()])
                else:
                    v, cols = sorted(v + cols[:16]), cols[16:]
            srow.append(s)
            vrow.append(v)
        slash.append(srow)
        vert.append(vrow)
    return VSIndex.from_lists(slash, vert, B)


def test_structure_is_vertical_slash():
    b, hq, hkv, n, d, B = 1, 4, 2, 2048, 64, 64
    q, k = synthetic_vs_qk(b, hq, hkv, n, d, seed=0)
    oracle = oracle_index(q, k, B, density=0.08)
    ro = attention_recall(q, k, oracle)
    assert ro["mean_density"] <= 0.08 + 1e-6
    assert ro["mean_recall"] >= 0.9 and float(ro["recall"].min()) >= 0.85, ro
    rr = attention_recall(q, k, _random_index_at(ro["mean_density"], b, hq, n, B, seed=0))
    assert rr["mean_density"] >= ro["mean_density"]
    assert rr["mean_recall"] < 0.6 and ro["mean_recall"] - rr["mean_recall"] > 0.3, (ro, rr)
    # Both line kinds matter: the sink column alone, and the diagonal alone, each hold a real share.
    diag = VSIndex.from_lists([[[0]] * hq], [[[]] * hq], B)
    diag_sink = VSIndex.from_lists([[[0]] * hq], [[[0]] * hq], B)
    r_diag = attention_recall(q, k, diag)["mean_recall"]
    assert 0.2 < r_diag < 0.7
    assert attention_recall(q, k, diag_sink)["mean_recall"] - r_diag > 0.1
