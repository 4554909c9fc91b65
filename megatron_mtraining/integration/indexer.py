"""MTrainingIndexer: the per-layer pre-attention step that builds the vertical-slash index.

Megatron's in-tree precedent for an attention that needs an index is an attention module that
owns an indexer submodule (``experimental_attention_variant/dsa.py``); MTraining follows it
rather than stashing the index through a forward pre-hook:

* the data flow is explicit: ``index = self.indexer(q, k, group)`` inside the attention's
  forward, so calling ``forward`` directly works and nothing is left behind between calls;
* the indexer shows up in ``print(model)`` and is swapped through the layer spec like any other
  Megatron submodule (``MTrainingAttentionSubmodules(indexer=MyIndexer)``);
* under activation recompute (``--recompute-granularity full`` or ``selective``) the attention
  forward re-runs and so does the indexer; the approximator is deterministic (no colliding
  float atomics, fixed reduction orders), so the recomputed index is bit-identical to the
  first one;
* observers (tests, user tools) can attach ordinary forward hooks to the indexer and see the
  index it returns.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import Tensor

from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from ..approx import approximate_index
from ..block_index import BlockIndex
from ..config import MTrainingConfig
from ..documents import Documents
from ..index import VSIndex

__all__ = ["MTrainingAttentionSubmodules", "MTrainingIndexer"]


class MTrainingIndexer(MegatronModule):
    """Builds one layer's index from its post-RoPE q ``[b, np, s_local, hn]`` and k
    ``[b, ng, s_local, hn]`` with ``approximate_index`` (the ``index`` builder of the config:
    ``vs``, ``dense`` or ``fixed``, a ``VSIndex``; ``moba``, a ``BlockIndex``); layers marked
    dense get the dense index. No parameters;
    no autograd (the index is integer data)."""

    def __init__(self, config: TransformerConfig, layer_number: int, mtraining_config: MTrainingConfig,
                 dense: bool = False, softmax_scale: Optional[float] = None):
        super().__init__(config=config)
        self.layer_number = layer_number
        self.dense = bool(dense)
        self.mtraining_config = (dataclasses.replace(mtraining_config, index="dense") if self.dense
                                 else mtraining_config)
        self.softmax_scale = softmax_scale

    @torch.no_grad()
    def forward(self, q: Tensor, k: Tensor, group=None,
                cu_seqlens: Optional[Documents] = None) -> Union[VSIndex, BlockIndex]:
        """``cu_seqlens``: the packed documents the attention uses, if any (a ``documents.Documents``)."""
        cfg = self.mtraining_config
        return approximate_index(q.detach(), k.detach(), cfg, group=group,
                                 softmax_scale=self.softmax_scale, cu_seqlens=cu_seqlens)

    def extra_repr(self) -> str:
        cfg = self.mtraining_config
        return (f"layer={self.layer_number}, index={cfg.index}, top_p={cfg.top_p}, "
                f"block_size={cfg.block_size}, layout={cfg.layout}")


@dataclass
class MTrainingAttentionSubmodules:
    """Submodules of ``MTrainingAttention`` (set in the layer spec). ``indexer`` is built with
    ``(config=, layer_number=, mtraining_config=, dense=, softmax_scale=)`` and called as
    ``indexer(q, k, group) -> VSIndex``, with packed documents as ``indexer(q, k, group,
    cu_seqlens=documents)``, a ``documents.Documents`` (its ``cu_seqlens`` attribute is the int32
    tensor; ``approximate_index`` takes the object as it is). A custom indexer must accept that
    keyword to train on packed data."""

    indexer: Union[ModuleSpec, type] = MTrainingIndexer
