"""Packed documents (docs/design.md §1): ``cu_seqlens`` and the tables the kernels read.

A packed sequence of ``N`` tokens holds documents given by ``cu_seqlens``, int32
``[0, e1, ..., N]`` of GLOBAL positions, strictly increasing, the same on every batch element and
every context-parallel rank. Query ``n`` may attend key ``m`` only if both lie in one document;
the vertical-slash block grid stays global, so a block may straddle a document boundary (a
token-level mask applies there, as on the causal diagonal). One document ``[0, N]`` is exactly
the unpacked function.

Everything is derived on the tensors' device with fixed shapes (no host synchronisation):
  doc_start          int32 [N]   global position -> first position of its document
  block_first_start  int32 [nb]  global block -> the document start of its first token (the
                                 earliest document any of its queries reads)
  block_last_start   int32 [nb]  global block -> the document start of its last token (keys
                                 before it are in another document for SOME query of the block:
                                 a token-level mask is needed there)
  key_block_floor    int32 [nb]  global query block -> the first key block that can share a
                                 document with one of its queries (earlier blocks are skipped)
Checking the VALUES of ``cu_seqlens`` (start, end, increasing) needs them on the host:
``check_cu_seqlens`` does it for free on CPU tensors, and ``validate_cu_seqlens`` on any device
(one synchronisation: call it once per batch, never per layer).
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Optional

import torch
import torch.distributed as dist

from .index import value_checks


def check_cu_seqlens_structure(cu_seqlens: torch.Tensor, where: str = "cu_seqlens") -> None:
    """dtype, rank and length checks; no host synchronisation."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise ValueError(f"{where} must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise ValueError(f"{where} must be int32, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1:
        raise ValueError(f"{where} must be 1-D [num_documents + 1], got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.numel() < 2:
        raise ValueError(f"{where} needs at least two entries [0, seq_len], got {cu_seqlens.numel()}")


def validate_cu_seqlens(cu_seqlens: torch.Tensor, seq_len: int, where: str = "cu_seqlens") -> None:
    """Full check against the global sequence length. Synchronises with the device on GPU
    tensors: once per batch is fine, per layer is not."""
    check_cu_seqlens_structure(cu_seqlens, where)
    values = cu_seqlens.detach().to("cpu", torch.int64)
    if int(values[0]) != 0:
        raise ValueError(f"{where} must start at 0, got {int(values[0])}")
    if int(values[-1]) != seq_len:
        raise ValueError(f"{where} must end at the global sequence length {seq_len}, got {int(values[-1])}")
    steps = values[1:] - values[:-1]
    if bool((steps <= 0).any()):
        bad = int(torch.nonzero(steps <= 0)[0])
        raise ValueError(f"{where} must be strictly increasing (every document at least one token); "
                         f"entries {bad} and {bad + 1} are {int(values[bad])} and {int(values[bad + 1])}")


def check_cu_seqlens(cu_seqlens: torch.Tensor, seq_len: int, where: str = "cu_seqlens") -> None:
    """The checks that are free here: the full check on CPU tensors (and on GPU ones with
    MTRAINING_VALIDATE=1, ``index.value_checks``), the structure elsewhere."""
    if isinstance(cu_seqlens, torch.Tensor) and value_checks(cu_seqlens.device):
        validate_cu_seqlens(cu_seqlens, seq_len, where)
    else:
        check_cu_seqlens_structure(cu_seqlens, where)


_CHECKED = []  # weak references to the cu_seqlens tensors already checked, with their versions
_CHECKED_KEEP = 8


def _already_checked(cu_seqlens: torch.Tensor, seq_len: int, group) -> bool:
    for ref, version, length, grp in _CHECKED:
        if ref() is cu_seqlens and version == cu_seqlens._version and length == seq_len and grp is group:
            return True
    return False


def _checksum(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """int64 [2]: (number of entries, a position-weighted sum of them): equal values give equal
    sums, and a change of any entry changes the sum (odd weights, no wrap at these sizes)."""
    values = cu_seqlens.to(torch.int64)
    weights = 2 * torch.arange(values.numel(), device=values.device, dtype=torch.int64) + 1
    return torch.stack([torch.tensor(values.numel(), device=values.device), (values * weights).sum()])


def check_documents_across_ranks(cu_seqlens: torch.Tensor, seq_len: int, group=None) -> None:
    """Full check of ``cu_seqlens`` and, over ``group``, that every rank holds the same one: an
    all-reduce of a checksum (MIN and MAX), so every rank sees a disagreement and raises, none
    hangs. Once per tensor (kept by weak reference): one synchronisation per batch when the
    layers of an iteration share the tensor."""
    if _already_checked(cu_seqlens, seq_len, group):
        return
    validate_cu_seqlens(cu_seqlens, seq_len)
    if group is not None and dist.get_world_size(group) > 1:
        device = cu_seqlens.device if dist.get_backend(group) == "nccl" else torch.device("cpu")
        mine = _checksum(cu_seqlens.to(device))
        low, high = mine.clone(), mine.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
        if not torch.equal(low, high):
            raise ValueError(
                f"cu_seqlens differ across the context-parallel ranks (rank {dist.get_rank(group)} has "
                f"{cu_seqlens.tolist()}): every rank must pass the documents of the WHOLE packed sequence, "
                "in global positions, not those of its own shard")
    _CHECKED.append((weakref.ref(cu_seqlens), cu_seqlens._version, seq_len, group))
    del _CHECKED[:-_CHECKED_KEEP]


def document_starts(cu_seqlens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """int32: the first position of the document holding each of ``positions``."""
    cu = cu_seqlens.to(device=positions.device, dtype=torch.int64)
    which = torch.searchsorted(cu, positions.to(torch.int64), right=True) - 1
    return cu[which.clamp(0, cu.numel() - 1)].to(torch.int32)


@dataclasses.dataclass
class Documents:
    """The kernels' view of ``cu_seqlens`` for one global sequence length and block size."""

    cu_seqlens: torch.Tensor      # int32 [docs + 1], on the attention's device
    seq_len: int
    block_size: int
    doc_start: torch.Tensor          # int32 [seq_len]
    block_first_start: torch.Tensor  # int32 [seq_len // block_size]
    block_last_start: torch.Tensor   # int32 [seq_len // block_size]
    key_block_floor: torch.Tensor    # int32 [seq_len // block_size]

    @classmethod
    def build(cls, cu_seqlens: torch.Tensor, seq_len: int, block_size: int,
              device: Optional[torch.device] = None) -> "Documents":
        check_cu_seqlens(cu_seqlens, seq_len)
        device = cu_seqlens.device if device is None else device
        cu = cu_seqlens.to(device)
        doc_start = document_starts(cu, torch.arange(seq_len, device=device))
        if seq_len % block_size:
            raise ValueError(f"sequence length {seq_len} is not a multiple of block_size {block_size}")
        first = doc_start[::block_size].contiguous()
        last = doc_start[block_size - 1::block_size].contiguous()
        return cls(cu, int(seq_len), int(block_size), doc_start.contiguous(), first, last,
                   (first // block_size).to(torch.int32).contiguous())


_BUILT = []  # (weak reference to cu_seqlens, its version, seq_len, block_size, device, Documents)


def as_documents(cu_seqlens: Optional[torch.Tensor], seq_len: int, block_size: int,
                 device: torch.device) -> Optional[Documents]:
    """``Documents`` for an optional ``cu_seqlens`` (None: one unbroken sequence). The tables of
    the last few tensors are kept (by weak reference, so a new batch's tensor is built anew), so
    the layers of one iteration, which share the tensor, build them once."""
    if cu_seqlens is None:
        return None
    device = torch.device(device)
    for ref, version, length, block, dev, docs in _BUILT:
        if (ref() is cu_seqlens and version == cu_seqlens._version and length == seq_len and block == block_size
                and dev == device):
            return docs
    docs = Documents.build(cu_seqlens, seq_len, block_size, device)
    _BUILT.append((weakref.ref(cu_seqlens), cu_seqlens._version, seq_len, block_size, device, docs))
    del _BUILT[:-_CHECKED_KEEP]
    return docs
