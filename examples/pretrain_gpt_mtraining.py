#!/usr/bin/env python
"""Pretrain a GPT model with MTraining sparse context-parallel attention; no Megatron-LM checkout.

A self-contained counterpart of Megatron-LM's ``pretrain_gpt.py`` built on ``megatron.training``
as shipped in the megatron-core >= 0.19 wheel (which has no ``pretrain_gpt.py``,
``gpt_builders.py`` or ``model_provider.py``). It takes Megatron's usual flags plus the
plugin's ``--mtraining*`` flags:

    CUDA_DEVICE_MAX_CONNECTIONS=1 python -m torch.distributed.run --nproc-per-node 4 examples/pretrain_gpt_mtraining.py \\
        --mock-data --tokenizer-type NullTokenizer --vocab-size 32000 \\
        --num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 65536 \\
        --max-position-embeddings 65536 --position-embedding-type rope --attention-dropout 0 \\
        --micro-batch-size 1 --global-batch-size 1 --train-iters 20 --lr 3e-4 --bf16 \\
        --transformer-impl transformer_engine --no-gradient-accumulation-fusion \\
        --context-parallel-size 4 --mtraining

on Transformer Engine layers (Megatron's default, with its fused RoPE; TE 2.20 is the tested
version). Without Transformer Engine use ``--transformer-impl local --no-rope-fusion
--no-persist-layer-norm`` instead; without apex keep ``--no-gradient-accumulation-fusion``.

With ``--mtraining`` every layer's core attention is ``MTrainingAttention`` (local or Transformer
Engine layer spec, after ``--transformer-impl``), and ``patches.install`` makes the CP batch split
and the RoPE slicing follow the MTraining token layout. Without ``--mtraining`` the same script
trains with Megatron's own attention: the dense baseline. Context parallelism with Megatron's
attention needs Transformer Engine; without it use ``--mtraining --mtraining-index dense`` (exact
causal attention over MTraining's ring) as the dense baseline.

Data: ``--mock-data`` (MockGPTDataset) or ``--data-path`` (GPTDataset, a Megatron indexed
dataset). Not supported by this self-contained script: packed documents (``--sft``,
``--dataloader-inter-document-masking``, ``--reset-attention-mask`` with ``--mtraining``: the launcher
and the patched fork take them, through Megatron-LM's ``pretrain_gpt.py``), hybrid CP, multi-token
prediction, and ``--spec`` (the layer spec is chosen as above).

Works with the ``pretrain(cfg_container, ...)`` API of megatron-core 0.19.x; the older
``pretrain(train_valid_test_dataset_provider, model_provider, ...)`` API (Megatron-LM
core_r0.14 - core_r0.18) is supported on a best-effort basis.
"""

import functools
import inspect
import os
import warnings

import torch

from megatron_mtraining.integration.args import add_mtraining_args, integration_options

SUPPORTED = ("megatron-core 0.19.x (megatron.training.pretrain(cfg_container, ...)); best effort: "
             "Megatron-LM core_r0.14 - core_r0.18 (pretrain(train_valid_test_dataset_provider, "
             "model_provider, ..., extra_args_provider=...))")
BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")

_state = {"configured": False, "mtraining_config": None}


class ConfigError(ValueError):
    """A command line this script cannot train; the message says what to change."""


def print_rank_0(message):
    dist = torch.distributed
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))
    if rank == 0:
        print(message, flush=True)


def have_transformer_engine():
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    return True


def extra_args_provider(parser):
    """The ``--mtraining*`` flags (unless the parser has them already, e.g. a patched fork)."""
    if "--mtraining" in getattr(parser, "_option_string_actions", {}):
        return parser
    return add_mtraining_args(parser)


def check_args(args, te_available=None):
    """Raise ConfigError for settings this script (or MTraining) cannot train."""
    mtraining = bool(getattr(args, "mtraining", False))
    impl = getattr(args, "transformer_impl", "transformer_engine")
    cp = int(getattr(args, "context_parallel_size", 1) or 1)
    dense_hint = ("--mtraining --mtraining-index dense (exact causal attention over MTraining's "
                  "context-parallel ring, no Transformer Engine needed)")
    if impl not in ("local", "transformer_engine"):
        raise ConfigError(f"--transformer-impl {impl} is not supported here; use local or transformer_engine")
    if impl == "transformer_engine" and not (have_transformer_engine() if te_available is None else te_available):
        raise ConfigError("--transformer-impl transformer_engine (Megatron's default) needs Transformer Engine, "
                          "which is not importable; pass --transformer-impl local" +
                          ("" if mtraining or cp == 1 else f", and for a dense baseline with CP > 1 use {dense_hint}"))
    if not mtraining and cp > 1 and impl == "local":
        raise ConfigError(f"context parallelism (--context-parallel-size {cp}) with Megatron's own attention "
                          "needs Transformer Engine (--transformer-impl transformer_engine): the local "
                          f"DotProductAttention has none. For a dense baseline without it use {dense_hint}")
    unsupported = {"--sft": getattr(args, "sft", False),
                   "--dataloader-inter-document-masking": getattr(args, "dataloader_inter_document_masking", False),
                   "--hybrid-context-parallel": getattr(args, "hybrid_context_parallel", False),
                   "--mtp-num-layers": getattr(args, "mtp_num_layers", None),
                   "--reset-attention-mask with --mtraining": mtraining and getattr(args, "reset_attention_mask", False)}
    bad = [flag for flag, value in unsupported.items() if value]
    if bad:
        raise ConfigError(f"not supported by this script: {', '.join(bad)} (packed documents train through "
                          "Megatron-LM's pretrain_gpt.py: the launcher or the patched fork, README)")


def configure(args):
    """Check ``args``; with ``--mtraining`` build the MTrainingConfig, validate it against the
    transformer config and install the patches. Idempotent; returns the config or None."""
    if _state["configured"]:
        return _state["mtraining_config"]
    check_args(args)
    # Every layer spec used here is causal and builds its own mask: skip the O(seq^2) dataloader mask.
    if getattr(args, "create_attention_mask_in_dataloader", False) and not getattr(args, "reset_attention_mask", False):
        args.create_attention_mask_in_dataloader = False
    config = None
    if getattr(args, "mtraining", False):
        import megatron.core.models.gpt.gpt_model  # noqa: F401  (imports the RoPE helpers before patching)

        from megatron_mtraining.integration.enable import enable_mtraining

        # Validation, patches, telemetry: as the launcher and the fork patch do.
        config = enable_mtraining(args).config
        print_rank_0(f"> MTraining sparse attention enabled: {config}")
    _state.update(configured=True, mtraining_config=config)
    return config


def get_layer_spec(args, config, vp_stage=None, mtraining_config=None):
    """The GPT layer (or, with MoE, block) spec; with an MTrainingConfig its core attention is
    MTrainingAttention. ``args.transformer_impl`` picks the local or Transformer Engine spec."""
    from megatron.core.models.gpt import gpt_layer_specs

    use_te = args.transformer_impl == "transformer_engine"
    common = dict(qk_layernorm=config.qk_layernorm, multi_latent_attention=config.multi_latent_attention,
                  qk_l2_norm=getattr(config, "qk_l2_norm", False))
    if config.num_moe_experts:
        spec = gpt_layer_specs.get_gpt_decoder_block_spec(config, use_transformer_engine=use_te,
                                                          normalization=config.normalization,
                                                          qk_l2_norm=common["qk_l2_norm"], vp_stage=vp_stage)
    elif use_te:
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(**common)
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization=config.normalization, **common)
    if mtraining_config is not None:
        from megatron_mtraining.integration.spec import get_gpt_layer_spec

        spec = get_gpt_layer_spec(mtraining_config, base_spec=spec,
                                  dense_layers=integration_options(args)["dense_layers"])
    return spec


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    """Build a megatron-core GPTModel (one pipeline stage / virtual stage)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.training import get_args

    args = get_args()
    mtraining_config = configure(args)  # done in main() with megatron-core >= 0.19
    if config is None:
        from megatron.training.arguments import core_transformer_config_from_args

        config = core_transformer_config_from_args(args)
    print_rank_0(f"building GPT model ({'MTraining' if mtraining_config else 'Megatron'} attention) ...")
    kwargs = dict(
        config=config,
        transformer_layer_spec=get_layer_spec(args, config, vp_stage, mtraining_config),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=getattr(args, "rope_scaling_factor", 8.0),
        seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
    )
    if vp_stage is not None:
        kwargs["vp_stage"] = vp_stage
    if pg_collection is not None:
        kwargs["pg_collection"] = pg_collection
    return GPTModel(**kwargs)


@functools.lru_cache(maxsize=None)
def _parameters(fn):
    return frozenset(inspect.signature(fn).parameters)


def get_batch(data_iterator, vp_stage=None):
    """This rank's (tokens, labels, loss_mask, attention_mask, position_ids): broadcast over TP,
    then split over CP (in the MTraining layout once ``patches.install`` ran)."""
    from megatron.core import mpu
    from megatron.core import utils as core_utils
    from megatron.training import get_args
    from megatron.training.utils import is_first_or_last_pipeline_stage

    if not is_first_or_last_pipeline_stage(vp_stage):
        return (None,) * len(BATCH_KEYS)
    args = get_args()
    tp_broadcast = getattr(core_utils, "get_batch_on_this_tp_rank", None)
    if tp_broadcast is not None and "has_cu_seqlens" in _parameters(tp_broadcast):  # megatron-core >= 0.19
        tp_rank = mpu.get_tensor_model_parallel_rank()
        batch = {}
        if tp_rank == 0:
            data = next(data_iterator)
            batch = {key: data[key].cuda(non_blocking=True) if data.get(key) is not None else None
                     for key in BATCH_KEYS}
        batch = tp_broadcast(
            batch, has_cu_seqlens=False, is_hybrid_cp=False,
            create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
            broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
            broadcast_group=mpu.get_tensor_model_parallel_group(), cp_size=args.context_parallel_size,
            tp_rank=tp_rank, micro_batch_size=args.micro_batch_size, seq_length=args.seq_length,
            mtp_on_this_rank=False, pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            is_pipeline_first_stage=mpu.is_pipeline_first_stage(),
            is_pipeline_last_stage=mpu.is_pipeline_last_stage())
    else:  # older Megatron-LM: the helper reads the iterator itself
        from megatron.training.utils import get_batch_on_this_tp_rank

        batch = get_batch_on_this_tp_rank(data_iterator)

    # Looked up at call time: install() may have replaced it (megatron-core <= 0.16).
    cp_split = core_utils.get_batch_on_this_cp_rank
    kwargs = {}
    if "cp_group" in _parameters(cp_split):
        kwargs["cp_group"] = mpu.get_context_parallel_group()
    if "is_hybrid_cp" in _parameters(cp_split):
        kwargs["is_hybrid_cp"] = False
    batch = cp_split(batch, **kwargs)
    return tuple(batch.get(key) for key in BATCH_KEYS)


def loss_func(loss_mask, output_tensor):
    """Summed masked LM loss, its token count, and the [sum, count] report that the training loop
    all-reduces over the data- and context-parallel ranks (megatron-core >= 0.13 loss form)."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine
    from megatron.training import get_args

    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)

    if get_args().check_for_nan_in_loss_and_grad:
        rerun_state_machine = get_rerun_state_machine()
        for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            rerun_state_machine.validate_result(result=loss, rejection_func=reject, tolerance=0.0, fatal=True,
                                                message=f"found {what} in local forward loss calculation")
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    return loss, num_tokens, report


def forward_step(data_iterator, model):
    """Forward one micro-batch; returns the per-token losses and the loss function."""
    from megatron.core.utils import get_attr_wrapped_model
    from megatron.training import get_timers

    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator, vp_stage)
    timers("batch-generator").stop()

    output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output_tensor, functools.partial(loss_func, loss_mask)


def gpt_dataset_config_from_args(args):
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.training import get_tokenizer
    from megatron.training.utils import get_blend_and_blend_per_split

    blend, blend_per_split = get_blend_and_blend_per_split(args)
    kwargs = dict(random_seed=args.seed, sequence_length=args.seq_length, blend=blend,
                  blend_per_split=blend_per_split, split=args.split,
                  num_dataset_builder_threads=args.num_dataset_builder_threads, path_to_cache=args.data_cache_path,
                  mmap_bin_files=args.mmap_bin_files, tokenizer=get_tokenizer(),
                  reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
                  eod_mask_loss=args.eod_mask_loss, create_attention_mask=args.create_attention_mask_in_dataloader)
    # Fields of newer releases: set when both the config and the arguments have them.
    optional = dict(multiple_validation_sets=None, full_validation=None, object_storage_cache_path=None,
                    mid_level_dataset_surplus=None, allow_ambiguous_pad_tokens=None,
                    fast_cache_load="dataloader_fast_cache_load",
                    defer_npy_index_mmap="dataloader_defer_npy_index_mmap",
                    context_parallel_size=None, data_parallel_size=None)
    fields = {f.name for f in GPTDatasetConfig.__dataclass_fields__.values() if f.init}
    for field, arg in optional.items():
        if field in fields and getattr(args, arg or field, None) is not None:
            kwargs[field] = getattr(args, arg or field)
    return GPTDatasetConfig(**kwargs)


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """MockGPTDataset (--mock-data) or GPTDataset (--data-path ...) splits."""
    from megatron.core import mpu
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset
    from megatron.training import get_args
    from megatron.training.utils import is_first_or_last_pipeline_stage

    args = get_args()
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset

    def is_built_on_rank():
        return mpu.get_tensor_model_parallel_rank() == 0 and is_first_or_last_pipeline_stage(vp_stage)

    print_rank_0(f"> building train, validation, and test datasets for GPT ({dataset_type.__name__}) ...")
    datasets = BlendedMegatronDatasetBuilder(dataset_type, train_val_test_num_samples, is_built_on_rank,
                                             gpt_dataset_config_from_args(args)).build()
    print_rank_0("> finished creating GPT datasets ...")
    return datasets


train_valid_test_datasets_provider.is_distributed = True  # every rank calls it; is_built_on_rank decides


def api_of(pretrain):
    """'config' for pretrain(cfg_container, ...) (megatron-core >= 0.19), 'legacy' for
    pretrain(train_valid_test_dataset_provider, model_provider, ..., extra_args_provider=...)."""
    params = list(inspect.signature(pretrain).parameters)
    if params[:1] == ["cfg_container"]:
        return "config"
    if "extra_args_provider" in params and "model_provider" in params[:2]:
        return "legacy"
    raise SystemExit(f"pretrain_gpt_mtraining.py: error: unsupported megatron.training.pretrain signature "
                     f"{params}; supported: {SUPPORTED}")


def use_prebuilt_dataset_helpers():
    """megatron.training runs ``make`` in megatron/core/datasets at start-up, but the wheel ships
    the compiled ``helpers_cpp`` without the Makefile, so that step fails. When the compiled
    module imports and there is no Makefile, skip the compilation (a Megatron-LM checkout, which
    has the Makefile, compiles as usual)."""
    from megatron.core.datasets import utils as dataset_utils

    if os.path.exists(os.path.join(os.path.dirname(dataset_utils.__file__), "Makefile")):
        return
    try:
        import megatron.core.datasets.helpers_cpp  # noqa: F401
    except ImportError:
        return  # nothing prebuilt: let Megatron report its own error
    dataset_utils.compile_helpers = lambda: print_rank_0("> using the prebuilt dataset helpers (helpers_cpp)")


def main():
    from megatron.core.enums import ModelType

    try:
        from megatron.training import pretrain
    except ImportError as err:
        raise SystemExit(f"pretrain_gpt_mtraining.py: error: megatron.training is not importable ({err}); it "
                         f"ships with the megatron-core wheel >= 0.19 (needs CUDA). Supported: {SUPPORTED}") from None

    use_prebuilt_dataset_helpers()
    if api_of(pretrain) == "legacy":  # arguments are parsed inside pretrain; model_provider configures
        pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder,
                 forward_step, extra_args_provider=extra_args_provider)
        finish_telemetry()
        return

    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    args = parse_and_validate_args(extra_args_provider=extra_args_provider)
    try:
        configure(args)  # before pretrain() builds the model and the data
    except ValueError as err:
        raise SystemExit(f"pretrain_gpt_mtraining.py: error: {err}") from None
    with warnings.catch_warnings():  # the model comes from model_provider, on purpose
        warnings.filterwarnings("ignore", message=r"[\s\S]*recommended to use a ModelConfig")
        cfg_container = pretrain_cfg_container_from_args(args)
    pretrain(cfg_container, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step,
             model_provider=model_provider)
    finish_telemetry()


def finish_telemetry():
    """Log the telemetry's last log iteration if the run ended on one (the next forward would have)."""
    from megatron_mtraining.integration import telemetry

    telemetry.disable_telemetry(flush=True)


if __name__ == "__main__":
    main()
