"""Pipeline parallelism: megatron-core GPTModel over PP = 2 x CP = 2 (4 gloo processes, CPU), driven by
megatron-core's own 1F1B and interleaved schedules, equals the same model on one process.

1F1B: every rank runs ``get_forward_backward_func()`` (``forward_backward_pipelining_without_interleaving``)
on its stage of a 4-layer GPT (stage 0: embedding, global layers 1-2; stage 1: global layers 3-4,
final layernorm, output layer), ``MICRO`` micro-batches, ``forward_only=False``: activations and
their gradients travel between the stages through Megatron's P2P communicator, every stage's
batch goes through the real CP batch split (``get_batch_on_this_cp_rank``, patched by
``patches.install``) and the attention runs MTraining's ring over each stage's own CP group (global
ranks {0, 1} and {2, 3}). The reference runs the same weights on one process (PP = 1, CP = 1), one
plain forward/backward per micro-batch.

* dense index: loss and every parameter's gradient equal megatron-core's own attention (the local
  spec's ``DotProductAttention``), fp32, 1e-5;
* sparse ``vs`` index: equal to the plugin at PP = 1, CP = 1 with the same config;
* ``dense_layers=1`` (``--mtraining-dense-layers 1``), sparse elsewhere: the layers of stage 1 know
  they are GLOBAL layers 3 and 4 (megatron-core numbers them with the stage's offset), so only
  global layer 1 runs the dense index; equal to PP = 1 with the same settings.

The loss is Megatron-LM's per-token loss (``calculate_per_token_loss``: the summed masked loss of
every micro-batch and CP rank, over their total token count). The pipeline settings are those
Megatron-LM's training sets (``pipeline_dtype``, batched P2P, ``deallocate_pipeline_outputs``); with
3 micro-batches the first stage runs every phase of 1F1B (warm-up, steady state, cool-down).

Interleaved (virtual pipeline parallelism, Megatron-LM's ``--num-layers-per-virtual-pipeline-stage 1``):
``virtual_pipeline_model_parallel_size=2``, so each pipeline rank holds two model chunks (GPTModels built
with ``vp_stage=0, 1``) of one layer each: rank 0 global layers 1 (with the embedding) and 3, rank 1
global layers 2 and 4 (with the final layernorm and output layer), as ``get_transformer_layer_offset``
numbers them; ``get_forward_backward_func()`` is ``forward_backward_pipelining_with_interleaving``, on
``VP_MICRO`` = 4 micro-batches (its micro-batch groups are PP = 2 long, and a last group shorter than PP
is refused). The activations go round the ring rank 0 -> 1 -> 0 -> 1; the chunks alternate between
micro-batches (chunk 0 runs micro-batches 0 and 1, then chunk 1 runs 0 and 1, ...), which every rank's
order of forward steps is checked against. P2P as Megatron-LM sets it for this schedule at PP = 2:
overlapped, not batched (``--overlap-p2p-communication``, its default; it refuses the interleaved
schedule with batched P2P below PP = 3); on gloo its sends need the tensors they send kept alive
(``_TorchWithGlooSafeIsend``). The same three cases, the same checks.

What megatron-core's schedules need on a CPU is shimmed here, in the test, with the reason beside it.
"""

import functools
import re

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core")

from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from megatron_mtraining import MTrainingConfig  # noqa: E402
from megatron_mtraining.integration import core_attention as mt_attention  # noqa: E402
from megatron_mtraining.integration import packing, patches  # noqa: E402
from megatron_mtraining.testing.cpu_shims import apply_cpu_shims  # noqa: E402
from megatron_mtraining.integration.spec import get_gpt_layer_spec  # noqa: E402
from megatron_batch import cp_split  # noqa: E402
from oracle import rel_err  # noqa: E402

SEQ, VOCAB, BLOCK = 512, 128, 64
LAYERS, PP, CP, MICRO = 4, 2, 2, 3
VP, VP_MICRO = 2, 4  # interleaved schedule: model chunks per pipeline rank, micro-batches
TOL = 1e-5
SETTINGS = [("dense", 0), ("vs", 0), ("vs", 1)]  # (index, dense_layers) of the cases


pytestmark = pytest.mark.usefixtures("clean_mtraining_state")


# ---------------------------------------------------------------------------- model, data, reference


def transformer_config(**overrides) -> TransformerConfig:
    kwargs = dict(num_layers=LAYERS, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                  use_cpu_initialization=True, gradient_accumulation_fusion=False, bias_dropout_fusion=False,
                  masked_softmax_fusion=False, apply_rope_fusion=False, attention_dropout=0.0, hidden_dropout=0.0,
                  calculate_per_token_loss=True)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_gpt(layer_spec, seed=1234, pre_process=True, post_process=True, vp_stage=None, **config) -> GPTModel:
    torch.manual_seed(seed)
    return GPTModel(config=transformer_config(**config), transformer_layer_spec=layer_spec, vocab_size=VOCAB,
                    max_sequence_length=SEQ, position_embedding_type="rope", pre_process=pre_process,
                    post_process=post_process, share_embeddings_and_output_weights=False, vp_stage=vp_stage)


def mt_config(index="dense"):
    return MTrainingConfig(index=index, layout="striped", block_size=BLOCK, top_p=0.5, max_slash=2, max_vertical=32,
                           min_vertical=0, last_q=64)


def micro_batches(seed=0, count=MICRO):
    """``count`` random micro-batches ``[1, SEQ]``; about a tenth of the tokens masked out of the loss."""
    g = torch.Generator().manual_seed(seed)
    return [dict(tokens=torch.randint(0, VOCAB, (1, SEQ), generator=g),
                 labels=torch.randint(0, VOCAB, (1, SEQ), generator=g),
                 loss_mask=(torch.rand(1, SEQ, generator=g) > 0.1).float(),
                 position_ids=torch.arange(SEQ)[None]) for _ in range(count)]


def run_reference(model, batches):
    """One process, plain forward/backward per micro-batch: the per-token loss over all micro-batches
    and its gradients."""
    model.zero_grad(set_to_none=True)
    total = sum(b["loss_mask"].sum() for b in batches)
    loss = 0.0
    for b in batches:
        losses = model(b["tokens"], b["position_ids"], None, labels=b["labels"])  # [1, SEQ] per token
        summed = (losses.float() * b["loss_mask"]).sum()
        (summed / total).backward()
        loss += summed.detach()
    return loss / total, {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def state_of(model):
    return {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in model.state_dict().items()}


def global_name(name: str, layer_offset: int) -> str:
    """A stage's (model chunk's) parameter / state name under the PP = 1 model's numbering: megatron-core
    numbers the ``decoder.layers`` of each stage from 0 (stage 1's ``decoder.layers.0`` is global layer 3
    here)."""
    return re.sub(r"^decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m.group(1)) + layer_offset}.", name)


# ---------------------------------------------------------------------------- PP x CP workers (gloo)


class _TorchOnCpu:
    """``torch`` as megatron-core's schedules see it, under the test only: the pipeline schedules count the
    micro-batches' tokens in ``torch.zeros([], dtype=torch.int, device="cuda")``, which a CPU-only torch
    cannot build (the count is only read by ``finalize_model_grads_func``); that one tensor is built on
    the CPU. Everything else is torch itself."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device="cpu" if str(device).startswith("cuda") else device, **kwargs)


class _TorchWithGlooSafeIsend:
    """``torch`` as megatron-core's P2P communicator sees it, under the interleaved schedule's overlapped
    (not batched) P2P only. A gloo ``isend`` reads the tensor's memory from gloo's own thread after it
    has returned, and ``deallocate_pipeline_outputs`` frees a sent activation's memory (it swaps the
    output's ``.data`` for a 1-element tensor) right after the send is posted, before the schedule waits
    for it: on GPUs, NCCL's stream order and the caching allocator make that safe; on gloo it is a
    use-after-free (without this shim the interleaved run's gradients come out slightly or wholly wrong,
    or NaN, differently from run to run). So each tensor is sent as a detached alias of its memory (the
    same bytes), kept alive here until the schedule has finished. The 1F1B run needs none of this: its
    batched P2P waits for every send before the output is freed. Everything else is torch itself."""

    def __init__(self):
        self.sent = []
        self.distributed = _DistributedWithGloo(self.sent)

    def __getattr__(self, name):
        return getattr(torch, name)


class _DistributedWithGloo:
    """``torch.distributed`` for ``_TorchWithGlooSafeIsend``: ``isend`` sends a kept alias."""

    def __init__(self, sent):
        self.sent = sent

    def __getattr__(self, name):
        return getattr(dist, name)

    def isend(self, tensor, *args, **kwargs):
        alias = tensor.detach()
        self.sent.append(alias)
        return dist.isend(alias, *args, **kwargs)


def _finalize_grads(model_chunks, num_tokens, pg_collection=None, force_all_reduce=False):
    """What megatron-core's ``finalize_model_grads`` does for this run, without its DDP wrapper (whose
    grad buffers the test does not build): the token count of the last stage goes to every stage of
    the pipeline and is summed over the CP ranks; every gradient is summed over the CP ranks and
    divided by that count (``calculate_per_token_loss``). Shared embeddings are off: no embedding
    all-reduce between the first and last stage."""
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    cp_group = parallel_state.get_context_parallel_group()
    dist.broadcast(num_tokens, src=parallel_state.get_pipeline_model_parallel_last_rank(), group=pp_group)
    dist.all_reduce(num_tokens, group=cp_group)
    for model in model_chunks:
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=cp_group)
                p.grad /= num_tokens


def _forward_step(cp_group, data_iterator, model):
    """Megatron-LM's ``pretrain_gpt`` forward step: the first stage gets tokens and position ids, the
    last stage labels and loss mask (``get_batch_on_this_tp_rank``), both through the CP batch split.
    Which stage: ``is_first_or_last_pipeline_stage(vp_stage)`` with the model chunk's ``vp_stage`` (the
    first chunk of the first rank, the last chunk of the last rank); a chunk that is neither (interleaved
    schedule) reads no batch, as ``get_batch`` returns Nones there."""
    vp_stage = model.vp_stage
    first = parallel_state.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    if not (first or last):
        return model(None, None, None), functools.partial(_loss_func, None)
    full = next(data_iterator)
    batch = dict(tokens=full["tokens"] if first else None, position_ids=full["position_ids"] if first else None,
                 labels=full["labels"] if last else None, loss_mask=full["loss_mask"] if last else None,
                 attention_mask=None)
    batch = cp_split(batch, cp_group)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, functools.partial(_loss_func, batch["loss_mask"])


def _loss_func(loss_mask, output_tensor):
    """Megatron-LM's GPT loss function: (summed masked loss, token count, report)."""
    loss = (output_tensor.float().reshape(-1) * loss_mask.reshape(-1).float()).sum()
    num_tokens = loss_mask.sum().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.stack([loss.detach(), num_tokens.float()])}


def _pp_worker(rank, world_size, cases, batches, vp=None):
    """Each case on this (PP rank, CP rank): the loss (last stage) and the gradients of this rank's model
    chunks under their global names, finalized over the CP group; per model chunk, per attention layer
    (global layer number, dense, density); the model chunk (``vp_stage``) of every forward step, in the
    order the schedule ran them. Also per chunk: (layer offset, pre_process, post_process). ``vp``: the
    interleaved schedule with ``vp`` model chunks per pipeline rank; None: 1F1B, one model per rank."""
    from megatron.core.pipeline_parallel import get_forward_backward_func, p2p_communication, schedules
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    shims = apply_cpu_shims()
    schedules_torch, schedules.torch = schedules.torch, _TorchOnCpu()
    p2p_torch = p2p_communication.torch
    if vp is not None:
        p2p_communication.torch = _TorchWithGlooSafeIsend()
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=PP, virtual_pipeline_model_parallel_size=vp,
                                             context_parallel_size=CP)
    try:
        assert parallel_state.get_context_parallel_world_size() == CP and world_size == PP * CP
        cp_group = parallel_state.get_context_parallel_group()
        first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
        # pipeline_dtype: the dtype of the activations the stages exchange. 1F1B: batched P2P (the default)
        # with batch_p2p_sync=False: it only adds a torch.cuda.synchronize() after the batched P2P calls (a
        # guard for old NCCL versions), which has nothing to wait for on gloo with CPU tensors and fails on a
        # CPU-only torch. Interleaved: what Megatron-LM sets at PP = 2, overlapped P2P and
        # batch_p2p_comm = not overlap_p2p_comm.
        pipeline = dict(context_parallel_size=CP, pipeline_model_parallel_size=PP, pipeline_dtype=torch.float32,
                        deallocate_pipeline_outputs=True, finalize_model_grads_func=_finalize_grads)
        if vp is None:
            pipeline.update(batch_p2p_sync=False)
        else:
            pipeline.update(virtual_pipeline_model_parallel_size=vp, overlap_p2p_comm=True, batch_p2p_comm=False)
        vp_stages = [None] if vp is None else list(range(vp))
        results, layout, steps = [], None, []

        def forward_step(data_iterator, model):
            steps.append(model.vp_stage)
            return _forward_step(cp_group, data_iterator, model)

        for cfg, dense_layers, state in cases:
            patches.install(cfg)
            packing.reset_packing()
            chunks, offsets = [], []
            for vp_stage in vp_stages:  # as Megatron-LM's get_model: embedding / output only at the model's ends
                model = build_gpt(get_gpt_layer_spec(cfg, dense_layers=dense_layers), vp_stage=vp_stage,
                                  pre_process=first and vp_stage in (None, 0),
                                  post_process=last and vp_stage in (None, len(vp_stages) - 1), **pipeline)
                offset = get_transformer_layer_offset(model.config, vp_stage)
                model.load_state_dict({k: state[global_name(k, offset)] for k in model.state_dict()})
                model.zero_grad(set_to_none=True)
                chunks.append(model)
                offsets.append(offset)
            layout = [(offset, model.pre_process, model.post_process) for offset, model in zip(offsets, chunks)]

            forward_backward = get_forward_backward_func()
            assert forward_backward is (schedules.forward_backward_pipelining_without_interleaving if vp is None
                                        else schedules.forward_backward_pipelining_with_interleaving)
            steps.clear()
            reports = forward_backward(forward_step_func=forward_step,
                                       data_iterator=iter(batches) if vp is None else [iter(batches) for _ in chunks],
                                       model=chunks, num_microbatches=len(batches), seq_length=SEQ,
                                       micro_batch_size=1, forward_only=False)
            if vp is not None:
                dist.barrier()  # every send received: the sent tensors may go
                p2p_communication.torch.sent.clear()
            loss = None
            if last:
                assert len(reports) == len(batches)
                summed = torch.stack([r["lm loss"] for r in reports]).sum(0)
                dist.all_reduce(summed, group=cp_group)
                loss = summed[0] / summed[1]
            grads = {}
            for model, offset in zip(chunks, offsets):
                chunk_grads = {global_name(n, offset): p.grad for n, p in model.named_parameters()}
                assert not grads.keys() & chunk_grads.keys()  # every parameter lives in one chunk
                grads.update(chunk_grads)
            layers = [[(m.layer_number, m.dense, m.last_index.density(SEQ).mean().item())
                       for m in model.modules() if isinstance(m, mt_attention.MTrainingAttention)] for model in chunks]
            results.append((loss, grads, layers, list(steps)))
            patches.uninstall()
        return parallel_state.get_pipeline_model_parallel_rank(), layout, results
    finally:
        schedules.torch = schedules_torch
        p2p_communication.torch = p2p_torch
        parallel_state.destroy_model_parallel()
        patches.uninstall()
        packing.reset_packing()
        shims.remove()


def _cases_and_references(batches):
    """The ``SETTINGS`` cases for the workers and their one-process references (loss, gradients) on these
    micro-batches: megatron-core's own attention for the dense index, the plugin for the sparse one."""
    reference = build_gpt(get_gpt_layer_local_spec())
    state = state_of(reference)
    dense_ref = run_reference(reference, batches)
    cases, refs = [], []
    for index, dense_layers in SETTINGS:
        cfg = mt_config(index)
        cases.append((cfg, dense_layers, state))
        patches.install(cfg)
        model = build_gpt(get_gpt_layer_spec(cfg, dense_layers=dense_layers))
        model.load_state_dict(state)
        refs.append(dense_ref if index == "dense" else run_reference(model, batches))
        if index == "dense":  # the plugin's dense index is megatron-core's attention on one process too
            loss, grads = run_reference(model, batches)
            assert abs(loss.item() - dense_ref[0].item()) <= TOL * abs(dense_ref[0].item())
            assert all(rel_err(grads[n], g) < TOL for n, g in dense_ref[1].items())
        patches.uninstall()
    # the cases differ from each other: the comparisons below can see a wrong index or a wrong dense layer
    assert rel_err(refs[1][1]["decoder.layers.0.self_attention.linear_qkv.weight"],
                   refs[2][1]["decoder.layers.0.self_attention.linear_qkv.weight"]) > 1e-2
    assert rel_err(refs[0][1]["embedding.word_embeddings.weight"],
                   refs[1][1]["embedding.word_embeddings.weight"]) > 1e-2
    return cases, refs


def _check_against_references(results, refs, schedule, layer_numbers, steps):
    """``results``: ``run_distributed(_pp_worker, ...)``'s, against ``refs``; ``layer_numbers``: per PP rank,
    per model chunk, the global layer numbers it must hold; ``steps``: the model chunk of each forward
    step, in order (the same on every rank)."""
    # megatron-core's rank order: CP groups {0, 1} (stage 0) and {2, 3} (stage 1); PP groups {0, 2}, {1, 3}
    assert [stage for stage, _, _ in results] == [r // CP for r in range(PP * CP)]
    for r, (stage, layout, _) in enumerate(results):  # layer offsets; embedding / output at the model's ends
        chunks = len(layer_numbers[stage])
        assert layout == [(numbers[0] - 1, stage == 0 and c == 0, stage == PP - 1 and c == chunks - 1)
                          for c, numbers in enumerate(layer_numbers[stage])], (schedule, r, layout)
    results = [cases_of_rank for _, _, cases_of_rank in results]
    stages = [results[0], results[CP]]
    for i, (index, dense_layers) in enumerate(SETTINGS):
        what = f"{schedule} PP={PP} x CP={CP} {index} index, dense_layers={dense_layers}"
        ref_loss, ref_grads = refs[i]
        loss = stages[-1][i][0]
        assert abs(loss.item() - ref_loss.item()) <= TOL * abs(ref_loss.item()), (what, loss, ref_loss)
        for r in range(PP * CP):  # both CP ranks of a stage report the same loss and the same gradients
            twin = results[r - r % CP]
            assert (results[r][i][0] is None) == (r // CP != PP - 1), (what, r)
            assert results[r][i][0] is None or torch.equal(results[r][i][0], twin[i][0]), (what, r)
            for name, g in results[r][i][1].items():
                assert torch.equal(g, twin[i][1][name]), (what, r, name)
            assert results[r][i][3] == steps, (what, r, results[r][i][3])
        grads = {}
        for stage in stages:
            assert not grads.keys() & stage[i][1].keys(), what  # every parameter lives on one stage
            grads.update(stage[i][1])
        assert grads.keys() == ref_grads.keys(), (what, sorted(grads.keys() ^ ref_grads.keys()))
        for name, g in ref_grads.items():
            assert rel_err(grads[name], g) < TOL, (what, name, rel_err(grads[name], g))
        # global layer numbers, per stage and chunk, 1..LAYERS once each; only the first dense_layers dense
        numbers = [[[n for n, _, _ in chunk] for chunk in stage[i][2]] for stage in stages]
        assert numbers == layer_numbers, (what, numbers)
        layers = [layer for stage in stages for chunk in stage[i][2] for layer in chunk]
        assert sorted(n for n, _, _ in layers) == list(range(1, LAYERS + 1)), (what, layers)
        for number, dense, density in layers:
            assert dense == (number <= dense_layers), (what, number)
            if index == "vs" and not dense:
                assert density < 0.9, (what, number, density)  # really sparse
            else:
                assert abs(density - 1.0) < 1e-6, (what, number, density)


def test_pipeline_2_x_context_parallel_2_equals_one_device(megatron_cpu):
    """PP = 2 x CP = 2 through megatron-core's 1F1B schedule equals PP = 1, CP = 1: the dense index
    against megatron-core's own attention, the sparse index (with and without a dense first layer)
    against the plugin on one process."""
    from dist_utils import run_distributed

    batches = micro_batches()
    cases, refs = _cases_and_references(batches)
    results = run_distributed(_pp_worker, PP * CP, cases, batches, timeout=300)
    # one model per rank: stage 0 global layers 1-2, stage 1 layers 3-4
    _check_against_references(results, refs, "1F1B", layer_numbers=[[[1, 2]], [[3, 4]]], steps=[None] * MICRO)


def test_interleaved_pipeline_2_x_virtual_2_x_context_parallel_2_equals_one_device(megatron_cpu):
    """PP = 2 with 2 model chunks per rank x CP = 2 through megatron-core's interleaved schedule equals
    PP = 1, CP = 1: the same cases and checks as 1F1B; with dense_layers=1 only chunk 0 of rank 0
    (global layer 1) is dense."""
    from dist_utils import run_distributed

    batches = micro_batches(count=VP_MICRO)
    cases, refs = _cases_and_references(batches)
    results = run_distributed(_pp_worker, PP * CP, cases, batches, VP, timeout=300)
    # rank 0: the chunks of global layers 1 (with the embedding) and 3; rank 1: layers 2 and 4 (with the
    # output layer). Forward steps in micro-batch groups of PP: chunk 0 on micro-batches 0, 1, then chunk 1
    # on 0, 1, then chunk 0 on 2, 3, ...
    _check_against_references(results, refs, "interleaved", layer_numbers=[[[1], [3]], [[2], [4]]],
                              steps=[0, 0, 1, 1] * (VP_MICRO // PP))
