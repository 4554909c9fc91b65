"""BlockIndex (block-sparse index, docs/design.md §1-2): construction, checks, the per-step
conversion, and sparse_attention / reference_attention with it (every backend) against a float64
oracle whose mask is built entry by entry from Python sets."""

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_mtraining import BlockIndex, Documents, VSIndex, reference_attention, sparse_attention
from megatron_mtraining.config import Settings
from megatron_mtraining.kernels.block_plan import convert_block_step
from megatron_mtraining.kernels.step_plan import build_step_plan, single_device_plan
from megatron_mtraining.layout import local_block_ids
from oracle import attention_f64, rel_err

B = 16
BACKENDS = ["torch", "triton"]  # triton runs in the CPU interpreter when there is no GPU
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def block_sets(index: BlockIndex):
    """[batch][head][query block] -> set of key blocks, read on the host."""
    return [[[set(index.key_blocks[b, h, i, :int(index.n_key_blocks[b, h, i])].tolist())
              for i in range(index.num_blocks)] for h in range(index.heads)] for b in range(index.batch)]


def oracle_mask(index: BlockIndex, n: int, ends=None) -> torch.Tensor:
    """bool [b, h, n, n] of docs/design.md §1 for a block index, pair by pair."""
    sets, bs = block_sets(index), index.block_size

    def doc(p):
        return 0 if ends is None else sum(1 for e in ends[1:] if e <= p)

    mask = torch.zeros(index.batch, index.heads, n, n, dtype=torch.bool)
    for b in range(index.batch):
        for h in range(index.heads):
            for qp in range(n):
                for kp in range(qp + 1):
                    mask[b, h, qp, kp] = (kp // bs) in sets[b][h][qp // bs] and doc(kp) == doc(qp)
    return mask


def inputs(b, hq, hkv, n, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=g).to(DEVICE).requires_grad_() for h in (hq, hkv, hkv)]


def mask_with(b, h, nb, density, seed):
    return torch.rand(b, h, nb, nb, generator=torch.Generator().manual_seed(seed)) < density


# ------------------------------------------------------------------------------------ the index

def test_from_mask_lists_ascending_blocks_with_the_diagonal_and_drops_future_blocks():
    mask = torch.zeros(1, 2, 4, 4, dtype=torch.bool)
    mask[0, 0, 3, [0, 2]] = True      # two earlier blocks, diagonal missing: added
    mask[0, 0, 1, [1, 3]] = True      # block 3 is after query block 1: dropped
    mask[0, 1] = True                 # everything: the causal blocks
    index = BlockIndex.from_mask(mask, B).validate(4 * B)
    assert block_sets(index)[0][0] == [{0}, {1}, {2}, {0, 2, 3}]
    assert block_sets(index)[0][1] == [set(range(i + 1)) for i in range(4)]
    assert index.key_blocks[0, 0, 3, :3].tolist() == [0, 2, 3]
    assert index.n_key_blocks[0, 0].tolist() == [1, 1, 1, 3]
    want = (mask | torch.eye(4, dtype=torch.bool)) & torch.ones(4, 4, dtype=torch.bool).tril()
    assert torch.equal(index.to_mask(), want)


def test_from_mask_capacity():
    mask = mask_with(2, 2, 6, 0.5, seed=1)
    widest = int(((mask & torch.ones(6, 6, dtype=torch.bool).tril()) | torch.eye(6, dtype=torch.bool)).sum(-1).max())
    index = BlockIndex.from_mask(mask, B, max_blocks=widest)
    assert index.capacity == widest
    assert torch.equal(index.to_mask(), BlockIndex.from_mask(mask, B).to_mask())
    with pytest.raises(ValueError, match="max_blocks"):
        BlockIndex.from_mask(mask, B, max_blocks=widest - 1)


@pytest.mark.parametrize("mask, message", [
    (torch.ones(1, 1, 4, 4, dtype=torch.int32), "bool"),
    (torch.ones(1, 4, 4, dtype=torch.bool), "bool tensor"),
    (torch.ones(1, 1, 4, 3, dtype=torch.bool), "square"),
])
def test_from_mask_refuses_bad_masks(mask, message):
    with pytest.raises(ValueError, match=message):
        BlockIndex.from_mask(mask, B)


def _raw(rows, counts, nb=4):
    blocks = torch.zeros(1, 1, nb, max(len(r) for r in rows), dtype=torch.int32)
    for i, r in enumerate(rows):
        blocks[0, 0, i, :len(r)] = torch.tensor(r, dtype=torch.int32)
    return BlockIndex(blocks, torch.tensor([[counts]], dtype=torch.int32), B)


@pytest.mark.parametrize("rows, counts, message", [
    ([[0], [1], [2], [0, 2]], [1, 1, 1, 2], "diagonal block missing"),
    ([[0], [0, 2], [2], [3]], [1, 2, 1, 1], "after its query block"),
    ([[0], [1], [2], [1, 1, 3]], [1, 1, 1, 3], "duplicate"),
    ([[0], [1], [2], [2, 1, 3]], [1, 1, 1, 3], "sorted"),
    ([[0], [1], [2], [-1, 3]], [1, 1, 1, 2], "out of range"),
    ([[0], [1], [2], [3]], [1, 0, 1, 1], "counts must lie"),
    ([[0], [1], [2], [3]], [1, 1, 1, 2], "counts must lie"),
])
def test_validate_names_the_problem(rows, counts, message):
    with pytest.raises(ValueError, match=message):
        _raw(rows, counts).validate(4 * B)


def test_validate_accepts_a_good_index_and_checks_the_length():
    index = _raw([[0], [0, 1], [2], [0, 1, 3]], [1, 2, 1, 3])
    assert index.validate(4 * B) is index
    with pytest.raises(ValueError, match="4 query blocks"):
        index.validate(8 * B)
    with pytest.raises(ValueError, match="multiple of block_size"):
        index.validate(4 * B + 3)


@pytest.mark.parametrize("kwargs, message", [
    (dict(key_blocks=torch.zeros(1, 1, 4, 2, dtype=torch.int64)), "int32"),
    (dict(key_blocks=torch.zeros(1, 1, 4, dtype=torch.int32)), "query blocks, capacity"),
    (dict(n_key_blocks=torch.ones(1, 1, 3, dtype=torch.int32)), "n_key_blocks has shape"),
    (dict(key_blocks=torch.zeros(1, 1, 4, 0, dtype=torch.int32)), "capacity >= 1"),
    (dict(block_size=24), "power of two"),
])
def test_structure_errors(kwargs, message):
    args = dict(key_blocks=torch.zeros(1, 1, 4, 2, dtype=torch.int32),
                n_key_blocks=torch.ones(1, 1, 4, dtype=torch.int32), block_size=B)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        BlockIndex(**args)


def test_density_counts_active_pairs():
    index = BlockIndex.random(2, 3, 8 * B, B, density=0.4, generator=torch.Generator().manual_seed(3))
    mask = oracle_mask(index, 8 * B)
    want = mask.sum((-1, -2)).double() / (8 * B * (8 * B + 1) / 2)
    assert torch.allclose(index.density(8 * B).double(), want, rtol=1e-6)
    assert torch.allclose(BlockIndex.dense(1, 1, 8 * B, B).density(8 * B), torch.ones(1, 1))


def token_mask(index: BlockIndex, n: int) -> torch.Tensor:
    """bool [b, h, n, n]: ``to_mask()`` expanded to tokens, causal (apart from ``covers``)."""
    bs = index.block_size
    mask = index.to_mask().repeat_interleave(bs, -2).repeat_interleave(bs, -1)
    return mask & torch.ones(n, n, dtype=torch.bool).tril()


def test_covers_matches_the_token_mask_on_every_pair():
    """covers() on every (row, col) pair of random indices (junk padding included) against the
    block mask expanded to tokens and the pair-by-pair oracle; non-causal pairs are never covered."""
    n = 6 * B
    rows, cols = (x.reshape(-1) for x in torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij"))
    g = torch.Generator().manual_seed(7)
    for density in (0.0, 0.3, 0.7):
        index = BlockIndex.random(2, 3, n, B, density=density, generator=g)
        covered = index.covers(rows, cols, n)
        assert covered.shape == (2, 3, n * n) and covered.dtype == torch.bool
        assert torch.equal(covered, token_mask(index, n)[..., rows, cols])
        assert torch.equal(covered, oracle_mask(index, n)[..., rows, cols])
        assert not covered[..., cols > rows].any()


def test_covers_edge_cases():
    """Row 3*B+5 (last block, 3) attends blocks {0, 3}; row B+2 (block 1) only its own block."""
    mask = torch.zeros(1, 2, 4, 4, dtype=torch.bool)
    mask[0, 0, 3, 0] = True
    index = BlockIndex.from_mask(mask, B)
    n, row = 4 * B, 3 * B + 5
    cases = [  # (row, col, covered in head 0)
        (row, row, True),            # col == row: the diagonal
        (row, 3 * B, True),          # first token of the row's own block
        (row, row + 1, False),       # the own block, after the row: not causal
        (row, n - 1, False),         # the last token of the sequence, after the row
        (row, 0, True),              # a selected earlier block
        (row, B - 1, True),          # its last token
        (row, B, False),             # the first token of an unselected block
        (row, 3 * B - 1, False),     # the block just before the own one, unselected
        (n - 1, n - 1, True),        # the last token, its own key
        (B + 2, 0, False),           # block 1 selects only itself
        (B + 2, B, True),
        (0, 0, True),                # the first token
    ]
    rows = torch.tensor([r for r, _, _ in cases])
    cols = torch.tensor([c for _, c, _ in cases])
    covered = index.covers(rows, cols, n)
    assert covered[0, 0].tolist() == [want for _, _, want in cases]
    # Head 1 selects only the diagonal blocks: exactly the causal pairs of one block.
    assert covered[0, 1].tolist() == [r >= c and r // B == c // B for r, c, _ in cases]
    assert torch.equal(covered, token_mask(index, n)[..., rows, cols])
    with pytest.raises(ValueError, match="4 query blocks"):
        index.covers(rows, cols, 8 * B)
    with pytest.raises(ValueError, match="multiple of block_size"):
        index.covers(rows, cols, n + 3)


def test_covers_agrees_with_the_vertical_slash_index_of_one_pattern():
    """A slash-only VSIndex and the BlockIndex of the same blocks cover the same pairs."""
    nb, slash = 6, [0, 2, 3]
    vs = VSIndex.from_lists([[slash]], [[[]]], block_size=B)
    mask = torch.zeros(1, 1, nb, nb, dtype=torch.bool)
    for i in range(nb):
        for d in slash:
            if i - d >= 0:
                mask[0, 0, i, i - d] = True
    n = nb * B
    rows, cols = (x.reshape(-1) for x in torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij"))
    assert torch.equal(BlockIndex.from_mask(mask, B).covers(rows, cols, n), vs.covers(rows, cols, n))


def test_random_index_is_valid_with_junk_padding():
    index = BlockIndex.random(2, 2, 6 * B, B, generator=torch.Generator().manual_seed(0))
    index.validate(6 * B)
    pad = torch.arange(index.capacity) >= index.n_key_blocks[..., None]
    assert pad.any() and (index.key_blocks[pad] == 98765).all()


# ------------------------------------------------------------------------- FlexAttention's BlockMask

flex = pytest.importorskip("torch.nn.attention.flex_attention")


def _sliding(window):
    def mask_mod(b, h, q, kv):
        return (q >= kv) & (q - kv < window)
    return mask_mod


def test_from_block_mask_matches_the_block_masks_dense_form():
    n = 8 * B
    bm = flex.create_block_mask(_sliding(40), 1, 1, n, n, device="cpu", BLOCK_SIZE=B)
    index = BlockIndex.from_block_mask(bm, batch=2, heads=3).validate(n)
    assert (index.batch, index.heads, index.block_size) == (2, 3, B)
    # Key blocks within 40 tokens of some query of the block, partial or full: 3 or 4 blocks back.
    want = bm.to_dense().bool()[..., :8, :8] | torch.eye(8, dtype=torch.bool)
    assert torch.equal(index.to_mask(), want.expand(2, 3, 8, 8))
    for i in range(8):
        assert set(index.key_blocks[1, 2, i, :int(index.n_key_blocks[1, 2, i])].tolist()) == \
            {j for j in range(8) if j <= i and (i - j) * B - (B - 1) < 40}


def test_from_block_mask_per_head_documents_and_full_blocks():
    n, ends = 8 * B, torch.tensor([0, 37, 80, 8 * B])
    doc = torch.searchsorted(ends, torch.arange(n), right=True)

    def mask_mod(b, h, q, kv):
        return (q >= kv) & ((doc[q] == doc[kv]) | (h == 1))  # head 1: causal; head 0: documents

    bm = flex.create_block_mask(mask_mod, 1, 2, n, n, device="cpu", BLOCK_SIZE=B)
    assert bm.full_kv_num_blocks is not None and int(bm.full_kv_num_blocks.sum()) > 0  # full blocks too
    index = BlockIndex.from_block_mask(bm)
    token = torch.stack([mask_mod(0, h, torch.arange(n)[:, None], torch.arange(n)[None, :]) for h in range(2)])
    blocks = token.view(2, 8, B, 8, B).any(-1).any(2)  # a block pair with any active token pair
    assert torch.equal(index.to_mask()[0], blocks)


def test_from_block_mask_errors():
    n = 4 * B
    bm = flex.create_block_mask(_sliding(20), 2, 1, n, n, device="cpu", BLOCK_SIZE=B)
    with pytest.raises(ValueError, match="batch 2, cannot serve 3"):
        BlockIndex.from_block_mask(bm, batch=3)
    with pytest.raises(ValueError, match="square"):
        BlockIndex.from_block_mask(flex.create_block_mask(_sliding(20), 1, 1, n, n, device="cpu",
                                                          BLOCK_SIZE=(16, 32)))
    with pytest.raises(ValueError, match="equal multiples"):
        BlockIndex.from_block_mask(flex.create_block_mask(_sliding(20), 1, 1, n, 2 * n, device="cpu",
                                                          BLOCK_SIZE=B))
    with pytest.raises(ValueError, match="expected a FlexAttention BlockMask"):
        BlockIndex.from_block_mask(torch.ones(1, 1, 4, 4, dtype=torch.bool))


# ---------------------------------------------------------------------------- per-step conversion

def _conversion_by_loops(index, q_ids, k_ids, floor=None):
    """The plan's lists for a block index, entry by entry: (kv lists, q lists) per (b, h), as
    Python lists of local block ids in ascending global order."""
    sets = block_sets(index)
    q_ids, k_ids = q_ids.tolist(), k_ids.tolist()
    kv, qs = {}, {}
    for b in range(index.batch):
        for h in range(index.heads):
            def reads(qg, kg):
                return kg in sets[b][h][qg] and kg <= qg and (floor is None or kg >= floor[qg])
            kv[b, h] = [[j for j in sorted(range(len(k_ids)), key=lambda j: k_ids[j]) if reads(qg, k_ids[j])]
                        for qg in q_ids]
            qs[b, h] = [[i for i in sorted(range(len(q_ids)), key=lambda i: q_ids[i]) if reads(q_ids[i], kg)]
                        for kg in k_ids]
    return kv, qs


def _lists(count, values):
    return [values[i, :int(count[i])].tolist() for i in range(count.shape[0])]


@pytest.mark.parametrize("layout, world, source, all_sources", [
    ("striped", 1, 0, False), ("striped", 4, 1, False), ("striped", 3, 2, False), ("zigzag", 2, 0, False),
    ("zigzag", 2, 1, False), ("zigzag", 3, 1, False), ("striped", 3, 0, True), ("zigzag", 2, 1, True),
])
@pytest.mark.parametrize("documents", [False, True])
def test_conversion_matches_the_definition(layout, world, source, all_sources, documents):
    n = 12 * B * world
    nb = n // B
    index = BlockIndex.random(2, 2, n, B, density=0.3, generator=torch.Generator().manual_seed(world + source))
    rank = (source + 1) % world
    q_ids = local_block_ids(n, layout, world, rank, B)
    k_ids = (torch.cat([local_block_ids(n, layout, world, r, B) for r in range(world)]) if all_sources
             else local_block_ids(n, layout, world, source, B))
    floor = None
    if documents:
        ends = torch.tensor([0, 40, 41, n // 2 + 3, n], dtype=torch.int32)
        floor = Documents(ends, n).blocks(B, "cpu").key_block_floor
    parts = convert_block_step(index.key_blocks, index.n_key_blocks, q_ids.int(), k_ids.int(), nb, floor)
    kv_count, kv_blocks, q_count, q_blocks, col_count, cols = parts
    assert kv_blocks.shape[-1] == q_blocks.shape[-1] >= q_ids.numel()  # one capacity (the Triton backward's)
    assert cols.shape[-1] == 0 and not col_count.any()
    kv, qs = _conversion_by_loops(index, q_ids, k_ids, None if floor is None else floor.tolist())
    for b in range(2):
        for h in range(2):
            assert _lists(kv_count[b, h], kv_blocks[b, h]) == kv[b, h]
            assert _lists(q_count[b, h], q_blocks[b, h]) == qs[b, h]
    assert any(len(x) for x in kv[0, 0]), "the case must exercise some blocks"


def test_plan_refuses_the_extension_for_a_block_index():
    index = BlockIndex.dense(1, 1, 4 * B, B)
    with pytest.raises(ValueError, match="PyTorch only"):
        single_device_plan(index, 4 * B, impl="ext")
    ids = torch.arange(4, dtype=torch.int32)
    plan = build_step_plan(index, ids, ids, 4)  # auto: the PyTorch conversion
    assert plan.kv_count[0, 0].tolist() == [1, 2, 3, 4] and plan.cols.shape[-1] == 0


# ------------------------------------------------------------------------------ attention

def check_against_oracle(q, k, v, index, backend, tol, ends=None):
    n = q.shape[2]
    mask = oracle_mask(index, n, None if ends is None else ends.tolist()).to(DEVICE)
    cu = None if ends is None else ends.to(DEVICE, torch.int32)
    out = sparse_attention(q, k, v, index.to(DEVICE), backend=backend, cu_seqlens=cu)
    assert out.dtype == q.dtype and out.shape == q.shape
    expected = attention_f64(q, k, v, mask)
    ref_out, _ = reference_attention(q, k, v, index.to(DEVICE), cu_seqlens=cu)
    grad = torch.randn_like(expected)
    got = torch.autograd.grad(out, (q, k, v), grad.to(out.dtype))
    want = torch.autograd.grad(expected, (q, k, v), grad)
    ref_grads = torch.autograd.grad(ref_out, (q, k, v), grad.float())
    assert rel_err(ref_out, expected) < tol, "reference_attention vs float64 oracle"
    assert rel_err(out, expected) < tol, "forward vs float64 oracle"
    for name, a, e, r in zip(("dq", "dk", "dv"), got, want, ref_grads):
        assert torch.isfinite(a).all(), name
        assert rel_err(a, e) < tol, f"{name} vs float64 oracle: {rel_err(a, e)}"
        assert rel_err(r, e) < tol, f"{name} of reference_attention vs float64 oracle: {rel_err(r, e)}"


def _only_own_block(b, h, nb):
    return BlockIndex.from_mask(torch.zeros(b, h, nb, nb, dtype=torch.bool), B)


def _sink_and_local(b, h, nb):
    mask = torch.zeros(b, h, nb, nb, dtype=torch.bool)
    mask[..., 0] = True                                  # every query block reads block 0 (sink)
    mask[:, 1:] |= torch.ones(nb, nb, dtype=torch.bool).tril(-1) & ~torch.ones(nb, nb, dtype=torch.bool).tril(-3)
    return BlockIndex.from_mask(mask, B, max_blocks=4)


INDEX_CASES = {
    "random": lambda b, h, nb: BlockIndex.random(b, h, nb * B, B, density=0.35,
                                                 generator=torch.Generator().manual_seed(nb)),
    "only_own_block": _only_own_block,
    "all_blocks": lambda b, h, nb: BlockIndex.from_mask(torch.ones(b, h, nb, nb, dtype=torch.bool), B),
    "sink_and_local_per_head": _sink_and_local,
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(INDEX_CASES))
def test_sparse_attention_matches_the_oracle(backend, case):
    q, k, v = inputs(1, 4, 2, 6 * B, 32, seed=len(case))
    check_against_oracle(q, k, v, INDEX_CASES[case](1, 4, 6), backend, 1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sparse_attention_with_documents(backend):
    ends = torch.tensor([0, 1, 21, 48, 49, 90, 6 * B])     # boundaries inside blocks, one-token documents
    q, k, v = inputs(2, 2, 1, 6 * B, 16, seed=7)
    index = BlockIndex.random(2, 2, 6 * B, B, density=0.5, generator=torch.Generator().manual_seed(7))
    check_against_oracle(q, k, v, index, backend, 1e-5, ends)


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_blocks_equal_causal_sdpa_and_the_dense_vs_index(backend):
    q, k, v = inputs(2, 2, 2, 4 * B, 16, seed=11)
    out = sparse_attention(q, k, v, BlockIndex.dense(2, 2, 4 * B, B, device=DEVICE), backend=backend)
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    vs = sparse_attention(q, k, v, VSIndex.dense(2, 2, 4 * B, B, device=DEVICE), backend=backend)
    assert rel_err(out, sdpa) < 1e-5 and rel_err(out, vs) < 1e-5


def test_block_and_vertical_slash_index_of_one_pattern_agree():
    """A slash-only VSIndex is a block index too: the same outputs through both conversions."""
    nb, slash = 6, [0, 2, 3]
    vs = VSIndex.from_lists([[slash]], [[[]]], block_size=B, device=DEVICE)
    mask = torch.zeros(1, 1, nb, nb, dtype=torch.bool)
    for i in range(nb):
        for d in slash:
            if i - d >= 0:
                mask[0, 0, i, i - d] = True
    block = BlockIndex.from_mask(mask.to(DEVICE), B)
    q, k, v = inputs(1, 1, 1, nb * B, 16, seed=5)
    assert rel_err(sparse_attention(q, k, v, block, backend="torch"),
                   sparse_attention(q, k, v, vs, backend="torch")) < 1e-6


def test_sparse_attention_input_errors():
    q, k, v = inputs(1, 2, 1, 4 * B, 16)
    with pytest.raises(ValueError, match="4 query blocks"):
        sparse_attention(q[:, :, :2 * B], k[:, :, :2 * B], v[:, :, :2 * B],
                         BlockIndex.dense(1, 2, 4 * B, B, DEVICE))
    with pytest.raises(ValueError, match="batch 1 x 3 query heads"):
        sparse_attention(q, k, v, BlockIndex.dense(1, 3, 4 * B, B, DEVICE))
    with pytest.raises(ValueError, match="VSIndex or a BlockIndex"):
        sparse_attention(q, k, v, torch.ones(1, 2, 4, 4, dtype=torch.bool))
    bad = _raw([[0], [1], [2], [0, 2]], [1, 1, 1, 2])  # no diagonal in query block 3
    checked = Settings(validate=True)  # the values are checked on a GPU too (it synchronises)
    with pytest.raises(ValueError, match="diagonal block missing"):
        sparse_attention(q[:1, :1], k[:1, :1], v[:1, :1], bad.to(DEVICE), backend="torch", settings=checked)


def test_reference_block_mask_at_arbitrary_positions():
    """reference_attention of a (query chunk, key chunk) pair equals the full result's rows."""
    n = 8 * B
    index = BlockIndex.random(1, 2, n, B, density=0.4, generator=torch.Generator().manual_seed(2))
    q, k, v = (x.detach() for x in inputs(1, 2, 2, n, 16, seed=2))
    full, full_lse = reference_attention(q, k, v, index)
    rows = local_block_ids(n, "striped", 2, 1, B)
    pos = (rows[:, None] * B + torch.arange(B)).reshape(-1).to(q.device)
    part, part_lse = reference_attention(q[:, :, pos], k, v, index, q_positions=pos)
    assert torch.allclose(part, full[:, :, pos], atol=1e-6) and torch.allclose(part_lse, full_lse[:, :, pos])
    assert math.isfinite(float(full_lse.min()))


# ------------------------------------------------------------------------------------ GPU

@pytest.mark.gpu
@pytest.mark.parametrize("n, bs, d", [(8192, 64, 128), (8192, 128, 128), (8192, 128, 64), (16384, 64, 64)])
def test_gpu_bf16_kernels_match_the_fp32_path(n, bs, d):
    """The GPU's kernels (Triton, and the Hopper ones where dispatch picks them) on a random block
    index, every query block reading a sink block too, against the fp32 PyTorch path."""
    g = torch.Generator(device="cuda").manual_seed(n + bs)
    hq, hkv, nb = 8, 2, n // bs
    q, k, v = (torch.randn(1, h, n, d, device="cuda", generator=g) for h in (hq, hkv, hkv))
    mask = torch.rand(1, hq, nb, nb, generator=torch.Generator().manual_seed(n)) < 0.1
    mask[..., 0] = True
    index = BlockIndex.from_mask(mask, bs).to("cuda").validate(n)
    q16, k16, v16 = (x.bfloat16().requires_grad_() for x in (q, k, v))
    q32, k32, v32 = (x.bfloat16().float().requires_grad_() for x in (q, k, v))
    out = sparse_attention(q16, k16, v16, index, backend="triton")
    ref = sparse_attention(q32, k32, v32, index, backend="torch")
    grad = torch.randn_like(ref)
    got = torch.autograd.grad(out, (q16, k16, v16), grad.bfloat16())
    want = torch.autograd.grad(ref, (q32, k32, v32), grad)
    assert rel_err(out, ref) < 1e-2
    for name, a, e in zip(("dq", "dk", "dv"), got, want):
        assert rel_err(a, e) < 2e-2, name
