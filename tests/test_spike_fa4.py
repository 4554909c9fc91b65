"""benchmarks/spike_fa4.py (issue 17): the block lists it hands FlashAttention-4 must be exactly the
slash part of our index (DESIGN.md section 1, columns dropped) on the B x B grid, the diagonal as
the one causally masked block, and the backward's lists its transpose. FA4 itself needs an sm_90
GPU; here its two names the script imports are stand-ins, and the lists are checked against the
pairs of the PyTorch reference's mask."""

import collections
import os
import sys
import types

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

FIELDS = ("mask_block_cnt mask_block_idx full_block_cnt full_block_idx block_size dq_write_order "
          "dq_write_order_full spt")


@pytest.fixture
def spike(monkeypatch):
    stand_in = types.ModuleType("flash_attn.cute.block_sparsity")
    tensors = collections.namedtuple("BlockSparseTensorsTorch", FIELDS, defaults=(None,) * 4)
    stand_in.BlockSparseTensorsTorch = tensors
    stand_in.compute_dq_write_order = lambda *lists, spt: (None, None)
    for name, module in (("flash_attn", types.ModuleType("flash_attn")),
                         ("flash_attn.cute", types.ModuleType("flash_attn.cute")),
                         ("flash_attn.cute.block_sparsity", stand_in)):
        monkeypatch.setitem(sys.modules, name, module)
    import spike_fa4
    return spike_fa4


def listed(count, idx):
    """{(b, h, row): set of listed blocks} from (count, idx) lists."""
    out = {}
    for b in range(count.shape[0]):
        for h in range(count.shape[1]):
            for row in range(count.shape[2]):
                out[b, h, row] = set(idx[b, h, row, :count[b, h, row]].tolist())
    return out


@pytest.mark.parametrize("seq_len,block", [(2048, 128), (4096, 64)])
def test_block_lists_are_the_slash_part_of_the_index(spike, seq_len, block):
    from megatron_mtraining.index import VSIndex

    nb = seq_len // block
    gen = torch.Generator().manual_seed(seq_len)
    heads = 3
    slash = torch.full((1, heads, 6), 0, dtype=torch.int32)
    n_slash = torch.tensor([[1, 4, 6]], dtype=torch.int32)  # only the diagonal; a few; up to the far end
    for h in range(heads):
        far = torch.randperm(nb - 1, generator=gen)[:5].sort().values + 1
        slash[0, h, 1:] = far.to(torch.int32)
    slash[0, 2, 5] = nb - 1
    slash[0, 2, 1:] = slash[0, 2, 1:].sort().values
    vertical = torch.arange(8, dtype=torch.int32).expand(1, heads, 8).contiguous()
    index = VSIndex(slash, n_slash, vertical, torch.full((1, heads), 8, dtype=torch.int32), block)
    index = spike.slash_only(index).validate(seq_len)
    assert int(index.n_vertical.sum()) == 0

    forward, backward = spike.block_lists(index, seq_len)
    assert forward.block_size == backward.block_size == (block, block)
    full, masked = listed(forward.full_block_cnt, forward.full_block_idx), listed(forward.mask_block_cnt,
                                                                                  forward.mask_block_idx)
    for h in range(heads):
        offsets = set(slash[0, h, :n_slash[0, h]].tolist())
        for q in range(nb):
            expected = {q - o for o in offsets if q - o >= 0}
            assert masked[0, h, q] == {q}  # the diagonal: the only block with a token-level (causal) mask
            assert full[0, h, q] == expected - {q}
            row = forward.full_block_idx[0, h, q, :forward.full_block_cnt[0, h, q]]
            assert torch.equal(row, row.sort().values)  # ascending, as FlexAttention's BlockMask
    # The backward's lists: per key block, the query blocks that list it.
    t_full = listed(backward.full_block_cnt, backward.full_block_idx)
    t_masked = listed(backward.mask_block_cnt, backward.mask_block_idx)
    for h in range(heads):
        for k in range(nb):
            assert t_masked[0, h, k] == {k}
            assert t_full[0, h, k] == {q for q in range(nb) if k in full[0, h, q]}
    assert backward.spt is True
