import pytest
import torch

from megatron_mtraining import VSIndex
from oracle import dense_mask


def make(slash, vertical, B=16, **kw):
    return VSIndex.from_lists([[slash]], [[vertical]], block_size=B, **kw)


def test_valid_index_passes():
    make([0, 2, 3], [1, 17, 40]).validate(64)


@pytest.mark.parametrize("slash, vertical, message", [
    ([1, 2], [], "diagonal offset 0"),
    ([0, 4], [], "out of range"),
    ([0, 2, 2], [], "duplicate"),
    ([0, 3, 2], [], "sorted"),
    ([0], [70], "out of range"),
    ([0], [-1], "out of range"),
    ([0], [9, 9], "duplicate"),
    ([0], [9, 3], "sorted"),
])
def test_validate_names_the_problem(slash, vertical, message):
    with pytest.raises(ValueError, match=message):
        make(slash, vertical).validate(64)


@pytest.mark.parametrize("slash, vertical, message", [([0, 2, 2], [], "duplicate block offsets"),
                                                      ([0], [9, 3], "columns must be sorted ascending")])
def test_from_lists_refuses_unsorted_entries_when_built(slash, vertical, message):
    """At construction, before any validate(): attention on a GPU never checks the order (it would
    synchronise), and a duplicate entry would count its pairs twice."""
    with pytest.raises(ValueError, match=message):
        make(slash, vertical)


def test_validate_count_above_capacity():
    idx = make([0, 1], [3])
    idx.n_slash.fill_(5)
    with pytest.raises(ValueError, match="n_slash out of range"):
        idx.validate(64)


def test_validate_missing_diagonal_with_zero_count():
    idx = make([0], [])
    idx.n_slash.zero_()
    with pytest.raises(ValueError, match="at least one slash"):
        idx.validate(64)


def test_validate_length_not_multiple_of_block():
    with pytest.raises(ValueError, match="multiple of block_size"):
        make([0], []).validate(60)


def test_structure_errors():
    s = torch.zeros(1, 1, 2, dtype=torch.int32)
    n = torch.ones(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="int32"):
        VSIndex(s.long(), n, s, n)
    with pytest.raises(ValueError, match="shape"):
        VSIndex(s, n, s, torch.ones(2, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="batch, heads, capacity"):
        VSIndex(s[0], n, s, n)
    with pytest.raises(ValueError, match="block_size must be 64 or 128"):
        VSIndex(s, n, s, n, block_size=48)
    with pytest.raises(ValueError, match="capacity >= 1"):
        VSIndex(s[..., :0], n, s, n)


def test_padding_is_ignored():
    idx = VSIndex.random(2, 3, 128, 16, max_slash=5, max_vertical=9, generator=torch.Generator().manual_seed(1))
    idx.validate(128)  # random() fills the padding with junk on purpose


def test_density_matches_mask_count():
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        idx = VSIndex.random(1, 3, 96, 16, max_slash=4, max_vertical=12, generator=g)
        mask = dense_mask(idx, 96)
        expected = mask.sum((-1, -2)).double() / (96 * 97 / 2)
        torch.testing.assert_close(idx.density(96).double(), expected, rtol=1e-6, atol=1e-9)


def test_dense_index_density_is_one():
    idx = VSIndex.dense(1, 2, 128, 16)
    torch.testing.assert_close(idx.density(128), torch.ones(1, 2))


@pytest.mark.parametrize("block_size", [32, 256, 8])
def test_block_sizes_outside_the_documented_ones_are_refused(block_size):
    """64 and 128 (and 16, the small CPU size): every constructor says which, before any work."""
    message = rf"block_size must be 64 or 128 \(or 16, for small shapes on the CPU\), got {block_size}"
    with pytest.raises(ValueError, match=message):
        VSIndex.from_lists([[[0, 1]]], [[[0, 5]]], block_size=block_size)
    with pytest.raises(ValueError, match=message):
        VSIndex.dense(1, 1, 1024, block_size)
    with pytest.raises(ValueError, match=message):
        VSIndex.random(1, 1, 1024, block_size)
    for allowed in (16, 64, 128):
        assert VSIndex.from_lists([[[0, 1]]], [[[0, 5]]], block_size=allowed).block_size == allowed


def test_a_cuda_device_without_cuda_is_a_clear_error(monkeypatch):
    """device="cuda" where CUDA is not available: a ValueError naming the call, not torch's
    AssertionError ("Torch not compiled with CUDA enabled")."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    calls = {"VSIndex.from_lists": lambda: VSIndex.from_lists([[[0]]], [[[1]]], device="cuda"),
             "VSIndex.dense": lambda: VSIndex.dense(1, 1, 64, device=torch.device("cuda", 0)),
             "VSIndex.random": lambda: VSIndex.random(1, 1, 64, 16, device="cuda:0"),
             "VSIndex.to": lambda: make([0], [1]).to("cuda")}
    for where, call in calls.items():
        with pytest.raises(ValueError, match=rf"{where}: device='cuda(:0)?', but CUDA is not available here"):
            call()
    assert make([0], [1]).to("cpu").device.type == "cpu"


def test_covers_matches_the_dense_mask():
    """covers() against the oracle's dense mask on every (row, col) pair, random indices with
    padding junk (random() fills it on purpose), including non-causal pairs (never covered)."""
    g = torch.Generator().manual_seed(3)
    n = 96
    rows, cols = (x.reshape(-1) for x in torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij"))
    for _ in range(4):
        idx = VSIndex.random(2, 3, n, 16, max_slash=4, max_vertical=12, generator=g)
        mask = dense_mask(idx, n)  # [b, h, n, n] bool, causal
        assert torch.equal(idx.covers(rows, cols, n), mask[..., rows, cols])


def test_slash_bitmap_ignores_offsets_outside_the_blocks():
    """Like the per-step conversion: an offset below 0 or past the last block selects nothing
    (``validate`` rejects both, but an index built on a GPU is not validated)."""
    index = VSIndex(torch.tensor([[[-1, 0, 2, 9]]], dtype=torch.int32), torch.tensor([[4]], dtype=torch.int32),
                    torch.zeros(1, 1, 0, dtype=torch.int32), torch.tensor([[0]], dtype=torch.int32), block_size=16)
    assert index.slash_bitmap(5).tolist() == [[[1, 0, 1, 0, 0]]]
