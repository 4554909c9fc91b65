"""Token layouts across context-parallel ranks (docs/design.md §3)."""

import pytest
import torch

from megatron_mtraining.layout import (LAYOUTS, check_layout, gather_sequence, local_block_ids, local_positions,
                                       shard_sequence)

B = 16
WORLD_SIZES = [1, 2, 3, 4, 8]


def valid_lengths(layout, world_size):
    unit = B * world_size * (2 if layout == "zigzag" else 1)
    return [unit, 3 * unit]


CASES = [(layout, w, n) for layout in LAYOUTS for w in WORLD_SIZES for n in valid_lengths(layout, w)]


@pytest.mark.parametrize("layout,world_size,seq_len", CASES)
def test_positions_form_a_permutation(layout, world_size, seq_len):
    positions = [local_positions(seq_len, layout, world_size, r, B) for r in range(world_size)]
    for pos in positions:
        assert pos.dtype == torch.int64 and pos.shape == (seq_len // world_size,)
    assert torch.equal(torch.sort(torch.cat(positions))[0], torch.arange(seq_len))


@pytest.mark.parametrize("layout,world_size,seq_len", CASES)
def test_positions_are_whole_blocks_in_block_order(layout, world_size, seq_len):
    for r in range(world_size):
        blocks = local_block_ids(seq_len, layout, world_size, r, B)
        pos = local_positions(seq_len, layout, world_size, r, B)
        assert torch.equal(pos, (blocks[:, None] * B + torch.arange(B)).reshape(-1))
        assert bool((blocks[1:] > blocks[:-1]).all()), "local blocks ascend in global order"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("blocks_per_rank", [1, 2, 5])
def test_striped_rank_holds_every_world_size_th_block(world_size, blocks_per_rank):
    seq_len = B * world_size * blocks_per_rank
    for r in range(world_size):
        blocks = local_block_ids(seq_len, "striped", world_size, r, B)
        assert blocks.tolist() == [r + i * world_size for i in range(blocks_per_rank)]
        # Local block i is global block i*W + r.
        pos = local_positions(seq_len, "striped", world_size, r, B)
        assert pos[:B].tolist() == list(range(r * B, (r + 1) * B))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("blocks_per_chunk", [1, 3])
def test_zigzag_rank_holds_chunks_r_and_mirror(world_size, blocks_per_chunk):
    chunk = B * blocks_per_chunk
    seq_len = 2 * world_size * chunk
    for r in range(world_size):
        pos = local_positions(seq_len, "zigzag", world_size, r, B)
        mirror = 2 * world_size - 1 - r
        expected = list(range(r * chunk, (r + 1) * chunk)) + list(range(mirror * chunk, (mirror + 1) * chunk))
        assert pos.tolist() == expected


def test_single_rank_holds_everything_in_order():
    for layout in LAYOUTS:
        assert torch.equal(local_positions(4 * B, layout, 1, 0, B), torch.arange(4 * B))


def test_known_small_layouts():
    # 8 blocks of 16 tokens on 2 ranks, by block id.
    assert local_block_ids(128, "striped", 2, 0, B).tolist() == [0, 2, 4, 6]
    assert local_block_ids(128, "striped", 2, 1, B).tolist() == [1, 3, 5, 7]
    assert local_block_ids(128, "zigzag", 2, 0, B).tolist() == [0, 1, 6, 7]
    assert local_block_ids(128, "zigzag", 2, 1, B).tolist() == [2, 3, 4, 5]


@pytest.mark.parametrize("layout,world_size,seq_len", CASES)
@pytest.mark.parametrize("dim", [0, 1, 2, -1])
def test_shard_then_gather_is_identity(layout, world_size, seq_len, dim):
    shape = [2, 3, 5, 4]
    shape[dim] = seq_len
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seq_len + world_size))
    shards = [shard_sequence(x, dim, layout, world_size, r, B) for r in range(world_size)]
    for r, shard in enumerate(shards):
        expected_shape = list(shape)
        expected_shape[dim] = seq_len // world_size
        assert list(shard.shape) == expected_shape
        pos = local_positions(seq_len, layout, world_size, r, B)
        assert torch.equal(shard, x.index_select(dim, pos))
    assert torch.equal(gather_sequence(shards, dim, layout, B), x)


def test_shard_sequence_keeps_dtype_and_grad():
    x = torch.arange(64, dtype=torch.float64).reshape(1, 64).requires_grad_()
    shard = shard_sequence(x, 1, "zigzag", 2, 1, B)
    assert shard.dtype == torch.float64
    shard.sum().backward()
    expected = torch.zeros(64, dtype=torch.float64)
    expected[16:48] = 1
    assert torch.equal(x.grad[0], expected)


def test_valid_layouts_pass_check():
    check_layout(64, "striped", 4, 16)
    check_layout(128, "zigzag", 4, 16)
    check_layout(128, "striped", 1, 128)


@pytest.mark.parametrize("layout,seq_len,world_size,match", [
    ("striped", 48, 2, r"striped layout: sequence length 48 is not divisible by block_size \* world_size = 32"),
    ("striped", 100, 1, r"sequence length 100 is not divisible by block_size \* world_size = 16"),
    ("zigzag", 96, 2, r"zigzag layout: sequence length 96 is not divisible by 2 \* world_size \* block_size = 64"),
    ("zigzag", 32, 2, r"not divisible by 2 \* world_size \* block_size = 64"),
])
def test_indivisible_sequence_is_a_clear_error(layout, seq_len, world_size, match):
    with pytest.raises(ValueError, match=match):
        check_layout(seq_len, layout, world_size, B)
    with pytest.raises(ValueError, match=match):
        local_positions(seq_len, layout, world_size, 0, B)
    with pytest.raises(ValueError, match=match):
        shard_sequence(torch.zeros(seq_len), 0, layout, world_size, 0, B)


def test_error_mentions_block_and_cp_size():
    with pytest.raises(ValueError, match=r"block_size 16, context-parallel size 3"):
        check_layout(16 * 4, "striped", 3, 16)


def test_bad_layout_name():
    with pytest.raises(ValueError, match=r"layout must be one of \('striped', 'zigzag'\), got 'ring'"):
        check_layout(64, "ring", 2, B)
    with pytest.raises(ValueError, match="layout must be one of"):
        local_positions(64, "Striped", 2, 0, B)


def test_bad_world_size_and_rank():
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        check_layout(64, "striped", 0, B)
    with pytest.raises(ValueError, match=r"rank 2 is outside \[0, 2\)"):
        local_block_ids(64, "striped", 2, 2, B)
    with pytest.raises(ValueError, match=r"rank -1 is outside \[0, 2\)"):
        local_positions(64, "zigzag", 2, -1, B)


def test_layout_tables_are_built_once_per_device_and_key_and_bounded(monkeypatch):
    from megatron_mtraining import layout

    monkeypatch.setattr(layout, "_TABLES", layout._TABLES.__class__())
    built = []

    def build():
        built.append(1)
        return (torch.arange(4), torch.arange(2))

    first = layout.layout_table("t", "cpu", (8, "striped"), build)
    again = layout.layout_table("t", torch.device("cpu"), (8, "striped"), build)
    assert again is first and len(built) == 1 and isinstance(first, tuple)
    layout.layout_table("t", "cpu", (16, "striped"), build)  # another key: built
    layout.layout_table("u", "cpu", (8, "striped"), build)   # another name: built
    assert len(built) == 3
    assert layout.layout_table("v", "cpu", (), lambda: [torch.zeros(1)])[0].shape == (1,)  # a list stays a list
    for i in range(layout._TABLE_ENTRIES + 5):
        layout.layout_table("w", "cpu", (i,), lambda: torch.zeros(1))
    assert len(layout._TABLES) == layout._TABLE_ENTRIES
    assert ("w", "cpu", (layout._TABLE_ENTRIES + 4,)) in layout._TABLES and ("t", "cpu", (8, "striped")) not in layout._TABLES
