"""Packed documents from Megatron's data paths, handed to MTrainingAttention as ``Documents``.

MTraining attention takes packed documents as a ``documents.Documents`` (docs/design.md §1: built
from ``cu_seqlens``, int32 ``[0, e1, ..., N]`` in GLOBAL positions, shared by the batch and by
every context-parallel rank), never as an S x S mask. ONE object per micro-batch, built and
checked once, carries every derived table (the kernels', the approximator's, RoPE's) to every
layer. Megatron packs documents in two ways, and both reach the layers:

1. THD batches (``--sft``, ``--dataloader-inter-document-masking``): ``PackedSeqParams`` with
   ``qkv_format='thd'`` travels with the forward to every layer (and every pipeline stage: Megatron
   broadcasts the THD metadata to all of them). The micro-batch is one flat sequence of
   ``micro_batch_size * seq_length`` tokens (``flatten_batch_for_packed_sequences``) and
   ``cu_seqlens_q_padded`` (else ``cu_seqlens_q``) are its documents in global positions: exactly
   MTraining's ``cu_seqlens``. The ``Documents`` ride on that tensor (``thd_documents``): the
   first layer's RoPE or attention builds them, every later one (and a recompute's re-run) finds
   them there. Context parallelism splits that flat sequence in the MTraining layout
   (``patches/batch.py``), not per document, so no per-document padding is needed; RoPE restarts
   per document as in Megatron (``thd_rope_freqs``).
2. Pretraining with ``--reset-attention-mask`` (plus ``--reset-position-ids`` / ``--eod-mask-loss``):
   Megatron's GPT dataset ends a document after each EOD token (``_get_ltor_masks_and_position_ids``
   in ``megatron/core/datasets/gpt_dataset.py``), and with ``--reset-position-ids`` the position ids
   restart at 0 there. The CP batch split (``patches/batch.py``), the one place that sees the WHOLE
   micro-batch before it is cut into CP shards, calls ``prepare_batch``: the documents come from
   ``position_ids == 0`` when ``--reset-position-ids`` is on, else from the EOD tokens, are turned
   into ``Documents`` on the batch's device, validated once, and left in this module's "current
   batch documents" holder, which every MTrainingAttention of that forward reads
   (``documents_for_attention``). The holder is a module global because nothing else reaches
   core attention here: Megatron's GPT forward passes core attention only q/k/v, the
   attention_mask (None with ``--no-create-attention-mask-in-dataloader``) and
   ``packed_seq_params`` (which must stay None: it would switch Megatron to THD); a stale holder
   is an error (its length and batch size must match the attention's). The dataloader's
   attention_mask, if any, is not used for masking (said once in the log):
   ``--no-create-attention-mask-in-dataloader`` saves building it.
   RoPE: megatron-core's GPTModel does not read ``position_ids`` for RoPE (only learned absolute
   position embeddings do), so with ``--reset-position-ids`` Megatron's own attention rotates by
   the global positions; MTraining does the same. Within a document only position differences
   enter the scores, so this equals restarting the positions per document (up to rounding).

Host synchronisation: the number of documents is data dependent, so ``prepare_batch`` makes ONE
host synchronisation per micro-batch (``torch.nonzero`` of the document starts; the micro-batch
check and the validation read small tensors right after it, when the stream is already drained),
and compares the CP ranks' documents there. THD batches: one synchronisation per micro-batch
(the validation, where the ``Documents`` are built). The layers add none.

Activation recompute and pipeline parallelism. THD documents ride in ``packed_seq_params``, which
Megatron's recompute hands to the re-run forward as it did to the first (an input of the
checkpointed function, or a closure of it), so they need nothing here. Documents from the holder
are tied to the forward that read them: the no-grad first pass of a recompute keeps the tensor it
used on the module, and the re-run (a forward inside the backward) takes that one back instead of
reading the holder again, so a batch split between a forward and its backward (a prefetching loop,
another micro-batch) cannot change the documents of a re-run. Megatron hands intermediate pipeline
stages no pretraining batch at all (``get_batch`` returns Nones there, so those stages never see the
document boundaries; Megatron's own attention falls back to causal there), so the EOD /
position-id path needs pipeline size 1 (``patches.validate_megatron_config`` says so at start-up);
``--dataloader-inter-document-masking`` is the packed path that works with pipeline parallelism.

Settings: the Megatron flags are read from Megatron-LM's parsed arguments (``megatron.training``'s
global args and tokenizer, when a Megatron-LM run has set them), or set explicitly with
``configure_packing`` (megatron-core users without ``megatron.training``).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from typing import Any, Dict, Optional

import torch

import torch.distributed as dist

from ..documents import Documents
from ..layout import local_positions_on

logger = logging.getLogger(__name__)

__all__ = ["BatchDocuments", "PackingOptions", "clear_batch_documents", "configure_packing",
           "current_batch_documents", "documents_for_attention", "documents_from_batch",
           "packing_options", "prepare_batch", "reset_packing", "set_batch_documents", "thd_documents",
           "thd_rope_freqs"]


# ------------------------------------------------------------------------------ settings

@dataclasses.dataclass(frozen=True)
class PackingOptions:
    """Megatron's packing flags, as far as MTraining needs them.

    reset_attention_mask: ``--reset-attention-mask``: attention stays within documents.
    reset_position_ids: ``--reset-position-ids``: position ids restart at 0 at each document start
        (then the documents are read off them; otherwise off the EOD tokens).
    eod_token: the end-of-document token id; None: the Megatron-LM tokenizer's ``eod`` (needed only
        with ``reset_attention_mask`` and without ``reset_position_ids``).
    """

    reset_attention_mask: bool = False
    reset_position_ids: bool = False
    eod_token: Optional[int] = None


# Megatron's API: the packing flags of a megatron-core run, which has no parsed global arguments.
_EXPLICIT: Optional[PackingOptions] = None


def configure_packing(reset_attention_mask: bool = False, reset_position_ids: bool = False,
                      eod_token: Optional[int] = None) -> PackingOptions:
    """Set the packing flags explicitly (they then win over Megatron-LM's parsed arguments)."""
    global _EXPLICIT
    _EXPLICIT = PackingOptions(bool(reset_attention_mask), bool(reset_position_ids),
                               None if eod_token is None else int(eod_token))
    return _EXPLICIT


def reset_packing() -> None:
    """Forget the explicit flags and the current batch's documents."""
    global _EXPLICIT
    _EXPLICIT = None
    clear_batch_documents()


def _megatron_global(name: str):
    """A global of ``megatron.training.global_vars`` if a Megatron-LM run has loaded and set it
    (never imported here: megatron-core alone has no ``megatron.training``)."""
    module = sys.modules.get("megatron.training.global_vars")
    return getattr(module, name, None) if module is not None else None


def packing_options() -> PackingOptions:
    """The explicit flags (``configure_packing``), else Megatron-LM's parsed arguments, else none."""
    if _EXPLICIT is not None:
        return _EXPLICIT
    args = _megatron_global("_GLOBAL_ARGS")
    if args is None:
        return PackingOptions()
    return PackingOptions(bool(getattr(args, "reset_attention_mask", False)),
                          bool(getattr(args, "reset_position_ids", False)))


def _eod_token(options: PackingOptions) -> int:
    if options.eod_token is not None:
        return options.eod_token
    tokenizer = _megatron_global("_GLOBAL_TOKENIZER")
    eod = getattr(tokenizer, "eod", None) if tokenizer is not None else None
    if eod is None:
        raise ValueError("MTraining packed documents (--reset-attention-mask without --reset-position-ids): the "
                         "documents end at EOD tokens, but no Megatron-LM tokenizer with an `eod` id is set; add "
                         "--reset-position-ids (documents then come from the position-id resets) or call "
                         "megatron_mtraining.integration.packing.configure_packing(eod_token=...)")
    return int(eod)


# ------------------------------------------------------------------------------ the current batch

@dataclasses.dataclass(frozen=True)
class BatchDocuments:
    """The documents of the current micro-batch (on the batch's device), shared by its
    ``batch_size`` samples."""

    documents: Documents
    batch_size: int
    source: str  # "position_ids" or "eod"

    @property
    def cu_seqlens(self) -> torch.Tensor:
        return self.documents.cu_seqlens

    @property
    def seq_len(self) -> int:
        return self.documents.seq_len


# The one global of the packed path: for [s, b, ...] batches nothing per call of ours reaches core
# attention (module docstring). Set by every CP batch split, checked against each attention's shape.
_CURRENT: Optional[BatchDocuments] = None


def set_batch_documents(documents: Optional[BatchDocuments]) -> None:
    global _CURRENT
    if documents is not None and not isinstance(documents, BatchDocuments):
        raise TypeError(f"set_batch_documents expects BatchDocuments or None, got {type(documents).__name__}")
    _CURRENT = documents


def clear_batch_documents() -> None:
    set_batch_documents(None)


def current_batch_documents() -> Optional[BatchDocuments]:
    """What the last batch split left for the layers (None: no packed documents)."""
    return _CURRENT


_LOGGED = set()  # log once: messages already logged (changes no result)


def _log_once(key: str, message: str, *args) -> None:
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.info(message, *args)


def documents_from_batch(tokens: Optional[torch.Tensor], position_ids: Optional[torch.Tensor],
                         options: PackingOptions, cp_group=None) -> Optional[BatchDocuments]:
    """The documents of a FULL (not CP-split) pretraining micro-batch ``[b, s]`` as Megatron's GPT
    dataset draws them (None without ``--reset-attention-mask``): a document starts at position 0,
    and where ``position_ids == 0`` (``--reset-position-ids``) or right after an EOD token. Built on
    the batch's device; one host synchronisation (``torch.nonzero``). ValueError when the samples
    of the micro-batch have different documents (MTraining's ``cu_seqlens`` is shared by the batch).
    With a context-parallel ``cp_group`` the ranks' documents are compared here too, once, while
    the stream is drained (the layers then take the object as checked and do not synchronise)."""
    if not options.reset_attention_mask:
        return None
    if options.reset_position_ids and position_ids is not None:
        starts, source = position_ids == 0, "position_ids"
    elif tokens is not None:
        starts = torch.zeros(tokens.shape, dtype=torch.bool, device=tokens.device)
        starts[:, 1:] = tokens[:, :-1] == _eod_token(options)
        source = "eod"
    else:
        raise ValueError("MTraining packed documents (--reset-attention-mask): this batch has neither tokens nor "
                         "position_ids to find the document boundaries in (an intermediate or last pipeline "
                         "stage?); use pipeline-parallel size 1, or --dataloader-inter-document-masking")
    if starts.dim() != 2:
        raise ValueError(f"MTraining packed documents: expected [micro_batch, seq] tokens / position_ids, got "
                         f"shape {tuple(starts.shape)}")
    starts = starts.clone()
    starts[:, 0] = True
    b, s = starts.shape
    differ = (starts[1:] != starts[:1]).any(dim=1) if b > 1 else None
    begins = torch.nonzero(starts[0]).flatten()  # the host synchronisation of this batch
    if differ is not None and bool(differ.any()):  # read after the sync: nothing left to wait for
        rows = [0] + [i + 1 for i in torch.nonzero(differ).flatten().tolist()]
        raise ValueError(f"MTraining packed documents: the samples of this micro-batch ({b} samples) have different "
                         f"document boundaries (samples {rows[:2]} differ), but MTraining's cu_seqlens is shared by "
                         "the micro-batch; use --micro-batch-size 1, or --dataloader-inter-document-masking (one "
                         "packed THD sequence per micro-batch)")
    cu = torch.cat([begins, begins.new_full((1,), s)]).to(torch.int32)
    documents = Documents(cu, s, "packed documents (cu_seqlens from the batch)")
    documents.check_across_ranks(cp_group)
    return BatchDocuments(documents, int(b), source)


def _real_group(cp_group):
    """``cp_group`` if it is a process group of more than one rank (else None: no cross-rank check)."""
    if cp_group is None or not (dist.is_available() and dist.is_initialized()):
        return None
    if not isinstance(cp_group, dist.ProcessGroup):
        return None
    return cp_group if dist.get_world_size(cp_group) > 1 else None


def prepare_batch(batch: Dict[str, Any], cp_group=None) -> Optional[BatchDocuments]:
    """Called by the CP batch split with the FULL micro-batch: sets (or clears) the current batch's
    documents for the layers of the coming forward. THD batches (a ``cu_seqlens`` entry) carry
    theirs in ``PackedSeqParams`` and clear the holder. ``cp_group``: the context-parallel group
    the batch is split over (its ranks' documents are compared here)."""
    if not isinstance(batch, dict):
        clear_batch_documents()
        return None
    options = packing_options()
    if batch.get("cu_seqlens") is not None or not options.reset_attention_mask:
        clear_batch_documents()
        return None
    documents = documents_from_batch(batch.get("tokens"), batch.get("position_ids"), options, _real_group(cp_group))
    set_batch_documents(documents)
    _log_once("documents", "MTraining: packed documents (--reset-attention-mask) from %s reach every attention "
              "layer as one Documents object (one host synchronisation per micro-batch)",
              "the position-id resets" if documents.source == "position_ids" else "the EOD tokens")
    if batch.get("attention_mask") is not None:
        _log_once("mask", "MTraining: the dataloader's attention_mask is ignored (documents reach MTraining "
                  "attention as cu_seqlens); --no-create-attention-mask-in-dataloader saves building it")
    return documents


# ------------------------------------------------------------------------------ THD batches

# Megatron attaches its own flags to tensors (``param.sequence_parallel``); this is ours: the
# (tensor version, Documents) of a THD cu_seqlens tensor. The version makes an in-place change of
# the tensor rebuild (and re-check) the documents instead of using stale tables.
_THD_ATTRIBUTE = "_mtraining_documents"


def _documents_on_tensor(cu_seqlens, seq_len: int) -> Documents:
    """The ``Documents`` of a THD ``cu_seqlens`` tensor for ``seq_len`` GLOBAL tokens: built (and
    checked: one synchronisation on GPUs) by the first layer of the micro-batch that asks,
    attached to the tensor Megatron hands every layer, found there by the others."""
    attached = getattr(cu_seqlens, _THD_ATTRIBUTE, None)
    if attached is not None and attached[0] == cu_seqlens._version and attached[1].seq_len == seq_len:
        return attached[1]
    documents = Documents(cu_seqlens, seq_len, "THD cu_seqlens (packed_seq_params)")
    setattr(cu_seqlens, _THD_ATTRIBUTE, (cu_seqlens._version, documents))
    return documents


def thd_documents(packed_seq_params, seq_len: int) -> Documents:
    """The documents of a THD batch (``cu_seqlens_q_padded``, else ``cu_seqlens_q``, as Megatron's
    RoPE and Transformer Engine take them) for a flat sequence of ``seq_len`` GLOBAL tokens; built
    once per micro-batch (``_documents_on_tensor``)."""
    fmt = getattr(packed_seq_params, "qkv_format", None)
    if fmt != "thd":
        raise ValueError(f"MTrainingAttention takes packed sequences in the THD format only (packed_seq_params."
                         f"qkv_format='thd'), got {fmt!r}")
    if getattr(packed_seq_params, "local_cp_size", None) is not None or \
            getattr(packed_seq_params, "cp_group", None) is not None:
        raise ValueError("MTrainingAttention does not support hybrid context parallelism (packed_seq_params with "
                         "local_cp_size / cp_group)")
    q = getattr(packed_seq_params, "cu_seqlens_q_padded", None)
    kv = getattr(packed_seq_params, "cu_seqlens_kv_padded", None)
    if q is None:
        q, kv = getattr(packed_seq_params, "cu_seqlens_q", None), getattr(packed_seq_params, "cu_seqlens_kv", None)
    if q is None:
        raise ValueError("MTrainingAttention: THD packed_seq_params without cu_seqlens_q")
    if isinstance(q, torch.Tensor) and q.dim() == 2 and q.shape[0] == 1:
        raise ValueError("MTrainingAttention: THD cu_seqlens must be 1-D (Megatron squeezes the batch dim in "
                         f"forward_step), got shape {tuple(q.shape)}")
    documents = _documents_on_tensor(q, seq_len)
    if kv is not None and kv is not q and getattr(kv, _THD_ATTRIBUTE, (None, None))[1] is not documents:
        if not isinstance(kv, torch.Tensor) or kv.shape != q.shape or not torch.equal(kv, q):
            raise ValueError("MTrainingAttention is self attention: THD cu_seqlens_q and cu_seqlens_kv must be equal")
        setattr(kv, _THD_ATTRIBUTE, (kv._version, documents))
    return documents


# ------------------------------------------------------------------------------ the attention's documents

def _in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (a recompute's re-run)."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


def documents_for_attention(module, packed_seq_params, seq_len: int, batch_size: int) -> Optional[Documents]:
    """The ``Documents`` an MTrainingAttention forward attends with (None: one causal sequence):
    THD ``packed_seq_params``, else the current batch's. ``seq_len``: GLOBAL tokens.

    Recompute: the no-grad first pass of a training forward keeps what it used on ``module``; the
    re-run (a forward inside the backward, as activation recompute does it) takes it back."""
    if packed_seq_params is not None:
        module._recompute_documents = None
        return thd_documents(packed_seq_params, seq_len)
    in_backward = _in_backward()
    kept = getattr(module, "_recompute_documents", None)  # None, or (documents,) of a first pass
    if module.training and torch.is_grad_enabled() and in_backward and kept is not None:
        module._recompute_documents = None
        documents = kept[0]
    else:
        documents = current_batch_documents()
        first_pass = module.training and not torch.is_grad_enabled() and not in_backward
        module._recompute_documents = (documents,) if first_pass else None
    if documents is None:
        return None
    if documents.seq_len != seq_len or documents.batch_size != batch_size:
        raise ValueError(f"MTraining packed documents: the current batch's documents cover {documents.batch_size} x "
                         f"{documents.seq_len} tokens, but this attention sees {batch_size} x {seq_len} (global); "
                         "the documents are set by the CP batch split (patches.install) for each micro-batch")
    return documents.documents


# ------------------------------------------------------------------------------ RoPE of THD over CP

def thd_rope_freqs(freqs: torch.Tensor, cu_seqlens: torch.Tensor, local_tokens: int, world_size: int, rank: int,
                   layout: str, block_size: int) -> torch.Tensor:
    """RoPE rows ``[local_tokens, 1, 1, d]`` of this rank's THD tokens in the MTraining layout, as
    Megatron's ``_apply_rotary_pos_emb_thd`` picks them on one device: a token at global position
    ``p`` of a document starting at ``s`` takes row ``p - s`` of ``freqs`` (``[max_seqlen, 1, 1,
    d]``: positions restart per document); when ``freqs`` has a row per packed token (Megatron's
    "exact mapping" case), row ``p``. The gather index is kept on the batch's ``Documents``; no host
    synchronisation but the one that builds them (``_documents_on_tensor``, once per micro-batch)."""
    seq_len = local_tokens * world_size
    positions = local_positions_on(freqs.device, seq_len, layout, world_size, rank, block_size)
    if freqs.shape[0] == seq_len:
        return freqs.index_select(0, positions)
    documents = _documents_on_tensor(cu_seqlens, seq_len)
    key = ("rope rows", freqs.device, layout, world_size, rank, block_size)
    rows = documents.derived(key, lambda: positions - documents.doc_start(freqs.device)[positions].to(positions.dtype))
    return freqs.index_select(0, rows)
