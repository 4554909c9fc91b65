"""The compiled per-step conversion (megatron_mtraining._C) against the PyTorch reference."""

import zlib

import pytest
import torch

from megatron_mtraining import _ext
from megatron_mtraining.index import VSIndex
from megatron_mtraining.kernels.step_plan import convert_step_reference

NAMES = ("kv_count", "kv_blocks", "q_count", "q_blocks", "col_count", "cols")
B = 16  # block size


def ids(blocks):
    return torch.tensor(list(blocks), dtype=torch.int32)


def striped(nb, world, rank):
    return ids(range(rank, nb, world))


def zigzag(world, chunk, rank):
    """2*world chunks of `chunk` blocks; rank r holds chunks r and 2*world-1-r."""
    first, second = rank * chunk, (2 * world - 1 - rank) * chunk
    return ids([*range(first, first + chunk), *range(second, second + chunk)])


def chunk_cases():
    """(name, num_blocks, q_block_ids, k_block_ids) for the layouts the ring uses."""
    cases = [("single", 12, ids(range(12)), ids(range(12)))]
    for world in (2, 3, 4):
        nb = 4 * world + 1  # not a multiple of world: ranks hold different block counts
        for r in range(world):
            for s in range(world):
                cases.append((f"striped{world}-{r}-{s}", nb, striped(nb, world, r), striped(nb, world, s)))
    for world, chunk in ((2, 2), (3, 1), (4, 2)):
        nb = 2 * world * chunk
        for r in range(world):
            for s in range(world):
                cases.append((f"zigzag{world}-{r}-{s}", nb, zigzag(world, chunk, r), zigzag(world, chunk, s)))
    return cases


CASES = chunk_cases()


def index_cases(nb, seed):
    """Random indices with junk padding, an empty vertical capacity, no verticals, and dense."""
    g = torch.Generator().manual_seed(seed)
    seq = nb * B
    yield VSIndex.random(2, 3, seq, B, max_slash=6, max_vertical=20, generator=g)
    yield VSIndex.random(1, 4, seq, B, max_slash=nb, max_vertical=seq, generator=g)
    yield VSIndex.random(2, 2, seq, B, max_slash=3, max_vertical=0, generator=g)  # max_v == 0
    idx = VSIndex.random(2, 2, seq, B, max_slash=4, max_vertical=8, generator=g)
    idx.n_vertical.zero_()  # capacity but no verticals: every entry is padding to skip
    yield idx
    yield VSIndex.dense(2, 2, seq, B)


def run_both(idx, nb, q_ids, k_ids, device):
    args = (idx.slash, idx.n_slash, idx.vertical, idx.n_vertical, q_ids, k_ids)
    ref = convert_step_reference(*args, nb, B)
    out = _ext.module().convert_step(*(a.to(device) for a in args), nb, B)
    return ref, out


def assert_same(ref, out, where):
    assert len(out) == 6
    for name, r, o in zip(NAMES, ref, out):
        assert o.dtype == torch.int32 and o.is_contiguous(), f"{where}: {name} {o.dtype}"
        assert torch.equal(r, o.cpu()), f"{where}: {name} differs\nreference {r}\nextension {o}"


needs_ext = pytest.mark.skipif(not _ext.available(), reason=f"megatron_mtraining._C: {_ext.status()}")
needs_cuda_ext = pytest.mark.skipif(
    not (torch.cuda.is_available() and _ext.supports(torch.device("cuda"))),
    reason="needs a CUDA GPU and megatron_mtraining._C built with CUDA")


def test_reference_hand_made():
    """Striped world 2, rank 1 (blocks 1, 3) reading rank 0's keys (blocks 0, 2); nb 4, block 16."""
    junk_s, junk_v = 123456, -7  # padding must never be read
    slash = torch.tensor([[[0, 2, junk_s], [0, 1, 3]]], dtype=torch.int32)
    vertical = torch.tensor([[[5, 40, junk_v], [17, 33, 63]]], dtype=torch.int32)
    n_slash = torch.tensor([[2, 3]], dtype=torch.int32)
    n_vertical = torch.tensor([[2, 3]], dtype=torch.int32)
    out = convert_step_reference(slash, n_slash, vertical, n_vertical, ids([1, 3]), ids([0, 2]), 4, 16)
    expected = {
        # head 0, offsets {0, 2}: odd query blocks never meet even key blocks.
        # head 1, offsets {0, 1, 3}: q 1 reads k 0 (local 0); q 3 reads k 0, 2 (local 0, 1).
        "kv_count": [[[0, 0], [1, 2]]],
        "kv_blocks": [[[[0, 0, 0], [0, 0, 0]], [[0, 0, 0], [0, 1, 0]]]],
        # transpose: k 0 is read by q 1, 3 (local 0, 1); k 2 by q 3 (local 1; q 5 is past the end).
        "q_count": [[[0, 0], [2, 1]]],
        "q_blocks": [[[[0, 0, 0], [0, 0, 0]], [[0, 1, 0], [1, 0, 0]]]],
        # columns in key blocks 0 and 2: 5 -> local 5, 40 -> local 16 + 8; 33 -> 16 + 1.
        "col_count": [[2, 1]],
        "cols": [[[5, 24, 0], [17, 0, 0]]],
    }
    for name, tensor in zip(NAMES, out):
        assert tensor.dtype == torch.int32
        assert tensor.tolist() == expected[name], name


def test_negative_slash_offsets_are_dropped():
    """An offset below 0 (an index built on the GPU skips VSIndex.validate) would list a key block
    after its query block, which the kernels would not mask: the conversion drops it."""
    slash = torch.tensor([[[0, -1, 2]]], dtype=torch.int32)
    vertical = torch.zeros(1, 1, 0, dtype=torch.int32)
    n_slash, n_vertical = torch.tensor([[3]], dtype=torch.int32), torch.tensor([[0]], dtype=torch.int32)
    clean = torch.tensor([[[0, 2, 0]]], dtype=torch.int32), torch.tensor([[2]], dtype=torch.int32)
    nb = 4
    impls = [convert_step_reference] + ([_ext.module().convert_step] if _ext.available() else [])
    for convert in impls:
        got = convert(slash, n_slash, vertical, n_vertical, ids(range(nb)), ids(range(nb)), nb, B)
        want = convert(*clean, vertical, n_vertical, ids(range(nb)), ids(range(nb)), nb, B)
        for name, a, b in zip(NAMES, got, want):
            assert torch.equal(a[..., :2] if name.endswith("blocks") else a,
                               b[..., :2] if name.endswith("blocks") else b), name


def test_reference_single_device_order():
    """kv lists key blocks ascending (diagonal last); q lists query blocks ascending."""
    idx = VSIndex.from_lists([[[0, 1, 3]]], [[[]]], block_size=B)
    nb = 5
    kv_count, kv_blocks, q_count, q_blocks, *_ = convert_step_reference(
        idx.slash, idx.n_slash, idx.vertical, idx.n_vertical, ids(range(nb)), ids(range(nb)), nb, B)
    assert kv_count.tolist() == [[[1, 2, 2, 3, 3]]]
    assert kv_blocks[0, 0, 4].tolist() == [1, 3, 4]
    assert q_count.tolist() == [[[3, 3, 2, 2, 1]]]
    assert q_blocks[0, 0, 1].tolist() == [1, 2, 4]


@needs_ext
@pytest.mark.parametrize("name,nb,q_ids,k_ids", CASES, ids=[c[0] for c in CASES])
def test_cpu_matches_reference(name, nb, q_ids, k_ids):
    for n, idx in enumerate(index_cases(nb, seed=zlib.crc32(name.encode()))):
        assert_same(*run_both(idx, nb, q_ids, k_ids, "cpu"), f"{name} index {n}")


@needs_ext
def test_cpu_counts_out_of_range():
    """Counts below 0 or past the capacity act like the reference's mask (clamped)."""
    nb = 8
    idx = VSIndex.random(2, 3, nb * B, B, max_slash=4, max_vertical=6, generator=torch.Generator().manual_seed(1))
    idx.n_slash[0, 0], idx.n_slash[1, 2] = -3, 99
    idx.n_vertical[0, 1], idx.n_vertical[1, 0] = -1, 50
    idx.slash[1, 2] = torch.tensor([0, 1, 2, 5], dtype=torch.int32)  # valid entries for the full capacity
    idx.vertical[1, 0] = torch.tensor([1, 2, 3, 70, 100, 127], dtype=torch.int32)
    assert_same(*run_both(idx, nb, striped(nb, 2, 1), striped(nb, 2, 0), "cpu"), "out-of-range counts")


@needs_ext
def test_cpu_input_checks():
    idx = VSIndex.random(1, 2, 4 * B, B, generator=torch.Generator().manual_seed(0))
    conv = _ext.module().convert_step
    args = [idx.slash, idx.n_slash, idx.vertical, idx.n_vertical, ids(range(4)), ids(range(4))]
    with pytest.raises(RuntimeError, match="slash must be int32"):
        conv(idx.slash.long(), *args[1:], 4, B)
    with pytest.raises(RuntimeError, match="n_slash must have 2 dims"):
        conv(args[0], idx.n_slash[0], *args[2:], 4, B)
    with pytest.raises(RuntimeError, match="out of range"):
        conv(*args[:5], ids([0, 4]), 4, B)
    with pytest.raises(RuntimeError, match="twice"):
        conv(*args[:4], ids([1, 1]), ids(range(4)), 4, B)
    with pytest.raises(RuntimeError, match="contiguous"):
        conv(*args[:5], ids(range(8))[::2], 8, B)


@needs_ext
def test_has_cuda_flag():
    assert isinstance(_ext.module().has_cuda(), bool)


@pytest.mark.gpu
@needs_cuda_ext
@pytest.mark.parametrize("name,nb,q_ids,k_ids", CASES, ids=[c[0] for c in CASES])
def test_cuda_matches_reference(name, nb, q_ids, k_ids):
    stream = torch.cuda.Stream()  # the kernels must follow the current stream
    for n, idx in enumerate(index_cases(nb, seed=zlib.crc32(name.encode()))):
        with torch.cuda.stream(stream):
            ref, out = run_both(idx, nb, q_ids, k_ids, "cuda")
        stream.synchronize()
        assert all(o.device.type == "cuda" for o in out)
        assert_same(ref, out, f"{name} index {n}")


@pytest.mark.gpu
@needs_cuda_ext
@pytest.mark.parametrize("rank", [0, 2])
def test_cuda_long_column_rows(rank):
    """Column rows much longer than the CUDA column kernel's block of threads (several entries per
    thread, runs that straddle the chunk's blocks) keep the reference's entries and order."""
    nb, world = 384, 3
    g = torch.Generator().manual_seed(rank)
    idx = VSIndex.random(2, 3, nb * B, B, max_slash=8, max_vertical=nb * B, generator=g)
    idx.n_vertical[0, 0] = 5  # a short row beside the long ones
    ref, out = run_both(idx, nb, striped(nb, world, 1), striped(nb, world, rank), "cuda")
    assert_same(ref, out, f"rank {rank}")
    assert int(ref[4].max()) > 2 * 256  # rows of more than 2 entries per thread of the block


def _bounds_cases():
    """The ring's chunks plus chunks whose blocks are in no particular order."""
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(3)).to(torch.int32)
    return CASES + [("permuted", 12, perm[:7], perm[5:])]


@pytest.mark.parametrize("name, nb, q_ids, k_ids", _bounds_cases(), ids=[c[0] for c in _bounds_cases()])
def test_column_bounds_skip_only_columns_after_every_query(name, nb, q_ids, k_ids):
    """``StepPlan.col_limit`` (query-stationary kernels) and ``first_query_blocks`` (the column
    gradient kernel) are the tightest bounds that keep every causally visible (query block,
    column) pair: brute force over all pairs, for any order of the chunks' blocks."""
    from megatron_mtraining.kernels.step_plan import build_step_plan
    from megatron_mtraining.kernels.step_plan import first_query_blocks

    block_col = 4
    for index in index_cases(nb, zlib.crc32(name.encode())):
        plan = build_step_plan(index, q_ids, k_ids, nb, impl="torch")
        last_query = q_ids.long() * B + B - 1
        b, h, max_v = plan.cols.shape
        for bb in range(b):
            for hh in range(h):
                pos = [int(plan.k_block_ids[c // B]) * B + c % B
                       for c in plan.cols[bb, hh, :plan.col_count[bb, hh]].tolist()]
                for i, last in enumerate(last_query.tolist()):
                    visible = [j for j, p in enumerate(pos) if p <= last]
                    assert plan.col_limit[bb, hh, i] == (visible[-1] + 1 if visible else 0)
        n_tiles = -(-max_v // block_col)
        if n_tiles == 0:
            continue
        q_first = first_query_blocks(plan, block_col).view(b, h, n_tiles)
        for bb in range(b):
            for hh in range(h):
                pos = plan.col_pos[bb, hh].tolist()
                for t in range(n_tiles):
                    tile = [p for p in pos[t * block_col:(t + 1) * block_col] if p < nb * B]
                    seeing = [i for i, last in enumerate(last_query.tolist()) if tile and min(tile) <= last]
                    # every block that sees the tile is at or after q_first; the first that does is q_first
                    assert q_first[bb, hh, t] == (seeing[0] if seeing else len(last_query))


@pytest.mark.parametrize("name, nb, q_ids, k_ids", _bounds_cases(), ids=[c[0] for c in _bounds_cases()])
def test_column_words_mark_exactly_the_live_columns(name, nb, q_ids, k_ids):
    """``StepPlan.column_words``: bit s of word w for query block i is set iff slot w*64+s holds a
    column whose block is not after block i and not read through one of its slash offsets; diag
    flags a live column in the block itself. Brute force over all (query block, slot) pairs, for
    indices with and without the diagonal offset; the Triton kernel (interpreter) gives the same."""
    from megatron_mtraining.kernels.column_words import column_words_reference, column_words_triton
    from megatron_mtraining.kernels.step_plan import build_step_plan
    from megatron_mtraining.kernels.common import interpreting

    seed = zlib.crc32(name.encode())
    no_diagonal = VSIndex.from_lists([[[1, 3], [2]]], [[[5, 20, 21, 40, 47], [1, 35, 36]]], block_size=B)
    for index in [*index_cases(nb, seed), no_diagonal]:
        plan = build_step_plan(index, q_ids, k_ids, nb, impl="torch")
        words, diag = plan.column_words
        b, h, max_v = plan.cols.shape
        assert words.shape == (b, h, len(q_ids), -(-max_v // 64)) and words.dtype == torch.int64
        bitmap = index.slash_bitmap(nb)
        for bb in range(b):
            for hh in range(h):
                pos = plan.col_pos[bb, hh].tolist()
                for i, qb in enumerate(q_ids.tolist()):
                    bits = [(int(words[bb, hh, i, s // 64]) >> (s % 64)) & 1 for s in range(max_v)]
                    live = [p < nb * B and p // B <= qb and not bitmap[bb, hh, qb - p // B] for p in pos]
                    assert bits == [int(x) for x in live], (bb, hh, i)
                    in_block = any(x and p // B == qb for x, p in zip(live, pos))
                    assert int(diag[bb, hh, i]) == int(in_block)
        if interpreting() or torch.cuda.is_available():
            dev = "cuda" if torch.cuda.is_available() else "cpu"
            args = (plan.col_pos.to(dev), plan.q_block_ids.to(dev), plan.slash_bitmap.to(dev), B)
            want = column_words_reference(*args)
            for got in (column_words_triton(*args), column_words_triton(*args, col_count=plan.col_count.to(dev))):
                for g, w in zip(got, want):
                    assert torch.equal(g.cpu(), w.cpu())
    if name == "single":  # the index without a diagonal has live columns inside query blocks
        assert int(diag.sum()) > 0


@pytest.mark.skipif(not torch.cuda.is_available() and not __import__("os").environ.get("TRITON_INTERPRET"),
                    reason="needs a GPU or Triton's interpreter")
def test_column_words_kernel_over_many_words():
    """More words than the Triton kernel takes per iteration (16), a partial last word and empty
    slots: equal to the reference."""
    from megatron_mtraining.kernels.column_words import column_words_reference, column_words_triton

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(7)
    nb, block, max_v = 40, 16, 17 * 64 + 5
    col_pos = torch.randint(0, nb * block, (1, 2, max_v), generator=g).sort(-1).values
    col_pos[:, 1, 900:] = nb * block  # empty slots of a shorter row
    q_ids = torch.arange(3, nb, 2, dtype=torch.int32)
    bitmap = (torch.rand(1, 2, nb, generator=g) < 0.3).to(torch.int8)
    bitmap[0, 0, 0] = 0  # no diagonal in head 0: columns inside query blocks stay live
    args = (col_pos.to(dev), q_ids.to(dev), bitmap.to(dev), block)
    want = column_words_reference(*args)
    assert bool(want[1].any())
    # With the counts, whole iterations of words past a row's columns are stored as zeros without
    # reading their positions (row 1's words 16 and 17: its 900 columns end in word 14).
    counts = torch.tensor([[max_v, 900]], dtype=torch.int32, device=dev)
    for got in (column_words_triton(*args), column_words_triton(*args, col_count=counts)):
        for a, b in zip(got, want):
            assert torch.equal(a.cpu(), b.cpu())
