"""collective/agreement.py's device words on one process: the one-pass checksums equal the
per-tensor formula, see what they must, and the caches stay bounded."""

import pytest
import torch

from conftest import requires_gpu

from megatron_mtraining.collective import agreement
from megatron_mtraining.collective.agreement import Checksum, checksum
from megatron_mtraining.config import Settings


def reference(values, counts=None):
    """The checksum's definition, one tensor at a time (the former implementation)."""
    entries = values.long() + 1
    if counts is not None:
        valid = torch.arange(values.shape[-1]) < counts[..., None].long()
        entries = torch.where(valid, entries, torch.zeros_like(entries))
    flat = entries.flatten()
    weights = (torch.arange(flat.numel(), dtype=torch.int64) * 2654435761) % 2147483647 + 1
    return int((flat * weights).sum() & ((1 << 62) - 1))


def parts():
    g = torch.Generator().manual_seed(0)
    slash = torch.randint(-5, 1 << 30, (2, 3, 7), generator=g, dtype=torch.int32)
    n_slash = torch.tensor([[0, 3, 7], [7, -2, 1]], dtype=torch.int32)  # -2: a bad count counts nothing
    cu = torch.tensor([0, 5, 9, 64], dtype=torch.int64)
    return [Checksum(n_slash), Checksum(slash, n_slash), Checksum(cu), Checksum(torch.zeros(0, dtype=torch.int32))]


def test_one_pass_equals_each_tensor_alone():
    ps = parts()
    for p in ps:
        assert int(checksum(p.values, p.counts)) == reference(p.values, p.counts)
    slots = [3, 5, 6, 9]
    layout = agreement._layout(ps, slots, torch.device("cpu"), torch.device("cpu"))
    words = torch.index_add(torch.zeros(12, dtype=torch.int64), 0, layout.slot,
                            agreement._products(ps, layout)) & ((1 << 62) - 1)
    want = torch.zeros(12, dtype=torch.int64)
    for p, s in zip(ps, slots):
        want[s] = reference(p.values, p.counts)
    assert words.tolist() == want.tolist()


def test_padding_is_ignored_and_order_and_counts_are_seen():
    slash, n_slash = parts()[1]
    base = int(checksum(slash, n_slash))
    padded = slash.clone()
    padded[0, 0, 0] += 1  # row 0, head 0 counts 0 entries: padding
    assert int(checksum(padded, n_slash)) == base
    swapped = slash.clone()
    swapped[0, 1, [0, 1]] = swapped[0, 1, [1, 0]]  # a permutation of valid entries
    assert slash[0, 1, 0] != slash[0, 1, 1] and int(checksum(swapped, n_slash)) != base
    fewer = n_slash.clone()
    fewer[1, 0] -= 1
    assert int(checksum(slash, fewer)) != base


def test_counts_must_have_the_values_leading_shape():
    slash, n_slash = parts()[1]
    with pytest.raises(ValueError, match="must have the leading shape"):
        checksum(slash, n_slash[:, :2])


def test_the_caches_are_bounded():
    for n in range(1, 3 * agreement._CACHE_ENTRIES):
        checksum(torch.arange(n))
        agreement._host_words([n, 0, 1], torch.device("cpu"))
    assert len(agreement._LAYOUTS) <= agreement._CACHE_ENTRIES
    assert len(agreement._HOST_WORDS) <= agreement._CACHE_ENTRIES


def test_a_word_of_another_kind_is_refused(monkeypatch):
    monkeypatch.setattr(agreement.dist, "get_world_size", lambda group: 2)
    monkeypatch.setattr(agreement.dist, "get_rank", lambda group: 0)
    monkeypatch.setattr(agreement.dist, "get_backend", lambda group: "gloo")
    with pytest.raises(TypeError, match="'index': a word is an int or a Checksum"):
        agreement.agree(None, "f", [("index", torch.zeros(()), None)], None, torch.device("cpu"), Settings())


def test_own_checks_raise_without_peers_and_record_with_them():
    with pytest.raises(ValueError, match="bad"):
        with agreement.OwnChecks(None, Settings()):
            raise ValueError("bad")
    with agreement.OwnChecks(object(), Settings()) as checks:
        raise ValueError("bad")
    assert isinstance(checks.error, ValueError)
    with pytest.raises(KeyboardInterrupt):  # not a check failure: never recorded
        with agreement.OwnChecks(object(), Settings()):
            raise KeyboardInterrupt
    checks = agreement.OwnChecks(None, Settings())
    assert checks.agree("f", lambda: 1 / 0, torch.device("cpu")) is None  # items not built


def _deferred_verdict(group, what, disagree: bool):
    """A deferred verdict of a call over ``group`` as ``agree`` leaves it (one item, two ranks; the
    reduced words [max..., -min...] on the CPU, as on gloo: ready at once)."""
    world, low, high = 2, 5, 6 if disagree else 5
    reduced = torch.tensor([0, 0, high, 0, 0, -low], dtype=torch.int64)
    verdict = agreement.Verdict(what, [("slash offsets", Checksum(torch.zeros(1)), None)], reduced, world, group)
    agreement._PENDING.setdefault(group, []).append(verdict)
    return verdict


def test_a_deferred_verdict_belongs_to_its_call_and_group(monkeypatch):
    """A verdict raises in a call over its own group (its call's backward, or the group's next
    call), never in a call over another group; reading it does not drop the other groups'."""
    monkeypatch.setattr(agreement, "_PENDING", {})
    ring_a, ring_b = object(), object()  # two CP groups
    bad = _deferred_verdict(ring_a, "sparse_ring_attention", disagree=True)
    assert bool(bad.bad)
    good = _deferred_verdict(ring_b, "dense_ring_attention", disagree=False)
    assert not bool(good.bad)
    agreement.check_deferred(ring_b)  # another group's call: its own verdict is good, a's is not its business
    assert ring_b not in agreement._PENDING and agreement._PENDING[ring_a] == [bad]
    agreement.check_deferred(None)  # a call without a group: nothing
    with pytest.raises(agreement.RingAgreementError, match=r"sparse_ring_attention: .*found after the call returned"
                                                           r".*slash offsets"):
        agreement.check_deferred(ring_a)
    assert agreement._PENDING == {}
    agreement.check_deferred(ring_a)  # raised once


def test_the_ring_backward_checks_its_own_verdicts_group(monkeypatch):
    """``RingAttentionFunction`` keeps its call's verdict group and checks that group in its
    backward (and nothing when its agreement was eager)."""
    from megatron_mtraining.ring import sparse as ring_sparse

    checked = []
    monkeypatch.setattr(agreement, "check_deferred", checked.append)
    ctx = type("Ctx", (), {})()
    verdict = agreement.Verdict("sparse_ring_attention", [], torch.zeros(4, dtype=torch.int64), 2, "group a")
    ctx.verdict_group = verdict.group
    ctx.saved_tensors = ()
    with pytest.raises(ValueError, match="not enough values to unpack"):  # after the check: no tensors here
        ring_sparse.RingAttentionFunction.backward(ctx, torch.zeros(1))
    assert checked == ["group a"]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_poison_is_the_cast_itself(dtype, device):
    """A good call's output is bit for bit ``out.to(dtype)`` (signed zeros, infinities, rounding);
    a disagreement makes every entry NaN; the cast and the poison are one result (PyTorch's on a
    CPU, the row copy's on a GPU)."""
    out = torch.randn(2, 3, 40, 8, generator=torch.Generator().manual_seed(0)).to(device) * 300
    out[0, 0, 0, :3] = torch.tensor([-0.0, float("inf"), -float("inf")])
    good = agreement.poison(out.clone(), torch.tensor(False, device=device), dtype)
    assert good.dtype == dtype and torch.equal(good.view(torch.uint8), out.to(dtype).view(torch.uint8))
    bad = agreement.poison(out.clone(), torch.tensor(True, device=device), dtype)
    assert bad.dtype == dtype and bool(torch.isnan(bad).all())
    assert torch.equal(agreement.poison(out.clone(), None, dtype), out.to(dtype))
