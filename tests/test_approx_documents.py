"""The index approximator with packed documents (``cu_seqlens``): each scored document's own last
queries, distributed equals single device (gloo W=2, 3; striped and zigzag), needles found from
their own document only, one document is the unpacked index bit for bit, short documents are
dense, bad ``cu_seqlens`` fail; the Triton statistics (CPU interpreter here, the GPU under
``-m gpu``) equal the PyTorch ones."""

from __future__ import annotations

import pytest
import torch

from dist_utils import interpreter_works, run_distributed
from megatron_mtraining import MTrainingConfig, VSIndex, shard_sequence
from megatron_mtraining.approx import _document_rows, approximate_index, vs_statistics
from megatron_mtraining.documents import Documents

needs_interpreter = pytest.mark.skipif(not interpreter_works(), reason="Triton's CPU interpreter needs numpy < 2.4")

B = 16
N = 384  # 24 blocks: striped and zigzag at W = 2 and 3
FIELDS = ("slash", "n_slash", "vertical", "n_vertical")

# One-token documents, boundaries inside blocks, a document of exactly one block (64..80), one of
# at most a block across a block boundary (155..170), five documents longer than a block.
MIXED = (0, 1, 37, 64, 80, 81, 155, 170, 300, 301, N)
TINY = tuple(range(0, 40)) + (41, 90, 91, 200, N)


def config(**overrides) -> MTrainingConfig:
    # block_size 16 keeps CPU shapes small; MTrainingConfig only allows 64/128, so bypass it.
    values = dict(block_size=64, top_p=0.9, last_q=32, max_vertical=48, max_slash=12, min_vertical=2,
                  min_slash=1, sink_tokens=3, local_window=2, max_documents=4)
    values.update(overrides)
    cfg = MTrainingConfig(**values)
    object.__setattr__(cfg, "block_size", B)
    return cfg


def cu(ends) -> torch.Tensor:
    return torch.tensor(ends, dtype=torch.int32)


def structured_qk(n=N, hq=4, hkv=2, d=16, seed=0, batch=2):
    """Random q/k with a few strong key columns and locality, so budgets vary per head."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, hq, n, d, generator=g)
    k = torch.randn(batch, hkv, n, d, generator=g)
    k[:, :, torch.randint(0, n, (8,), generator=g)] += 2.5 * q[:, :1, -1:].mean(1, keepdim=True)
    k = k + 0.8 * q[:, ::hq // hkv]
    return q, k


def as_dict(index: VSIndex) -> dict:
    return {name: getattr(index, name) for name in FIELDS}


def assert_same_index(a: VSIndex, b: VSIndex):
    for name in FIELDS:
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def selected(index: VSIndex, name: str, b: int, h: int) -> set:
    return set(getattr(index, name)[b, h, :int(getattr(index, f"n_{name}")[b, h])].tolist())


# ---------------------------------------------------------------- distributed equals single device
CASES = [  # (layout, cu_seqlens ends, config overrides, statistics backend)
    ("striped", MIXED, {}, "torch"),
    ("zigzag", MIXED, {}, "torch"),
    ("striped", MIXED, dict(max_documents=16, local_window=1), "torch"),  # every long document scored
    ("zigzag", TINY, dict(local_window=1), "torch"),
    ("striped", (0, N), {}, "torch"),  # one document: the unpacked index
]
if interpreter_works():  # the fused statistics kernels, in Triton's interpreter in the gloo workers
    CASES.append(("zigzag", MIXED, dict(max_documents=16), "triton"))


def _case_index(rank, world, layout, ends, overrides, backend):
    import torch.distributed as dist
    q, k = structured_qk()
    shard = lambda x: shard_sequence(x, 2, layout, world, rank, B)  # noqa: E731
    return approximate_index(shard(q), shard(k), config(layout=layout, **overrides), group=dist.group.WORLD,
                             backend=backend, cu_seqlens=cu(ends))


def _distributed_worker(rank, world):
    out = [as_dict(_case_index(rank, world, *case)) for case in CASES]
    # Without documents, for the one-document case.
    import torch.distributed as dist
    q, k = structured_qk()
    shard = lambda x: shard_sequence(x, 2, "striped", world, rank, B)  # noqa: E731
    out.append(as_dict(approximate_index(shard(q), shard(k), config(), group=dist.group.WORLD)))
    return out


@pytest.fixture(scope="module", params=[2, 3])
def distributed(request):
    """One gloo run per world size computes every case (spawning is slow)."""
    return request.param, run_distributed(_distributed_worker, request.param, timeout=240)


@pytest.mark.parametrize("case", range(len(CASES)),
                         ids=[f"{c[0]}-{len(c[1]) - 1}docs-{c[3]}-{c[2]}" for c in CASES])
def test_distributed_index_equals_single_device(distributed, case):
    world, per_rank = distributed
    layout, ends, overrides, _ = CASES[case]
    q, k = structured_qk()
    single = approximate_index(q, k, config(**overrides), cu_seqlens=cu(ends))
    single.validate(N)
    for got in per_rank:
        assert_same_index(VSIndex(**got[case], block_size=B), single)
    if len(ends) == 2:  # one document: also equal to the unpacked index on every rank
        for got in per_rank:
            assert_same_index(VSIndex(**got[case], block_size=B), VSIndex(**got[-1], block_size=B))


# ------------------------------------------------------------------- one document, no documents
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_interpreter)])
def test_one_document_is_the_unpacked_index_bit_for_bit(backend):
    q, k = structured_qk(n=128)
    cfg = config()
    plain = approximate_index(q, k, cfg, backend=backend)
    one = approximate_index(q, k, cfg, backend=backend, cu_seqlens=cu((0, 128)))
    assert_same_index(one, plain)
    v0, s0, _ = vs_statistics(q, k, cfg, backend=backend)
    v1, s1, _ = vs_statistics(q, k, cfg, backend=backend, cu_seqlens=cu((0, 128)))
    assert torch.equal(v0, v1) and torch.equal(s0, s1)


# ------------------------------------------------------------------------------ row selection
def test_rows_longest_documents_first_fixed_shapes():
    cfg = config(max_documents=4)
    rows = _document_rows(Documents(cu(MIXED), N), cfg, torch.device("cpu"))
    # Long documents (> one block): [1,37) 36, [37,64) 27, [81,155) 74, [170,300) 130, [301,384) 83.
    # Capacity 4: the longest four, longest first; [37, 64) is left out.
    assert rows.slot_start.tolist() == [170, 301, 81, 1] and rows.slot_valid.all()
    assert rows.rows == 4 * 32 and rows.row_pos.shape == (128,)
    assert float(rows.total) == 4 * cfg.last_q
    assert bool(rows.straddle)  # [155, 170) crosses the boundary at 160
    # Each slot's rows are its document's last min(last_q, length) positions, weighted last_q / rows.
    slot = rows.row_pos.view(4, 32)
    assert slot[0].tolist() == list(range(300 - 32, 300))
    assert slot[3].tolist() == [-1] * (32 - 32) + list(range(37 - 32, 37))
    weights = rows.row_weight.view(4, 32)
    assert torch.all(weights == 1.0)
    # A short scored document: the rows it has, weighted up.
    rows = _document_rows(Documents(cu((0, 20, N)), N), config(max_documents=3), torch.device("cpu"))
    assert rows.slot_valid.tolist() == [True, True, False]
    assert rows.row_pos.view(3, 32)[1].tolist() == [-1] * 12 + list(range(0, 20))
    assert torch.allclose(rows.row_weight.view(3, 32)[1, 12:], torch.full((20,), 32 / 20, dtype=torch.float64))
    assert float(rows.total) == 2 * 32
    # Ties in length: the later document first.
    rows = _document_rows(Documents(cu((0, 100, 200, 300, N)), N), config(max_documents=2), torch.device("cpu"))
    assert rows.slot_start.tolist() == [200, 100]


# ------------------------------------------------------------------------------------- needles
def needle_problem(needle_doc: int, needle_pos: int, ends, seed=1, strength=4.0):
    """Diffuse random q/k (batch 1); the last queries of document ``needle_doc`` all carry a strong
    component along e_0, and key ``needle_pos`` is ``strength * e_0``: it attracts them. The other
    documents' queries have a NEGATIVE e_0 component (they are repelled by the key)."""
    g = torch.Generator().manual_seed(seed)
    d = 16
    q = 0.5 * torch.randn(1, 4, N, d, generator=g)
    k = 0.5 * torch.randn(1, 2, N, d, generator=g)
    q[..., 0] = -2.0
    start, end = ends[needle_doc], ends[needle_doc + 1]
    q[:, :, start:end, 0] = strength
    k[:, :, needle_pos] = 0.0
    k[:, :, needle_pos, 0] = strength
    return q, k


NEEDLE_ENDS = (0, 100, 150, 190, 240, N)  # document 3 of 5: [190, 240), 50 tokens; the last one 144


def test_needle_of_document_3_of_5_is_found():
    cfg = config(max_vertical=16, min_vertical=0, top_p=0.5, sink_tokens=1)
    needle = 200  # document 3, 40 tokens (2.5 blocks) before its end: outside the window
    q, k = needle_problem(3, needle, NEEDLE_ENDS)
    packed = approximate_index(q, k, cfg, cu_seqlens=cu(NEEDLE_ENDS))
    packed.validate(N)
    for h in range(4):
        assert needle in selected(packed, "vertical", 0, h)
    # Without documents, the sequence's last queries (document 4, repelled) never pick it.
    unpacked = approximate_index(q, k, cfg)
    for h in range(4):
        assert needle not in selected(unpacked, "vertical", 0, h)


def test_needle_in_another_document_does_not_count():
    """A key in document 2 that document 3's queries would love (were documents ignored) must
    not change the index: document 2's queries score it exactly as a zero key (their e_0
    component is 0), and document 3's queries cannot see it."""
    ends = (0, 100, 150, 190, 240, N)
    cfg = config(max_vertical=16, min_vertical=0, top_p=0.5, sink_tokens=1, max_documents=8)
    distractor = 170  # document 2
    q, k = needle_problem(3, distractor, ends)
    q[:, :, 150:190, 0] = 0.0
    # Document 3 last: then its last queries are the sequence's last queries, and the unpacked
    # index shows that the distractor would be chosen if documents were ignored.
    ends3 = (0, 100, 150, 190, N)
    q[:, :, 190:, 0] = 4.0
    unpacked = approximate_index(q, k, cfg)
    assert all(distractor in selected(unpacked, "vertical", 0, h) for h in range(4))
    with_distractor = approximate_index(q, k, cfg, cu_seqlens=cu(ends3))
    k_plain = k.clone()
    k_plain[:, :, distractor] = 0.0
    without = approximate_index(q, k_plain, cfg, cu_seqlens=cu(ends3))
    assert_same_index(with_distractor, without)


def test_small_document_needle_is_not_drowned_by_a_big_document():
    """Document 1 (20 tokens: fewer rows than last_q) has one needle; document 2 (300 tokens)
    holds strong attention on a few columns. Every scored document holds last_q of mass (its
    rows weighted last_q / rows), and the small document's needle is selected under a budget
    of 4 columns."""
    ends = (0, 34, 54, 84, N)
    cfg = config(max_vertical=4, min_vertical=0, top_p=0.9, sink_tokens=0)
    g = torch.Generator().manual_seed(3)
    q = 0.3 * torch.randn(1, 2, N, 16, generator=g)
    k = 0.3 * torch.randn(1, 1, N, 16, generator=g)
    q[:, :, 34:54, 0] = 4.0   # document 1's queries -> the needle at 36
    k[:, :, 36, 0] = 4.0
    q[:, :, 84:, 1] = 4.0     # document 3's queries -> 4 columns
    strong = torch.tensor([100, 180, 250, 330])
    k[:, :, strong, 1] = 4.0
    vertical, _, _ = vs_statistics(q, k, cfg, cu_seqlens=cu(ends))
    for a, e in zip(ends[:-1], ends[1:]):
        torch.testing.assert_close(vertical[..., a:e].double().sum(-1), torch.full((1, 2), 32.0, dtype=torch.float64))
    index = approximate_index(q, k, cfg, cu_seqlens=cu(ends))
    for h in range(2):
        assert 36 in selected(index, "vertical", 0, h) and int(index.n_vertical[0, h]) == 4


# ----------------------------------------------------------------------- short documents, sinks
@pytest.mark.parametrize("ends", [MIXED, TINY, (0, 3, 10, 16, 20, 33, 40, 64, 70, 90, N)],
                         ids=["mixed", "tiny", "boundaries"])
def test_documents_of_at_most_a_block_are_dense(ends):
    cfg = config(local_window=1)
    q, k = structured_qk()
    index = approximate_index(q, k, cfg, cu_seqlens=cu(ends))
    index.validate(N)
    rows, cols = [], []
    for a, e in zip(ends[:-1], ends[1:]):
        if e - a <= B:
            for n in range(a, e):
                rows += [n] * (n - a + 1)
                cols += list(range(a, n + 1))
    assert torch.all(index.covers(torch.tensor(rows), torch.tensor(cols), N))


def test_only_short_documents_give_the_mandatory_index():
    cfg = config(local_window=1)
    q, k = structured_qk()
    aligned = tuple(range(0, N + 1, B))  # every document one block, none across a boundary
    index = approximate_index(q, k, cfg, cu_seqlens=cu(aligned))
    index.validate(N)
    assert torch.all(index.n_slash == 1) and torch.all(index.n_vertical == cfg.sink_tokens)
    shifted = (0,) + tuple(range(8, N, B)) + (N,)  # every one across a boundary: offset 1 too
    index = approximate_index(q, k, cfg, cu_seqlens=cu(shifted))
    assert torch.all(index.n_slash == 2) and torch.all(index.slash[..., 1] == 1)


def test_scored_documents_keep_their_sinks():
    cfg = config(max_documents=3)
    q, k = structured_qk()
    index = approximate_index(q, k, cfg, cu_seqlens=cu(MIXED))
    index.validate(N)
    rows = _document_rows(Documents(cu(MIXED), N), cfg, torch.device("cpu"))
    starts = rows.slot_start[rows.slot_valid].tolist()
    for b in range(2):
        for h in range(4):
            cols = selected(index, "vertical", b, h)
            assert set(range(cfg.sink_tokens)) <= cols
            for s in starts:
                assert set(range(s, s + cfg.sink_tokens)) <= cols


def test_statistics_hold_last_q_per_scored_document():
    cfg = config(max_documents=16)
    q, k = structured_qk()
    vertical, slash, _ = vs_statistics(q, k, cfg, cu_seqlens=cu(MIXED))
    torch.testing.assert_close(slash.sum(-1), torch.full((2, 4), 5.0 * cfg.last_q, dtype=torch.float64))
    torch.testing.assert_close(vertical.sum(-1).double(), torch.full((2, 4), 5.0 * cfg.last_q, dtype=torch.float64))
    # Keys of short documents get no vertical mass; each scored document's keys hold last_q.
    for a, e in zip(MIXED[:-1], MIXED[1:]):
        mass = vertical[..., a:e].double().sum(-1)
        want = float(cfg.last_q) if e - a > B else 0.0
        torch.testing.assert_close(mass, torch.full_like(mass, want))


def test_slash_statistic_weights_each_document_by_its_tokens():
    """Slash offsets are shared by all documents, so each document's slash masses count by its
    share of the scored tokens (the average query, as without documents): the packed statistic
    is the token-weighted sum of each document's own unpacked statistic. Block-aligned documents,
    so every document's offsets are its own block offsets."""
    ends = (0, 64, 96, 256, N)  # 64, 32, 160 and 128 tokens, all scored
    cfg = config(max_documents=16)
    q, k = structured_qk()
    _, slash, _ = vs_statistics(q, k, cfg, cu_seqlens=cu(ends))
    lengths = [e - a for a, e in zip(ends[:-1], ends[1:])]
    want = torch.zeros_like(slash)
    for a, e in zip(ends[:-1], ends[1:]):
        _, own, _ = vs_statistics(q[:, :, a:e], k[:, :, a:e], cfg)
        want[..., :own.shape[-1]] += len(lengths) * (e - a) / sum(lengths) * own
    torch.testing.assert_close(slash, want)
    # Not the equal-weight sum (the two differ wherever documents weigh differently).
    assert not torch.allclose(slash, _equal_weight_slash(q, k, cfg, ends, slash))


def _equal_weight_slash(q, k, cfg, ends, like):
    out = torch.zeros_like(like)
    for a, e in zip(ends[:-1], ends[1:]):
        own = vs_statistics(q[:, :, a:e], k[:, :, a:e], cfg)[1]
        out[..., :own.shape[-1]] += own
    return out


# --------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("ends, message", [
    ((1, 100, N), "start at 0"), ((0, 100, N - 1), "end at"), ((0, 100, 100, N), "strictly increasing"),
])
def test_bad_cu_seqlens_fail(ends, message):
    q, k = structured_qk()
    with pytest.raises(ValueError, match=message):
        approximate_index(q, k, config(), cu_seqlens=cu(ends))


def test_cu_seqlens_must_be_int32_1d():
    q, k = structured_qk()
    with pytest.raises(ValueError, match="int32"):
        approximate_index(q, k, config(), cu_seqlens=torch.tensor([0, 100, N]))
    with pytest.raises(ValueError, match="1-D"):
        approximate_index(q, k, config(), cu_seqlens=cu(((0, N),)))


def test_max_documents_is_validated():
    with pytest.raises(ValueError, match="max_documents"):
        MTrainingConfig(max_documents=0)


# ------------------------------------------------------------------------- Triton statistics
@needs_interpreter
@pytest.mark.parametrize("ends, last_q, hq, hkv", [
    (MIXED, 32, 4, 2),
    ((0, 5, 150, 151, 260, N), 40, 2, 1),  # last_q not a power of two: unused rows pad each slot
])
def test_triton_statistics_equal_the_pytorch_ones_with_documents(ends, last_q, hq, hkv):
    cfg = config(last_q=last_q, max_documents=4)
    q, k = structured_qk(hq=hq, hkv=hkv, batch=1)
    v_torch, s_torch, _ = vs_statistics(q, k, cfg, backend="torch", cu_seqlens=cu(ends))
    v_triton, s_triton, _ = vs_statistics(q, k, cfg, backend="triton", cu_seqlens=cu(ends))
    torch.testing.assert_close(v_triton, v_torch, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s_triton, s_torch, rtol=1e-5, atol=1e-5)
    assert_same_index(approximate_index(q, k, cfg, backend="triton", cu_seqlens=cu(ends)),
                      approximate_index(q, k, cfg, backend="torch", cu_seqlens=cu(ends)))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_statistics_equal_the_cpu_ones_with_documents(dtype):
    """The Triton path on CUDA against the PyTorch path on the CPU (same values in fp32), with
    packed documents: same statistics up to summation order, same index up to near-ties, no host
    synchronisation, repeat calls bit-identical."""
    from synthetic import synthetic_vs_qk
    n = 16384
    ends = [0, 1, 700, 720, 5000, 5001, 9000, 9100, 16000, n]
    cfg = MTrainingConfig(top_p=0.9, max_documents=4)
    q, k = synthetic_vs_qk(1, 8, 2, n, 64, seed=4, device="cuda", dtype=dtype)
    cu_gpu = torch.tensor(ends, dtype=torch.int32, device="cuda")
    index = approximate_index(q, k, cfg, cu_seqlens=cu_gpu)  # warm-up (compiles, caches positions)
    fresh = cu_gpu.clone()  # another tensor: its row table is built inside the no-sync region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = approximate_index(q, k, cfg, cu_seqlens=fresh)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_same_index(again, index)
    index.validate(n)
    qc, kc = q.float().cpu(), k.float().cpu()
    v_gpu, s_gpu, _ = vs_statistics(q, k, cfg, cu_seqlens=cu_gpu)
    v_cpu, s_cpu, _ = vs_statistics(qc, kc, cfg, cu_seqlens=cu(ends))
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-3)
    torch.testing.assert_close(v_gpu.cpu(), v_cpu, **tol)
    torch.testing.assert_close(s_gpu.cpu(), s_cpu, **tol)
    cpu = approximate_index(qc, kc, cfg, cu_seqlens=cu(ends))
    for h in range(8):
        for name, need in (("vertical", 0.95), ("slash", 0.9)):
            got, want = selected(index, name, 0, h), selected(cpu, name, 0, h)
            assert len(got & want) >= need * max(len(got), len(want)), (name, h)
