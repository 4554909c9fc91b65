"""MTraining sparse attention inside a Hugging Face model, for evaluation.

``enable_mtraining_attention(model, config)`` registers ``mtraining_attention_forward`` with
transformers' attention interface under the name "mtraining" and switches the model to it. Every
layer then builds its index from its own post-RoPE queries and keys (``approximate_index``) and
attends with ``sparse_attention``, as it does in training, so a model is evaluated with the
attention it was trained with.

What it accepts: a causal prefill over the whole sequence (query length = key length), batch of
any size without padding. A sequence that is not a multiple of the block size is padded at the end
with zeros and the output sliced back; causal attention leaves the real tokens unaffected (the
padded queries enter the approximator's last-query window: the index can only come out denser).
Decode steps of a generation with a KV cache (query length < key length) run transformers' dense
SDPA over the cache: the sparse index is built for full causal sequences. A padding mask, sliding
windows, logit soft-capping, attention sinks and dropout are refused with an error.
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional

import torch
import torch.nn.functional as F

from ..approx import approximate_index
from ..attention import sparse_attention
from ..config import MTrainingConfig
from .errors import EvaluationError

__all__ = ["CONFIG_ATTRIBUTE", "NAME", "enable_mtraining_attention", "index_densities", "mtraining_attention_config",
           "mtraining_attention_forward", "register"]

NAME = "mtraining"
CONFIG_ATTRIBUTE = "mtraining_config"  # attribute of each attention module: its MTrainingConfig
_DENSITIES = "_mtraining_densities"  # attribute of each attention module: index density per prefill


def mtraining_attention_config(top_p: float = 0.9, block_size: int = 64, index: str = "vs",
                               **fields: Any) -> MTrainingConfig:
    """The ``MTrainingConfig`` of evaluation-time attention: ``index`` "vs" (approximated from
    q and k, as in training) or "dense" (every causal key: the same model, dense). ``fields``:
    other ``MTrainingConfig`` fields (``last_q``, ``min_vertical``, ...)."""
    return MTrainingConfig(top_p=top_p, block_size=block_size, index=index, **fields)


def register() -> None:
    """Register "mtraining" with transformers' attention interface, and sdpa's mask function for it
    (so that a padding mask reaches the attention and is refused, instead of being dropped)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, mtraining_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def enable_mtraining_attention(model, config: Optional[MTrainingConfig] = None, dense_layers: int = 0,
                               record_density: bool = True):
    """Switch the Hugging Face ``model`` to MTraining attention with ``config`` (default:
    ``mtraining_attention_config()``); the first ``dense_layers`` layers get the dense index (as
    ``--mtraining-dense-layers`` trains them). Returns the model."""
    config = config or mtraining_attention_config()
    register()
    layers = _attention_modules(model)
    if not layers:
        raise EvaluationError(f"{type(model).__name__} has no attention modules that use transformers' attention "
                              "interface: MTraining attention cannot be switched on for it")
    if dense_layers < 0 or dense_layers > len(layers):
        raise EvaluationError(f"dense_layers must be in [0, {len(layers)}] (the model's layers), got {dense_layers}")
    dense = dataclasses.replace(config, index="dense")
    for i, module in enumerate(layers):
        setattr(module, CONFIG_ATTRIBUTE, dense if getattr(module, "layer_idx", i) < dense_layers else config)
        setattr(module, _DENSITIES, [] if record_density else None)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(NAME)
    else:
        model.config._attn_implementation = NAME
    return model


def index_densities(model, clear: bool = True) -> List[float]:
    """The mean index density (active over causal query-key pairs) of every prefill each layer ran
    since the last call, in layer order; ``clear`` empties the record."""
    out: List[float] = []
    for module in _attention_modules(model):
        record = getattr(module, _DENSITIES, None)
        if record:
            out += record
            if clear:
                record.clear()
    return out


def mtraining_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None,
                                dropout: float = 0.0, **kwargs: Any):
    """transformers' attention function signature: q ``[b, hq, n, d]``, k/v ``[b, hkv, n_kv, d]``;
    returns ``(out [b, n, hq, d], None)``. The config is the module's (``enable_mtraining_attention``),
    else ``mtraining_attention_config()``; ``module.mtraining_config`` sets it for one module."""
    for name in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise EvaluationError(f"MTraining attention does not support {name} (layer "
                                  f"{getattr(module, 'layer_idx', '?')}): evaluate this model with --attention dense")
    if dropout:
        raise EvaluationError(f"MTraining attention at evaluation takes no dropout (got {dropout}): call model.eval()")
    if kwargs.get("is_causal", getattr(module, "is_causal", True)) is False:
        raise EvaluationError("MTraining attention is causal; this layer is not (an encoder?)")
    if kwargs.get("output_attentions"):
        raise EvaluationError("MTraining attention returns no attention weights: drop output_attentions")
    n, n_kv = query.shape[2], key.shape[2]
    if n != n_kv:  # a decode step (or a chunk) over a KV cache: dense attention over the cache
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if attention_mask is None and n > 1:  # sdpa's is_causal aligns top-left: the cache needs bottom-right
            attention_mask = torch.ones(n, n_kv, dtype=torch.bool, device=query.device).tril(n_kv - n)[None, None]
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=scaling, **kwargs)
    if attention_mask is not None and not _is_plain_causal(attention_mask, n):
        raise EvaluationError("MTraining attention got an attention mask beyond the causal one (padding?): evaluate "
                              "one sequence at a time without padding (batch 1, no attention_mask)")
    config = getattr(module, CONFIG_ATTRIBUTE, None) or mtraining_attention_config()
    pad = -n % config.block_size
    if pad:  # zeros at the end: causal, so the real tokens do not see them
        query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
    index = approximate_index(query, key, config, softmax_scale=scaling)
    out = sparse_attention(query, key, value, index, softmax_scale=scaling)
    record = getattr(module, _DENSITIES, None)
    if record is not None:
        record.append(float(index.density(n + pad).mean()))
    return out[:, :, :n].transpose(1, 2).contiguous(), None


def _is_plain_causal(mask: torch.Tensor, n: int) -> bool:
    """Whether a 4-D mask (bool: True attends; float: 0 attends) is exactly the causal mask."""
    if mask.dim() != 4 or mask.shape[-2:] != (n, n):
        return False
    allowed = mask if mask.dtype == torch.bool else mask == 0
    causal = torch.ones(n, n, dtype=torch.bool, device=mask.device).tril()
    return bool((allowed == causal).all())


def _attention_modules(model) -> List[torch.nn.Module]:
    """The self-attention modules of a transformers decoder (they hold ``layer_idx`` and
    ``num_key_value_groups``), in layer order."""
    found = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "num_key_value_groups")]
    return sorted(found, key=lambda m: m.layer_idx)
