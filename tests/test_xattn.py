"""The XAttention index builder (``--mtraining-index xattn``, ``block_approx.xattn_index``): against
a plain-PyTorch rule written here from its definition (strided antidiagonal scores, a softmax per
query group, block sums, a threshold per query block), on one device and over gloo CP groups
(striped and zigzag, W = 2 and 3; every rank gets the same index), and through the ring."""

from __future__ import annotations

import dataclasses
import functools
import math
import traceback

import pytest
import torch

from dist_utils import run_distributed
from megatron_mtraining import BlockIndex, MTrainingConfig, approximate_index, sparse_attention
from megatron_mtraining.block_approx import xattn_index
from megatron_mtraining.documents import Documents
from megatron_mtraining.layout import gather_sequence, shard_sequence
from oracle import rel_err

B = 64


def config(**kw):
    base = dict(block_size=B, index="xattn", xattn_stride=16, xattn_threshold=0.8, xattn_max_blocks=5)
    base.update(kw)
    return MTrainingConfig(**base)


def inputs(n, b=2, hq=4, hkv=2, d=16, seed=0, sharp=3.0):
    """Random q, k with a few heavy key blocks, so that the threshold keeps some blocks and drops others."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, n, d, generator=g) * sharp
    k = torch.randn(b, hkv, n, d, generator=g)
    heavy = torch.randperm(n // B, generator=g)[:3]
    for blk in heavy.tolist():
        k[:, :, blk * B:(blk + 1) * B] *= 2.0
    return q, k


def xattn_rule(q, k, cfg):
    """{(b, h, query block): set of key blocks} from the definition, one head at a time."""
    S, tau, cap = cfg.xattn_stride, cfg.xattn_threshold, cfg.xattn_max_blocks
    b, hq, n, d = q.shape
    group, groups, per = hq // k.shape[1], n // S, B // S
    out = {}
    for bi in range(b):
        for h in range(hq):
            qh, kh = q[bi, h].double(), k[bi, h // group].double()
            rows = torch.stack([torch.cat([qh[t * S + S - 1 - i] for i in range(S)]) for t in range(groups)])
            cols = torch.stack([torch.cat([kh[u * S + i] for i in range(S)]) for u in range(groups)])
            scores = rows @ cols.T / (S * math.sqrt(d))
            scores = scores.masked_fill(torch.ones(groups, groups, dtype=torch.bool).triu(1), float("-inf"))
            p = torch.softmax(scores, -1)
            for qb in range(n // B):
                mass = [float(p[qb * per:(qb + 1) * per, j * per:(j + 1) * per].sum()) for j in range(qb + 1)]
                total, kept, chosen = sum(mass), mass[qb], {qb}
                for j in sorted(range(qb), key=lambda j: (-mass[j], j)):
                    if kept >= tau * total or len(chosen) >= cap:
                        break
                    chosen.add(j)
                    kept += mass[j]
                out[bi, h, qb] = chosen
    return out


def as_sets(index: BlockIndex):
    return {(b, h, i): set(index.key_blocks[b, h, i, :int(index.n_key_blocks[b, h, i])].tolist())
            for b in range(index.batch) for h in range(index.heads) for i in range(index.num_blocks)}


@pytest.mark.parametrize("kw", [dict(), dict(xattn_stride=8, xattn_threshold=0.6), dict(xattn_max_blocks=2),
                                dict(xattn_threshold=1.0, xattn_max_blocks=64)])
def test_single_device_matches_the_rule(kw):
    n, cfg = 10 * B, config(**kw)
    q, k = inputs(n, seed=len(kw))
    index = xattn_index(q, k, cfg).validate(n)
    want = xattn_rule(q, k, cfg)
    assert as_sets(index) == want
    sizes = [len(s) for s in want.values()]
    assert max(sizes) <= min(cfg.xattn_max_blocks, 10)
    if cfg.xattn_threshold == 1.0:  # every causal block
        assert torch.equal(index.to_mask(), BlockIndex.dense(2, 4, n, B).to_mask())
    else:  # the threshold drops blocks somewhere, and keeps more than the own block somewhere
        assert any(len(s) < qb + 1 for (_, _, qb), s in want.items()) and max(sizes) > 1


def test_packed_documents_are_refused_with_a_clear_error():
    n = 4 * B
    q, k = inputs(n)
    with pytest.raises(ValueError, match="does not score packed documents"):
        approximate_index(q, k, config(), cu_seqlens=torch.tensor([0, 100, n], dtype=torch.int32))
    one = xattn_index(q, k, config(), documents=Documents(torch.tensor([0, n], dtype=torch.int32), n))
    assert as_sets(one) == as_sets(xattn_index(q, k, config()))  # one document: the unpacked index


def test_approximate_index_builds_xattn():
    n = 6 * B
    q, k = inputs(n, seed=2)
    index = approximate_index(q, k, config())
    assert isinstance(index, BlockIndex) and as_sets(index) == xattn_rule(q, k, config())


@pytest.mark.parametrize("kw, flag", [(dict(xattn_stride=12), "xattn_stride"), (dict(xattn_stride=128), "xattn_stride"),
                                      (dict(xattn_threshold=0.0), "xattn_threshold"),
                                      (dict(xattn_max_blocks=0), "xattn_max_blocks")])
def test_config_errors(kw, flag):
    with pytest.raises(ValueError, match=flag):
        config(**kw)


# ---------------------------------------------------------------------------------- CP groups

@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    layout: str
    n: int


CASES = {2: (Case("striped", "striped", 12 * B), Case("zigzag", "zigzag", 12 * B)),
         3: (Case("striped", "striped", 12 * B), Case("zigzag", "zigzag", 12 * B))}


def _worker(rank: int, world: int, cases) -> dict:
    from megatron_mtraining import sparse_ring_attention

    results = {}
    for case in cases:
        try:
            cfg = config(layout=case.layout)
            q, k = inputs(case.n, seed=len(case.name))
            v = torch.randn(k.shape, generator=torch.Generator().manual_seed(7))
            ql, kl, vl = (shard_sequence(x, 2, case.layout, world, rank, B) for x in (q, k, v))
            index = approximate_index(ql, kl, cfg, group=torch.distributed.group.WORLD)
            out = sparse_ring_attention(ql, kl, vl, index, layout=case.layout, backend="torch")
            results[case.name] = {"key_blocks": index.key_blocks, "n_key_blocks": index.n_key_blocks, "out": out}
        except Exception:
            results[case.name] = traceback.format_exc()
    return results


@functools.lru_cache(maxsize=None)
def cp_results(world: int) -> list:
    return run_distributed(_worker, world, CASES[world], timeout=240)


@pytest.mark.parametrize("world, name", [(w, c.name) for w in CASES for c in CASES[w]])
def test_cp_group_builds_the_single_device_index(world, name):
    case = next(c for c in CASES[world] if c.name == name)
    per_rank = [r[name] for r in cp_results(world)]
    for rank, r in enumerate(per_rank):
        assert not isinstance(r, str), f"rank {rank} raised:\n{r}"
    cfg = config(layout=case.layout)
    q, k = inputs(case.n, seed=len(case.name))
    want = xattn_index(q, k, cfg)
    assert as_sets(want) == xattn_rule(q, k, cfg)
    for rank, r in enumerate(per_rank):
        got = BlockIndex(r["key_blocks"], r["n_key_blocks"], B)
        assert as_sets(got) == as_sets(want), f"rank {rank} built another index"
    v = torch.randn(k.shape, generator=torch.Generator().manual_seed(7))
    expected = sparse_attention(q, k, v, want, backend="torch")
    got = gather_sequence([r["out"] for r in per_rank], 2, case.layout, B)
    assert rel_err(got, expected) < 1e-5


def test_megatrons_strided_bf16_views_give_the_contiguous_index():
    """The builder gets Megatron's [b, h, s, d] views of [s, b, h, d] tensors, in bf16."""
    n, cfg = 6 * B, config()
    q, k = (x.bfloat16() for x in inputs(n, seed=6))
    views = [x.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3) for x in (q, k)]
    assert not views[0].is_contiguous()
    assert torch.equal(xattn_index(*views, cfg).to_mask(), xattn_index(q, k, cfg).to_mask())
