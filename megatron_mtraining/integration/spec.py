"""GPT layer specs whose core attention is MTrainingAttention.

``get_gpt_layer_spec`` rewrites the ``self_attention.submodules.core_attention`` slot of a
megatron-core GPT layer spec (the local spec by default; the Transformer Engine spec has the
same slot, where it replaces ``TEDotProductAttention``). Everything else in the spec (fused
layer-norm linears, MLP, MoE) is kept as it is.

The slot becomes ``ModuleSpec(module=MTrainingAttention, params={"mtraining_config": config,
"dense_layers": n}, submodules=MTrainingAttentionSubmodules(indexer=...))``: the settings are
data in the spec, and megatron-core builds the module with ``params`` as keyword arguments, as
for any of its own modules. No module-level state is set.
"""

from __future__ import annotations

import copy
from typing import Optional

from ..config import MTrainingConfig
from .core_attention import MTrainingAttention
from .indexer import MTrainingAttentionSubmodules

__all__ = ["get_gpt_layer_spec", "mtraining_attention_spec"]


def _module_name(module) -> str:
    if isinstance(module, tuple):  # (import path, name)
        return str(module[-1])
    return getattr(module, "__name__", type(module).__name__)


def _set_core_attention(layer_spec, where: str, core_attention) -> None:
    """Point one transformer layer spec's core attention at MTrainingAttention, in place."""
    layer_sub = getattr(layer_spec, "submodules", None)
    self_attention = getattr(layer_sub, "self_attention", None)
    attn_sub = getattr(self_attention, "submodules", None)
    if attn_sub is None or not hasattr(attn_sub, "core_attention"):
        raise ValueError(f"{where}: expected a transformer layer spec with "
                         "submodules.self_attention.submodules.core_attention, got "
                         f"{_module_name(getattr(layer_spec, 'module', layer_spec))}")
    kind = _module_name(getattr(self_attention, "module", "")) + " " + type(attn_sub).__name__
    if "MLA" in kind:
        raise ValueError(f"{where}: multi-latent attention (MLA) is not supported by MTraining "
                         "(its q/k and v head dims differ)")
    attn_sub.core_attention = core_attention


def mtraining_attention_spec(config: Optional[MTrainingConfig] = None, dense_layers: int = 0, indexer=None):
    """The core-attention ``ModuleSpec``: ``MTrainingAttention`` with ``config`` and
    ``dense_layers`` in its params, and ``indexer`` (a module class or ``ModuleSpec``; default
    ``MTrainingIndexer``) as its indexer submodule. Without ``config`` the params carry none and
    the attention takes ``MTrainingConfig()``."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if config is not None and not isinstance(config, MTrainingConfig):
        raise TypeError(f"get_gpt_layer_spec: config must be an MTrainingConfig, got {type(config).__name__}")
    if isinstance(dense_layers, bool) or not isinstance(dense_layers, int) or dense_layers < 0:
        raise ValueError(f"get_gpt_layer_spec: dense_layers must be an integer >= 0, got {dense_layers!r}")
    params = {}
    if config is not None:
        params["mtraining_config"] = config
    if config is not None or dense_layers:
        params["dense_layers"] = dense_layers
    submodules = MTrainingAttentionSubmodules() if indexer is None else MTrainingAttentionSubmodules(indexer=indexer)
    return ModuleSpec(module=MTrainingAttention, params=params, submodules=submodules)


def get_gpt_layer_spec(config: Optional[MTrainingConfig] = None, base_spec=None, dense_layers: int = 0,
                       indexer=None):
    """A deep copy of ``base_spec`` with MTrainingAttention as every layer's core attention.

    ``base_spec``: a GPT transformer-layer ``ModuleSpec`` (default:
    ``get_gpt_layer_local_spec()``; a Transformer Engine spec works the same way), or a
    ``TransformerBlockSubmodules`` (``.layer_specs``, e.g. from ``get_gpt_decoder_block_spec``).
    ``config``: the MTraining settings of the attention and its indexer (default:
    ``MTrainingConfig()``); ``dense_layers``: layers with ``layer_number <= dense_layers``
    (1-based, global across pipeline stages) use the dense index. Both go into the core
    attention's ``ModuleSpec.params`` (``mtraining_attention_spec``).
    ``indexer``: a module class or ``ModuleSpec`` replacing ``MTrainingIndexer`` as the
    pre-attention index step (see ``indexer.py``).
    """
    core_attention = mtraining_attention_spec(config, dense_layers=dense_layers, indexer=indexer)
    if base_spec is None:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        base_spec = get_gpt_layer_local_spec()
    spec = copy.deepcopy(base_spec)
    layer_specs = getattr(spec, "layer_specs", None)
    if layer_specs is not None:  # TransformerBlockSubmodules
        if not layer_specs:
            raise ValueError("get_gpt_layer_spec: the block spec has no layer_specs")
        for i, layer_spec in enumerate(layer_specs):
            _set_core_attention(layer_spec, f"get_gpt_layer_spec: layer_specs[{i}]", core_attention)
    else:
        _set_core_attention(spec, "get_gpt_layer_spec", core_attention)
    return spec
