"""MTrainingAttention: megatron-core core attention backed by MTraining sparse attention.

``MTrainingAttention`` has the constructor and forward of megatron-core's core-attention
modules (``DotProductAttention`` / ``TEDotProductAttention``), so it drops into the
``self_attention.submodules.core_attention`` slot of a GPT layer spec (see ``spec.py``):

    forward(query [sq, b, np, hn], key/value [sk, b, ng, hn]) -> [sq, b, np * hn]

The inputs are post-RoPE and hold this context-parallel rank's tokens, in the token layout of
the MTraining config ("striped" or "zigzag"; the batch split and RoPE slicing patches put them
there). Each forward first builds the layer's vertical-slash index from q and k with its
``indexer`` submodule (``indexer.py``: the per-layer pre-attention step), then runs
``sparse_ring_attention`` over the context-parallel group, or ``sparse_attention`` when
CP == 1. A layer with a dense index and ``deterministic=False`` runs the dense kernels instead
where they can (``uses_dense_kernels``). Context parallelism needs neither Transformer Engine
nor apex.

The MTraining settings travel in the layer spec, like every megatron-core module's settings:
``ModuleSpec(module=MTrainingAttention, params={"mtraining_config": cfg, "dense_layers": n})``
(``spec.get_gpt_layer_spec`` builds it); Megatron's ``build_module`` passes ``params`` to the
constructor as keyword arguments, and the attention hands its config on to its indexer.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from megatron.core import parallel_state
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig

from ..attention import sparse_attention
from ..config import MTrainingConfig
from ..index import VSIndex
from ..kernels.dense_kernels import expand_kv
from ..kernels.dispatch import use_dense_kernels
from ..kernels.relayout import heads_major, sequence_major
from ..ring import dense_ring_attention, instrument, sparse_ring_attention
from . import consistency, packing, telemetry
from .indexer import MTrainingAttentionSubmodules
from .patches.engine import check_placement

logger = logging.getLogger(__name__)

__all__ = ["MTrainingAttention", "inner_ring_size"]

def _checked_dense_layers(dense_layers) -> int:
    if isinstance(dense_layers, bool) or int(dense_layers) != dense_layers or dense_layers < 0:
        raise ValueError(f"dense_layers must be an integer >= 0, got {dense_layers!r}")
    return int(dense_layers)


def _group_size(group) -> int:
    if group is None:
        return 1
    size = getattr(group, "size", None)
    return size() if callable(size) else dist.get_world_size(group)


def inner_ring_size(group_ranks, ranks_per_node: Optional[int]) -> Optional[int]:
    """Ranks of the inner (intra-node) ring for a CP group with these global ranks.

    ``ranks_per_node`` (``MTrainingConfig.inner_ring_size``; its default is the launcher's
    ranks per node) counts global ranks, while CP groups are strided by tensor parallelism:
    the inner ring is the CP ranks that share a node. None (flat ring) when the whole group is
    on one node or no ``ranks_per_node`` is set. ValueError when nodes hold unequal or
    non-contiguous parts of the group (the hierarchical ring needs ``W = W_outer * W_inner``).
    """
    if ranks_per_node is None:
        return None
    ranks_per_node = int(ranks_per_node)
    nodes = [r // ranks_per_node for r in group_ranks]
    world = len(nodes)
    per_node = nodes.count(nodes[0])
    if per_node == world:
        return None
    expected = [nodes[i - i % per_node] for i in range(world)]
    if world % per_node or nodes != expected or len(set(nodes)) != world // per_node:
        raise ValueError(f"MTraining: the context-parallel ranks {list(group_ranks)} are not split evenly "
                         f"and contiguously across nodes of {ranks_per_node} ranks "
                         "(--mtraining-inner-ring-size); set it to match the launch or leave it unset")
    return per_node


def _is_window_layer(config: TransformerConfig, layer_number: int) -> bool:
    window_size = getattr(config, "window_size", None)
    if window_size is None:
        return False
    try:
        from megatron.core.transformer.utils import is_layer_window_attention
    except ImportError:  # older megatron-core: every layer uses the window
        return True
    return bool(is_layer_window_attention(window_size, getattr(config, "window_attn_skip_freq", None),
                                          layer_number))


@contextlib.contextmanager
def _untimed(what: str, cuda: bool):
    yield


class MTrainingAttention(MegatronModule):
    """Vertical-slash sparse causal attention with Megatron's core-attention interface.

    Args follow megatron-core's ``DotProductAttention``. ``pg_collection`` (megatron-core >=
    0.14) and ``model_comm_pgs`` (older releases) are the same thing under two names; its
    ``cp`` group is the context-parallel ring. Without either, the CP group comes from
    ``parallel_state``. ``mtraining_config`` and ``dense_layers`` come from the layer spec
    (``ModuleSpec.params``): layers with ``layer_number <= dense_layers`` (1-based, global across
    pipeline stages) use the dense index. Further keyword arguments that newer megatron-core
    versions may pass are accepted and ignored.

    Packed documents (``packing.py``) arrive as THD ``packed_seq_params`` (q ``[t, np, hn]``, out
    ``[t, np*hn]``; ``--sft``, ``--dataloader-inter-document-masking``) or, for ``[s, b, ...]``
    batches, as the current batch's documents set by the CP batch split (``--reset-attention-mask``);
    either way one ``documents.Documents`` per micro-batch reaches the indexer and the kernels, and
    attention stays within documents, never through an S x S mask.

    Not supported (ValueError): non-causal masks, cross attention, attention dropout while
    training, attention bias, packed formats other than THD, sliding-window attention and
    non-vanilla softmax. The ``attention_mask`` argument is ignored: the attention is causal
    (within documents).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
        model_comm_pgs=None,
        mtraining_config: Optional[MTrainingConfig] = None,
        dense_layers: Optional[int] = None,
        submodules: Optional[MTrainingAttentionSubmodules] = None,
        **kwargs,
    ):
        super().__init__(config=config)
        if kwargs:
            logger.debug("MTrainingAttention ignores the arguments %s", sorted(kwargs))
        if pg_collection is not None and model_comm_pgs is not None and pg_collection is not model_comm_pgs:
            raise ValueError("MTrainingAttention: pass pg_collection or model_comm_pgs, not both")

        self.config: TransformerConfig = config
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.cp_comm_type = cp_comm_type  # the ring is MTraining's own; kept for reference only
        self.pg_collection = pg_collection if pg_collection is not None else model_comm_pgs

        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"MTrainingAttention supports only causal attention, got attn_mask_type="
                             f"{getattr(attn_mask_type, 'name', attn_mask_type)}")
        if attention_type != "self":
            raise ValueError(f"MTrainingAttention supports only self attention, got attention_type="
                             f"{attention_type!r}")
        if _is_window_layer(config, layer_number):
            raise ValueError("MTrainingAttention does not support sliding-window attention (window_size)")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(f"MTrainingAttention supports only softmax_type='vanilla', got "
                             f"{config.softmax_type!r}")
        if getattr(config, "qk_clip", False):
            raise ValueError("MTrainingAttention does not support qk_clip (no attention logits are kept)")

        if mtraining_config is None:  # a spec without params: the defaults
            mtraining_config = MTrainingConfig()
        if not isinstance(mtraining_config, MTrainingConfig):
            raise TypeError(f"MTrainingAttention: mtraining_config must be an MTrainingConfig, got "
                            f"{type(mtraining_config).__name__}")
        self.mtraining_config = mtraining_config
        self.dense_layers = 0 if dense_layers is None else _checked_dense_layers(dense_layers)
        self.dense = self.layer_number <= self.dense_layers

        self.attention_dropout_p = float(config.attention_dropout if attention_dropout is None
                                         else attention_dropout)
        head_dim = config.kv_channels
        # apply_query_key_layer_scaling divides the scale by the layer number in the scores and
        # multiplies it back in the softmax: the net scale is unchanged, so it is ignored here.
        self.softmax_scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(head_dim)

        submodules = submodules if submodules is not None else MTrainingAttentionSubmodules()
        self.indexer = build_module(submodules.indexer, config=config, layer_number=self.layer_number,
                                    mtraining_config=self.mtraining_config, dense=self.dense,
                                    softmax_scale=self.softmax_scale)

        # The index of the last forward (telemetry, tests); dropped with the next forward.
        self.last_index: Optional[VSIndex] = None
        self._inner_sizes = {}  # CP group -> inner ring size
        # The autocast dtype of the no-grad first pass of an activation recompute (see forward).
        self._recompute_dtype: Optional[torch.dtype] = None
        # The batch documents of that first pass, for its re-run (packing.documents_for_attention).
        self._recompute_documents = None

    # ------------------------------------------------------------------ process groups

    def cp_group(self):
        """This layer's context-parallel group, or None when CP == 1 (single device)."""
        group = getattr(self.pg_collection, "cp", None) if self.pg_collection is not None else None
        if group is None:
            if not (dist.is_available() and dist.is_initialized()):
                return None
            if not parallel_state.model_parallel_is_initialized():
                return None
            if parallel_state.get_context_parallel_world_size() == 1:
                return None
            group = parallel_state.get_context_parallel_group()
        return group if _group_size(group) > 1 else None

    def ring_inner_size(self, group) -> Optional[int]:
        """The inner ring size of the hierarchical ring over ``group`` (None: flat ring)."""
        if group not in self._inner_sizes:
            ranks = dist.get_process_group_ranks(group)
            self._inner_sizes[group] = inner_ring_size(ranks, self.mtraining_config.inner_ring_size)
        return self._inner_sizes[group]

    # ------------------------------------------------------------------ forward

    def _check_forward_args(self, attn_mask_type, attention_bias, packed_seq_params) -> None:
        if packed_seq_params is not None and getattr(packed_seq_params, "qkv_format", None) != "thd":
            raise ValueError(f"MTrainingAttention takes packed sequences in the THD format only, got packed_seq_params "
                             f"with qkv_format={getattr(packed_seq_params, 'qkv_format', None)!r}")
        if attention_bias is not None:
            raise ValueError("MTrainingAttention does not support attention_bias")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if mask_type != AttnMaskType.causal:
            raise ValueError(f"MTrainingAttention supports only causal attention, got attn_mask_type="
                             f"{getattr(mask_type, 'name', mask_type)}")
        if self.training and self.attention_dropout_p > 0.0:
            raise ValueError(f"MTrainingAttention does not support attention dropout in training "
                             f"(attention_dropout={self.attention_dropout_p}); set attention_dropout=0")

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params=None,
    ) -> Tensor:
        """q ``[sq, b, np, hn]``, k/v ``[sk, b, ng, hn]`` (this rank's tokens) -> ``[sq, b, np*hn]``;
        THD (``packed_seq_params``): q ``[t, np, hn]``, k/v ``[t, ng, hn]`` -> ``[t, np*hn]``."""
        self._check_forward_args(attn_mask_type, attention_bias, packed_seq_params)
        if packed_seq_params is not None and query.dim() == 3:  # THD: one flat packed sequence
            out = self.forward(*(x.unsqueeze(1) for x in (query, key, value)), attention_mask,
                               attn_mask_type, attention_bias, packed_seq_params)
            return out.squeeze(1)
        if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
            raise ValueError(f"MTrainingAttention expects [s, b, heads, head_dim] inputs, got q "
                             f"{tuple(query.shape)}, k {tuple(key.shape)}, v {tuple(value.shape)}")
        sq, b, np_, hn = query.shape
        if key.shape[0] != sq:
            raise ValueError(f"MTrainingAttention is self attention: sq ({sq}) != sk ({key.shape[0]})")

        dtype = self._attention_dtype(query.device.type)
        if dtype is not None:
            # Autocast stays off inside, so that the fp32 statistics and accumulations are not
            # cast down again.
            with torch.autocast(query.device.type, enabled=False):
                return self._attend(*(x.to(dtype) for x in (query, key, value)), packed_seq_params=packed_seq_params)
        return self._attend(query, key, value, packed_seq_params=packed_seq_params)

    def _attention_dtype(self, device_type: str) -> Optional[torch.dtype]:
        """The dtype to attend in: the autocast dtype inside an autocast region, like PyTorch's
        fused attention (megatron-core's layers can hand us fp32 q/k/v there, and the fp32
        kernels are tens of times slower); None (the inputs' own dtype) otherwise.

        Megatron's activation recompute (``tensor_parallel.checkpoint``) runs a no-grad first
        pass, then re-runs the forward in the backward outside the autocast region. The first
        pass's dtype is kept for that re-run, so that it attends, and builds its index, as the
        forward did; any other forward drops it."""
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            first_pass_of_recompute = self.training and not torch.is_grad_enabled()
            self._recompute_dtype = dtype if first_pass_of_recompute else None
            return dtype
        # Outside autocast, the re-run of a recompute (training, with grad) takes the first pass's dtype.
        dtype = self._recompute_dtype if self.training and torch.is_grad_enabled() else None
        self._recompute_dtype = None
        return dtype

    def uses_dense_kernels(self, group, q: Tensor) -> bool:
        """Whether this layer attends with dense kernels (cuDNN or flash on GPUs): when it is
        dense (``--mtraining-index dense``, or one of ``--mtraining-dense-layers``), they compute
        the same causal attention faster than the sparse kernels walking every block, which makes
        the dense run a fair baseline. Only where a dense kernel can express every step: one
        device (SDPA), or the zigzag ring with fp16/bf16 ``q`` on CUDA (``dense_ring_attention``:
        its fp32 steps would materialise the scores; the striped ring's steps are block-causal).
        Elsewhere the sparse kernels run the all-blocks index. Their backward is not guaranteed
        deterministic, so ``deterministic=True`` (the default) keeps the sparse kernels too.
        Decided from this layer's own settings, not the indexer's (a custom indexer keeps none).
        A sequence of at most ``dense_max_seq_length`` tokens (over CP) is dense too. ``q`` is
        ``[b, heads, s_local, hn]``, as the forward holds it."""
        cfg = self.mtraining_config
        short = cfg.dense_max_seq_length > 0 and q.shape[2] * _group_size(group) <= cfg.dense_max_seq_length
        return use_dense_kernels(self.dense or cfg.index == "dense" or short, cfg.deterministic, group is not None,
                                 cfg.layout, q)

    def _attend_dense(self, q: Tensor, k: Tensor, v: Tensor, group) -> Tensor:
        """Exact causal attention with the dense kernels; [b, heads, s, hn] in and out."""
        if group is None:
            groups = q.shape[1] // k.shape[1]
            return torch.nn.functional.scaled_dot_product_attention(
                q, expand_kv(k, groups), expand_kv(v, groups), is_causal=True, scale=self.softmax_scale)
        return dense_ring_attention(q, k, v, group=group, layout="zigzag", inner_size=self.ring_inner_size(group),
                                    softmax_scale=self.softmax_scale, sequence_major_grads=True,
                                    settings=self.mtraining_config.settings)

    def _attend(self, query: Tensor, key: Tensor, value: Tensor, packed_seq_params=None) -> Tensor:
        sq, b, np_, hn = query.shape
        group = self.cp_group()
        if group is not None:  # the tokens and positions this rank holds come from the installed patches
            check_placement(self.mtraining_config, f"layer {self.layer_number}'s spec (its attention)")
        # Packed documents (THD packed_seq_params, or the current batch's): one Documents per batch, or None.
        documents = packing.documents_for_attention(self, packed_seq_params, sq * _group_size(group), b)
        # [s, b, heads, hn] -> [b, heads, s, hn]. The ring sends k/v, so it gets dense tensors (one row
        # copy each, kernels/relayout.py) and writes their gradients back in [s, b, heads, hn] memory
        # (sequence_major_grads); one device reads the strided views as they are.
        if group is not None:
            q, k, v = (heads_major(x) for x in (query, key, value))
        else:
            q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))

        tele = telemetry.get_telemetry()
        # Telemetry counts training forwards that build autograd graphs: not eval forwards, and
        # not the no-grad first pass of an activation recompute (its recompute is counted).
        counted = tele is not None and self.training and torch.is_grad_enabled()
        record = tele.recorder(group) if counted else None
        timed = record.timed if record is not None else _untimed
        cuda = q.is_cuda

        # CP ranks must agree on flags and index: checked in the first forward and at log iterations.
        checking = consistency.due(self, group, record)
        if checking:
            consistency.check_flags(self, group, q)
        with timed("approximator", cuda), torch.profiler.record_function("mtraining::approximator"):
            # the pre-attention step: this layer's VSIndex (custom indexers see documents only when there are some)
            index = (self.indexer(q, k, group) if documents is None
                     else self.indexer(q, k, group, cu_seqlens=documents))
        if checking:
            consistency.check_index(index, group, self.layer_number)
        self.last_index = index
        with timed("attention_fwd", cuda), (instrument.suspended() if tele is not None and not counted
                                            else contextlib.nullcontext()):
            if documents is None and self.uses_dense_kernels(group, q):  # the dense kernels know no documents
                out = self._attend_dense(q, k, v, group)
            elif group is None:
                out = sparse_attention(q, k, v, index, softmax_scale=self.softmax_scale, cu_seqlens=documents,
                                       settings=self.mtraining_config.settings)
            else:
                cfg = self.mtraining_config
                out = sparse_ring_attention(q, k, v, index, group=group, layout=cfg.layout,
                                            inner_size=self.ring_inner_size(group),
                                            softmax_scale=self.softmax_scale, cu_seqlens=documents,
                                            sequence_major_grads=True, settings=cfg.settings)
        if record is not None:
            record.record_index(self.layer_number, index, sq * _group_size(group))
            record.time_backward(out, q, cuda)

        # [b, np, sq, hn] -> [sq, b, np * hn]
        return sequence_major(out).view(sq, b, np_ * hn)

