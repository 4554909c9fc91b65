"""The planner's memory model (megatron_mtraining/plan/memory.py): against Megatron's own estimate
(``megatron/training/theoretical_memory_usage.py`` of the real Megatron-LM tree) where both model
the same thing, against the peaks the end-to-end runs' logs measured, and its invariants; and the
planner recommending only configurations that fit."""

import argparse
import glob
import os
import sys
import tarfile

import pytest

from megatron_lm_tree import require_tarball

from megatron_mtraining.plan import Cluster, ModelShape, Split, Workload, load_profile, memory_estimate, plan
from megatron_mtraining.plan.memory import GiB, activation_bytes_per_token_layer, fewest_recomputed_layers
from megatron_mtraining.plan.cli import main as cli_main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
H100, H200 = load_profile("nvidia-h100"), load_profile("nvidia-h200")
QWEN = ModelShape()
LLAMA_8B = ModelShape(hidden=4096, heads=32, kv_groups=8, head_dim=128, layers=32, ffn=14336, vocab=128256,
                      qkv_bias=False)


# ----------------------------------------------------------------------------------------------
# Megatron's own estimate
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def megatron_estimate():
    """Megatron's theoretical_memory_usage module, read from the real tree (its one relative import,
    of print helpers, replaced: the functions compared here do not use them)."""
    tarball = require_tarball("the memory model against megatron/training/theoretical_memory_usage.py")
    with tarfile.open(tarball) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("megatron/training/theoretical_memory_usage.py"))
        source = tar.extractfile(member).read().decode()
    assert "from .utils import is_hybrid_model, print_rank_0" in source
    source = source.replace("from .utils import is_hybrid_model, print_rank_0",
                            "is_hybrid_model = print_rank_0 = None")
    namespace = {"__name__": "theoretical_memory_usage"}
    exec(compile(source, member.name, "exec"), namespace)
    return namespace


def _megatron_args(shape: ModelShape, seq_len: int, tp: int = 1, dp: int = 1, distributed: bool = True):
    return argparse.Namespace(
        kv_channels=shape.head_dim, num_attention_heads=shape.heads, hidden_size=shape.hidden,
        group_query_attention=True, num_query_groups=shape.kv_groups, num_experts=None, swiglu=True,
        moe_shared_expert_intermediate_size=None, mtp_num_layers=None, num_layers=shape.layers,
        normalization="RMSNorm", multi_latent_attention=False, padded_vocab_size=shape.vocab,
        untie_embeddings_and_output_weights=shape.untied_embeddings, ffn_hidden_size=shape.ffn,
        moe_latent_size=None, moe_router_topk=None, add_bias_linear=False, moe_shared_expert_gate=False,
        expert_tensor_parallel_size=tp, expert_model_parallel_size=1, pipeline_model_parallel_size=1,
        world_size=tp * dp, tensor_model_parallel_size=tp, use_distributed_optimizer=distributed,
        data_parallel_size=dp, seq_length=seq_len, micro_batch_size=1, virtual_pipeline_model_parallel_size=None)


@pytest.mark.parametrize("shape", [ModelShape(qkv_bias=False), LLAMA_8B],
                         ids=["qwen2.5_3b", "llama3.1_8b"])
@pytest.mark.parametrize("tp,dp,cp,distributed", [(1, 1, 1, True), (2, 1, 1, True), (1, 4, 1, True),
                                                   (1, 1, 8, True), (2, 2, 4, True), (1, 1, 1, False)])
def test_model_states_equal_megatrons(megatron_estimate, shape, tp, dp, cp, distributed):
    """Weights, gradients and Adam's states: the same bytes as Megatron's estimate, whose data-parallel
    size is ours times CP (the distributed optimizer shards over both; Megatron's estimate has no CP).
    Megatron's estimate leaves out QKV biases, so the shapes here have none."""
    ours = memory_estimate(shape, Workload(65536), Split(tp=tp, cp=cp, dp=dp), H200, "mtraining", shape.layers,
                           distributed_optimizer=distributed)["components_gib"]
    states = (ours["weights"] + ours["gradients"] + ours["optimizer"]) * GiB
    theirs = megatron_estimate["compute_weight_and_optimizer_memory"](
        _megatron_args(shape, 65536, tp=tp, dp=dp * cp, distributed=distributed))
    assert states == pytest.approx(theirs, rel=1e-9)


def test_qkv_bias_adds_its_parameters():
    with_bias = memory_estimate(QWEN, Workload(65536), Split(), H200)["params_per_gpu"]
    without = memory_estimate(ModelShape(qkv_bias=False), Workload(65536), Split(), H200)["params_per_gpu"]
    assert with_bias - without == QWEN.layers * (QWEN.heads + 2 * QWEN.kv_groups) * QWEN.head_dim


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_layer_activations_against_megatrons_count_tensor_by_tensor(megatron_estimate, tp):
    """Megatron's per-layer activations (Korthikanti et al., Table 2, with sequence parallelism and
    flash-style attention) are 18 h + 4 f bytes per token for multi-head attention and a plain
    two-GEMM MLP, divided by TP: the norms' inputs and outputs (8 h), Q, K, V (6 h), the projection's
    input (2 h), the MLP's two activations (4 f) and two dropout masks (2 h). For such a layer (query
    groups = heads) ours on TE's layers in bf16 hold the same tensors, without the dropout masks (the
    launchers train with dropout 0), with SwiGLU's gated half (2 f) and the attention's fp32
    log-sum-exp (4 per head); MTraining's attention keeps its output twice (2 h more)."""
    mha = ModelShape(hidden=4096, heads=32, kv_groups=32, head_dim=128, layers=1, ffn=16384, vocab=32000)
    seq = 32768
    args = _megatron_args(mha, seq, tp=tp)
    theirs_total = megatron_estimate["compute_activation_memory"](args, num_microbatches=1)
    # Their total adds the embedding input and dropout and the output layer's input and logits.
    theirs_outside = 8 * seq + seq * mha.hidden + seq * mha.hidden * 4 * (1 + mha.vocab / mha.hidden)
    theirs_layer = theirs_total - theirs_outside / tp
    masks, gated_half, lse = 2 * mha.hidden, 2 * mha.ffn, 4 * mha.heads
    for method, second_output in (("dense", 0), ("mtraining", 2 * mha.hidden)):
        ours = activation_bytes_per_token_layer(mha, "transformer_engine", False, method) * seq / tp
        assert ours == pytest.approx(theirs_layer + (gated_half + lse + second_output - masks) * seq / tp,
                                     rel=1e-12), method


def test_output_layer_counts_the_bf16_logits_beside_the_fp32_loss():
    """Megatron's estimate counts 4 bytes per logit (the loss's fp32 softmax); at the loss the bf16
    logits the output layer produced are alive too: 6 bytes, the transient that dominates at long
    sequences (64K tokens x 152K vocabulary: 56 GiB)."""
    m = memory_estimate(QWEN, Workload(65536), Split(), H200, recompute_layers=QWEN.layers)
    assert m["transient"] == "output layer and loss"
    assert m["loss_gib"] == pytest.approx(65536 * (4 * QWEN.hidden + 6 * QWEN.vocab) / GiB)
    assert 55 < m["loss_gib"] < 57
    halved = memory_estimate(QWEN, Workload(65536), Split(tp=2), H200, recompute_layers=QWEN.layers)
    assert halved["loss_gib"] == pytest.approx(65536 * (4 * QWEN.hidden + 3 * QWEN.vocab) / GiB)


# ----------------------------------------------------------------------------------------------
# Measured peaks
# ----------------------------------------------------------------------------------------------


def _logged_runs():
    from flagship import parse_log

    runs = []
    for path in sorted(glob.glob(os.path.join(REPO, "benchmarks", "results", "logs", "e2e_mtraining_*.log"))):
        text = open(path).read()
        argv = text.split("\n", 1)[0].split()
        parsed = parse_log(text)
        if parsed["peak_allocated_gib"] is None:
            continue
        runs.append((os.path.basename(path), argv, parsed["peak_allocated_gib"]))
    return runs


def test_memory_model_within_7_percent_of_every_logged_peak():
    """The 4-layer end-to-end runs (local layers, no recompute, no distributed optimizer, 128K tokens
    per GPU on 1, 2 and 4 GPUs) logged Megatron's peak allocation: 60.7-62.7 GiB. The model is within
    7% of each (measured: +3% to +6.5%, over)."""
    from flagship import _flag, shape_of

    runs = _logged_runs()
    assert len(runs) >= 5
    for name, argv, measured in runs:
        shape = shape_of(argv)
        cp = int(_flag(argv, "--context-parallel-size"))
        work = Workload(int(_flag(argv, "--seq-length")), layers="local")
        predicted = memory_estimate(shape, work, Split(cp=cp), H200, "mtraining", 0,
                                    distributed_optimizer="--use-distributed-optimizer" in argv)["peak_gib"]
        assert abs(predicted / measured - 1) <= 0.07, (name, predicted, measured)


# ----------------------------------------------------------------------------------------------
# Invariants and the recommendation
# ----------------------------------------------------------------------------------------------


def test_memory_falls_with_each_recomputed_layer_gpu_and_tp_rank():
    work = Workload(524288, layers="transformer_engine")
    peaks = [memory_estimate(QWEN, work, Split(cp=8), H200, recompute_layers=k)["peak_gib"]
             for k in range(QWEN.layers + 1)]
    assert all(a > b for a, b in zip(peaks, peaks[1:]))
    full = peaks[-1]
    assert memory_estimate(QWEN, work, Split(cp=16), H200, recompute_layers=36)["peak_gib"] < full
    assert memory_estimate(QWEN, work, Split(tp=2, cp=4), H200, recompute_layers=36)["peak_gib"] < \
        memory_estimate(QWEN, work, Split(cp=4), H200, recompute_layers=36)["peak_gib"]
    fp8 = memory_estimate(QWEN, Workload(524288, layers="transformer_engine", fp8=True), Split(cp=8), H200,
                          recompute_layers=0)
    assert fp8["components_gib"]["fp8_weights"] > 0
    assert fp8["components_gib"]["stored_activations"] < \
        memory_estimate(QWEN, work, Split(cp=8), H200, recompute_layers=0)["components_gib"]["stored_activations"]


def test_fewest_recomputed_layers_is_the_first_that_fits():
    work = Workload(524288, layers="transformer_engine")
    k, m = fewest_recomputed_layers(QWEN, work, Split(cp=8), H200)
    assert 0 < k < QWEN.layers and m["fits"]
    assert not memory_estimate(QWEN, work, Split(cp=8), H200, recompute_layers=k - 1)["fits"]
    none, m = fewest_recomputed_layers(QWEN, Workload(524288), Split(cp=2), H200)
    assert none is None and not m["fits"] and m["recompute_layers"] == QWEN.layers


@pytest.mark.parametrize("bad,message", [({"tp": 3}, "do not split over TP 3"), ({"tp": 0}, "tp must be")])
def test_bad_splits_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        memory_estimate(QWEN, Workload(65536), Split(**bad), H200)


def test_recommendation_fits_and_says_what_would_when_nothing_does(capsys):
    """The cases a user met: 384K over 3 H200s and Llama-3.1-8B at 512K over 8 were recommended while
    not fitting. Now a recommendation always fits; when nothing does, the plan says what would."""
    rows = plan(QWEN, Workload(393216, layers="transformer_engine"), Cluster(3, 8), H200)
    assert rows["recommendation"] is None and not any(p["fits"] for p in rows["predictions"])
    advice = rows["advice"]
    assert advice["gpus"] == 6 and advice["seq_len"] < 393216
    shorter = plan(QWEN, Workload(advice["seq_len"], layers="transformer_engine"), Cluster(3, 8), H200)
    assert shorter["recommendation"] is not None
    llama = plan(LLAMA_8B, Workload(524288, layers="transformer_engine"), Cluster(8, 8), H200)
    rec = llama["recommendation"]
    best = next(p for p in llama["predictions"] if p["megatron_flags"] == rec["megatron_flags"])
    assert best["fits"] and best["memory"]["fits"]
    for p in llama["predictions"]:
        if p["method"] == "mtraining" and p["fits"]:
            assert p["step_ms"] >= best["step_ms"]
    assert cli_main(["--gpus", "3", "--seq-length", "393216", "--gpu-type", "h200",
                     "--transformer-impl", "transformer_engine"]) == 0
    text = capsys.readouterr().out
    assert "recommended" not in text and "nothing fits in 140 GiB per GPU" in text and "6 GPUs at this length" in text


def test_startup_line_predicts_the_run_as_configured(capsys):
    argv = ["--num-layers", "36", "--hidden-size", "2048", "--ffn-hidden-size", "11008", "--num-attention-heads",
            "16", "--num-query-groups", "2", "--kv-channels", "128", "--add-qkv-bias",
            "--untie-embeddings-and-output-weights", "--vocab-size", "151936", "--seq-length", "524288",
            "--context-parallel-size", "8", "--tensor-model-parallel-size", "1", "--transformer-impl",
            "transformer_engine", "--recompute-granularity", "full", "--recompute-method", "uniform",
            "--recompute-num-layers", "1", "--use-distributed-optimizer", "--mtraining", "--mtraining-top-p", "0.9",
            "--fp8", "--gpu-type", "h200", "--startup"]
    assert cli_main(argv) == 0
    line = capsys.readouterr().out.strip()
    assert "\n" not in line and line.startswith("[mtraining plan] nvidia-h200 x 8, 524288 tokens: this run "
                                               "(mtraining_flat, TP 1 x CP 8, recompute full) predicted")
    assert "(fits)" in line and "fastest that fits: mtraining_flat" in line and "--recompute-method block" in line
    # Megatron's --fp8 is its own flag, not an abbreviation of the planner's --fp8-format.
    assert cli_main(argv[:-1] + ["--json"]) == 0
    import json
    result = json.loads(capsys.readouterr().out)
    assert result["workload"]["fp8"] is False and "--fp8" in result["ignored_args"]
    assert "--mtraining-top-p" not in result["ignored_args"]


def test_a_runs_tp_without_sequence_parallelism_keeps_the_residual_stream_whole():
    """The launchers' TP=N adds no --sequence-parallel (local layers cannot take it): each TP rank then
    holds every layer's input and its norms' tensors whole. The run as configured is predicted so; the
    search still plans TP with sequence parallelism (its flags say so)."""
    from megatron_mtraining.plan.cli import run

    argv = ["--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336", "--num-attention-heads", "32",
            "--num-query-groups", "8", "--kv-channels", "128", "--untie-embeddings-and-output-weights",
            "--vocab-size", "128256", "--seq-length", "524288", "--context-parallel-size", "4",
            "--tensor-model-parallel-size", "2", "--transformer-impl", "transformer_engine",
            "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
            "--use-distributed-optimizer", "--mtraining", "--gpu-type", "nvidia-h200"]
    without, with_sp = run(argv)["configured"], run(argv + ["--sequence-parallel"])["configured"]
    tokens = 524288 // 4
    inputs = without["memory"]["components_gib"]["recomputed_layer_inputs"]
    assert inputs == pytest.approx(32 * tokens * 4096 * 2 / GiB)  # whole on each of the 2 TP ranks
    assert with_sp["memory"]["components_gib"]["recomputed_layer_inputs"] == pytest.approx(inputs / 2)
    assert without["memory"]["peak_gib"] - with_sp["memory"]["peak_gib"] == pytest.approx(16.0, rel=0.05)
    assert "--sequence-parallel" not in without["megatron_flags"] and "--sequence-parallel" in with_sp["megatron_flags"]
    rec = run(argv)["recommendation"]
    assert rec["tp"] == 1 or "--sequence-parallel" in rec["megatron_flags"]
    # Per layer: the hidden-sized tensors whole, the head- and FFN-split ones halved.
    work = Workload(524288, layers="transformer_engine")
    none_sp = memory_estimate(LLAMA_8B, work, Split(tp=2, cp=4, sequence_parallel=False), H200, recompute_layers=0)
    sp = memory_estimate(LLAMA_8B, work, Split(tp=2, cp=4), H200, recompute_layers=0)
    residual = (2 * 2 * 4096 + 2 * 2 * 4096) * tokens * 32 / 2
    assert (none_sp["components_gib"]["stored_activations"] - sp["components_gib"]["stored_activations"]) * GiB == \
        pytest.approx(residual)


def test_when_a_held_tp_or_recompute_is_what_does_not_fit_the_advice_says_so(capsys):
    """Held to TP 1 and no recompute, Qwen2.5-3B at 512K over 8 H200s does not fit; planned freely it
    does. The advice must not claim that nothing fits "even with full recompute and every TP size" and
    then offer this very length."""
    argv = ["--gpus", "8", "--seq-length", "524288", "--gpu-type", "h200", "--transformer-impl",
            "transformer_engine", "--recompute-granularity", "selective", "--tp", "1"]
    assert cli_main(argv) == 0
    text = capsys.readouterr().out
    assert "recommended" not in text and "even with full recompute" not in text
    assert "with the TP or PP size or recompute given" in text and "this run fits" in text
    assert plan(QWEN, Workload(524288, layers="transformer_engine"), Cluster(8, 8), H200)["recommendation"]


def test_a_runs_flags_without_the_distributed_optimizer_are_megatrons_default():
    """Megatron shards Adam's states only with --use-distributed-optimizer. A run's own flags without it
    are predicted unsharded (Llama-3.1-8B at TP 1: 12 bytes per parameter, 90 GiB, on every GPU), and the
    recommendation, whose fit counts on the sharding, carries the flag."""
    from megatron_mtraining.plan.cli import run

    argv = ["--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336", "--num-attention-heads", "32",
            "--num-query-groups", "8", "--kv-channels", "128", "--untie-embeddings-and-output-weights",
            "--vocab-size", "128256", "--seq-length", "524288", "--context-parallel-size", "8",
            "--transformer-impl", "transformer_engine", "--recompute-granularity", "full", "--recompute-method",
            "uniform", "--recompute-num-layers", "1", "--mtraining", "--gpu-type", "nvidia-h200"]
    plain, sharded = run(argv), run(argv + ["--use-distributed-optimizer"])
    params = plain["configured"]["memory"]["params_per_gpu"]
    assert plain["configured"]["memory"]["components_gib"]["optimizer"] == pytest.approx(params * 12 / GiB)
    assert sharded["configured"]["memory"]["components_gib"]["optimizer"] == pytest.approx(params * 12 / 8 / GiB)
    assert not plain["configured"]["fits"] and sharded["configured"]["fits"]
    for result in (plain, sharded):
        assert "--use-distributed-optimizer" in result["recommendation"]["megatron_flags"]
    assert "--use-distributed-optimizer" not in run(argv + ["--no-distributed-optimizer"])["predictions"][0][
        "megatron_flags"]
