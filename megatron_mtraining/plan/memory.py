"""Peak memory per GPU of one training step, by component (``docs/scaling.md``, "Memory").

The model counts what Megatron keeps on a GPU during a step of a decoder with context (CP) and
tensor (TP) parallelism, bf16 training, micro-batch ``b``:

* model states: bf16 weights (2 bytes per parameter), fp32 main gradients (4), and Adam's fp32
  master weights and two moments (12), the last sharded over the data-parallel x CP ranks by the
  distributed optimizer (``--use-distributed-optimizer``) and kept whole without it. TP splits the
  projections, the MLP, the embedding and the output layer; norms are replicated. FP8 GEMMs add
  Transformer Engine's FP8 copy and transpose of every layer weight (2 bytes);
* activations, per token and layer (tokens = sequence / CP; sequence parallelism divides them
  by TP): the tensors a layer saves for its backward (the norms' inputs and outputs, q/k/v,
  the attention's output and log-sum-exp, the MLP's inputs, its gated pair and activation);
  under full recompute a layer keeps only its input (``2 * hidden`` bytes) and one layer's
  activations live again during its backward; Megatron's ``--recompute-method block
  --recompute-num-layers k`` recomputes ``k`` layers and keeps the others whole;
* the output layer and loss: bf16 logits and the cross entropy's fp32 softmax over the vocabulary
  shard (6 bytes per entry at the loss, the same in its backward), the largest single term at
  long sequences: 64K tokens x 152K vocabulary is 56 GiB;
* transient buffers: the attention's ring (fp32 partial outputs, K/V in flight, the fp32 dQ and
  dK/dV sums) and a layer's backward gradients; the peak is the larger of the loss and one
  layer's backward, over everything kept;
* pipeline parallelism (``Split.pp`` stages of ``layers / pp`` layers, Megatron's 1F1B schedule):
  each stage holds its own layers' states; the first stage the embedding and the activations of
  ``min(pp, micro-batches)`` micro-batches in flight, the last the output layer (a copy of the
  embedding when they are tied) and the loss, one micro-batch's activations; the peak is the larger
  of the two stages'.

``fits`` compares the peak with the device's memory less what the allocator and the CUDA
context take beside the tensors (``RESERVED_OVER_ALLOCATED``, ``CONTEXT_GIB``). Megatron's
own estimate (``megatron/training/theoretical_memory_usage.py``) counts the same model states;
it knows neither CP nor full recompute (tests/test_plan_memory.py compares the two).
"""

from __future__ import annotations

import dataclasses
from typing import Dict

from .model import ModelShape, Workload
from .profiles import Profile

GiB = 2 ** 30
BF16, FP32 = 2, 4
# PyTorch's reserved memory over its peak allocation: 1.05 on one GPU, 1.13-1.16 over 2-4 GPUs in the
# end-to-end runs' logs (benchmarks/results/logs); a middle value, for the fit only.
RESERVED_OVER_ALLOCATED = 1.10
# The CUDA context, cuBLAS and NCCL workspaces: outside PyTorch's allocator.
CONTEXT_GIB = 2.0
LOGITS_BYTES = 6  # bf16 logits + the loss's fp32 softmax, per vocabulary entry


@dataclasses.dataclass(frozen=True)
class Split:
    """How the GPUs divide the work: tensor x context x data x pipeline parallel.

    ``sequence_parallel`` (Megatron's ``--sequence-parallel``, with TP > 1): the tensors of the residual
    stream (a layer's input, the norms' inputs and outputs) are split over the TP ranks too; without it
    every TP rank holds them whole."""

    tp: int = 1
    cp: int = 1
    dp: int = 1
    sequence_parallel: bool = True
    pp: int = 1

    def __post_init__(self):
        for name in ("tp", "cp", "dp", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"split: {name} must be a positive integer, got {value!r}")

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.dp * self.pp


def tp_problem(shape: ModelShape, tp: int) -> str:
    """Why Megatron refuses this TP size for the shape ('' when it takes it)."""
    if shape.heads % tp:
        return f"{shape.heads} attention heads do not split over TP {tp}"
    if shape.kv_groups % tp:
        return f"{shape.kv_groups} query groups do not split over TP {tp}"
    if shape.ffn % tp:
        return f"FFN {shape.ffn} does not split over TP {tp}"
    return ""


def layer_parameters(shape: ModelShape) -> Dict[str, float]:
    """One layer's parameters: the TP-split GEMM weights and the replicated norms."""
    h, d = shape.hidden, shape.head_dim
    gemm = h * (shape.heads + 2 * shape.kv_groups) * d + shape.heads * d * h + 3 * h * shape.ffn
    qkv_bias = (shape.heads + 2 * shape.kv_groups) * d if shape.qkv_bias else 0
    return {"split": gemm + qkv_bias, "replicated": 2 * h}


def parameters_per_gpu(shape: ModelShape, tp: int) -> Dict[str, float]:
    layer = layer_parameters(shape)
    embeddings = (2 if shape.untied_embeddings else 1) * shape.vocab * shape.hidden
    split = shape.layers * layer["split"] + embeddings
    replicated = shape.layers * layer["replicated"] + shape.hidden  # + the final norm
    return {"layer_gemm": shape.layers * (layer["split"]) / tp, "total": split / tp + replicated}


def activation_bytes_per_token_layer(shape: ModelShape, layers: str = "local", fp8: bool = False,
                                     method: str = "mtraining") -> float:
    """Bytes a layer saves for its backward, per token, before any split.

    The norms' inputs (2 x hidden, bf16), their outputs (the QKV and FC1 GEMM inputs; FP8 copies
    under TE's FP8), q/k/v after RoPE (and before it on local layers, whose RoPE is not fused),
    the attention output and its fp32 log-sum-exp, the MLP's gated pair (2 x FFN) and its
    activation (the FC2 input). MTraining's attention keeps its output in [b, h, s, d] for its
    backward and hands the projection a [s, b, h*d] copy: two tensors; Transformer Engine's
    attention and the projection share one (under FP8 the projection keeps its FP8 copy too)."""
    h, d, H, G, f = shape.hidden, shape.head_dim, shape.heads, shape.kv_groups, shape.ffn
    gemm_input = 1 if fp8 else BF16
    norms = BF16 * 2 * h + gemm_input * 2 * h
    qkv = BF16 * (H + 2 * G) * d + (BF16 * (H + G) * d if layers == "local" else 0)
    projection_input = gemm_input if method == "mtraining" else (1 if fp8 else 0)
    attention_out = BF16 * H * d + projection_input * H * d + FP32 * H
    mlp = BF16 * 2 * f + gemm_input * f
    return norms + qkv + attention_out + mlp


def residual_stream_bytes_per_token_layer(shape: ModelShape, fp8: bool = False) -> float:
    """The part of ``activation_bytes_per_token_layer`` that is hidden-sized (the norms' inputs and
    outputs): split over TP ranks only with sequence parallelism; the rest is split by heads and FFN."""
    return BF16 * 2 * shape.hidden + (1 if fp8 else BF16) * 2 * shape.hidden


def ring_buffer_bytes_per_token(shape: ModelShape, method: str) -> float:
    """The attention's transient buffers per local token, at their larger direction (the backward):
    MTraining's fp32 dQ, the fp32 dK/dV sums (its own and the one in flight), the K/V in flight;
    Transformer Engine's p2p ring: the K/V and dK/dV in flight and its per-step partials."""
    d, H, G = shape.head_dim, shape.heads, shape.kv_groups
    if method == "mtraining":
        return FP32 * H * d + 2 * FP32 * 2 * G * d + 2 * BF16 * 2 * G * d
    return 2 * BF16 * H * d + 2 * BF16 * 2 * G * d + 2 * FP32 * 2 * G * d


def stage_layers(shape: ModelShape, pp: int) -> int:
    """Layers per pipeline stage (Megatron's even split: the layers must divide by the stages)."""
    if shape.layers % pp:
        raise ValueError(f"{shape.layers} layers do not split into {pp} pipeline stages")
    return shape.layers // pp


def memory_estimate(shape: ModelShape, work: Workload, split: Split, profile: Profile, method: str = "mtraining",
                    recompute_layers: int = 0, distributed_optimizer: bool = True, micro_batches: int = 1) -> Dict:
    """Peak GiB per GPU by component for ``recompute_layers`` of a stage's layers recomputed (all
    ``shape.layers`` without pipeline parallelism); ``micro_batches``: per step and pipeline (the
    first of ``split.pp > 1`` stages holds ``min(pp, micro_batches)`` of them in flight)."""
    if method not in ("mtraining", "dense"):
        raise ValueError(f"memory: method must be 'mtraining' or 'dense', got {method!r}")
    pp = split.pp
    L = stage_layers(shape, pp)
    if not isinstance(recompute_layers, int) or not 0 <= recompute_layers <= L:
        raise ValueError(f"memory: recompute_layers must be an integer in [0, {L}], got {recompute_layers!r}")
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"memory: micro_batches must be a positive integer, got {micro_batches!r}")
    problem = tp_problem(shape, split.tp)
    if problem:
        raise ValueError(problem)
    tp, k = split.tp, recompute_layers
    sp = tp if split.sequence_parallel else 1  # what divides the residual stream's tensors
    tokens = work.seq_len // split.cp * work.micro_batch
    optimizer_shards = split.dp * split.cp if distributed_optimizer else 1
    residual = residual_stream_bytes_per_token_layer(shape, work.fp8)
    per_layer = tokens * ((activation_bytes_per_token_layer(shape, work.layers, work.fp8, method) - residual) / tp
                          + residual / sp)
    layer_input = tokens * shape.hidden * BF16 / sp
    # A layer's backward: the gradients of its largest intermediates (the MLP's gated pair and activation).
    backward_workspace = tokens * BF16 * 3 * shape.ffn / tp
    ring = tokens * ring_buffer_bytes_per_token(shape, method) / tp
    one_layer_backward = (per_layer if k else 0.0) + backward_workspace + ring
    # The output layer: the final norm's input and output, then the logits and the loss.
    # (Hidden-sized and whole even with sequence parallelism: the output layer gathers its input.)
    loss = tokens * (2 * BF16 * shape.hidden + LOGITS_BYTES * shape.vocab / tp)
    layer = layer_parameters(shape)
    table = shape.vocab * shape.hidden / tp
    # (stage, embedding and output-layer tables held, final norm, micro-batches in flight, with the loss)
    if pp == 1:
        stages = [("whole model", 2 if shape.untied_embeddings else 1, True, 1, True)]
    else:  # the last stage keeps its own copy of a tied embedding for the output layer
        stages = [("first stage", 1, False, min(pp, micro_batches), False), ("last stage", 1, True, 1, True)]
    usable = profile.memory_gib - CONTEXT_GIB
    best = None
    for name, tables, final_norm, in_flight, with_loss in stages:
        params = L * layer["split"] / tp + tables * table + L * layer["replicated"] + (shape.hidden if final_norm
                                                                                     else 0)
        parts = {
            "weights": params * BF16,
            "gradients": params * FP32,
            "optimizer": params * 12 / optimizer_shards,
            "fp8_weights": L * layer["split"] / tp * 2 if work.fp8 else 0.0,
            "recomputed_layer_inputs": in_flight * k * layer_input,
            "stored_activations": in_flight * (L - k) * per_layer,
            "peak_transient": max(loss, one_layer_backward) if with_loss else one_layer_backward,
        }
        peak = sum(parts.values())
        if best is None or peak > best[0]:
            best = (peak, name, parts, params, with_loss and loss >= one_layer_backward)
    peak, name, parts, params, loss_peaks = best
    out = {
        "components_gib": {part: value / GiB for part, value in parts.items()},
        "transient": "output layer and loss" if loss_peaks else "one layer's backward",
        "loss_gib": loss / GiB, "one_layer_backward_gib": one_layer_backward / GiB,
        "params_per_gpu": params, "tokens_per_gpu": tokens, "recompute_layers": k,
        "peak_gib": peak / GiB, "reserved_gib": peak / GiB * RESERVED_OVER_ALLOCATED + CONTEXT_GIB,
        "capacity_gib": profile.memory_gib, "fits": peak / GiB * RESERVED_OVER_ALLOCATED <= usable,
    }
    if pp > 1:
        out["stage"] = name
    return out


def fewest_recomputed_layers(shape: ModelShape, work: Workload, split: Split, profile: Profile,
                             method: str = "mtraining", distributed_optimizer: bool = True, micro_batches: int = 1):
    """The fewest layers (of a pipeline stage's) to recompute for the step to fit (recompute only adds
    time), with its memory; (None, the full-recompute memory) when even full recompute does not fit."""
    for k in range(stage_layers(shape, split.pp) + 1):
        memory = memory_estimate(shape, work, split, profile, method, k, distributed_optimizer, micro_batches)
        if memory["fits"]:
            return k, memory
    return None, memory
