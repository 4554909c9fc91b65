"""The per-step kernel interface the ring uses: chunks of any layout, merged through lse.

A single process plays every rank: for each query chunk, every key chunk is one step
(forward merges into fp32 accumulators; backward adds into fp32 gradient buffers). The
result must equal single-device sparse attention on the full sequence.
"""

import math

import pytest
import torch
import triton
import triton.language as tl

from megatron_mtraining import Settings, VSIndex, reference_attention
from megatron_mtraining.kernels import build_step_plan, step_backward, step_forward
from megatron_mtraining.kernels.column_partials import column_program
from oracle import rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def striped_blocks(nb, world, rank):
    return torch.arange(rank, nb, world)


def zigzag_blocks(nb, world, rank):
    per = nb // (2 * world)
    first = torch.arange(rank * per, (rank + 1) * per)
    second = torch.arange((2 * world - 1 - rank) * per, (2 * world - rank) * per)
    return torch.cat([first, second])


def token_rows(blocks, B):
    return (blocks[:, None] * B + torch.arange(B)).reshape(-1)


def without_diagonal(n, B, g):
    """Random slash offsets from 1 up and columns inside the query blocks: outside DESIGN's
    contract (offset 0 is mandatory; ``validate`` rejects it), but the kernels must stay exact
    when no check ran, through the column words' token-level causal path."""
    idx = VSIndex.random(1, 4, n, B, max_slash=4, max_vertical=30, generator=g)
    idx.slash[..., :] = torch.arange(1, idx.slash.shape[-1] + 1, dtype=torch.int32)
    idx.slash[0, 0, 0] = -1  # a negative offset selects nothing (no future block, no coverage)
    idx.n_slash[0, 0] = max(int(idx.n_slash[0, 0]), 2)
    return idx


def many_columns(n, B, g):
    """More than 64 columns per head with B = 16: several column words per query block, and
    16-column tiles at every offset inside a word (the GPU's 64-column tiles only see offset 0)."""
    cols = [sorted(torch.randperm(n, generator=g)[:140].tolist()) for _ in range(4)]
    return VSIndex.from_lists([[[0, 1, 4]] * 4], [cols], block_size=B)


def uneven_columns(n, B, g):
    """Heads whose columns fill a step's capacity very unevenly: 140 random (several live tiles in
    every step), 3, none, and 70 in the even blocks only (none in a striped odd chunk), so the
    column programs are dealt to 0, 1 or most tiles of the capacity (``column_partials``)."""
    even = [c for c in torch.randperm(n, generator=g).tolist() if (c // B) % 2 == 0][:70]
    cols = [sorted(torch.randperm(n, generator=g)[:140].tolist()), [5, 77, n - 1], [], sorted(even)]
    return VSIndex.from_lists([[[0, 1, 4]] * 4], [cols], block_size=B)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("layout, world, kind", [("striped", 3, "random"), ("zigzag", 2, "random"),
                                                 ("striped", 1, "without_diagonal"),
                                                 ("striped", 2, "without_diagonal"),
                                                 ("striped", 1, "many_columns"),
                                                 ("zigzag", 2, "many_columns"),
                                                 ("striped", 2, "uneven_columns")])
def test_chunked_steps_equal_full_attention(backend, layout, world, kind, settings=Settings()):
    B, nb, d = 16, 12, 32
    n = nb * B
    g = torch.Generator().manual_seed(world)
    if kind == "random":
        index = VSIndex.random(1, 4, n, B, max_slash=5, max_vertical=30, generator=g)
    elif kind == "many_columns":
        index = many_columns(n, B, g)
    elif kind == "uneven_columns":
        index = uneven_columns(n, B, g)
    else:
        index = without_diagonal(n, B, g)
    index = index.to(DEVICE)
    q, k, v = (torch.randn(1, h, n, d, generator=g).to(DEVICE).requires_grad_() for h in (4, 2, 2))
    full, full_lse = reference_attention(q, k, v, index)
    grad = torch.randn_like(full)
    want = torch.autograd.grad(full, (q, k, v), grad)

    blocks_of = striped_blocks if layout == "striped" else zigzag_blocks
    chunks = [blocks_of(nb, world, r) for r in range(world)]
    rows = [token_rows(c, B).to(DEVICE) for c in chunks]
    scale = 1.0 / math.sqrt(d)
    bitmap = index.slash_bitmap(nb)
    qd, kd, vd = q.detach(), k.detach(), v.detach()

    outs, lses = [], []
    for r in range(world):
        out = torch.zeros(1, 4, len(rows[r]), d, device=DEVICE)
        lse = torch.full((1, 4, len(rows[r])), float("-inf"), device=DEVICE)
        for step in range(world):
            s = (r - step) % world  # the ring's source order
            plan = build_step_plan(index, chunks[r], chunks[s], nb, slash_bitmap=bitmap)
            step_forward(backend, qd[:, :, rows[r]], kd[:, :, rows[s]], vd[:, :, rows[s]], plan, out, lse,
                         scale, accumulate=True, settings=settings)
        assert rel_err(out, full[:, :, rows[r]]) < 1e-5
        torch.testing.assert_close(lse, full_lse[:, :, rows[r]], rtol=1e-5, atol=1e-5)
        outs.append(out)
        lses.append(lse)

    dq = torch.zeros_like(qd)
    dk = torch.zeros_like(kd)
    dv = torch.zeros_like(vd)
    for r in range(world):
        do = grad[:, :, rows[r]].contiguous()
        delta = (do * outs[r]).sum(-1)
        dq_r = torch.zeros(1, 4, len(rows[r]), d, device=DEVICE)
        for s in range(world):
            dk_s = torch.zeros(1, 2, len(rows[s]), d, device=DEVICE)
            dv_s = torch.zeros_like(dk_s)
            plan = build_step_plan(index, chunks[r], chunks[s], nb, slash_bitmap=bitmap)
            step_backward(backend, qd[:, :, rows[r]], kd[:, :, rows[s]], vd[:, :, rows[s]], do, lses[r], delta,
                          plan, dq_r, dk_s, dv_s, scale, settings=settings)
            dk[:, :, rows[s]] += dk_s
            dv[:, :, rows[s]] += dv_s
        dq[:, :, rows[r]] = dq_r
    for name, got, exp in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        assert rel_err(got, exp) < 1e-5, name
    if kind == "without_diagonal":  # the case reached the token-level causal path of the column words
        assert any(bool(build_step_plan(index, c, c, nb).column_words[1].any()) for c in chunks)


@pytest.mark.parametrize("programs", [1, 40])
def test_column_programs_dealt_to_live_tiles(monkeypatch, programs):
    """Fewer column programs than the default (one split per tile, so programs past the live
    tiles idle; or two, so a live tile takes several): the same gradients (``column_partials``)."""
    from megatron_mtraining.kernels import step
    settings = Settings(kernel_launch={"bwd": {"COLUMN_PROGRAMS": programs}})
    splits = []
    monkeypatch.setattr(step, "_column_splits", lambda *args, real=step._column_splits: splits.append(args[2])
                        or real(*args))
    test_chunked_steps_equal_full_attention("triton", "striped", 2, "uneven_columns", settings)
    test_chunked_steps_equal_full_attention("triton", "zigzag", 2, "many_columns", settings)
    assert splits and set(splits) == {programs}  # the call's settings reached the backward


@pytest.mark.skipif(torch.cuda.is_available(), reason="counts the interpreter's ops (a GPU's launches dispatch none)")
def test_column_scatter_launches_one_kernel_per_gqa_position():
    """The backward's column dK/dV sum and scatter runs once per ring step, where launches bound
    small steps: each more GQA position adds one launch of ``column_partials``' kernel and nothing
    else (counted as dispatched ops: none on a GPU, the interpreter's copies of the launch's
    tensors on CPU, the same for every launch)."""
    import collections

    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            schema = func._schema
            is_view = not schema.is_mutable and any(r.alias_info is not None for r in schema.returns)
            if not is_view:  # a view launches nothing
                self.ops[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    def ops(hq):
        g = torch.Generator().manual_seed(0)
        B, n, d = 16, 256, 16
        index = VSIndex.random(1, hq, n, B, max_slash=3, max_vertical=40, generator=g)
        nb = n // B
        plan = build_step_plan(index, torch.arange(0, nb, 2), torch.arange(1, nb, 2), nb)
        q, do = (torch.randn(1, hq, n // 2, d, generator=g) for _ in range(2))
        k, v = (torch.randn(1, 1, n // 2, d, generator=g) for _ in range(2))
        lse, delta = (torch.randn(1, hq, n // 2, generator=g) for _ in range(2))
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        with Count() as count:
            step_backward("triton", q, k, v, do, lse, delta, plan, dq, dk, dv, 0.25)
        assert dk.abs().sum() > 0 and dv.abs().sum() > 0  # the columns did scatter
        return count.ops

    def one_launch():  # the partials kernel alone, for one head
        from megatron_mtraining.kernels.column_partials import add_column_partials, empty_column_partials

        dk_part, dv_part = empty_column_partials(1, 1, 1, 2, 16, 16, torch.device("cpu"))
        dk_part.zero_(), dv_part.zero_()
        dk, dv = torch.zeros(1, 1, 32, 16), torch.zeros(1, 1, 32, 16)
        with Count() as count:
            add_column_partials(dk_part, dv_part, torch.tensor([[3]], dtype=torch.int32),
                                torch.tensor([[[4, 9, 30]]], dtype=torch.int32), dk, dv)
        return count.ops

    two, eight, launch = ops(2), ops(8), one_launch()
    grown = {name: eight[name] - two[name] for name in set(two) | set(eight) if eight[name] != two[name]}
    assert grown == {name: (8 - 2) * n for name, n in launch.items()}, (grown, launch)



@triton.jit
def _deal_column_programs(Counts, Out, PROGRAMS, TILE_COLS: tl.constexpr):
    """(tile, split, splits) of every column program of every head count (the test below)."""
    program = tl.program_id(0)
    head = tl.program_id(1)
    tile, split, n_splits = column_program(program, tl.load(Counts + head), PROGRAMS, TILE_COLS)
    at = Out + (head * PROGRAMS + program) * 3
    tl.store(at, tile)
    tl.store(at + 1, split)
    tl.store(at + 2, n_splits)


@pytest.mark.skipif(DEVICE == "cpu" and not __import__("os").environ.get("TRITON_INTERPRET"),
                    reason="needs a GPU or Triton's interpreter")
@pytest.mark.parametrize("n_tiles, splits, tile_cols", [(7, 1, 16), (7, 3, 64), (5, 2, 16)])
def test_column_programs_cover_each_live_tile_once(n_tiles, splits, tile_cols):
    """``column_partials.column_program`` (the Triton kernel's; the Gluon twin is the same
    arithmetic): for every count of columns, the programs past the live tiles idle and the others
    cover each (live tile, split) exactly once, programs // live tiles splits per tile: never fewer
    than the launch's, more where few tiles are live."""
    programs = n_tiles * splits
    counts = torch.arange(0, n_tiles * tile_cols + 1, dtype=torch.int32, device=DEVICE)
    out = torch.empty(len(counts), programs, 3, dtype=torch.int32, device=DEVICE)
    _deal_column_programs[(programs, len(counts))](counts, out, programs, TILE_COLS=tile_cols)
    for count, dealt in zip(counts.tolist(), out.cpu()):
        live = -(-count // tile_cols)
        want_splits = programs // max(live, 1)
        assert want_splits >= splits and bool((dealt[:, 2] == want_splits).all()), (count, dealt)
        assert bool((dealt[:, 0] < n_tiles).all())
        working = sorted((t, s) for t, s, _ in dealt.tolist() if t < live)
        assert working == [(t, s) for t in range(live) for s in range(want_splits)], count


def test_column_partials_refuse_what_they_cannot_add():
    """``add_column_partials`` names a bad accumulator or partials buffer before any launch."""
    from megatron_mtraining.kernels.column_partials import add_column_partials, empty_column_partials

    counts, cols = torch.tensor([[3]], dtype=torch.int32), torch.tensor([[[4, 9, 30]]], dtype=torch.int32)
    dk_part, dv_part = empty_column_partials(1, 1, 1, 2, 16, 16, torch.device("cpu"))
    dk = torch.zeros(1, 1, 32, 16)
    with pytest.raises(ValueError, match="must be contiguous"):
        add_column_partials(dk_part, dv_part, counts, cols, dk.transpose(-1, -2), dk.transpose(-1, -2))
    with pytest.raises(ValueError, match="fp32 accumulators"):
        add_column_partials(dk_part, dv_part, counts, cols, dk.bfloat16(), dk.bfloat16())
    with pytest.raises(ValueError, match="do not fit"):
        add_column_partials(dk_part[:, :1].contiguous(), dv_part, counts, cols, dk, dk.clone())
