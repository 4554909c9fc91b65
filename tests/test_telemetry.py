"""Sparse-attention telemetry of MTrainingAttention (--mtraining-log-interval): what a log
iteration records, what it prints and writes, and that other iterations record nothing."""

import math
import types

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.transformer.enums import AttnMaskType  # noqa: E402

from megatron_mtraining import MTrainingConfig  # noqa: E402
from megatron_mtraining.integration import telemetry  # noqa: E402
from megatron_mtraining.integration.core_attention import MTrainingAttention  # noqa: E402
from megatron_mtraining.ring import instrument  # noqa: E402
from test_megatron_attention import transformer_config  # noqa: E402

CFG = MTrainingConfig(index="vs", block_size=64, top_p=0.5, max_slash=2, max_vertical=16, min_vertical=0, last_q=64)
HEADS, GROUPS, HEAD_DIM = 4, 2, 16


class FakeWriter:
    def __init__(self):
        self.scalars = []

    def add_scalar(self, name, value, step):
        self.scalars.append((name, value, step))


def attention_layers(n_layers=2, pg_collection=None):
    config = transformer_config(num_attention_heads=HEADS, num_query_groups=GROUPS, hidden_size=HEADS * HEAD_DIM)
    return [MTrainingAttention(config, layer_number=i + 1, attn_mask_type=AttnMaskType.causal,
                               attention_type="self", mtraining_config=CFG, pg_collection=pg_collection)
            for i in range(n_layers)]


def run_iteration(layers, tele, iteration, seq, seed=0):
    g = torch.Generator().manual_seed(seed * 1000 + iteration)
    tele.step(iteration)
    x = torch.randn(seq, 1, HEADS, HEAD_DIM, generator=g, requires_grad=True)
    out = x
    for layer in layers:  # chain the layers so one backward runs through all of them
        q = out
        kv = q.view(seq, 1, GROUPS, 2, HEAD_DIM)[:, :, :, 0]
        out = layer(q, kv, kv, None).view(seq, 1, HEADS, HEAD_DIM)
    out.float().square().mean().backward()


@pytest.fixture
def tele():
    lines, writer = [], FakeWriter()
    t = telemetry.enable_telemetry(2, writer=writer, printer=lines.append)
    t.lines, t.writer = lines, writer
    yield t
    telemetry.disable_telemetry()
    assert instrument.current() is None


def test_log_iterations_record_index_and_times(tele):
    layers = attention_layers()
    for it in (1, 2, 3):
        run_iteration(layers, tele, it, seq=512)
        if it == 2:
            assert instrument.current() is not None  # the ring step timer spans forward and backward
        else:
            assert instrument.current() is None
    # Iteration 2 was logged when iteration 3 started; iteration 3 is not a log iteration.
    assert [int(s["iteration"]) for s in tele.history] == [2]
    s = tele.history[0]
    for layer in (1, 2):
        assert 0 < s[f"density/layer_{layer}"] < 1
        assert s[f"slash/layer_{layer}"] >= 1 and s[f"vertical/layer_{layer}"] >= 1
    assert s["density"] == pytest.approx((s["density/layer_1"] + s["density/layer_2"]) / 2)
    assert s["approximator_ms"] > 0 and s["attention_fwd_ms"] > 0 and s["attention_bwd_ms"] > 0
    assert s["approximator_share"] == pytest.approx(
        s["approximator_ms"] / (s["attention_fwd_ms"] + s["attention_bwd_ms"]))
    assert "worker_imbalance" not in s  # one rank: no ring
    assert len(tele.lines) == 1 and tele.lines[0].startswith(" [MTraining] iteration 2 | density")
    names = {name for name, _, step in tele.writer.scalars if step == 2}
    assert {"mtraining/density/layer_1", "mtraining/approximator_share", "mtraining/slash"} <= names

    run_iteration(layers, tele, 4, seq=512)
    assert tele.flush()["iteration"] == 4 and len(tele.history) == 2
    assert tele.flush() is None


def test_density_matches_the_layer_index(tele):
    layers = attention_layers(1)
    run_iteration(layers, tele, 2, seq=512)
    s = tele.flush()
    assert s["density/layer_1"] == pytest.approx(layers[0].last_index.density(512).float().mean().item())


def test_eval_forwards_are_not_recorded(tele):
    layers = attention_layers(1)
    for layer in layers:
        layer.eval()
    with torch.no_grad():
        tele.step(2)
        q = torch.randn(512, 1, HEADS, HEAD_DIM)
        layers[0](q, q[:, :, :GROUPS], q[:, :, :GROUPS], None)
    assert tele.flush() is None


def test_needs_an_iteration_outside_megatron_training():
    telemetry.enable_telemetry(1)
    try:
        layer = attention_layers(1)[0]
        q = torch.randn(128, 1, HEADS, HEAD_DIM)
        with pytest.raises(RuntimeError, match=r"step\(iteration\)"):
            layer(q, q[:, :, :GROUPS], q[:, :, :GROUPS], None)
    finally:
        telemetry.disable_telemetry()


def test_interval_must_be_positive():
    with pytest.raises(ValueError, match="log_interval"):
        telemetry.Telemetry(0)


def _cp_telemetry_worker(rank, world_size):
    import torch.distributed as dist

    from megatron_mtraining.layout import shard_sequence

    lines = []
    tele = telemetry.enable_telemetry(1, printer=lines.append)
    layers = attention_layers(2, pg_collection=types.SimpleNamespace(cp=dist.group.WORLD))
    g = torch.Generator().manual_seed(0)
    full = torch.randn(1024, 1, HEADS, HEAD_DIM, generator=g)
    x = shard_sequence(full, 0, "striped", world_size, rank, CFG.block_size).requires_grad_(True)
    tele.step(1)
    out = x
    for layer in layers:
        kv = out.view(out.shape[0], 1, GROUPS, 2, HEAD_DIM)[:, :, :, 0]
        out = layer(out, kv, kv, None).view(out.shape[0], 1, HEADS, HEAD_DIM)
    out.float().square().mean().backward()
    summary = tele.flush()
    telemetry.disable_telemetry()
    return summary, lines


def test_context_parallel_telemetry_has_imbalance_metrics():
    from dist_utils import run_distributed

    results = run_distributed(_cp_telemetry_worker, 2, timeout=120)
    (s0, lines0), (s1, lines1) = results
    assert s0 == s1  # one reduced summary on every CP rank
    assert s0["density/layer_1"] < 1
    for key in ("worker_imbalance", "step_imbalance"):
        assert 1.0 <= s0[key] < math.inf
    assert 0 < s0["computation_ratio"] <= 1
    # The approximator's cost is the fastest rank's time (the others' include waiting for it).
    assert 0 < s0["approximator_ms"] <= s0["approximator_max_ms"]
    assert len(lines0) == 1 and "imbalance worker" in lines0[0] and lines1 == []


def test_recompute_is_counted_once(tele):
    """A checkpointed layer runs its forward twice (no-grad, then recomputed in backward): the
    telemetry counts the recomputed one only."""
    import torch.utils.checkpoint as checkpoint

    layer = attention_layers(1)[0]
    tele.step(2)
    x = torch.randn(512, 1, HEADS, HEAD_DIM, requires_grad=True)

    def run(q):
        kv = q.view(512, 1, GROUPS, 2, HEAD_DIM)[:, :, :, 0]
        return layer(q, kv, kv, None)

    checkpoint.checkpoint(run, x, use_reentrant=True).float().square().mean().backward()
    record = tele._record
    assert [len(record.clocks[k]) for k in ("approximator", "attention_fwd", "attention_bwd")] == [1, 1, 1]
    assert tele.flush()["attention_bwd_ms"] > 0


def test_eval_forwards_do_not_reach_the_ring_timer(tele, monkeypatch):
    from megatron_mtraining.integration import core_attention as mt_attention

    layers = attention_layers(1)
    run_iteration(layers, tele, 2, seq=512)  # a log iteration: the ring timer is on until the next one
    timer = instrument.current()
    assert timer is not None
    timers_seen = []
    original = mt_attention.sparse_attention

    def spy(*args, **kwargs):  # what the attention (or the ring) would record into
        timers_seen.append(instrument.current())
        return original(*args, **kwargs)

    monkeypatch.setattr(mt_attention, "sparse_attention", spy)
    q = torch.randn(512, 1, HEADS, HEAD_DIM)
    layers[0](q, q[:, :, :GROUPS], q[:, :, :GROUPS], None)  # a training forward: timed
    layers[0].eval()
    with torch.no_grad():
        layers[0](q, q[:, :, :GROUPS], q[:, :, :GROUPS], None)  # eval: suspended
    assert timers_seen == [timer, None] and instrument.current() is timer


def test_disable_can_flush_the_last_log_iteration(tele):
    run_iteration(attention_layers(1), tele, 2, seq=512)
    telemetry.disable_telemetry(flush=True)
    assert [int(s["iteration"]) for s in tele.history] == [2] and len(tele.lines) == 1


def test_a_record_whose_group_is_gone_is_dropped_not_reduced(tele, caplog, monkeypatch):
    run_iteration(attention_layers(1), tele, 2, seq=512)
    tele._record.group = object()  # a CP group of a process group destroyed since
    monkeypatch.setattr(telemetry.dist, "is_initialized", lambda: False)
    with caplog.at_level("WARNING"):
        telemetry.disable_telemetry(flush=True)
    assert tele.history == [] and "iteration 2 not logged" in caplog.text


def test_step_timer_shares_spread_work_among_the_steps():
    """A SPREAD interval (the backward's one-pass dQ, timed inside the last step) leaves that
    step's compute and is shared evenly among the phase's steps: the per-step compute compares
    the steps' own work and still sums to the phase's; other phases and kinds are untouched."""

    class Fixed:
        cuda = False

        def __init__(self, ms):
            self._ms = ms

        def ms(self):
            return self._ms

    timer = instrument.StepTimer()
    timer._intervals = [("backward", "compute", 0, Fixed(10.0)), ("backward", "compute", 1, Fixed(14.0)),
                        ("backward", "compute", 2, Fixed(52.0)), ("backward", instrument.SPREAD, 2, Fixed(36.0)),
                        ("backward", "wait", 2, Fixed(1.0)), ("forward", "compute", 0, Fixed(5.0)),
                        ("forward", "compute", 1, Fixed(6.0))]
    steps = timer.summary()
    assert steps["backward"] == {"compute_ms": [22.0, 26.0, 28.0], "wait_ms": [0.0, 0.0, 1.0]}
    assert steps["forward"] == {"compute_ms": [5.0, 6.0]}
