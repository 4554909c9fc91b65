"""The step-time model and planner (megatron_mtraining/plan): its invariants, the CLI end to end, the
derivation of the committed profiles from the committed results, the validation file, and clear
errors on bad inputs."""

import ast
import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest

from megatron_mtraining.plan import (Cluster, ModelShape, Workload, load_profile, plan, predict_dense_a2a_p2p,
                                     predict_dense_p2p, predict_mtraining, simulate_ring, with_recompute)
from megatron_mtraining.plan.cli import main as cli_main
from megatron_mtraining.plan.cli import read_telemetry
from megatron_mtraining.plan.profiles import PROFILE_DIR, HostFloor, KernelCost, Profile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

H100 = load_profile("nvidia-h100")
H200 = load_profile("h200")
QWEN = ModelShape()


def _env():
    return dict(os.environ, PYTHONPATH=REPO)


# ----------------------------------------------------------------------------------------------
# Invariants
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("inner", [None, 8])
@pytest.mark.parametrize("gpus,seq_len", [(16, 524288), (64, 1048576)])
def test_more_bandwidth_is_never_slower(gpus, seq_len, inner):
    work = Workload(seq_len, 0.05)
    previous = math.inf
    for gbps in (1.0, 12.5, 50.0, 400.0, 4000.0):
        step = predict_mtraining(QWEN, work, Cluster(gpus, 8, inter_gbps=gbps), H100, inner=inner).step_ms
        assert step <= previous + 1e-9, (gbps, step, previous)
        previous = step
    previous = math.inf
    for gbps in (20.0, 80.0, 300.0):
        step = predict_mtraining(QWEN, work, Cluster(gpus, 8, intra_gbps=gbps), H100, inner=inner).step_ms
        assert step <= previous + 1e-9
        previous = step
    dense = [predict_dense_p2p(QWEN, work, Cluster(gpus, 8, inter_gbps=g), H100).step_ms for g in (1.0, 50.0, 400.0)]
    assert dense == sorted(dense, reverse=True)


def test_more_latency_is_never_faster():
    work = Workload(524288, 0.05)
    steps = [predict_mtraining(QWEN, work, Cluster(32, 8, inter_latency_us=lat), H100).step_ms
             for lat in (0, 5, 50, 500)]
    assert steps == sorted(steps) and steps[-1] > steps[0]


def test_dense_compute_scales_with_causal_pairs():
    cluster = Cluster(8, 8)
    a = predict_dense_p2p(QWEN, Workload(262144, 1.0), cluster, H200)
    b = predict_dense_p2p(QWEN, Workload(1048576, 1.0), cluster, H200)
    pairs = (1048576 * 1048577) / (262144 * 262145)
    def work(p):
        return p.attention_compute_ms - p.fixed_cost_ms
    assert work(b) / work(a) == pytest.approx(pairs)
    # The same work per GPU: doubling GPUs halves the dense compute (a2a+p2p does the same pairs).
    c = predict_dense_p2p(QWEN, Workload(1048576, 1.0), Cluster(16, 8), H200)
    assert c.attention_compute_ms - c.fixed_cost_ms == pytest.approx((b.attention_compute_ms - b.fixed_cost_ms) / 2)
    d = predict_dense_a2a_p2p(QWEN, Workload(1048576, 1.0), Cluster(16, 8), H200)
    assert d.attention_compute_ms - d.fixed_cost_ms == pytest.approx(c.attention_compute_ms - c.fixed_cost_ms)


def test_sparse_work_scales_with_density_and_fixed_costs_do_not():
    cluster = Cluster(32, 8)
    low = predict_mtraining(QWEN, Workload(524288, 0.025), cluster, H100)
    high = predict_mtraining(QWEN, Workload(524288, 0.1), cluster, H100)
    assert low.fixed_cost_ms == high.fixed_cost_ms > 0
    def work(p):
        return p.attention_compute_ms - p.fixed_cost_ms
    assert work(high) == pytest.approx(4 * work(low))


def test_one_gpu_is_the_kernel_alone():
    work = Workload(131072, 0.05)
    p = predict_mtraining(QWEN, work, Cluster(1, 8), H200)
    items, tiles = 16 * 131072 / 64, 0.05 * 131072 * 131073 / 2 * 16 / 64 ** 2
    grads_zeroed = 2 * 131072 * 2 * 128 * 4 / (H200.hbm_gbps * 1e9) * 1e3
    assert p.exposed_comm_ms == pytest.approx(0, abs=1e-9)
    kernels = H200.sparse_fwd.ms(items, tiles) + H200.sparse_bwd.ms(items, tiles)
    # The kernels outlast the floor: the call pays only the host's lead before its first kernels.
    lead = H200.ring_host_floor.lead_share * H200.ring_host_floor.per_step
    assert 0 < lead < 0.1 * kernels and p.host_lead_ms == pytest.approx(lead)
    assert p.attention_ms == pytest.approx(kernels + grads_zeroed + lead)
    # ...which is what kernel.py measured at 128K (36.79 ms fwd+bwd) within the fit's error.
    assert p.attention_ms == pytest.approx(36.79, rel=0.06)


def test_ring_simulation_limits():
    link_fast = lambda s, d: (1e9, 0.0)  # noqa: E731
    assert simulate_ring(8, 8, [2.0] * 8, {"kv": 1e6, "grad": 2e6}, link_fast) == pytest.approx(16.0)
    # Without compute, the forward is W-1 transfers in a row; the backward's last step adds one more hop.
    link = lambda s, d: (1.0, 0.0)  # noqa: E731  1 GB/s: 1 ms per MB
    assert simulate_ring(4, 4, [0.0] * 4, {"kv": 1e6, "grad": 1e6}, link) == pytest.approx(3.0)
    # Hierarchical on a uniform link: the outer transfer overlaps the inner loop.
    flat = simulate_ring(8, 8, [1.0] * 8, {"kv": 1e6, "grad": 1e6}, link)
    hier = simulate_ring(8, 2, [1.0] * 8, {"kv": 1e6, "grad": 1e6}, link)
    assert flat == pytest.approx(8.0) and hier == pytest.approx(8.0)
    with pytest.raises(ValueError, match="does not divide"):
        simulate_ring(8, 3, [1.0] * 8, {"kv": 1.0, "grad": 1.0}, link)


@pytest.mark.parametrize("world,inner", [(4, 4), (8, 2), (4, 1), (1, 1)])
def test_the_backward_hop_home_is_its_own_message(world, inner):
    """ring/schedule.py sends the complete dK/dV home in K/V's dtype: the model's backward has exactly
    one such transfer on a ring of more than one rank (the last one), and only it gets "grad_home"'s size."""
    from megatron_mtraining.ring.program import ring_program

    bwd = ring_program(world // inner, inner, backward=True)
    posts = [op for op in bwd if op[0] == "post" and op[3].startswith("grad")]
    sizes = {"inner": inner, "outer": world // inner}
    real = [op for op in posts if sizes[op[2]] > 1]
    assert [op[3] for op in real] == ["grad"] * (len(real) - 1) + ["grad_home"] * (len(real) > 0)
    link = lambda s, d: (1.0, 0.0)  # noqa: E731  1 ms per MB
    slow_home = simulate_ring(world, inner, [0.0] * world, {"kv": 1e6, "grad": 2e6}, link, backward=True)
    fast_home = simulate_ring(world, inner, [0.0] * world, {"kv": 1e6, "grad": 2e6, "grad_home": 1e6}, link,
                              backward=True)
    assert fast_home == pytest.approx(slow_home - (1.0 if world > 1 else 0.0))


def test_dq_after_the_send_hides_the_hop_home():
    """ring/schedule.py (from 92e682c) sends a backward step's dK/dV on before its dQ kernel: with
    10 ms steps, 40% of them dQ, and a 3 ms hop home, the flat ring's backward no longer waits for it;
    in the old order (share 0) it does. The middle hops hide either way (a whole step of slack)."""
    link = lambda s, d: (1.0, 0.0)  # noqa: E731  1 ms per MB
    sizes = {"kv": 1e6, "grad": 3e6, "grad_home": 3e6}
    old = simulate_ring(4, 4, [10.0] * 4, sizes, link, add_ms=0.5, backward=True)
    new = simulate_ring(4, 4, [10.0] * 4, sizes, link, add_ms=0.5, backward=True, queries_share=0.4)
    assert old == pytest.approx(40.0 + 3 * 0.5 + 3.0)
    assert new == pytest.approx(40.0 + 3 * 0.5)
    # A hop home longer than dQ shows its remainder only.
    longer = simulate_ring(4, 4, [10.0] * 4, {**sizes, "grad_home": 6e6}, link, add_ms=0.5, backward=True,
                           queries_share=0.4)
    assert longer == pytest.approx(40.0 + 3 * 0.5 + 2.0)
    with pytest.raises(ValueError, match="queries_share"):
        simulate_ring(4, 4, [10.0] * 4, sizes, link, backward=True, queries_share=1.0)
    # Over two nodes the hop home is the outer transfer: the last dQ follows its posting, so a 3 ms
    # outer hop hides too, and only the fast inner hand-off before it (0 ms here) remains.
    two_nodes = lambda s, d: (1.0, 0.0) if s // 2 != d // 2 else (1e6, 0.0)  # noqa: E731
    hier_old = simulate_ring(4, 2, [10.0] * 4, sizes, two_nodes, add_ms=0.5, backward=True)
    hier_new = simulate_ring(4, 2, [10.0] * 4, sizes, two_nodes, add_ms=0.5, backward=True, queries_share=0.4)
    assert hier_old - hier_new == pytest.approx(3.0, abs=0.01)


def _without_floor(profile):
    return dataclasses.replace(profile, ring_host_floor=HostFloor(0.0, 0.0))


def test_host_floor_binds_at_small_work_and_not_at_large():
    """A ring step lasts max(its kernels, the host's enqueue time): at 16K on one GPU (kernels ~1.2 ms)
    the call is the floor (4.3 ms, as measured); at 128K the kernels outlast it and it changes nothing."""
    ring = ModelShape(layers=1, vocab=8192)
    floor = H200.ring_host_floor
    small = predict_mtraining(ring, Workload(16384, 0.05), Cluster(1, 1), H200)
    assert small.attention_compute_ms < floor.per_step / 2
    assert small.attention_ms == pytest.approx(floor.per_step)
    assert small.host_wait_ms == pytest.approx(floor.per_step - small.attention_compute_ms)
    assert small.host_floor_ms == pytest.approx(floor.per_step)
    assert small.host_lead_ms == 0  # the floor binds: the lead hides inside it
    large = predict_mtraining(ring, Workload(131072, 0.05), Cluster(1, 1), H200)
    assert large.host_wait_ms == 0
    assert large.attention_ms == pytest.approx(predict_mtraining(
        ring, Workload(131072, 0.05), Cluster(1, 1), _without_floor(H200)).attention_ms + large.host_lead_ms)
    # Per step, not per call: W steps of 8K tokens each cost at least W floors (64 H100s at 512K) ...
    many = predict_mtraining(QWEN, Workload(524288, 0.05), Cluster(64, 8), H100)
    assert many.attention_ms >= 64 * H100.ring_host_floor.per_step and many.limit == "host/launch floor"
    # ... while 64K tokens per GPU (8 GPUs) are kernel-bound: there the floor changes nothing.
    few = predict_mtraining(QWEN, Workload(524288, 0.05), Cluster(8, 8), H100)
    assert few.host_wait_ms == 0 and few.limit == "attention kernels (work)"
    assert few.step_ms == pytest.approx(predict_mtraining(QWEN, Workload(524288, 0.05), Cluster(8, 8),
                                                          _without_floor(H100)).step_ms
                                        + QWEN.layers * few.host_lead_ms)


def test_host_floor_is_a_max_per_direction_and_counts_once_per_layer_call():
    """The floor replaces the kernels' time where it binds (it is not added to their fixed costs), in
    each direction apart; a training step pays it in every layer's ring call, forward and backward."""
    ring = ModelShape(layers=1, vocab=8192)
    work, cluster = Workload(131072, 0.05), Cluster(1, 1)
    bare = predict_mtraining(ring, work, cluster, _without_floor(H200))
    forward_only = dataclasses.replace(H200, ring_host_floor=HostFloor(bare.fwd_step_ms + 5.0, 0.0))
    p = predict_mtraining(ring, work, cluster, forward_only)
    assert p.attention_fwd_ms == pytest.approx(bare.fwd_step_ms + 5.0)
    assert p.attention_bwd_ms == pytest.approx(bare.attention_bwd_ms)
    assert p.host_wait_ms == pytest.approx(5.0) and p.fixed_cost_ms == bare.fixed_cost_ms
    shape = ModelShape(layers=4, vocab=8192)
    floored = predict_mtraining(shape, Workload(65536, 0.05), Cluster(4, 4), H200)
    unfloored = predict_mtraining(shape, Workload(65536, 0.05), Cluster(4, 4), _without_floor(H200))
    assert floored.host_wait_ms > 0
    assert floored.step_ms - unfloored.step_ms == pytest.approx(4 * (floored.attention_ms - unfloored.attention_ms))
    assert floored.rest_of_layer_ms == unfloored.rest_of_layer_ms and floored.head_ms == unfloored.head_ms
    # Full recompute runs every layer's ring forward again, floor included.
    work = Workload(65536, 0.05, recompute="full")
    p = predict_mtraining(shape, work, Cluster(4, 4), H200)
    forward = p.attention_fwd_ms + p.approximator_ms + p.rest_of_layer_ms / 3
    before = p.step_ms
    assert with_recompute(p, shape, work).step_ms == pytest.approx(before + 4 * forward)
    # The dense baselines have no measured floor.
    dense = predict_dense_p2p(shape, Workload(65536, 1.0), Cluster(4, 4), H200)
    assert dense.host_floor_ms == 0 and dense.host_wait_ms == 0


def test_the_hosts_lead_delays_each_directions_first_kernels():
    """Just past the floor (one GPU, 32K) a call lasts max(floor, lead + kernels) per direction: the
    host's plan conversion and first launches come before the GPU has anything to run."""
    ring = ModelShape(layers=1, vocab=8192)
    work, cluster = Workload(32768, 0.05), Cluster(1, 1)
    bare = predict_mtraining(ring, work, cluster, _without_floor(H200))
    floor = HostFloor(bare.fwd_step_ms / 2, bare.bwd_step_ms * 1.5, 0.0, lead_share=0.4)
    p = predict_mtraining(ring, work, cluster, dataclasses.replace(H200, ring_host_floor=floor))
    assert p.attention_fwd_ms == pytest.approx(bare.fwd_step_ms + 0.4 * floor.fwd)  # kernels + lead
    # The backward: the floor binds, and 0.4 of it plus the kernels is still under it.
    assert p.attention_bwd_ms == pytest.approx(max(floor.bwd, 0.4 * floor.bwd + bare.bwd_step_ms))
    assert p.host_lead_ms == pytest.approx(p.attention_ms - max(bare.fwd_step_ms, floor.fwd)
                                           - max(bare.bwd_step_ms, floor.bwd))
    assert p.exposed_comm_ms == pytest.approx(0, abs=1e-9)


def test_host_floor_rejects_negative_times():
    with pytest.raises(ValueError, match="fwd must be >= 0"):
        HostFloor(-1.0, 2.0)
    with pytest.raises(ValueError, match="bwd must be >= 0"):
        HostFloor(1.0, float("nan"))
    with pytest.raises(ValueError, match="lead_share must be in"):
        HostFloor(1.0, 2.0, lead_share=1.5)
    raw = {k: v for k, v in H200.raw.items() if k != "ring"}
    with pytest.raises(ValueError, match="lacks the field 'ring'"):
        Profile.from_dict(raw)


def test_hierarchical_beats_flat_over_a_slow_link_as_measured():
    """The slow-link runs' ranking (4 GPUs, nodes of 2, 1 GB/s: flat 1960 ms, hierarchical 880 ms)."""
    work = Workload(524288, 0.05)
    cluster = Cluster(4, 2, inter_gbps=1.0, inter_latency_us=0.0)
    flat = predict_mtraining(ModelShape(layers=1, vocab=8192), work, cluster, H200)
    hier = predict_mtraining(ModelShape(layers=1, vocab=8192), work, cluster, H200, inner=2)
    assert hier.attention_ms < flat.attention_ms / 1.8
    assert flat.limit == "exposed communication"


def test_plan_lists_every_configuration_and_recommends_the_fastest_that_fits():
    result = plan(QWEN, Workload(524288, 0.05), Cluster(32, 8), H100, tp=1)
    names = [p["name"] for p in result["predictions"]]
    hierarchical = [f"mtraining_hier_{i}" for i in (2, 4, 8, 16)]
    assert names == ["mtraining_flat"] + hierarchical + ["dense_te_p2p", "dense_te_a2a_p2p"]
    sparse = [p for p in result["predictions"] if p["method"] == "mtraining" and p["fits"]]
    best = min(sparse, key=lambda p: p["step_ms"])
    rec = result["recommendation"]
    assert rec["configuration"] == best["name"] and rec["speedup_over_best_dense"] > 1
    for p in result["predictions"]:
        assert p["tokens_per_s"] == pytest.approx(524288 / p["step_ms"] * 1e3)
    # With TP searched, every split the model takes is listed (2 query groups: TP 1 and 2).
    searched = plan(QWEN, Workload(524288, 0.05), Cluster(32, 8), H100)
    assert sorted({p["tp"] for p in searched["predictions"]}) == [1, 2]


def test_te_layers_and_fp8_change_only_the_rest_of_the_layer():
    """TE's layers and FP8 GEMMs change the rest of the layer (H200 rates calibrated on TE runs), not the
    attention; FP8 leaves the output layer in bf16."""
    shape, cluster = ModelShape(layers=4, vocab=8192), Cluster(4, 4)
    local = predict_mtraining(shape, Workload(524288, 0.03), cluster, H200)
    te = predict_mtraining(shape, Workload(524288, 0.03, layers="transformer_engine"), cluster, H200)
    fp8 = predict_mtraining(shape, Workload(524288, 0.03, layers="transformer_engine", fp8=True), cluster, H200)
    assert local.attention_ms == te.attention_ms == fp8.attention_ms
    assert fp8.rest_of_layer_ms < te.rest_of_layer_ms and fp8.head_ms == te.head_ms
    bf16_rate, elementwise = H200.te_rest_of_layer["bf16"]
    tokens = 524288 / 4
    expected = (shape.layer_gemm_flops_per_token() * tokens / (bf16_rate * 1e12) * 1e3
                + elementwise * 1e-6 * tokens)
    assert te.rest_of_layer_ms == pytest.approx(expected)
    dense = predict_dense_p2p(shape, Workload(524288, 1.0, layers="transformer_engine"), cluster, H200)
    assert dense.rest_of_layer_ms == te.rest_of_layer_ms


def test_te_layers_need_a_profile_calibrated_on_te_runs():
    assert set(H100.te_rest_of_layer) == set(H200.te_rest_of_layer) == {"bf16", "fp8"}
    uncalibrated = dataclasses.replace(H100, te_rest_of_layer={})
    with pytest.raises(ValueError, match="no Transformer Engine bf16 rates"):
        predict_mtraining(QWEN, Workload(524288, layers="transformer_engine"), Cluster(8, 8), uncalibrated)


@pytest.mark.parametrize("kwargs,message", [
    ({"fp8": True}, "FP8 GEMMs need Transformer Engine"),
    ({"layers": "te"}, "layers must be one of"),
    ({"recompute": True}, "recompute must be 'full', 'none', a number of layers or None"),
    ({"recompute": -1}, "recompute must be 'full', 'none', a number of layers or None"),
])
def test_workload_rejects_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Workload(524288, **kwargs)


def test_recompute_adds_each_layers_forward_and_can_be_forced():
    shape, cluster = ModelShape(layers=4, vocab=8192), Cluster(4, 4)
    work = Workload(1048576, 0.015, layers="transformer_engine", recompute="full")
    p = predict_mtraining(shape, work, cluster, H200)
    before = p.step_ms
    forward = p.attention_fwd_ms + p.approximator_ms + p.rest_of_layer_ms / 3
    with_recompute(p, shape, work)
    assert p.step_ms == pytest.approx(before + 4 * forward) and "full recompute" in p.note
    # Block recompute of k layers adds k layers' forwards.
    p = with_recompute(predict_mtraining(shape, work, cluster, H200), shape, work, 3)
    assert p.step_ms == pytest.approx(before + 3 * forward) and "3 of 4 layers recomputed" in p.note
    with pytest.raises(ValueError, match=r"integer in \[0, 4\]"):
        with_recompute(p, shape, work, 5)
    # "full" / "none" / k override the planner's choice; each recomputed layer slows every configuration.
    runs = {r: plan(shape, Workload(1048576, 0.015, recompute=r), cluster, H200, tp=1) for r in ("none", 2, "full")}
    assert runs["full"]["recommendation"]["recompute"] == "full"
    assert runs["none"]["recommendation"]["recompute"] == "none"
    assert runs[2]["recommendation"]["recompute"] == "2/4 layers"
    for a, b, c in zip(runs["none"]["predictions"], runs[2]["predictions"], runs["full"]["predictions"]):
        assert a["step_ms"] < b["step_ms"] < c["step_ms"]


def test_a2a_size_groups_and_its_ring_uses_the_links_it_crosses():
    """--hierarchical-context-parallel-sizes 2 2 on one node of 4: the ring over the two groups runs on
    NVLink, whatever the inter-node link; in nodes of 2 it crosses the inter-node link."""
    shape, work = ModelShape(layers=1, vocab=8192), Workload(524288, 1.0)
    one_node = predict_dense_a2a_p2p(shape, work, Cluster(4, 4, inter_gbps=0.01), H200, a2a_size=2)
    same = predict_dense_a2a_p2p(shape, work, Cluster(4, 4, inter_gbps=50.0), H200, a2a_size=2)
    two_nodes = predict_dense_a2a_p2p(shape, work, Cluster(4, 2, inter_gbps=0.01), H200, a2a_size=2)
    assert one_node.attention_ms == same.attention_ms < two_nodes.attention_ms
    assert "ring over 2 groups" in one_node.note
    # Half the heads per call, twice the tokens: the same causal pairs as the p2p ring.
    p2p = predict_dense_p2p(shape, work, Cluster(4, 4), H200)
    assert one_node.attention_compute_ms == pytest.approx(p2p.attention_compute_ms)
    for size, message in ((3, "positive divisor"), (8, "positive divisor"), (0, "positive divisor")):
        with pytest.raises(ValueError, match=message):
            predict_dense_a2a_p2p(shape, work, Cluster(4, 4), H200, a2a_size=size)
    with pytest.raises(ValueError, match="spans more than a node"):
        predict_dense_a2a_p2p(shape, work, Cluster(4, 2), H200, a2a_size=4)


# ----------------------------------------------------------------------------------------------
# The CLI
# ----------------------------------------------------------------------------------------------


def test_cli_table_and_json_end_to_end(capsys):
    out = subprocess.run([sys.executable, "-m", "megatron_mtraining.plan", "--gpus", "16", "--seq-length", "524288"],
                         capture_output=True, text=True, env=_env(), timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "recommended: mtraining_" in out.stdout and "dense_te_p2p" in out.stdout and "memory per GPU" in out.stdout
    assert "host floor" in out.stdout and "flags: --tensor-model-parallel-size" in out.stdout
    assert cli_main(["--gpus", "16", "--seq-length", "524288", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["cluster"]["gpus"] == 16 and result["profile"] == "nvidia-h100"
    assert {"predictions", "recommendation", "advice", "skipped"} <= set(result)
    assert all("memory" in p and "fits" in p for p in result["predictions"])


def test_cli_says_where_the_host_floor_binds(capsys):
    assert cli_main(["--gpus", "64", "--seq-length", "524288", "--tp", "1", "--pp", "1"]) == 0
    text = capsys.readouterr().out
    flat = next(line for line in text.splitlines() if line.startswith("mtraining_flat"))
    assert flat.endswith("host/launch floor") and "*" in flat
    # One sequence over 64 GPUs: the dense ring is the faster tool, and the plan says so and why.
    assert "recommended: dense_te_p2p" in text and "note: dense" not in text
    assert ("MTraining is not the right tool here: at 8K tokens per context-parallel rank its ring is "
            "host/launch-bound") in text
    assert cli_main(["--gpus", "8", "--seq-length", "524288", "--tp", "1", "--pp", "1"]) == 0
    flat = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("mtraining_flat"))
    assert "*" not in flat and flat.endswith("attention kernels (work)")


def test_cli_help_names_the_inputs(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--num-attention-heads", "--num-query-groups", "--kv-channels", "--ffn-hidden-size", "--telemetry",
                 "--gpus-per-node", "--inter-gbps", "--inter-latency-us", "--gpu-type", "--seq-length"):
        assert flag in text


def test_cli_takes_megatron_flags_and_telemetry(capsys):
    log = os.path.join(RESULTS, "logs", "e2e_mtraining_nvidia-h200_4gpu_cudnn.log")
    argv = ["--num-layers", "4", "--hidden-size", "2048", "--num-attention-heads", "16", "--group-query-attention",
            "--num-query-groups", "2", "--ffn-hidden-size", "11008", "--seq-length", "524288", "--padded-vocab-size",
            "8192", "--context-parallel-size", "4", "--swiglu", "--gpu-type", "h200", "--telemetry", log,
            "--transformer-impl", "local", "--json"]
    assert cli_main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["workload"]["density"] == pytest.approx(0.029)
    # Megatron's flags bring Megatron's defaults: tied embeddings, no QKV bias (the flags do not say otherwise).
    assert result["shape"] == {"hidden": 2048, "heads": 16, "kv_groups": 2, "head_dim": 128, "layers": 4,
                               "ffn": 11008, "vocab": 8192, "qkv_bias": False, "untied_embeddings": False}
    assert result["ignored_args"] == ["--group-query-attention"]
    # The run this log came from: 982.5 ms per iteration.
    flat = next(p for p in result["predictions"] if p["name"] == "mtraining_flat")
    assert flat["step_ms"] == pytest.approx(982.5, rel=0.10)


def test_cli_transformer_engine_fp8_and_recompute(capsys):
    argv = ["--gpus", "4", "--seq-length", "1048576", "--gpu-type", "h200", "--num-layers", "4", "--vocab", "8192",
            "--transformer-impl", "transformer_engine", "--fp8-format", "hybrid", "--recompute-granularity", "full",
            "--json"]
    assert cli_main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["workload"]["layers"] == "transformer_engine" and result["workload"]["fp8"] is True
    assert result["recommendation"]["recompute"] == "full"
    assert cli_main(argv[:-1]) == 0
    assert "layers: Transformer Engine's (--transformer-impl transformer_engine, Megatron's default), FP8 GEMMs" in \
        capsys.readouterr().out


def test_read_telemetry_json(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps([{"density": 0.2}, {"density": 0.031, "iteration": 8}]))
    assert read_telemetry(str(path)) == {"density": 0.031}
    path.write_text(json.dumps({"iteration": 3}))
    with pytest.raises(ValueError, match="no 'density'"):
        read_telemetry(str(path))


@pytest.mark.parametrize("argv,message", [
    (["--gpus", "12", "--seq-length", "524288"], "multiple of the GPUs per node"),
    (["--gpus", "8", "--seq-length", "524288", "--gpu-type", "a100"], "unknown GPU profile 'a100'"),
    (["--gpus", "8", "--seq-length", "524288", "--density", "1.5"], "density must be in"),
    (["--gpus", "8", "--seq-length", "524288", "--density", "0.1", "--telemetry", "x.log"], "not both"),
    (["--seq-length", "524288"], "--gpus N"),
    (["--gpus", "8", "--seq-length", "100000"], "not a multiple of MTraining's 64-token block: 99968 or 100032"),
    (["--gpus", "8", "--seq-length", "524288", "--num-attention-heads", "16", "--num-query-groups", "3"],
     "multiple of kv_groups"),
    (["--gpus", "8", "--seq-length", "524288", "--telemetry", "/nonexistent.log"], "does not exist"),
    (["--gpus", "8", "--seq-length", "524288", "--inter-gbps", "0"], "inter_gbps must be > 0"),
    (["--gpus", "0", "--seq-length", "524288"], "gpus must be a positive integer"),
    (["--gpus", "8", "--seq-length", "524288", "--fp8-format", "hybrid", "--transformer-impl", "local"],
     "needs --transformer-impl transformer_engine"),
    (["--gpus", "8", "--seq-length", "524288", "--tp", "3"], "do not split over TP 3"),
    (["--gpus", "8", "--seq-length", "524288", "--context-parallel-size", "3"], "is not a multiple of"),
    (["--gpus", "8", "--seq-length", "524288", "--mtraining-block-size", "128"], "calibrated at block size 64"),
])
def test_cli_bad_inputs_say_what_is_wrong(argv, message, capsys):
    assert cli_main(argv) == 2
    assert message in capsys.readouterr().err


def test_inner_ring_must_divide_the_gpus():
    with pytest.raises(ValueError, match="must divide the context-parallel size"):
        predict_mtraining(QWEN, Workload(524288), Cluster(16, 8), H100, inner=3)



# ----------------------------------------------------------------------------------------------
# Models, lengths, errors, the recommendation, data and pipeline parallelism
# ----------------------------------------------------------------------------------------------

# The published shapes (the models' config.json): layers, hidden, FFN, heads, KV heads, head dim, vocabulary,
# QKV bias, untied embeddings; and the parameter count the model cards give.
PUBLISHED = {
    "qwen2.5-3b": ((36, 2048, 11008, 16, 2, 128, 151936, True, False), 3.09e9),
    "qwen2.5-7b": ((28, 3584, 18944, 28, 4, 128, 152064, True, True), 7.6e9),
    "llama3.1-8b": ((32, 4096, 14336, 32, 8, 128, 128256, False, True), 8.0e9),
    "llama3.1-70b": ((80, 8192, 28672, 64, 8, 128, 128256, False, True), 70.6e9),
}


def _count(layers, hidden, ffn, heads, kv, d, vocab, bias, untied):
    """Parameters from the shape, written out: q, k, v (and biases), o, SwiGLU's gate, up and down, two
    RMSNorms per layer; the embedding (twice when untied) and the final norm."""
    q, k, v, o = hidden * heads * d, hidden * kv * d, hidden * kv * d, heads * d * hidden
    biases = (heads * d + 2 * kv * d) if bias else 0
    mlp = hidden * ffn * 2 + ffn * hidden
    return layers * (q + k + v + o + biases + mlp + 2 * hidden) + vocab * hidden * (2 if untied else 1) + hidden


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_model_presets_are_the_published_shapes(name):
    from megatron_mtraining.plan.memory import memory_estimate
    from megatron_mtraining.plan.memory import Split
    from megatron_mtraining.plan.presets import MODELS

    fields, published = PUBLISHED[name]
    shape = MODELS[name]
    assert (shape.layers, shape.hidden, shape.ffn, shape.heads, shape.kv_groups, shape.head_dim, shape.vocab,
            shape.qkv_bias, shape.untied_embeddings) == fields
    expected = _count(*fields)
    assert shape.parameters() == pytest.approx(expected, rel=0.01)
    assert expected == pytest.approx(published, rel=0.01)
    # The memory model holds the same parameters on one GPU.
    assert memory_estimate(shape, Workload(65536), Split(), H200)["params_per_gpu"] == shape.parameters()


def test_the_default_model_is_the_real_tied_qwen2_5_3b():
    from megatron_mtraining.plan.cli import run
    from megatron_mtraining.plan.presets import MODELS

    assert ModelShape() == MODELS["qwen2.5-3b"] and not ModelShape().untied_embeddings
    assert ModelShape().parameters() == pytest.approx(3.09e9, rel=0.005)
    result = run(["--gpus", "8", "--seq-length", "512k", "--gpu-type", "h200"])
    assert result["shape"] == dataclasses.asdict(MODELS["qwen2.5-3b"]) and result["model"] == "Qwen2.5-3B"
    # The untied variant has one more 151936 x 2048 table: 311M parameters more.
    untied = dataclasses.replace(ModelShape(), untied_embeddings=True)
    assert untied.parameters() - ModelShape().parameters() == 151936 * 2048


def test_shape_flags_override_a_presets_fields(capsys):
    from megatron_mtraining.plan.cli import run

    result = run(["--model", "llama3.1-8b", "--num-layers", "4", "--gpus", "8", "--seq-length", "128k"])
    assert result["shape"] == {"hidden": 4096, "heads": 32, "kv_groups": 8, "head_dim": 128, "layers": 4,
                               "ffn": 14336, "vocab": 128256, "qkv_bias": False, "untied_embeddings": True}
    assert result["model"] == "Llama-3.1-8B with layers 4"
    assert run(["--model", "Llama-3.1-70B", "--gpus", "64", "--seq-length", "128k", "--pp", "1"])["shape"][
        "layers"] == 80
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["--model", "gpt-5", "--gpus", "8", "--seq-length", "128k"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown model 'gpt-5'; known: qwen2.5-3b, qwen2.5-7b, llama3.1-8b, llama3.1-70b" in err


def test_the_same_model_gets_the_same_layers_and_answer_by_preset_or_flags(capsys):
    """The implementation does not depend on where the shape came from: Transformer Engine's layers
    (Megatron's default) either way, and the output says so."""
    base = ["--gpus", "8", "--seq-length", "512k", "--gpu-type", "h200"]
    flags = ["--num-layers", "36", "--hidden-size", "2048", "--ffn-hidden-size", "11008", "--num-attention-heads",
             "16", "--num-query-groups", "2", "--kv-channels", "128", "--vocab-size", "151936", "--add-qkv-bias"]
    from megatron_mtraining.plan.cli import run

    by_default, by_preset, by_flags = run(base), run(base + ["--model", "qwen2.5-3b"]), run(base + flags)
    for r in (by_default, by_preset, by_flags):
        assert r["workload"]["layers"] == "transformer_engine"
        assert r["model"] == "Qwen2.5-3B"
        assert r["recommendation"]["tokens_per_s"] == by_default["recommendation"]["tokens_per_s"]
    assert cli_main(base + flags) == 0
    text = capsys.readouterr().out
    assert "layers: Transformer Engine's (--transformer-impl transformer_engine, Megatron's default), bf16 GEMMs" \
        in text
    assert "model: Qwen2.5-3B (36 layers" in text and "tied embeddings): 3.09B parameters" in text
    # Local layers only when asked for, and said.
    assert run(base + ["--transformer-impl", "local"])["workload"]["layers"] == "local"
    assert cli_main(base + ["--transformer-impl", "local"]) == 0
    assert "layers: Megatron's local layers (--transformer-impl local)" in capsys.readouterr().out


@pytest.mark.parametrize("text,tokens", [("131072", 131072), ("128k", 131072), ("128K", 131072), ("512k", 524288),
                                         ("1M", 1048576), ("1m", 1048576), ("2M", 2097152), ("0.5k", 512),
                                         ("1.5M", 1572864)])
def test_token_counts_take_k_and_m_suffixes(text, tokens):
    from megatron_mtraining.plan.cli import run, token_count

    assert token_count(text) == tokens
    result = run(["--gpus", "1", "--seq-length", "64k", "--global-batch-tokens", "1M", "--layers", "2",
                  "--vocab", "8192"])
    assert result["workload"]["seq_len"] == 65536 and result["global_batch"] == 16


@pytest.mark.parametrize("value", ["12x", "k", "0", "0.3", "1.3k", "", "1e6", "1G", "128 kB"])
def test_a_bad_token_count_is_one_argparse_error(value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["--gpus", "8", "--seq-length", value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "argument --seq-length" in err and "is not a token count" in err
    with pytest.raises(SystemExit):
        cli_main(["--gpus", "8", "--seq-length", "128k", "--global-batch-tokens", value])
    assert "argument --global-batch-tokens" in capsys.readouterr().err


def test_a_length_that_does_not_split_is_one_error_that_speaks_of_the_cp_size(capsys):
    assert cli_main(["--gpus", "8", "--seq-length", "1000"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.count("error:") == 1 and err.count("1000") == 1
    assert "GPU count" not in err and "GPUs x block size" not in err
    assert "not a multiple of MTraining's 64-token block: 960 or 1024 (1K), say" in err
    # Held to one CP size (TP 1, no pipeline): whole blocks on each of its 8 ranks.
    assert cli_main(["--gpus", "8", "--seq-length", "1088", "--tp", "1", "--pp", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "the context-parallel size (CP 8 for the splits of 8 GPUs)" in err
    assert "a multiple of 512, 1024 (1K) or 1536" in err


def test_one_gpu_is_spoken_of_in_the_singular(capsys):
    assert cli_main(["--gpus", "1", "--seq-length", "128k"]) == 0
    text = capsys.readouterr().out
    assert "nothing fits" in text and "on this GPU" in text and "these 1 GPUs" not in text
    assert "nvidia-h100 x 1 (" in text
    assert cli_main(["--gpus", "2", "--seq-length", "1088", "--tp", "1", "--pp", "1"]) == 2
    assert "(CP 2 for the splits of 2 GPUs)" in capsys.readouterr().err
    from megatron_mtraining.plan.search import gpus_text
    assert (gpus_text(1), gpus_text(2)) == ("1 GPU", "2 GPUs")


@pytest.mark.parametrize("argv", [
    ["--model", "llama3.1-70b", "--seq-length", "128k", "--gpus", "64"],
    ["--model", "llama3.1-70b", "--seq-length", "128k", "--gpus", "64", "--pp", "1"],
    ["--gpus", "64", "--seq-length", "512k", "--tp", "1", "--pp", "1"],
    ["--gpus", "16", "--seq-length", "512k"],
    ["--model", "llama3.1-8b", "--gpus", "32", "--seq-length", "128k", "--global-batch-tokens", "4M"],
])
def test_the_recommendation_is_the_fastest_that_fits_whichever_attention(argv, capsys):
    from megatron_mtraining.plan.cli import run

    result = run(argv)
    rec = result["recommendation"]
    fitting = [r for r in result["predictions"] if r["fits"]]
    assert rec["step_ms"] == min(r["step_ms"] for r in fitting)
    assert rec["tokens_per_s"] == max(r["tokens_per_s"] for r in fitting)
    best = {m: max((r["tokens_per_s"] for r in fitting if r["method"] == m), default=None)
            for m in ("mtraining", "dense")}
    assert rec["speedup_over_best_dense"] == pytest.approx(best["mtraining"] / best["dense"])
    assert cli_main(argv) == 0
    text = capsys.readouterr().out
    assert text.count("recommended: ") == 1 and "predicted faster here" not in text
    if rec["method"] == "dense":
        assert "MTraining is not the right tool here: " in text and "against MTraining: its fastest that fits" in text
    else:
        assert "MTraining is not the right tool" not in text and "MTraining is" in text and "x faster" in text


def test_a_70b_model_at_128k_over_64_gpus_is_recommended_the_dense_ring_and_told_why(capsys):
    """One sequence of 128K over 64 GPUs: 16K tokens per CP rank at TP 8, where MTraining's ring is bound
    by the host's launches; the dense ring is the faster fitting configuration, recommended alone."""
    argv = ["--model", "llama3.1-70b", "--seq-length", "128k", "--gpus", "64"]
    from megatron_mtraining.plan.cli import run

    rec = run(argv)["recommendation"]
    assert rec["configuration"] == "dense_te_p2p" and (rec["tp"], rec["cp"]) == (8, 8)
    assert rec["best_mtraining"]["configuration"] == "mtraining_flat"
    assert rec["best_mtraining"]["limited_by"] == "host/launch floor" and rec["speedup_over_best_dense"] < 1
    assert cli_main(argv) == 0
    text = capsys.readouterr().out
    assert "recommended: dense_te_p2p (Transformer Engine's dense CP, p2p ring), TP 8 x CP 8" in text
    assert ("MTraining is not the right tool here: at 16K tokens per context-parallel rank its ring is "
            "host/launch-bound") in text and "--global-batch-tokens" in text
    assert "flags: --tensor-model-parallel-size 8 --context-parallel-size 8" in text and "--cp-comm-type p2p" in text
    # With a global batch the search spreads the sequences over replicas, and MTraining wins there.
    batched = run(argv + ["--global-batch-tokens", "2M"])["recommendation"]
    assert batched["method"] == "mtraining" and batched["dp"] * batched["pp"] > 1
    assert batched["tokens_per_s"] > 1.5 * rec["tokens_per_s"]


def test_the_search_covers_data_and_pipeline_parallelism_for_a_global_batch():
    result = plan(ModelShape(hidden=4096, heads=32, kv_groups=8, head_dim=128, layers=32, ffn=14336, vocab=128256,
                             qkv_bias=False, untied_embeddings=True),
                  Workload(131072, layers="transformer_engine"), Cluster(64, 8), H100, pp=None, dp=None,
                  sequences=64)
    rows = result["predictions"]
    splits = {(r["dp"], r["pp"], r["tp"], r["cp"]) for r in rows}
    assert all(dp * pp * tp * cp == 64 for dp, pp, tp, cp in splits)
    assert {dp for dp, _, _, _ in splits} == {1, 2, 4, 8, 16, 32, 64}
    assert {pp for _, pp, _, _ in splits} == {1, 2, 4, 8, 16, 32}
    for r in rows:
        assert r["dp"] * r["micro_batches"] * r["micro_batch"] == 64
        assert r["tokens_per_s"] == pytest.approx(64 * 131072 / r["step_ms"] * 1e3)
        assert r["bubble"] == pytest.approx((r["pp"] - 1) / (r["micro_batches"] + r["pp"] - 1))
        flags = r["megatron_flags"]
        assert flags[flags.index("--global-batch-size") + 1] == "64"
        assert ("--pipeline-model-parallel-size" in flags) == (r["pp"] > 1)
    rec = result["recommendation"]
    assert rec["dp"] > 1 and rec["tokens_per_s"] == max(r["tokens_per_s"] for r in rows if r["fits"])
    # Without a global batch a step is one sequence over all the GPUs: no data parallelism.
    single = plan(ModelShape(), Workload(524288), Cluster(16, 8), H100, pp=None, dp=None)
    assert {(r["dp"], r["micro_batches"]) for r in single["predictions"]} == {(1, 1)}
    with pytest.raises(ValueError, match="needs a global batch"):
        plan(ModelShape(), Workload(524288), Cluster(16, 8), H100, dp=2)


def test_a_pipeline_step_is_the_slowest_stage_m_plus_pp_minus_1_times():
    """PP stages of layers / PP layers; 1F1B runs m micro-batches in m + PP - 1 stage times (bubble
    (PP - 1) / (m + PP - 1)); the last stage, with the output layer and the loss, is the slowest; each
    micro-batch hands its activations on and its gradient back. PP 1 is the one-stage step, m times."""
    from megatron_mtraining.plan.search import configurations

    shape, work, cluster = ModelShape(), Workload(131072, layers="transformer_engine", recompute="none"), \
        Cluster(16, 8)
    one = {r["name"]: r for r in configurations(shape, work, cluster, H100, tp=1, pp=1, dp=1, sequences=1)["rows"]
           if r["cp"] == 16}
    for pp, m in ((2, 8), (4, 8), (4, 1)):
        rows = configurations(shape, work, cluster, H100, tp=1, pp=pp, dp=None, sequences=m)["rows"]
        row = next(r for r in rows if r["name"] == "mtraining_flat" and r["dp"] == 1)
        assert row["cp"] == 16 // pp and row["micro_batches"] == m
        layer = row["attention_fwd_ms"] + row["attention_bwd_ms"] + row["approximator_ms"] + row["rest_of_layer_ms"]
        stage = 36 // pp * layer + row["head_ms"] + row["pipeline_p2p_ms"]
        assert row["step_ms"] == pytest.approx((m + pp - 1) * stage + H100.step_fixed_ms)
        assert row["bubble"] == pytest.approx((pp - 1) / (m + pp - 1))
        # Activations between stages 8 GPUs apart or more cross nodes: CP x TP x DP ranks per stage.
        tokens = 131072 // row["cp"]
        gbps = 50.0 if 16 // pp >= 8 else H100.intra_gbps
        latency = 5.0 if 16 // pp >= 8 else H100.intra_latency_us
        assert row["pipeline_p2p_ms"] == pytest.approx(2 * (latency / 1e3 + tokens * 2048 * 2 / (gbps * 1e9) * 1e3))
    # Gradient accumulation without a pipeline: m one-stage steps.
    rows = configurations(shape, work, cluster, H100, tp=1, pp=1, dp=1, sequences=4)["rows"]
    flat = next(r for r in rows if r["name"] == "mtraining_flat")
    assert flat["step_ms"] == pytest.approx(4 * one["mtraining_flat"]["step_ms"])
    assert flat["tokens_per_s"] == pytest.approx(one["mtraining_flat"]["tokens_per_s"])
    with pytest.raises(ValueError, match="36 layers do not split into 5 pipeline stages"):
        configurations(shape, work, Cluster(5, 8), H100, tp=1, pp=5)


def test_pipeline_stages_hold_their_layers_the_tables_and_the_first_the_micro_batches_in_flight():
    """Stage memory: a stage's layers' states; the first stage the embedding and min(PP, m) micro-batches'
    activations (1F1B), the last the output layer (a tied embedding's copy) and the loss."""
    from megatron_mtraining.plan.memory import GiB, Split, memory_estimate

    work = Workload(131072, layers="transformer_engine")
    whole = memory_estimate(QWEN, work, Split(cp=8), H100, recompute_layers=0)
    two = memory_estimate(QWEN, work, Split(cp=8, pp=2), H100, recompute_layers=0)
    assert "stage" not in whole and two["stage"] == "last stage"
    layer_params = (whole["params_per_gpu"] - 151936 * 2048 - 2048) / 36
    assert two["params_per_gpu"] == pytest.approx(18 * layer_params + 151936 * 2048 + 2048)
    assert two["components_gib"]["stored_activations"] == pytest.approx(
        whole["components_gib"]["stored_activations"] / 2)
    # Four micro-batches in flight on the first of 4 stages: its 9 layers' activations four times over.
    first = memory_estimate(dataclasses.replace(QWEN, vocab=8192), work, Split(cp=8, pp=4), H100, recompute_layers=0,
                            micro_batches=8)
    single = memory_estimate(dataclasses.replace(QWEN, vocab=8192), work, Split(cp=8, pp=4), H100,
                             recompute_layers=0, micro_batches=1)
    assert first["stage"] == "first stage"
    assert first["components_gib"]["stored_activations"] == pytest.approx(
        4 * single["components_gib"]["stored_activations"])
    assert (first["peak_gib"] - single["peak_gib"]) * GiB == pytest.approx(
        3 * single["components_gib"]["stored_activations"] * GiB, rel=0.01)
    with pytest.raises(ValueError, match=r"recompute_layers must be an integer in \[0, 9\]"):
        memory_estimate(QWEN, work, Split(cp=8, pp=4), H100, recompute_layers=10)


def test_a_global_batch_must_be_whole_sequences_and_agree_with_megatrons_flag(capsys):
    base = ["--gpus", "8", "--seq-length", "128k"]
    assert cli_main(base + ["--global-batch-tokens", "200k"]) == 2
    assert "not a whole number of 131072-token sequences" in capsys.readouterr().err
    assert cli_main(base + ["--global-batch-tokens", "1M", "--global-batch-size", "4"]) == 2
    assert "is 8 sequences, --global-batch-size says 4" in capsys.readouterr().err
    from megatron_mtraining.plan.cli import run

    assert run(base + ["--global-batch-size", "8"])["global_batch"] == 8
    assert run(base + ["--global-batch-tokens", "1M"])["global_batch"] == 8

# ----------------------------------------------------------------------------------------------
# Calibration and validation on the committed results
# ----------------------------------------------------------------------------------------------


def test_committed_profiles_are_the_derivation_of_the_committed_results(tmp_path):
    import calibrate

    derived = calibrate.derive_all(RESULTS)
    for name, profile in derived.items():
        calibrate.write_profile(profile, str(tmp_path / f"{name}.json"))
        with open(tmp_path / f"{name}.json") as fh, open(os.path.join(PROFILE_DIR, f"{name}.json")) as committed:
            stale = f"{name}: rerun calibrate.py --from-results benchmarks/results"
            assert json.load(fh) == json.load(committed), stale
        for source in profile["sources"]:
            if source.startswith("benchmarks/results/"):
                assert os.path.isfile(os.path.join(REPO, source.split(" ")[0])), source
    h200 = derived["nvidia-h200"]["sparse"]["fit_max_abs_rel_error"]
    assert max(h200.values()) < 0.07  # one-GPU kernel points from 64K to 512K, 1.2-10% density


def _ring_result(world: int, runs, commit: str = "abc1234") -> dict:
    """A ring.py result of the sparse striped ring: runs of (S, fwd+bwd ms, forward and backward
    telemetry ms or None)."""
    def timeline(ms):
        return {"compute_ms": {"mean": ms, "max": ms}, "wait_ms": {"mean": 0.0, "max": 0.0},
                "plan_ms": {"mean": 0.0, "max": 0.0}, "merge_ms": {"mean": 0.0, "max": 0.0}}
    out = []
    for S, ms, telemetry in runs:
        section = {"fwdbwd_ms": ms}
        if telemetry:
            section["steps"] = {"timeline": {"forward": timeline(telemetry[0]), "backward": timeline(telemetry[1])}}
        out.append({"seq_len": S, "world_size": world, "variants": {"sparse_striped": section},
                    "index": {"active_pairs": 0.05 * S * (S + 1) / 2 * 16}})
    return {"meta": {"commit": commit}, "runs": out,
            "config": {"world_size": world, "block_size": 64, "heads": 16, "kv_heads": 2, "head_dim": 128}}


def test_calibrate_derives_the_floor_from_the_shortest_one_gpu_ring_run(tmp_path):
    import calibrate

    sp = json.load(open(os.path.join(PROFILE_DIR, "nvidia-h200.json")))["sparse"]
    files = {"ring_nvidia-h200_1gpu_a.json": _ring_result(1, [(16384, 5.0, (1.0, 3.0)), (131072, 38.0, (9.0, 28.0))]),
             # Shorter, but not one GPU (a multi-GPU point never calibrates) ...
             # (its 2 x 16K run, the floor's work per GPU, gives the per-call cost over ranks: 12 - 2 x 5 ms)
             "ring_nvidia-h200_2gpu_a.json": _ring_result(2, [(8192, 9.0, (2.0, 6.0)), (32768, 12.0, None)]),
             # another session's (commit) 2-GPU run never sets this session's call cost
             "ring_nvidia-h200_2gpu_b.json": _ring_result(2, [(32768, 30.0, None)], commit="def5678"),
             # ... and shorter, on one GPU, but without per-step telemetry (no forward/backward split).
             "ring_nvidia-h200_1gpu_b.json": _ring_result(1, [(8192, 4.0, None)])}
    for name, data in files.items():
        (tmp_path / name).write_text(json.dumps(data))
    ring = calibrate.derive_ring_floor(str(tmp_path), "nvidia-h200", sp["fwd"], sp["bwd"])
    assert ring["host_floor_ms_per_step"] == {"fwd": pytest.approx(5.0 * 0.25), "bwd": pytest.approx(5.0 * 0.75)}
    assert ring["source"]["file"] == "ring_nvidia-h200_1gpu_a.json" and ring["source"]["seq_len"] == 16384
    assert ring["source"]["kernels_ms"] < 2.5
    assert ring["host_call_ms_multi_rank"] == pytest.approx(2.0)
    assert [e["file"] for e in ring["multi_rank_source"]] == ["ring_nvidia-h200_2gpu_a.json"]
    # One session's floor: that commit's runs only (none of def5678's is on one GPU).
    assert calibrate.derive_ring_floor(str(tmp_path), "nvidia-h200", sp["fwd"], sp["bwd"], commit="def5678") is None
    assert calibrate.derive_ring_floor(str(tmp_path), "nvidia-h100", sp["fwd"], sp["bwd"]) is None
    # Where the kernels would take most of the call, it does not measure the host: refused.
    (tmp_path / "ring_nvidia-h200_1gpu_a.json").write_text(json.dumps(
        _ring_result(1, [(131072, 38.0, (9.0, 28.0))])))
    with pytest.raises(ValueError, match="not host-bound"):
        calibrate.derive_ring_floor(str(tmp_path), "nvidia-h200", sp["fwd"], sp["bwd"])
    with pytest.raises(ValueError, match="share of the ring call"):
        calibrate.host_floor(4.0, 1.0, 1.0, "x")


def test_calibrate_takes_the_hosts_lead_from_each_sessions_next_one_gpu_run(tmp_path):
    """Per session, the share with which the model's one-GPU call (per direction max(floor, share x
    floor + kernels)) takes the next run's measured time; the median over sessions."""
    import calibrate

    sp = json.load(open(os.path.join(PROFILE_DIR, "nvidia-h200.json")))["sparse"]
    items, tiles = 16 * 32768 / 64, 0.05 * 32768 * 32769 / 2 * 16 / 64 ** 2
    k_fwd = calibrate._cost_ms(sp["fwd"], items, tiles)
    k_bwd = calibrate._cost_ms(sp["bwd"], items, tiles) \
        + 2 * 32768 * 2 * 128 * 4 / (calibrate.SPEC["nvidia-h200"]["hbm_gbps"] * 1e9) * 1e3
    files = {  # session a: both directions past their floors (1 and 2 ms) at a share of 0.5: T = K + 1.5
        "ring_nvidia-h200_1gpu_a.json": _ring_result(1, [(16384, 3.0, (1.0, 2.0)), (32768, k_fwd + k_bwd + 1.5, None)]),
        # session b: a long backward floor (6 ms) the 32K backward stays on; the forward's lead is 0.6
        "ring_nvidia-h200_1gpu_b.json": _ring_result(1, [(16384, 7.0, (1.0, 6.0)), (32768, 6.0 + k_fwd + 0.6, None)],
                                                     commit="def5678"),
        # one run only, and a next run far past its floor: neither says anything of the lead
        "ring_nvidia-h200_1gpu_c.json": _ring_result(1, [(16384, 3.5, (1.0, 2.0))], commit="0000001"),
        "ring_nvidia-h200_1gpu_d.json": _ring_result(1, [(16384, 3.5, (1.0, 2.0)), (131072, 50.0, None)],
                                                     commit="0000002"),
        # a repeat at the floor's length only: no next run (skipped, not an error)
        "ring_nvidia-h200_1gpu_e.json": _ring_result(1, [(16384, 3.5, (1.0, 2.0)), (16384, 3.6, None)],
                                                     commit="0000003")}
    for name, data in files.items():
        (tmp_path / name).write_text(json.dumps(data))
    lead = calibrate.host_lead_share(str(tmp_path), "nvidia-h200", sp["fwd"], sp["bwd"])
    by_file = {e["file"]: e for e in lead["lead_sources"]}
    assert sorted(by_file) == ["ring_nvidia-h200_1gpu_a.json", "ring_nvidia-h200_1gpu_b.json"]
    assert 2.0 * 0.5 + k_bwd > 2.0 and 0.5 + k_fwd > 1.0  # session a's premise: the lead adds to both
    assert by_file["ring_nvidia-h200_1gpu_a.json"]["share"] == pytest.approx(0.5, abs=1e-9)
    assert 0.6 + k_fwd > 1.0 and 0.6 * 6.0 + k_bwd < 6.0  # session b's premise
    assert by_file["ring_nvidia-h200_1gpu_b.json"]["share"] == pytest.approx(0.6, abs=1e-9)  # the forward's alone
    for e in lead["lead_sources"]:  # the model's call at the share is the measured time
        assert calibrate._lead_call_ms(e["share"], e["floor_ms"], e["kernels_ms"]) == \
            pytest.approx(e["measured_fwdbwd_ms"])
    assert lead["host_lead_share"] == pytest.approx(0.55)
    empty = tmp_path / "none"
    empty.mkdir()
    assert calibrate.host_lead_share(str(empty), "nvidia-h200", sp["fwd"], sp["bwd"])["host_lead_share"] == 0.0


def test_committed_floor_is_the_one_gpu_16k_ring_call_and_h100_borrows_it():
    h200 = json.load(open(os.path.join(PROFILE_DIR, "nvidia-h200.json")))["ring"]
    source = h200["source"]
    with open(os.path.join(RESULTS, source["file"])) as fh:
        result = json.load(fh)
    assert result["config"]["world_size"] == 1
    run = next(r for r in result["runs"] if r["seq_len"] == source["seq_len"])
    assert H200.ring_host_floor.per_step == pytest.approx(run["variants"]["sparse_striped"]["fwdbwd_ms"], rel=1e-5)
    assert H100.ring_host_floor == H200.ring_host_floor
    h100 = json.load(open(os.path.join(PROFILE_DIR, "nvidia-h100.json")))
    assert h100["ring"]["borrowed_from"] == "nvidia-h200" and "borrowed" in h100["assumed"]["ring.host_floor_ms_per_step"]


def test_fit_drops_negative_coefficients():
    import calibrate

    points = [{"items": 1.0, "tiles": t, "y": 2.0 * t} for t in (1.0, 2.0, 4.0)]
    fit = calibrate.fit_cost(points, "y")
    assert fit["cost"]["per_tile"] == pytest.approx(2.0) and fit["max_abs_rel_error"] < 1e-9
    assert all(v >= 0 for v in fit["cost"].values())
    with pytest.raises(ValueError, match="cannot determine"):
        calibrate.fit_cost(points[:1], "y")


def test_profile_from_a_measurement():
    """calibrate.py --gpu's fits and profile, on a synthetic measurement (the GPU run itself is smoke-
    tested in test_calibrate_gpu_mode_smoke)."""
    import calibrate

    sparse = [{"items": i, "tiles": t, "fwd": 0.1 + 1e-5 * i + 5e-6 * t, "bwd": 0.3 + 4e-5 * i + 1.5e-5 * t}
              for i, t in ((1e4, 4e5), (2e4, 1.6e6), (2e4, 8e5), (8e4, 2.6e7))]
    dense = [{"items": 0.0, "tiles": t, "fwd": 3.7e-6 * t, "bwd": 9.7e-6 * t} for t in (1e6, 4e6, 6e7)]
    m = {"meta": {"device": "NVIDIA H200", "commit": "abc"}, "block_size": 64, "sparse": sparse, "dense": dense,
         "approximator": {"seq_len": 131072, "heads": 16, "ms": 2.0},
         "rest_of_layer": {"gemm_tflops": 600.0, "elementwise_ns_per_token_layer": 300.0},
         "p2p": {"intra_gbps": 150.0, "intra_latency_us": 12.0}, "memory_gib": 139.8,
         "ring_floor": {"seq_len": 16384, "fwd_ms": 1.5, "fwdbwd_ms": 4.5, "items": 4096.0, "tiles": 4e4,
                        "kv_heads": 2, "head_dim": 128}}
    profile = calibrate.profile_from_measurement(m, "nvidia-h200")
    assert profile["sparse"]["fwd"]["per_item"] == pytest.approx(1e-5, rel=1e-6)
    assert profile["sparse"]["bwd"]["per_call"] == pytest.approx(0.3, rel=1e-6)
    assert profile["p2p"] == {"intra_gbps": 150.0, "intra_latency_us": 12.0}
    loaded = Profile.from_dict(profile)
    assert loaded.memory_gib == 139.8
    assert (loaded.ring_host_floor.fwd, loaded.ring_host_floor.bwd) == (pytest.approx(1.5), pytest.approx(3.0))
    # A ring call whose kernels take most of it does not measure the floor; none at all is refused too.
    with pytest.raises(ValueError, match="not host-bound"):
        calibrate.profile_from_measurement(dict(m, ring_floor=dict(m["ring_floor"], fwdbwd_ms=1.0, fwd_ms=0.3)))
    with pytest.raises(ValueError, match="no 'ring_floor'"):
        calibrate.profile_from_measurement({k: v for k, v in m.items() if k != "ring_floor"})


def test_validation_file_is_current_and_meets_the_targets_on_planned_configurations():
    import plan_validation

    result = plan_validation.validate()
    with open(os.path.join(RESULTS, "plan_validation.json")) as fh:
        committed = json.load(fh)
    def predicted(cases):
        return [round(c["predicted_ms"], 3) for c in cases]
    assert predicted(result["cases"]) == predicted(committed["cases"]), "rerun benchmarks/plan_validation.py"
    planned = result["summary"]["planned_configurations"]
    assert planned["median_abs_error"] <= 0.10 and planned["worst_abs_error"] <= 0.20 and planned["met"]
    kinds = {c["kind"] for c in result["cases"]}
    assert kinds == {"ring", "approximator", "e2e"}
    assert {c["gpus"] for c in result["cases"]} == {1, 2, 4}
    assert any(c.get("slow_link_gbps") for c in result["cases"])
    # Every TE result is predicted on both sides; only the two profiled te_cp runs calibrate (TE's rest of layer).
    te = [c for c in result["cases"] if c["source"] in plan_validation.TE_RESULTS]
    for name in plan_validation.TE_RESULTS:
        variants = {c["variant"] for c in te if c["source"] == name}
        assert {"mtraining", "te_cp"} <= variants, name
    assert {c["variant"] for c in te} == {"mtraining", "te_cp", "te_cp_a2a_p2p"}
    assert sorted(c["source"] for c in te if c["role"] == "calibration") == sorted(
        ["e2e_te_nvidia-h200_2gpu.json", "e2e_te_fp8_nvidia-h200_2gpu.json"])
    assert all(c["variant"] == "te_cp" for c in te if c["role"] == "calibration")
    assert result["summary"]["transformer_engine_runs"]["predictions"] == len(te) - 2
    assert any("recompute" in c["setup"] for c in te) and any("FP8" in c["setup"] for c in te)
    # The host/launch floor is each session's (machine's) own: its one-GPU small-work call is held out
    # (the profile's among them); the other small-work rings are predictions.
    floor_source = H200.raw["ring"]["source"]
    ring_calibration = [c for c in result["cases"] if c["kind"] == "ring" and c["role"] == "calibration"]
    held_out = [(c["source"], c["seq_len"], c["gpus"]) for c in ring_calibration]
    assert (floor_source["file"], floor_source["seq_len"], 1) in held_out
    # Per session: its one-GPU call at the floor's work, and its W-GPU runs at the same work per GPU
    # (the per-call set-up), never a run at more work.
    floors = [(source, seq_len) for source, seq_len, gpus in held_out if gpus == 1]
    assert all(seq_len <= 16384 for _, seq_len in floors)
    assert len({source.rsplit("_", 1)[-1] for source, _ in floors}) == len(floors)  # one floor per session
    assert all(seq_len // gpus == 16384 for _, seq_len, gpus in held_out if gpus > 1), held_out
    assert {c["note"] for c in ring_calibration} == {"defines its session's host/launch floor: not a prediction",
                                                     "defines its session's per-call set-up over ranks: not a prediction"}
    small = [c for c in result["cases"] if c["kind"] == "ring" and c["seq_len"] // c["gpus"] <= 32768
             and c["role"] == "prediction"]
    assert {(c["gpus"], c["seq_len"]) for c in small} >= {(1, 32768), (2, 65536), (4, 131072)}
    # Within the worst bound (20%): on the host floor a session's own machine decides, and the
    # 2824381 session's 1-GPU 32K and 4-GPU 128K calls land at -18% and +13% (docs/scaling.md).
    assert all(abs(c["error"]) <= 0.20 and c["predicted_host_wait_ms"] > 0 for c in small), small


def test_density_of_runs_without_telemetry():
    import plan_validation

    assert plan_validation.density_at(524288)["density"] == pytest.approx(0.029)
    assert plan_validation.density_at(1048576)["density"] == pytest.approx(0.029 / 2)
    with pytest.raises(ValueError, match="no telemetry"):
        plan_validation.density_at(65536)


def _imports(path: str, module: str):
    """Absolute names of the modules a file imports (relative imports resolved from ``module``)."""
    tree = ast.parse(open(path).read())
    package = module.split(".")[:-1] if not path.endswith("__init__.py") else module.split(".")
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            name = ".".join(base + ([node.module] if node.module else []))
            yield name
            yield from (f"{name}.{a.name}" for a in node.names)


def test_plan_is_a_leaf():
    """Nothing else in the package imports the planner; the planner imports no torch and nothing of
    the package outside itself but the ring's schedule, which it prices (``ring/program.py``): it
    runs on any machine, from profiles alone."""
    package = os.path.join(REPO, "megatron_mtraining")
    for root, _, files in os.walk(package):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(root, f)
            module = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".").removesuffix(".__init__")
            names = list(_imports(path, module))
            if module.startswith("megatron_mtraining.plan"):
                assert not any(n.split(".")[0] == "torch" for n in names), path
                outside = [n for n in names
                           if n.startswith("megatron_mtraining") and not n.startswith("megatron_mtraining.plan")
                           and not n.startswith("megatron_mtraining.ring.program")]
                assert not outside, (path, outside)
            else:
                assert not any(n.startswith("megatron_mtraining.plan") for n in names), path


@pytest.mark.slow
def test_calibrate_gpu_mode_smoke(tmp_path):
    out = tmp_path / "profile.json"
    run = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "calibrate.py"), "--gpu", "--smoke", "--out",
                          str(out)], capture_output=True, text=True, env=_env(), timeout=600, cwd=REPO)
    assert run.returncode == 0, run.stderr[-2000:]
    profile = load_profile(str(out))
    assert profile.sparse_bwd.per_tile >= 0 and profile.block_size == 64


def test_a_call_over_several_ranks_pays_its_set_up_once_where_the_host_binds():
    """HostFloor.call_multi_rank: added once per layer call over W > 1 ranks where the floor binds
    (small work per GPU), never on one GPU and never where the kernels outlast the floor."""
    base = dataclasses.replace(H200, ring_host_floor=dataclasses.replace(H200.ring_host_floor, call_multi_rank=0.0))
    paid = dataclasses.replace(H200, ring_host_floor=dataclasses.replace(H200.ring_host_floor, call_multi_rank=2.5))
    shape = ModelShape(layers=1, vocab=8192)
    for W, S, extra in ((4, 4 * 16384, 2.5), (1, 16384, 0.0), (4, 524288, 0.0)):
        a, b = (predict_mtraining(shape, Workload(S), Cluster(W, W), p) for p in (base, paid))
        assert b.attention_ms - a.attention_ms == pytest.approx(extra), (W, S)
        assert b.host_wait_ms - a.host_wait_ms == pytest.approx(extra), (W, S)


def test_calibration_reads_kernel_costs_as_the_model_does():
    """calibrate.py's kernel cost is the model's (``KernelCost.ms``): the tiles' work scales with the
    head dim, the fixed costs do not; at d = 128 (every committed run) both read the fit as is."""
    import calibrate

    cost = {"per_call": 0.5, "per_item": 0.01, "per_tile": 0.002}
    assert calibrate._cost_ms(cost, 100, 1000) == pytest.approx(0.5 + 1.0 + 2.0)
    assert calibrate._cost_ms(cost, 100, 1000, head_dim=64) == pytest.approx(0.5 + 1.0 + 1.0)
    assert calibrate._cost_ms(cost, 100, 1000, head_dim=64) == pytest.approx(
        KernelCost(0.5, 0.01, 0.002).ms(100, 1000, 64))


def test_the_flagship_table_in_docs_is_current():
    """docs/scaling.md's flagship table is benchmarks/plan_validation.py --flagship's output."""
    import plan_validation

    docs = open(os.path.join(REPO, "docs", "scaling.md")).read()
    assert plan_validation.flagship_table() in docs, "rerun python benchmarks/plan_validation.py --flagship"


def test_flagship_table_puts_each_measured_run_in_its_precisions_row(tmp_path, monkeypatch):
    """benchmarks/flagship.py writes one file per model, length and machine, its bf16 and FP8 runs
    together (a run's own flags choose FP8 GEMMs): each lands in its own precision's row."""
    import plan_validation

    runs = [{"name": "mtraining", "megatron_argv": ["--mtraining", "--bf16"], "tokens_per_s": 50000.0},
            {"name": "te_cp", "megatron_argv": ["--bf16"], "tokens_per_s": 10000.0},
            {"name": "mtraining+--fp8-format hybrid", "megatron_argv": ["--mtraining", "--fp8-format", "hybrid"],
             "tokens_per_s": 60000.0}]
    with open(tmp_path / "flagship_qwen2.5_3b_256k_nvidia-h200_4gpu.json", "w") as fh:
        json.dump({"benchmark": "flagship", "model": "qwen2.5_3b", "seq_length": 262144, "world_size": 4,
                   "runs": runs}, fh)
    monkeypatch.setattr(plan_validation, "RESULTS", str(tmp_path))
    rows = {(r["model"], r["gpus"], r["fp8"]): r for r in plan_validation.flagship_rows()}
    assert sorted(rows[("qwen2.5_3b", 4, False)]["measured"]) == ["mtraining", "te_cp"]
    assert sorted(rows[("qwen2.5_3b", 4, True)]["measured"]) == ["mtraining+--fp8-format hybrid"]
    assert rows[("qwen2.5_3b", 8, False)]["measured"] == {}


def test_inner_ring_flag_counts_ranks_per_node_under_tp():
    """``--mtraining-inner-ring-size`` is the ranks of a node (global ranks; the integration takes the CP
    ranks among them, CP groups strided by TP). With TP 2 an inner ring of 4 CP ranks is a node of 8:
    the recommended flag must say 8, and a run's flag 8 is that ring, read back the same way."""
    from megatron_mtraining.plan.cli import run
    from megatron_mtraining.plan.search import configurations

    rows = configurations(QWEN, Workload(1048576, recompute="full"), Cluster(32, 8, inter_gbps=12.5), H200,
                          tp=2)["rows"]
    hier = {r["inner"]: r for r in rows if r["name"].startswith("mtraining_hier")}
    for inner, row in hier.items():
        flags = row["megatron_flags"]
        per_node = int(flags[flags.index("--mtraining-inner-ring-size") + 1])
        assert per_node == 2 * inner
        # The integration's own reading of it (megatron_mtraining.integration.core_attention.inner_ring_size).
        nodes = [r * 2 // per_node for r in range(row["cp"])]
        assert nodes.count(nodes[0]) == inner
    base = ["--seq-length", "1048576", "--context-parallel-size", "16", "--tensor-model-parallel-size", "2",
            "--mtraining", "--gpu-type", "h200", "--inter-gbps", "12.5"]
    assert run(base + ["--mtraining-inner-ring-size", "8"])["configured"]["name"] == "mtraining_hier_4"
    # Unset, the integration takes the launch's ranks per node: on 4 nodes, the same ring.
    assert run(base)["configured"]["name"] == "mtraining_hier_4"
    assert run(base + ["--mtraining-inner-ring-size", "32"])["configured"]["name"] == "mtraining_flat"


def test_dense_all_to_all_flags_are_ones_megatron_takes():
    """Megatron's validate_args refuses a2a+p2p without --hierarchical-context-parallel-sizes: on one
    node (the all-to-all over the whole CP group) the flags are TE's plain a2a, across nodes a2a+p2p
    with both sizes; a run's --cp-comm-type a2a is that configuration, not the p2p ring."""
    from megatron_mtraining.plan.cli import run
    from megatron_mtraining.plan.search import configurations

    one_node = {r["name"]: r for r in configurations(QWEN, Workload(262144, recompute="full"), Cluster(8, 8),
                                                        H200, tp=1)["rows"]}
    flags = one_node["dense_te_a2a_p2p"]["megatron_flags"]
    assert flags[flags.index("--cp-comm-type") + 1] == "a2a" and "--hierarchical-context-parallel-sizes" not in flags
    two_nodes = {r["name"]: r for r in configurations(QWEN, Workload(262144, recompute="full"), Cluster(16, 8),
                                                         H200, tp=1)["rows"]}
    flags = two_nodes["dense_te_a2a_p2p"]["megatron_flags"]
    i = flags.index("--hierarchical-context-parallel-sizes")
    assert flags[flags.index("--cp-comm-type") + 1] == "a2a+p2p" and int(flags[i + 1]) * int(flags[i + 2]) == 16
    base = ["--seq-length", "262144", "--context-parallel-size", "8", "--gpu-type", "h200"]
    assert run(base + ["--cp-comm-type", "a2a"])["configured"]["name"] == "dense_te_a2a_p2p"
    assert run(base)["configured"]["name"] == "dense_te_p2p"
    with pytest.raises(ValueError, match="allgather is not modelled"):
        run(base + ["--cp-comm-type", "allgather"])
