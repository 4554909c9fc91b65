"""Fault injection on the ring (CPU, gloo, 2-4 ranks): ranks that disagree, die or stall.

Every case must end on every surviving rank, within a stated bound, with the expected error
type; ``run_distributed_outcomes`` reports a rank that is still waiting at the harness timeout
as "hung", which fails the test (it does not kill the others 5 s after the first failure).

* Disagreement, on the first call and after earlier good calls (also after calls with both
  block sizes and both layouts, which a per-shape cache used to let through), for every
  parameter that changes the math: q / k shapes, sequence length, dtype, layout, block size,
  inner ring size, softmax scale, index contents and counts, cu_seqlens presence and values;
  and a rank whose own input check fails (the others must not wait for it). Expected:
  ``RingAgreementError`` on every rank (the failing rank: its own ``ValueError``), well under
  a second, and the group still works afterwards (a final call matches the reference).
* A rank that dies or stalls before the first forward, between two calls, or between the
  forward and the backward; a rank that raises in its own code and stays alive. Expected:
  ``RingCommunicationError`` on every surviving rank: a dead peer within a few seconds, a
  stalled one within the transfer timeout (the process group's, ``PG_TIMEOUT_S`` here, or
  ``MTRAINING_RING_TIMEOUT_S``), plus the time for the error to travel round the ring.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed_outcomes

from megatron_mtraining import VSIndex, dense_ring_attention, shard_sequence, sparse_attention, sparse_ring_attention

D = 16
PG_TIMEOUT_S = 6.0     # the process group's timeout in these tests: the bound of a stalled transfer
AGREEMENT_BOUND_S = 5.0  # a disagreement: every rank raises within this (measured: well under 1 s)
DEATH_BOUND_S = 8.0      # a dead peer: closed connections are seen at once
STALL_BOUND_S = 2 * PG_TIMEOUT_S + 6.0  # the first rank times out; its exit reaches the others


def _seq_len(world):
    return 128 * world * 2  # whole blocks of 64 and 128 per rank in either layout


def _inputs(n, hq=2, hkv=1, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, hq, n, D, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(1, hkv, n, D, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(1, hkv, n, D, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v


def _index(n, block=64, hq=2, vertical=(5, 70), slash=(0, 2)):
    return VSIndex.from_lists([[list(slash)] * hq], [[list(vertical)] * hq], block_size=block, max_slash=2,
                              max_vertical=2).validate(n)


def _call(rank, world, n=None, block=64, layout="striped", hq=2, dtype=torch.float32, inner=None, scale=None,
          index=None, cu="none", backward=True, settings=None):
    """One sparse_ring_attention forward (and backward) with these settings; returns the output shard."""
    n = n or _seq_len(world)
    q, k, v = _inputs(n, hq=hq, dtype=dtype)
    index = index if index is not None else _index(n, block, hq)
    shards = [shard_sequence(x, 2, layout, world, rank, index.block_size).contiguous().requires_grad_(True)
              for x in (q, k, v)]
    cu_seqlens = {"none": None, "two": torch.tensor([0, n // 2, n], dtype=torch.int32),
                  "two moved": torch.tensor([0, n // 4, n], dtype=torch.int32)}[cu]
    out = sparse_ring_attention(*shards, index, layout=layout, inner_size=inner, softmax_scale=scale,
                                cu_seqlens=cu_seqlens, settings=settings)
    if backward:
        out.sum().backward()
    return out.detach()


def _deviant(world, base, change):
    """Settings of each rank: ``base``, the last rank with ``change`` on top."""
    return lambda rank: {**base, **(change if rank == world - 1 else {})}


def _disagreement_cases(world):
    n = _seq_len(world)
    other_inner = 2 if world == 4 else 1
    bad_divisor = 3 if world == 4 else 2
    unsorted = VSIndex(torch.tensor([[[2, 0]] * 2], dtype=torch.int32), torch.full((1, 2), 2, dtype=torch.int32),
                       torch.tensor([[[5, 70]] * 2], dtype=torch.int32), torch.full((1, 2), 2, dtype=torch.int32), 64)
    B = {"block": 64}
    cases = [
        # (name, settings per rank, expected): "agree" = RingAgreementError on all ranks,
        # "local" = ValueError on the deviant and RingAgreementError on the others, "ok".
        ("first call: block size", _deviant(world, B, {"block": 128}), "agree"),
        ("good call, block 64", _deviant(world, B, {}), "ok"),
        ("good call, block 128", _deviant(world, {"block": 128}, {}), "ok"),
        ("block size, after both were used", _deviant(world, B, {"block": 128}), "agree"),
        ("good call, zigzag", _deviant(world, {**B, "layout": "zigzag"}, {}), "ok"),
        ("layout, after both were used", _deviant(world, B, {"layout": "zigzag"}), "agree"),
        ("index columns (same capacity)", _deviant(world, B, {"index": _index(n, vertical=(5, 71))}), "agree"),
        ("index offsets (same capacity)", _deviant(world, B, {"index": _index(n, slash=(0, 3))}), "agree"),
        ("index counts", _deviant(world, B, {"index": _index(n, vertical=(5,))}), "agree"),
        ("sequence length", _deviant(world, B, {"n": n + 128 * world}), "agree"),
        ("heads (q shape)", _deviant(world, B, {"hq": 4, "index": _index(n, hq=4)}), "agree"),
        ("dtype", _deviant(world, B, {"dtype": torch.float64}), "agree"),
        ("softmax scale", _deviant(world, B, {"scale": 0.3}), "agree"),
        ("good call, hierarchical ring", _deviant(world, {**B, "inner": other_inner}, {}), "ok"),
        ("inner ring size", _deviant(world, B, {"inner": other_inner}), "agree"),
        ("cu_seqlens on one rank only", _deviant(world, {**B, "cu": "two"}, {"cu": "none"}), "agree"),
        ("cu_seqlens values", _deviant(world, {**B, "cu": "two"}, {"cu": "two moved"}), "agree"),
        ("good call, documents", _deviant(world, {**B, "cu": "two"}, {}), "ok"),
        ("a rank's own check fails: unsorted index", _deviant(world, B, {"index": unsorted}), "local"),
        ("a rank's own check fails: inner size", _deviant(world, B, {"inner": bad_divisor}), "local"),
        ("good call after all that", _deviant(world, B, {}), "ok"),
    ]
    return cases


def _disagreement_worker(rank, world):
    from megatron_mtraining.collective.agreement import RingAgreementError

    results = []
    for name, settings, expected in _disagreement_cases(world):
        start = time.monotonic()
        try:
            out = _call(rank, world, **settings(rank))
            outcome = "ok"
            if expected == "ok":  # the group still computes the right thing
                s = settings(rank)
                n = s.get("n") or _seq_len(world)
                q, k, v = _inputs(n)
                cu = {"none": None, "two": torch.tensor([0, n // 2, n], dtype=torch.int32)}[s.get("cu", "none")]
                index = _index(n, s.get("block", 64))
                ref = sparse_attention(q, k, v, index, cu_seqlens=cu)
                ref = shard_sequence(ref, 2, s.get("layout", "striped"), world, rank, index.block_size)
                outcome = f"ok {float((out - ref).abs().max()):.1e}"
        except RingAgreementError as err:
            outcome = f"RingAgreementError: {err}"
        except ValueError as err:
            outcome = f"ValueError: {err}"
        results.append((name, expected, outcome, time.monotonic() - start))
    return results


def _check_disagreements(outcomes, world):
    table = []
    for o in outcomes:
        assert o.status == "ok", f"rank {o.rank}: {o.status} {o.error_type} {o.message}"
    for i, (name, expected, _, _) in enumerate(outcomes[0].value):
        for o in outcomes:
            _, _, outcome, seconds = o.value[i]
            table.append((name, o.rank, outcome.split(":")[0], round(seconds, 3)))
            assert seconds < AGREEMENT_BOUND_S, (name, o.rank, seconds)
            deviant = o.rank == world - 1
            if expected == "ok":
                assert outcome.startswith("ok "), (name, o.rank, outcome)
                assert float(outcome.split()[1]) < 1e-5, (name, o.rank, outcome)
            elif expected == "agree" or not deviant:
                assert outcome.startswith("RingAgreementError"), (name, o.rank, outcome)
                if expected == "local":
                    assert f"rank(s) [{world - 1}] failed their own input checks" in outcome, outcome
                else:
                    assert "ranks disagree" in outcome, outcome
            else:
                assert outcome.startswith("ValueError") and "RingAgreementError" not in outcome, (name, outcome)
    return table


def _print_table(title, rows):
    print(f"\n{title}")
    for row in rows:
        print("  " + " | ".join(str(x) for x in row))


@pytest.mark.parametrize("world", [3, 4])
def test_disagreement_on_any_call_fails_on_every_rank(world):
    outcomes = run_distributed_outcomes(_disagreement_worker, world, timeout=120, pg_timeout=PG_TIMEOUT_S)
    table = _check_disagreements(outcomes, world)
    _print_table(f"disagreement, W={world} (case | rank | outcome | seconds)", table)
    # The messages name what differs.
    by_name = {name: outcome for name, _, outcome, _ in outcomes[0].value}
    assert "block size (this rank: 64)" in by_name["block size, after both were used"]
    assert "layout (this rank: 'striped')" in by_name["layout, after both were used"]
    assert "vertical columns" in by_name["index columns (same capacity)"]
    assert "vertical counts" not in by_name["index columns (same capacity)"]
    assert "slash offsets" in by_name["index offsets (same capacity)"]
    assert "vertical counts (n_vertical)" in by_name["index counts"]
    assert "q shape" in by_name["sequence length"] and "k shape" in by_name["sequence length"]
    assert "dtype" in by_name["dtype"] and "softmax scale" in by_name["softmax scale"]
    assert "inner_size" in by_name["inner ring size"]
    assert "cu_seqlens given (this rank: True)" in by_name["cu_seqlens on one rank only"]
    assert "cu_seqlens values" in by_name["cu_seqlens values"]
    assert "cu_seqlens length" not in by_name["cu_seqlens values"]
    # The deviant rank names its own values: the other side of the disagreement.
    deviant = {name: outcome for name, _, outcome, _ in outcomes[-1].value}
    assert "block size (this rank: 128)" in deviant["block size, after both were used"]


def _dense_worker(rank, world):
    from megatron_mtraining.collective.agreement import RingAgreementError

    n = _seq_len(world)
    q, k, v = (shard_sequence(x, 2, "zigzag", world, rank, 64).contiguous() for x in _inputs(n))
    results = []
    for name, call in (
            ("good zigzag", lambda: dense_ring_attention(q, k, v, layout="zigzag")),
            ("softmax scale differs", lambda: dense_ring_attention(q, k, v, softmax_scale=0.2 + 0.1 * (rank == 1))),
            ("dense zigzag vs sparse", lambda: (dense_ring_attention(q, k, v) if rank == 0 else
                                                sparse_ring_attention(q, k, v, _index(n), layout="zigzag"))),
            ("bad layout on one rank", lambda: dense_ring_attention(q, k, v, layout="zigzag" if rank else "ring")),
            ("good zigzag again", lambda: dense_ring_attention(q, k, v, layout="zigzag"))):
        start = time.monotonic()
        try:
            call()
            outcome = "ok"
        except RingAgreementError as err:
            outcome = f"RingAgreementError: {err}"
        except ValueError as err:
            outcome = f"ValueError: {err}"
        results.append((name, outcome, time.monotonic() - start))
    return results


def test_dense_zigzag_ring_agrees_on_every_call():
    outcomes = run_distributed_outcomes(_dense_worker, 2, timeout=90, pg_timeout=PG_TIMEOUT_S)
    assert all(o.status == "ok" for o in outcomes), outcomes
    for o in outcomes:
        got = {name: (outcome, seconds) for name, outcome, seconds in o.value}
        assert got["good zigzag"][0] == "ok" and got["good zigzag again"][0] == "ok"
        assert got["softmax scale differs"][0].startswith("RingAgreementError") and \
            "softmax scale" in got["softmax scale differs"][0]
        assert got["dense zigzag vs sparse"][0].startswith("RingAgreementError") and \
            "function" in got["dense zigzag vs sparse"][0]
        bad = got["bad layout on one rank"][0]
        assert bad.startswith("ValueError: layout must be") if o.rank == 0 else \
            bad.startswith("RingAgreementError") and "failed their own input checks" in bad
        assert all(seconds < AGREEMENT_BOUND_S for _, seconds in got.values())


def _deferred_worker(rank, world):
    """The GPU's deferred agreement, run on gloo: NaN output, then the error in the backward."""
    from megatron_mtraining.config import Settings
    from megatron_mtraining.collective.agreement import RingAgreementError

    deferred = Settings(ring_agreement="deferred")
    n = _seq_len(world)
    index = _index(n, vertical=(5, 70 + (rank == 1)))  # contents differ: the transfers still match
    q, k, v = (shard_sequence(x, 2, "striped", world, rank, 64).contiguous().requires_grad_(True)
               for x in _inputs(n))
    out = sparse_ring_attention(q, k, v, index, settings=deferred)
    all_nan = bool(torch.isnan(out).all())
    try:
        out.sum().backward()
        raised = None
    except RingAgreementError as err:
        raised = str(err)
    good = sparse_ring_attention(q, k, v, _index(n), settings=deferred)  # the group is usable afterwards
    return all_nan, raised, bool(torch.isfinite(good).all())


def test_deferred_agreement_poisons_the_output_then_raises():
    outcomes = run_distributed_outcomes(_deferred_worker, 2, timeout=90, pg_timeout=PG_TIMEOUT_S)
    for o in outcomes:
        assert o.status == "ok", (o.rank, o.status, o.message)
        all_nan, raised, good_finite = o.value
        assert all_nan and good_finite
        assert raised is not None and "found after the call returned" in raised and "vertical columns" in raised


# ---------------------------------------------------------------------------- ranks that die or stall

FAULTY = 1


def _fault(how):
    if how == "exit":
        os._exit(1)  # gone: its sockets close
    if how == "raise_alive":
        try:
            raise RuntimeError("the user's own code failed on this rank")
        except RuntimeError:
            pass  # caught and ignored: the rank stays alive but never makes the call
    time.sleep(300)  # alive but silent (the harness kills it once the others have ended)


def _fault_worker(rank, world, when, how, ring_timeout):
    from megatron_mtraining.config import Settings

    settings = Settings(ring_timeout_s=ring_timeout)  # None: the process group's timeout
    if rank == FAULTY and when == "before the first forward":
        _fault(how)
    _call(rank, world, settings=settings)  # one good call (forward and backward)
    if rank == FAULTY and when == "between two calls":
        _fault(how)
    n = _seq_len(world)
    shards = [shard_sequence(x, 2, "striped", world, rank, 64).contiguous().requires_grad_(True)
              for x in _inputs(n)]
    out = sparse_ring_attention(*shards, _index(n), settings=settings)
    if rank == FAULTY and when == "between forward and backward":
        _fault(how)
    out.sum().backward()
    return "finished"


FAULT_CASES = [
    # (world, when, how, MTRAINING_RING_TIMEOUT_S, bound on the survivors' seconds)
    (3, "before the first forward", "exit", None, DEATH_BOUND_S),
    (3, "between two calls", "exit", None, DEATH_BOUND_S),
    (3, "between forward and backward", "exit", None, DEATH_BOUND_S),
    (2, "between forward and backward", "exit", None, DEATH_BOUND_S),
    (3, "before the first forward", "stall", None, STALL_BOUND_S),
    (3, "between forward and backward", "stall", None, STALL_BOUND_S),
    (2, "between two calls", "raise_alive", None, STALL_BOUND_S),
    # The explicit transfer timeout bounds a stall below the process group's (30 s here).
    (2, "between forward and backward", "stall", 2.0, 10.0),
]


@pytest.mark.parametrize("world,when,how,ring_timeout,bound", FAULT_CASES,
                         ids=[f"W{w}-{how}-{when.replace(' ', '_')}{'-ringtimeout' if t else ''}"
                              for w, when, how, t, _ in FAULT_CASES])
def test_dead_or_stalled_peer_ends_every_rank_within_a_bound(world, when, how, ring_timeout, bound):
    pg_timeout = 30.0 if ring_timeout is not None else PG_TIMEOUT_S
    start = time.monotonic()
    outcomes = run_distributed_outcomes(_fault_worker, world, when, how, ring_timeout, timeout=60,
                                        pg_timeout=pg_timeout, may_stay_silent=(FAULTY,))
    rows = [(o.rank, o.status, o.error_type, round(o.seconds, 2)) for o in outcomes]
    _print_table(f"W={world}, rank {FAULTY} {how} {when} (rank | status | error | seconds)", rows)
    for o in outcomes:
        if o.rank == FAULTY:
            assert o.status in ("died", "hung"), rows  # the injected fault itself
            continue
        assert o.status == "error" and o.error_type == "RingCommunicationError", (rows, o.message)
        assert o.seconds < bound, rows
        assert "MTraining ring" in o.message and "docs/troubleshooting.md" in o.message, o.message
        if when == "between forward and backward":
            assert "backward ring step" in o.message, o.message
        else:
            assert "agreement step" in o.message, o.message
    assert time.monotonic() - start < 60
