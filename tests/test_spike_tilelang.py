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


def walked_pairs(plan, seq_len):
    """int [b, hq, n, n]: how often the plan's forward and dQ kernels attend each pair, written
    from the kernels' loops: the listed slash blocks (causal on the diagonal), then each head's
    first ``col_limit`` columns unless their block offset is a selected slash one."""
    B = plan.block
    b, hq, nb = plan.fwd_cnt.shape
    mask = torch.zeros(b, hq, seq_len, seq_len, dtype=torch.int32)
    rows = torch.arange(B)
    for bi in range(b):
        for h in range(hq):
            for qb in range(nb):
                q_rows = qb * B + rows
                for kb in plan.fwd_idx[bi, h, qb, :plan.fwd_cnt[bi, h, qb]].tolist():
                    keys = kb * B + rows
                    mask[bi, h, q_rows[:, None], keys[None, :]] += (keys[None, :] <= q_rows[:, None]).int()
                limit = int(plan.col_limit[bi, h, qb])
                assert int(plan.col_tiles[bi, h, qb]) == -(-limit // B)
                for pos in plan.col_pos[bi, h, :limit].tolist():
                    if not plan.slash[bi, h, qb - pos // B]:
                        mask[bi, h, q_rows, pos] += 1
    return mask


@pytest.mark.parametrize("block", [64, 128])
def test_plan_walks_exactly_the_index_pairs(block):
    """Slash lists and column tiles together cover the index's pairs (vs_mask, the reference's
    mask) once each: a column inside a selected slash block is left to the slash part."""
    from megatron_mtraining.index import VSIndex
    from megatron_mtraining.kernels.reference import vs_mask
    from tilelang_slash import make_plan, with_columns

    seq_len, heads, kv_heads = 1024, 4, 2
    nb = seq_len // block
    gen = torch.Generator().manual_seed(block)
    slash = torch.zeros(1, heads, 4, dtype=torch.int32)
    for h in range(heads):
        slash[0, h, 1:] = (torch.randperm(nb - 1, generator=gen)[:3] + 1).sort().values.to(torch.int32)
    n_slash = torch.tensor([[1, 4, 2, 4]], dtype=torch.int32)
    width = 40
    inside = torch.tensor([0, block, block + 1])  # head 1: columns inside slash blocks too
    heads_cols = []
    for h in range(heads):
        perm = torch.randperm(seq_len, generator=gen)
        perm = perm[~torch.isin(perm, inside)]
        cols = torch.cat([inside, perm[:width - 3]]) if h == 1 else perm[:width]
        heads_cols.append(cols.sort().values)
    vertical = torch.stack(heads_cols)[None].to(torch.int32)
    n_vertical = torch.tensor([[0, width, 17, 1]], dtype=torch.int32)  # none; all; some; one
    index = VSIndex(slash, n_slash, vertical, n_vertical, block)
    plan = make_plan(index, seq_len, kv_heads, columns=True)
    assert plan.max_cols == -(-width // block) * block and plan.col_pos.shape[-1] == plan.max_cols
    positions = torch.arange(seq_len)
    expected = vs_mask(index, positions, positions)
    walked = walked_pairs(plan, seq_len)
    assert int(walked.max()) == 1  # no pair twice (a column in a slash block is the slash part's)
    assert torch.equal(walked.bool(), expected.expand(1, heads, seq_len, seq_len))

    # The column rows after the sequence: the group's heads in order, each its own columns.
    k = torch.randn(1, kv_heads, seq_len, 8)
    rows = with_columns(k, plan.col_pos, plan.max_cols)
    assert rows.shape == (1, kv_heads, seq_len + heads // kv_heads * plan.max_cols, 8)
    assert torch.equal(rows[:, :, :seq_len], k)
    for h in range(heads):
        hk, g = divmod(h, heads // kv_heads)
        start = seq_len + g * plan.max_cols
        assert torch.equal(rows[0, hk, start:start + plan.max_cols], k[0, hk, plan.col_pos[0, h].long()])

    # Without columns: nothing after the sequence, and no column tiles.
    slash_plan = make_plan(index, seq_len, kv_heads, columns=False)
    assert slash_plan.max_cols == 0 and int(slash_plan.col_tiles.sum()) == 0
    assert with_columns(k, slash_plan.col_pos, 0) is k


def test_spike_measurer_records_both_passes(tmp_path):
    """spike_common.measurer, the timing both spikes share: fwd and fwd+bwd milliseconds, their
    rates on the forward's FLOPs (x3.5 for fwd+bwd), the JSON rewritten after each, and a failing
    candidate recorded as an error instead of stopping the spike (CPU: wall-clock timing)."""
    import json

    from spike_common import measurer

    result = {"ms": {}, "tflops": {}}
    out = tmp_path / "spike.json"
    measure = measurer(result, torch.device("cpu"), reps=2, out=str(out))
    q, k, v = (torch.randn(1, 2, 8, 4, requires_grad=True) for _ in range(3))
    sets = [(q, k, v, torch.randn(1, 2, 8, 4))]
    measure("toy", lambda q_, k_, v_: (q_ * k_ + v_).tanh(), sets, flops=1e9)
    assert set(result["ms"]) == {"toy_fwd", "toy_fwdbwd"} and all(ms > 0 for ms in result["ms"].values())
    assert result["tflops"]["toy_fwdbwd"] == pytest.approx(3.5e9 / (result["ms"]["toy_fwdbwd"] * 1e9))
    assert json.loads(out.read_text())["ms"] == pytest.approx(result["ms"], rel=1e-4)  # write_json rounds

    def broken(q_, k_, v_):
        raise RuntimeError("no kernel for this shape")

    measure("broken", broken, sets, flops=1e9)
    assert "no kernel for this shape" in result["ms"]["broken_fwd_error"]
    assert "broken_fwd" not in result["tflops"]


def test_a_plan_with_columns_is_refused_by_autograd_before_any_kernel():
    """The spike has no column dK/dV kernel: SlashAttention must refuse a plan with columns with
    a clear error (before TileLang is even imported), not return gradients without the columns."""
    from megatron_mtraining.index import VSIndex
    from tilelang_slash import make_plan, slash_attention

    index = VSIndex(torch.zeros(1, 2, 1, dtype=torch.int32), torch.ones(1, 2, dtype=torch.int32),
                    torch.tensor([[[0, 5], [1, 9]]], dtype=torch.int32), torch.full((1, 2), 2, dtype=torch.int32), 64)
    plan = make_plan(index, 256, 1, columns=True)
    q, k, v = torch.randn(1, 2, 256, 8), torch.randn(1, 1, 256, 8), torch.randn(1, 1, 256, 8)
    with pytest.raises(NotImplementedError, match="no column dK/dV kernel"):
        slash_attention(q, k, v, plan)
