"""Megatron checkpoints in the ``torch_dist`` format, written and read through megatron-core.

A converted model is a *release* checkpoint, as Megatron-LM's own converters write them::

    CKPT/latest_checkpointed_iteration.txt      "release"
    CKPT/release/                               megatron-core dist_checkpointing (torch_dist):
                                                common.pt (args, checkpoint_version), metadata.json,
                                                the tensors (global shapes, so any TP / PP loads it)
    CKPT/mtraining_conversion.json              the source model: family, shape, vocabulary rows,
                                                tokenizer, the Megatron flags to train it with
    CKPT/mtraining_vocab_tail.pt                only when Megatron's padding drops embedding rows

``pretrain_gpt.py --pretrained-checkpoint CKPT`` (or ``--load CKPT --finetune``) loads it into a
local or Transformer Engine layer spec: megatron-core names the local spec's layer norms with the
TE names in its checkpoints (``sharded_state_dict_keys_map``), and its linear layers' extra state
under the keys TE's use (empty here: no FP8 scaling history), so one file serves both.

The keys and global shapes are those of megatron-core's own ``sharded_state_dict`` of a GPTModel
built for the shape (local spec, on the CPU, no initialisation); a single-process gloo group
stands in for the training job when none is running. Reading goes the same way, so a checkpoint
saved by any TP / PP layout or layer spec (and by megatron-core 0.16 to 0.19) is read back whole.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pickle
import tempfile
import types
from typing import Any, Dict, Iterator, Optional, Tuple

import torch

from .shape import ConversionError, Llama3RopeScaling, ModelShape, YarnRopeScaling

__all__ = ["RELEASE", "TRACKER", "build_gpt", "checkpoint_dir", "load_megatron_state", "read_saved_args",
           "save_release_checkpoint", "single_process_group"]

TRACKER = "latest_checkpointed_iteration.txt"
RELEASE = "release"
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[str(name).replace("torch.", "")]
    except KeyError:
        raise ConversionError(f"dtype {name!r}: use one of {', '.join(_DTYPES)}") from None


@contextlib.contextmanager
def single_process_group() -> Iterator[None]:
    """megatron-core's parallel state for one process (TP = PP = CP = 1) on gloo, unless a
    process group and megatron-core's parallel state exist already (then those are used). On a
    machine without CUDA, megatron-core's ``torch.cuda.current_device()`` while a model is built
    (the YaRN RoPE cache) answers "cpu" for the duration."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    with contextlib.ExitStack() as stack:
        if not torch.cuda.is_available():
            real = torch.cuda.current_device
            torch.cuda.current_device = lambda: "cpu"
            stack.callback(setattr, torch.cuda, "current_device", real)
        if dist.is_initialized() and parallel_state.model_parallel_is_initialized():
            yield
            return
        own_group = not dist.is_initialized()
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="mtraining-convert-"))
        if own_group:
            dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        parallel_state.initialize_model_parallel()
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()
            if own_group:
                dist.destroy_process_group()


def transformer_config(shape: ModelShape, dtype: torch.dtype, **overrides):
    """megatron-core's TransformerConfig for ``shape`` (what ``megatron_flags`` gives Megatron-LM)."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size, ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_attention_heads, num_query_groups=shape.num_query_groups,
        kv_channels=shape.kv_channels, normalization="RMSNorm", layernorm_epsilon=shape.norm_epsilon,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=shape.qkv_bias,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        use_cpu_initialization=True, perform_initialization=False, gradient_accumulation_fusion=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, attention_dropout=0.0, hidden_dropout=0.0)
    fields.update(overrides)
    config = TransformerConfig(**fields)
    scaling = shape.rope_scaling
    if isinstance(scaling, YarnRopeScaling):  # read by GPTModel's yarn branch as config attributes
        config.yarn_rotary_scaling_factor = scaling.factor
        config.yarn_original_max_position_embeddings = scaling.original_max_position_embeddings
        config.yarn_beta_fast, config.yarn_beta_slow = scaling.beta_fast, scaling.beta_slow
        config.yarn_mscale, config.yarn_mscale_all_dim = scaling.mscale, scaling.mscale_all_dim
        config.yarn_correction_range_round_to_int = True
    return config


def build_gpt(shape: ModelShape, padded_vocab: int, *, dtype: torch.dtype = torch.float32, layer_spec=None,
              max_sequence_length: Optional[int] = None, **config_overrides):
    """megatron-core's GPTModel for ``shape`` (local spec unless ``layer_spec`` is given)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = transformer_config(shape, dtype, **config_overrides)
    scaling = shape.rope_scaling
    return GPTModel(
        config=config, transformer_layer_spec=layer_spec or get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=padded_vocab, max_sequence_length=max_sequence_length or shape.max_position_embeddings,
        position_embedding_type="yarn" if isinstance(scaling, YarnRopeScaling) else "rope",
        rotary_base=shape.rope_base, rope_scaling=isinstance(scaling, Llama3RopeScaling),
        rope_scaling_factor=scaling.factor if isinstance(scaling, Llama3RopeScaling) else 8.0,
        share_embeddings_and_output_weights=shape.tied_embeddings)


def saved_args(shape: ModelShape, padded_vocab: int, divisible_by: int, tp: int) -> argparse.Namespace:
    """The argument namespace stored in the checkpoint, with Megatron-LM's names for what it
    checks at load (``check_checkpoint_args``) and what the export reads back."""
    scaling = shape.rope_scaling
    return argparse.Namespace(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size, ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_attention_heads, group_query_attention=True,
        num_query_groups=shape.num_query_groups, kv_channels=shape.kv_channels, normalization="RMSNorm",
        norm_epsilon=shape.norm_epsilon, swiglu=True, add_bias_linear=False, add_qkv_bias=shape.qkv_bias,
        untie_embeddings_and_output_weights=not shape.tied_embeddings, add_position_embedding=False,
        position_embedding_type="yarn" if isinstance(scaling, YarnRopeScaling) else "rope",
        rotary_base=shape.rope_base, max_position_embeddings=shape.max_position_embeddings,
        rotary_scaling_factor=scaling.factor if isinstance(scaling, YarnRopeScaling) else 1.0,
        yarn_original_max_position_embeddings=getattr(scaling, "original_max_position_embeddings", None)
        if isinstance(scaling, YarnRopeScaling) else None,
        yarn_beta_fast=getattr(scaling, "beta_fast", None), yarn_beta_slow=getattr(scaling, "beta_slow", None),
        mscale=getattr(scaling, "mscale", 1.0), mscale_all_dim=getattr(scaling, "mscale_all_dim", 0.0),
        use_rope_scaling=isinstance(scaling, Llama3RopeScaling),
        rope_scaling_factor=scaling.factor if isinstance(scaling, Llama3RopeScaling) else 8.0,
        padded_vocab_size=padded_vocab, make_vocab_size_divisible_by=divisible_by,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, ckpt_format="torch_dist",
        iteration=0, consumed_train_samples=0, consumed_valid_samples=0)


def save_release_checkpoint(directory: str, model, args: argparse.Namespace) -> None:
    """``directory/release`` (torch_dist) and the tracker file.

    The tensors are written whole, at megatron-core's global shapes and under its sharded keys,
    with PyTorch's distributed checkpoint (DCP) writer, which every TP / PP layout reads back
    sharded; ``common.pt`` holds the arguments, ``metadata.json`` names the format. (megatron-core's
    own torch_dist writer needs CUDA; this writes the same files on any machine.)"""
    import io

    import torch.distributed.checkpoint as dcp

    release = os.path.join(directory, RELEASE)
    os.makedirs(release, exist_ok=True)
    tensors, objects = _global_tensors(model)
    state: Dict[str, Any] = dict(tensors)
    for key, data in objects.items():  # megatron-core stores each object as a list, torch.save'd
        buffer = io.BytesIO()
        torch.save([data], buffer)
        state[key] = buffer
    dcp.save(state, storage_writer=dcp.FileSystemWriter(release), no_dist=True)
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 0}, os.path.join(release, "common.pt"))
    with open(os.path.join(release, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                   "common_backend": "torch", "common_backend_version": 1}, f)
    with open(os.path.join(directory, TRACKER), "w") as f:
        f.write(RELEASE)


def _sharded_pieces(model) -> Iterator[Tuple[str, Any]]:
    """(state-dict key, ShardedTensor or ShardedObject) for every piece of the model's sharded
    state dict, factories applied (SwiGLU's fc1 is two pieces of one tensor)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories

    sharded = model.sharded_state_dict()
    apply_factories(sharded)
    for name, value in sharded.items():
        for piece in (value if isinstance(value, list) else [value]):
            if not isinstance(piece, (ShardedTensor, ShardedObject)):
                raise ConversionError(f"{name}: unexpected entry {type(piece).__name__} in the sharded state dict")
            yield name, piece


def _piece_slice(piece) -> Tuple[slice, ...]:
    """Where a ShardedTensor's data lies in its global tensor (prepended axes: one index each)."""
    prepend = piece.prepend_axis_num
    index = [piece.global_offset[i] for i in range(prepend)]
    index += [slice(off, off + size) for off, size in zip(piece.global_offset[prepend:], piece.data.shape)]
    return tuple(index)


def _global_tensors(model) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """The model's tensors assembled at their global shapes (one process holds all of them), and
    its sharded objects by unique key."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    tensors: Dict[str, torch.Tensor] = {}
    objects: Dict[str, Any] = {}
    for _, piece in _sharded_pieces(model):
        if isinstance(piece, ShardedObject):
            objects[piece.unique_key] = piece.data
            continue
        if piece.flattened_range is not None:
            raise ConversionError(f"{piece.key}: flattened shards are not expected in a model state dict")
        full = tensors.get(piece.key)
        if full is None:
            full = tensors[piece.key] = piece.data.new_zeros(piece.global_shape)
        full[_piece_slice(piece)] = piece.data.detach()
    return tensors, objects


class _Unknown:
    """Stands in for a class the saving run had and this one lacks (another megatron-core
    version's enums and configs in the saved arguments): its fields are not needed here."""

    def __init__(self, *args, **kwargs):
        self.args = args

    def __setstate__(self, state):
        self.state = state


class _LenientUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        try:
            return super().find_class(module, name)
        except (AttributeError, ImportError):
            if not module.startswith("megatron"):
                raise
            return type(name, (_Unknown,), {"__module__": module})


_LENIENT_PICKLE = types.SimpleNamespace(Unpickler=_LenientUnpickler, load=lambda f, **kw: _LenientUnpickler(f, **kw).load(),
                                        __name__="mtraining_lenient_pickle")


def load_common(path: str) -> Dict[str, Any]:
    """The common (non-tensor) state of a torch_dist checkpoint: ``common.pt``, or the
    ``common_state`` object that newer megatron-core keeps inside the DCP files. Checkpoints are
    trusted files (as in Megatron, the argument namespace is unpickled; classes of another
    megatron-core version are replaced by placeholders)."""
    import io

    import torch.distributed.checkpoint as dcp

    folder = checkpoint_dir(path)
    legacy = os.path.join(folder, "common.pt")
    if os.path.isfile(legacy):
        return torch.load(legacy, map_location="cpu", weights_only=False, pickle_module=_LENIENT_PICKLE)
    class RawBytes(dcp.DefaultLoadPlanner):  # the stored bytes as they are; unpickled below
        def load_bytes(self, read_item, value):
            self.state_dict[read_item.dest_index.fqn].write(value.read())

    key = "common_state/shard_0_1"
    buffer = io.BytesIO()
    dcp.load({key: buffer}, storage_reader=dcp.FileSystemReader(folder), planner=RawBytes(), no_dist=True)
    buffer.seek(0)
    return torch.load(buffer, map_location="cpu", weights_only=False, pickle_module=_LENIENT_PICKLE)[0]


def checkpoint_dir(path: str) -> str:
    """The folder holding one checkpoint's tensors: ``path`` itself, or the iteration its tracker
    file names (``release`` or ``iter_NNNNNNN``)."""
    tracker = os.path.join(path, TRACKER)
    if os.path.isfile(tracker):
        with open(tracker) as f:
            text = f.read().strip()
        name = RELEASE if text == RELEASE else f"iter_{int(text):07d}"
        path = os.path.join(path, name)
    if not os.path.isfile(os.path.join(path, "metadata.json")):
        raise ConversionError(f"{path} is not a torch_dist checkpoint (no metadata.json; "
                              "Megatron saves this format with --ckpt-format torch_dist, its default)")
    return path


def read_saved_args(path: str) -> Optional[argparse.Namespace]:
    """The argument namespace Megatron stored in a torch_dist checkpoint (None if absent)."""
    return load_common(path).get("args")


def load_megatron_state(path: str, shape: ModelShape, padded_vocab: int, dtype: torch.dtype
                        ) -> Dict[str, torch.Tensor]:
    """The model tensors of a torch_dist checkpoint, by megatron-core local-spec state-dict key,
    whatever TP / PP / layer spec it was saved with; its optimizer state is not read."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    folder = checkpoint_dir(path)
    model = build_gpt(shape, padded_vocab, dtype=dtype)
    pieces = [(name, piece) for name, piece in _sharded_pieces(model) if not isinstance(piece, ShardedObject)]
    wanted = {piece.key: torch.empty(piece.global_shape, dtype=dtype) for _, piece in pieces}
    stored = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    problems = [f"{key} is not in it" for key in wanted if key not in stored]
    problems += [f"{key} is {tuple(stored[key].size)} in it, the model needs {tuple(wanted[key].shape)}"
                 for key in wanted if key in stored and tuple(stored[key].size) != tuple(wanted[key].shape)]
    if problems:
        raise ConversionError(f"the checkpoint at {folder} does not hold the model its arguments describe: "
                              + "; ".join(problems[:6]) + (f" (and {len(problems) - 6} more)" if len(problems) > 6 else ""))
    dcp.load(wanted, storage_reader=dcp.FileSystemReader(folder), no_dist=True)
    state: Dict[str, torch.Tensor] = {}
    for name, piece in pieces:
        part = wanted[piece.key][_piece_slice(piece)]
        state[name] = part if name not in state else torch.cat([state[name], part], dim=0)
    return state
