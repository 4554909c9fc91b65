"""benchmarks/tilelang_slash.py (issue 17's TileLang spike): the block lists its kernels walk must be
exactly the slash part of our index (DESIGN.md section 1, columns dropped) on the B x B grid:
forward, per query block its key blocks ascending with the diagonal last (the only block the
kernels mask causally); backward, per (KV head, key block) every (query head of the group, 64-row
query tile) that attends it. The kernels themselves need TileLang and an sm_90 GPU (the spike
checks them against ours there); the lists are plain PyTorch and are checked here."""

import os
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from tilelang_slash import QUERY_TILE, slash_block_lists  # noqa: E402


def random_bitmap(batch, heads, nb, seed):
    gen = torch.Generator().manual_seed(seed)
    bitmap = (torch.rand(batch, heads, nb, generator=gen) < 0.3).to(torch.int8)
    bitmap[..., 0] = 1  # the diagonal is always selected
    bitmap[0, 0, 1:] = 0  # a head with the diagonal only
    if heads > 1:
        bitmap[0, 1, :] = 1  # a head with every offset (dense causal)
    return bitmap


@pytest.mark.parametrize("seq_len,block,heads,kv_heads", [(1024, 64, 4, 2), (2048, 128, 4, 1), (1024, 128, 2, 2)])
def test_lists_are_the_slash_part(seq_len, block, heads, kv_heads):
    nb = seq_len // block
    batch = 2
    bitmap = random_bitmap(batch, heads, nb, seq_len + heads)
    fwd_idx, fwd_cnt, bwd_idx, bwd_cnt = slash_block_lists(bitmap, nb, kv_heads, block)
    assert fwd_idx.dtype == fwd_cnt.dtype == bwd_idx.dtype == bwd_cnt.dtype == torch.int32
    assert fwd_cnt.shape == (batch, heads, nb) and bwd_cnt.shape == (batch, kv_heads, nb)

    # Forward: the expected key blocks, ascending, diagonal last.
    expected = {}
    for b in range(batch):
        for h in range(heads):
            offsets = bitmap[b, h].nonzero().flatten().tolist()
            for q in range(nb):
                keys = sorted(q - o for o in offsets if q - o >= 0)
                got = fwd_idx[b, h, q, :fwd_cnt[b, h, q]].tolist()
                assert got == keys, (b, h, q)
                assert got[-1] == q
                expected[b, h, q] = set(keys)

    # Backward: decode each entry and compare with the transpose of the forward's pairs.
    groups = heads // kv_heads
    n_tiles = seq_len // QUERY_TILE
    tiles_per_block = block // QUERY_TILE
    for b in range(batch):
        for hk in range(kv_heads):
            for kb in range(nb):
                entries = bwd_idx[b, hk, kb, :bwd_cnt[b, hk, kb]].tolist()
                assert entries == sorted(entries) and len(set(entries)) == len(entries)
                decoded = {(hk * groups + e // n_tiles, e % n_tiles) for e in entries}
                want = {(h, qb * tiles_per_block + s)
                        for h in range(hk * groups, (hk + 1) * groups)
                        for qb in range(nb) if kb in expected[b, h, qb]
                        for s in range(tiles_per_block)}
                assert decoded == want, (b, hk, kb)


def test_padding_stays_in_range():
    """Entries past a row's count are padding the kernels never read; they must still be valid
    block numbers (a TMA coordinate computed from garbage is a fault, not a wrong number)."""
    nb, block = 16, 64
    bitmap = random_bitmap(1, 2, nb, 7)
    fwd_idx, _, bwd_idx, _ = slash_block_lists(bitmap, nb, 1, block)
    assert 0 <= int(fwd_idx.min()) and int(fwd_idx.max()) < nb
    assert 0 <= int(bwd_idx.min()) and int(bwd_idx.max()) < 2 * nb * block // QUERY_TILE
