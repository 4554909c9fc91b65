"""Loud failures instead of hangs or silent garbage (docs/troubleshooting.md):

a. CP ranks that disagree on MTraining flags or on a layer's index raise ``ConsistencyError`` on
   every rank (first forward and telemetry log iterations; nothing in between);
b. NaN / Inf in q, k or v reaches the output and the gradients (single device: PyTorch and the
   Triton interpreter; the ring at W=2), and the approximator keeps a valid index meanwhile;
c. a ring peer that dies or stalls raises ``RingCommunicationError`` naming the ring step,
   the direction and the source rank, within the process-group timeout;
d. the approximator returns a valid index (diagonal present) for degenerate q/k.
"""

import os
import time
import types
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from dist_utils import WorkerError, interpreter_works, run_distributed

from megatron_mtraining import MTrainingConfig, VSIndex, shard_sequence, sparse_attention, sparse_ring_attention
from megatron_mtraining.approx import approximate_index
from megatron_mtraining.layout import gather_sequence

B = 64
APPROX = dict(last_q=64, max_vertical=64, max_slash=8, min_vertical=16)
needs_interpreter = pytest.mark.skipif(torch.cuda.is_available() or not interpreter_works(),
                                       reason="Triton's CPU interpreter (CPU machines, numpy < 2.4)")


def _qkv(n, hq=2, hkv=1, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, hq, n, d, generator=g), torch.randn(1, hkv, n, d, generator=g),
            torch.randn(1, hkv, n, d, generator=g))


def _poison(q, k, v, which, value, row=None, col=None):
    """One element of q (query ``row``) or of k / v (key ``col``), in head 0, set to ``value``."""
    x = {"q": q, "k": k, "v": v}[which]
    x[0, 0, row if which == "q" else col, 3] = value


def _reached(index, n, which, row, col):
    """bool [hq, n]: the output rows that the poisoned entry must reach: the poisoned query row
    itself, or every query that attends the poisoned key (kv head 0 serves every query head here)."""
    rows = torch.arange(n)
    if which == "q":
        reached = torch.zeros(index.heads, n, dtype=torch.bool)
        reached[0, row] = True
        return reached
    return index.covers(rows, torch.full_like(rows, col), n)[0]


def _check_poisoned(out, grads, loss, index, n, which, value, row, col):
    reached = _reached(index, n, which, row, col)
    bad_rows = ~torch.isfinite(out[0]).all(-1)  # [hq, n]
    assert reached.any()
    if value != value or which != "k":
        # NaN anywhere, or Inf in q or v: every row it reaches is non-finite (not masked away).
        # (An infinite key gives -inf scores to the queries it meets with the opposite sign: a
        # softmax weight of 0 there is IEEE arithmetic, not masking.)
        missed = reached & ~bad_rows
        assert not missed.any(), f"rows {missed.nonzero().tolist()[:8]} stayed finite"
    assert not torch.isfinite(loss), loss
    if value != value:
        assert torch.isnan(loss)
    for name, g in grads.items():
        if which == "v" and name == "v":
            continue  # dV = P^T dO does not read V
        assert not torch.isfinite(g).all(), f"d{name} stayed finite"


def _index(n, hq=2):
    return VSIndex.from_lists([[[0, 2]] * hq], [[[5, 70]] * hq], block_size=B).validate(n)


# ---------------------------------------------------------------------------- b. NaN / Inf, one device


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_interpreter)])
@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_nonfinite_inputs_reach_output_single_device(backend, which, value):
    n, row, col = 256, 130, 70  # query 130 sees blocks 2 and 0 (offset 2) and columns 5, 70
    q, k, v = _qkv(n)
    _poison(q, k, v, which, value, row, col)
    index = _index(n)
    for x in (q, k, v):
        x.requires_grad_(True)
    out = sparse_attention(q, k, v, index, backend=backend)
    loss = out.sum()
    loss.backward()
    _check_poisoned(out.detach(), {"q": q.grad, "k": k.grad, "v": v.grad}, loss, index, n, which, value, row, col)


# ---------------------------------------------------------------------------- d. degenerate approximator input

DEGENERATE = {
    "zeros": lambda q, k: (torch.zeros_like(q), torch.zeros_like(k)),
    "constant": lambda q, k: (torch.full_like(q, 0.5), torch.full_like(k, 0.5)),
    "equal_large": lambda q, k: (torch.full_like(q, 100.0), torch.full_like(k, 100.0)),
    "huge": lambda q, k: (torch.full_like(q, 1e30), torch.full_like(k, 1e30)),  # scores overflow to +inf
    "all_masked": lambda q, k: (torch.full_like(q, 1e30), torch.full_like(k, -1e30)),  # every score -inf
    "inf": lambda q, k: (torch.full_like(q, float("inf")), k),
    "nan": lambda q, k: (torch.full_like(q, float("nan")), k),
    "one_nan": lambda q, k: (q.index_put((torch.tensor(0), torch.tensor(1), torch.tensor(q.shape[2] - 1),
                                          torch.tensor(0)), torch.tensor(float("nan"))), k),
}


def _check_valid(index, n, cfg):
    index.validate(n)  # sorted, unique, in range, diagonal first
    assert (index.n_slash >= 1).all() and (index.slash[..., 0] == 0).all()
    # The sink columns (mandatory) are kept whatever the statistics say.
    assert (index.n_vertical >= cfg.sink_tokens).all()
    assert (index.vertical[..., :cfg.sink_tokens] == torch.arange(cfg.sink_tokens, dtype=torch.int32)).all()


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_interpreter)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", sorted(DEGENERATE))
def test_approximator_degenerate_input_gives_valid_index(case, dtype, backend):
    n = 512
    q, k, _ = _qkv(n, hq=4, hkv=2)
    q, k = DEGENERATE[case](q, k)
    cfg = MTrainingConfig(**APPROX)
    index = approximate_index(q.to(dtype), k.to(dtype), cfg, backend=backend)
    _check_valid(index, n, cfg)


# ---------------------------------------------------------------------------- b + d over a ring of 2


def _ring_nonfinite_worker(rank, world, cases):
    n = 256
    results = []
    for which, value, backend in cases:
        q, k, v = _qkv(n)
        _poison(q, k, v, which, value, row=130, col=70)
        shards = [shard_sequence(x, 2, "striped", world, rank, B).contiguous().requires_grad_(True)
                  for x in (q, k, v)]
        out = sparse_ring_attention(*shards, _index(n), layout="striped", backend=backend)
        loss = out.detach().double().sum()
        dist.all_reduce(loss)
        out.sum().backward()
        results.append((out.detach(), [s.grad for s in shards], loss))
    # The distributed approximator on degenerate input (its collectives combine NaN and Inf too).
    cfg = MTrainingConfig(**APPROX)
    indices = {}
    for case in ("zeros", "huge", "all_masked", "nan", "one_nan"):
        q, k, _ = _qkv(n, hq=4, hkv=2)
        q, k = DEGENERATE[case](q, k)
        q, k = (shard_sequence(x, 2, "striped", world, rank, B) for x in (q, k))
        index = approximate_index(q, k, cfg, group=dist.group.WORLD)
        indices[case] = (index.slash, index.n_slash, index.vertical, index.n_vertical)
    return results, indices


RING_CASES = [("q", float("nan"), "torch"), ("k", float("nan"), "torch"), ("v", float("nan"), "torch"),
              ("q", float("inf"), "torch"), ("v", float("inf"), "torch")]


def test_nonfinite_inputs_reach_output_through_ring_and_approximator_stays_valid():
    cases = RING_CASES + ([("q", float("nan"), "triton"), ("v", float("nan"), "triton")]
                          if interpreter_works() and not torch.cuda.is_available() else [])
    per_rank = run_distributed(_ring_nonfinite_worker, 2, cases, timeout=120)
    n = 256
    for i, (which, value, backend) in enumerate(cases):
        out = gather_sequence([r[0][i][0] for r in per_rank], 2, "striped", B)
        grads = {name: gather_sequence([r[0][i][1][j] for r in per_rank], 2, "striped", B)
                 for j, name in enumerate("qkv")}
        loss = per_rank[0][0][i][2]  # summed over the ring
        _check_poisoned(out, grads, loss, _index(n), n, which, value, 130, 70)
    cfg = MTrainingConfig(**APPROX)
    for case, (slash, n_slash, vertical, n_vertical) in per_rank[0][1].items():
        other = per_rank[1][1][case]
        assert all(torch.equal(a, b) for a, b in zip((slash, n_slash, vertical, n_vertical), other)), case
        _check_valid(VSIndex(slash, n_slash, vertical, n_vertical, B), n, cfg)


# ---------------------------------------------------------------------------- a. ranks that disagree


SKEW = {"iterations": (), "padding": False, "iteration": 0}
_SKEWED_INDEXER = []


def _skewed_indexer():
    """Test indexer class: MTraining's, then (on CP rank 1, in ``SKEW["iterations"]``) one
    vertical column fewer; with ``SKEW["padding"]``, one more padding slot whose junk differs per
    rank. Built on first use (it needs megatron-core)."""
    if not _SKEWED_INDEXER:
        from megatron_mtraining.integration.indexer import MTrainingIndexer

        class SkewedIndexer(MTrainingIndexer):
            def forward(self, q, k, group=None):
                index = super().forward(q, k, group)
                vertical, n_vertical = index.vertical, index.n_vertical
                if SKEW["padding"]:
                    junk = torch.full_like(vertical[..., :1], 1000 + dist.get_rank())
                    vertical = torch.cat([vertical, junk], -1)
                if dist.get_rank() == 1 and SKEW["iteration"] in SKEW["iterations"]:
                    n_vertical = n_vertical - 1
                return VSIndex(index.slash, index.n_slash, vertical, n_vertical, index.block_size)

        _SKEWED_INDEXER.append(SkewedIndexer)
    return _SKEWED_INDEXER[0]


def _attention(cfg, indexer=None):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_mtraining.integration.core_attention import MTrainingAttention
    from megatron_mtraining.integration.indexer import MTrainingAttentionSubmodules

    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                               use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0)
    submodules = MTrainingAttentionSubmodules(indexer=indexer) if indexer is not None else None
    return MTrainingAttention(config, 1, AttnMaskType.causal, "self", mtraining_config=cfg,
                              pg_collection=types.SimpleNamespace(cp=dist.group.WORLD), submodules=submodules)


def _layer_inputs(rank, world, n=256, poison=False):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 1, h, 16, generator=g) for h in (4, 2, 2))  # [s, b, heads, hn]
    if poison:
        q[n - 3, 0, 1, 5] = float("nan")
    return [shard_sequence(x, 0, "striped", world, rank, B) for x in (q, k, v)]


def _outcome(fn):
    from megatron_mtraining.integration.consistency import ConsistencyError
    from megatron_mtraining.collective.agreement import RingAgreementError
    try:
        fn()
        return None
    except ConsistencyError as err:
        return str(err)
    except RingAgreementError as err:  # the ring's own per-call agreement
        return f"ring: {err}"


def _consistency_worker(rank, world):
    from megatron_mtraining.integration import consistency, telemetry

    base = MTrainingConfig(**APPROX)
    qkv = _layer_inputs(rank, world)
    report = {}
    # Flags: top_p differs (would compute a different index per rank: garbage); last_q differs (the
    # approximator's collectives would get different sizes: a hang or a crash). Raised before them.
    for name, change in (("top_p", {"top_p": 0.8}), ("last_q", {"last_q": 32}), ("same", {})):
        cfg = MTrainingConfig(**{**APPROX, **(change if rank == 1 else {})})
        report[name] = _outcome(lambda: _attention(cfg)(*qkv, None))
    # Telemetry log interval (the iterations the checks and the telemetry's collectives run at).
    telemetry.enable_telemetry(2 if rank == 0 else 3, printer=lambda line: None).step(1)
    report["log_interval"] = _outcome(lambda: _attention(base)(*qkv, None))
    telemetry.disable_telemetry()

    # The index: checked in the first forward and at log iterations (every 2), not in between.
    calls = []
    original = consistency._min_max
    consistency._min_max = lambda values, group: (calls.append(values.numel()), original(values, group))[1]
    try:
        tele = telemetry.enable_telemetry(2, printer=lambda line: None)
        attn = _attention(base, _skewed_indexer())
        SKEW.update(iterations=(3, 4), padding=False)
        report["per_iteration"] = []
        for it in range(1, 5):
            SKEW["iteration"] = it
            tele.step(it)
            report["per_iteration"].append((it, _outcome(lambda: attn(*qkv, None)), len(calls)))
        telemetry.disable_telemetry()
        # Padding is never read, so different junk there is no disagreement.
        SKEW.update(iterations=(), padding=True)
        report["padding"] = _outcome(lambda: _attention(base, _skewed_indexer())(*qkv, None))
    finally:
        consistency._min_max = original
    # NaN in q through the whole layer (approximator, then ring): the output carries it.
    out = _attention(base)(*_layer_inputs(rank, world, poison=True), None)
    report["nan_rows"] = (~torch.isfinite(out)).any(-1).flatten().nonzero().flatten().tolist()
    return report


def test_ranks_that_disagree_fail_on_every_rank():
    pytest.importorskip("megatron.core")
    reports = run_distributed(_consistency_worker, 2, timeout=120)
    for rank, report in enumerate(reports):
        for name, flag in (("top_p", "--mtraining-top-p"), ("last_q", "--mtraining-last-q"),
                           ("log_interval", "--mtraining-log-interval")):
            assert report[name] is not None and flag in report[name], (rank, name, report[name])
            assert "differ" in report[name] and "same --mtraining-* flags" in report[name]
        assert report["same"] is None
        # Iteration 1: first forward, checked (flags + index: 2 reductions). 2: log iteration,
        # checked. 3: skewed but not a log iteration: no consistency reduction, but the ring's
        # own agreement (every call) stops it. 4: skewed, log iteration: consistency check.
        (i1, e1, c1), (i2, e2, c2), (i3, e3, c3), (i4, e4, c4) = report["per_iteration"]
        assert (e1, e2) == (None, None) and (c1, c2, c3) == (2, 4, 4), report["per_iteration"]
        assert e3 is not None and e3.startswith("ring: sparse_ring_attention: the context-parallel ranks disagree")
        assert "vertical counts" in e3 and "vertical columns" in e3 and "slash" not in e3, e3
        assert e4 is not None and "vertical counts" in e4 and "vertical columns" in e4 and c4 == 6, e4
        assert "slash offsets" not in e4 and "slash counts" not in e4  # names only what differs
        assert report["padding"] is None
    # The NaN row (global position 253, on rank 1 in the striped layout) reaches the output there.
    assert reports[0]["nan_rows"] == [] and reports[1]["nan_rows"] == [64 + 61]


# ---------------------------------------------------------------------------- c. a ring peer dies or stalls


def _peer_failure_worker(rank, world, direction, how):
    group = dist.new_group([0, 1], timeout=timedelta(seconds=3))  # short: the test must not wait long
    q, k, v = (shard_sequence(x, 2, "striped", world, rank, B).contiguous().requires_grad_(True)
               for x in _qkv(256))
    index = _index(256)
    # One healthy step first (each call starts with the ring's agreement, a collective).
    sparse_ring_attention(q, k, v, index, group=group, layout="striped").sum().backward()
    if rank == 1 and direction == "forward":
        _die(how)
    out = sparse_ring_attention(q, k, v, index, group=group, layout="striped")
    if rank == 1:
        _die(how)
    out.sum().backward()
    return "finished"


def _die(how):
    if how == "exit":
        os._exit(0)  # the process is gone: its sockets close
    time.sleep(30)  # alive but silent: the peer's wait times out (the harness kills this one)
    os._exit(0)


@pytest.mark.parametrize("direction,how", [("forward", "exit"), ("backward", "exit"), ("forward", "stall")])
def test_dead_ring_peer_raises_naming_the_step(direction, how):
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        run_distributed(_peer_failure_worker, 2, direction, how, timeout=60)
    message = str(info.value)
    assert "rank 0 raised" in message, message
    assert "RingCommunicationError" in message
    if direction == "forward":  # the peer never makes the call: the per-call agreement, before any transfer
        assert "MTraining ring attention (sparse_ring_attention): the agreement step before the first ring " \
            "transfer failed" in message, message
    else:
        assert f"MTraining ring attention, {direction} ring step 0 of 2 (0-based)" in message, message
        assert "context-parallel rank 1 did not arrive from global rank 1" in message
    assert "--distributed-timeout-minutes" in message
    if how == "stall":
        assert "Timed out" in message or "timed out" in message.lower()
    assert time.monotonic() - start < 45
