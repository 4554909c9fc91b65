"""Packed documents (docs/design.md §1): one ``Documents`` object per batch, the tables derived from it.

A packed sequence of ``N`` tokens holds documents given by ``cu_seqlens``, int32
``[0, e1, ..., N]`` of GLOBAL positions, strictly increasing, the same on every batch element and
every context-parallel rank. Query ``n`` may attend key ``m`` only if both lie in one document;
the vertical-slash block grid stays global, so a block may straddle a document boundary (a
token-level mask applies there, as on the causal diagonal). One document ``[0, N]`` is exactly
the unpacked function.

``Documents(cu_seqlens, seq_len)`` is the mask as data (like FlexAttention's block mask): built
once per batch, where the batch is made, by the one constructor that checks ``cu_seqlens``, then
passed down to the approximator, the kernels and the ring. It carries every table derived from
``cu_seqlens``, each computed on first use and kept ON the object (so the layers of one batch,
which share the object, compute each table once, and a new batch gets new tables):
  ``blocks(block_size)``  ``DocumentBlocks``, the kernels' per-block tables (below)
  ``derived(key, build)`` any other table: the approximator's scoring rows, RoPE rows
Everything is derived on the tensors' device with fixed shapes (no host synchronisation).

Checking the VALUES of ``cu_seqlens`` (start, end, increasing) needs them on the host: free on
CPU tensors, one synchronisation on a GPU. ``Documents(...)`` checks them by default (once per
batch, where the batch is made); the attention functions, given a bare tensor, build the object
with ``Documents.of``, which checks the values only where that is free (the CPU, or a GPU with
``Settings.validate``: ``index.value_checks``), the structure always.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Hashable, Optional, Union

import torch
import torch.distributed as dist

from .index import value_checks


def _validate(cu_seqlens, seq_len: int, where: str, values: bool) -> None:
    """The one check of ``cu_seqlens``: structure (dtype, rank, length; free), then with
    ``values`` the entries against the global ``seq_len`` (reads them on the host)."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise ValueError(f"{where} must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise ValueError(f"{where} must be int32, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1:
        raise ValueError(f"{where} must be 1-D [num_documents + 1], got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.numel() < 2:
        raise ValueError(f"{where} needs at least two entries [0, seq_len], got {cu_seqlens.numel()}")
    if not values:
        return
    host = cu_seqlens.detach().to("cpu", torch.int64)
    if int(host[0]) != 0:
        raise ValueError(f"{where} must start at 0, got {int(host[0])}")
    if int(host[-1]) != seq_len:
        raise ValueError(f"{where} must end at the global sequence length {seq_len}, got {int(host[-1])}")
    steps = host[1:] - host[:-1]
    if bool((steps <= 0).any()):
        bad = int(torch.nonzero(steps <= 0)[0])
        raise ValueError(f"{where} must be strictly increasing (every document at least one token); "
                         f"entries {bad} and {bad + 1} are {int(host[bad])} and {int(host[bad + 1])}")


def document_starts(cu_seqlens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """int32: the first position of the document holding each of ``positions``."""
    cu = cu_seqlens.to(device=positions.device, dtype=torch.int64)
    which = torch.searchsorted(cu, positions.to(torch.int64), right=True) - 1
    return cu[which.clamp(0, cu.numel() - 1)].to(torch.int32)


def _checksum(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """int64 [2]: (number of entries, a position-weighted sum of them): equal values give equal
    sums, and a change of any entry changes the sum (odd weights, no wrap at these sizes)."""
    values = cu_seqlens.to(torch.int64)
    weights = 2 * torch.arange(values.numel(), device=values.device, dtype=torch.int64) + 1
    return torch.stack([torch.tensor(values.numel(), device=values.device), (values * weights).sum()])


@dataclasses.dataclass(frozen=True)
class DocumentBlocks:
    """The kernels' view of the documents for one block size, on one device:

      doc_start          int32 [N]   global position -> first position of its document
      block_first_start  int32 [nb]  global block -> the document start of its first token (the
                                     earliest document any of its queries reads)
      block_last_start   int32 [nb]  global block -> the document start of its last token (keys
                                     before it are in another document for SOME query of the
                                     block: a token-level mask is needed there)
      key_block_floor    int32 [nb]  global query block -> the first key block that can share a
                                     document with one of its queries (earlier blocks are skipped)
    """

    cu_seqlens: torch.Tensor         # int32 [docs + 1], on this device
    seq_len: int
    block_size: int
    doc_start: torch.Tensor
    block_first_start: torch.Tensor
    block_last_start: torch.Tensor
    key_block_floor: torch.Tensor


class Documents:
    """The packed documents of one batch: ``cu_seqlens`` (int32, GLOBAL positions) of a sequence
    of ``seq_len`` tokens, checked once here, and the tables derived from it (module docstring).

    ``check_values``: read the entries on the host and check them (default; one synchronisation
    on a GPU, meant for once per batch); False checks the structure only (``values_checked``
    says which). ``where`` names ``cu_seqlens`` in the error messages. Immutable: the tensor is copied, so a later in-place
    change of the caller's tensor cannot make the tables stale.
    """

    __slots__ = ("cu_seqlens", "seq_len", "values_checked", "_derived")

    def __init__(self, cu_seqlens: torch.Tensor, seq_len: int, where: str = "cu_seqlens",
                 check_values: bool = True):
        _validate(cu_seqlens, int(seq_len), where, check_values)
        self._fill(cu_seqlens.detach().clone(), int(seq_len), bool(check_values))

    def _fill(self, cu_seqlens: torch.Tensor, seq_len: int, values_checked: bool) -> None:
        for name, value in (("cu_seqlens", cu_seqlens), ("seq_len", seq_len), ("values_checked", values_checked),
                            ("_derived", {})):
            object.__setattr__(self, name, value)

    def __setattr__(self, name, value):
        raise AttributeError(f"Documents is immutable (tried to set {name!r})")

    def __reduce__(self):
        """Copies and pickles carry ``cu_seqlens`` (already checked); the tables are rebuilt on use."""
        return _restore, (self.cu_seqlens, self.seq_len, self.values_checked)

    def __repr__(self) -> str:
        return (f"Documents({self.num_documents} documents, seq_len={self.seq_len}, "
                f"device={self.cu_seqlens.device})")

    @classmethod
    def of(cls, documents: Union["Documents", torch.Tensor, None], seq_len: int,
           where: str = "cu_seqlens", validate: bool = False) -> Optional["Documents"]:
        """What an attention function does with its ``cu_seqlens=`` argument: None stays None; a
        ``Documents`` is used as it is (its length must be ``seq_len``: a host-side comparison);
        a tensor is built into one, its values checked where that is free (``index.value_checks``:
        the CPU, or a GPU with ``validate``)."""
        if documents is None:
            return None
        if isinstance(documents, Documents):
            if documents.seq_len != seq_len:
                raise ValueError(f"{where}: the documents cover {documents.seq_len} tokens, but this call attends "
                                 f"over a global sequence of {seq_len}")
            return documents
        device = documents.device if isinstance(documents, torch.Tensor) else torch.device("cpu")
        return cls(documents, seq_len, where, check_values=value_checks(device, validate))

    @property
    def num_documents(self) -> int:
        """From the shape: no synchronisation."""
        return self.cu_seqlens.numel() - 1

    @property
    def device(self) -> torch.device:
        return self.cu_seqlens.device

    def derived(self, key: Hashable, build: Callable[[], object]):
        """The table ``key`` of these documents: ``build()`` on first use, then kept on the object."""
        table = self._derived.get(key)
        if table is None:
            table = self._derived[key] = build()
        return table

    def on(self, device) -> torch.Tensor:
        """``cu_seqlens`` on ``device`` (one copy per device)."""
        device = torch.device(device)
        if device == self.cu_seqlens.device:
            return self.cu_seqlens
        return self.derived(("cu_seqlens", device), lambda: self.cu_seqlens.to(device))

    def doc_start(self, device=None) -> torch.Tensor:
        """int32 ``[seq_len]``: each global position's document start, on ``device``."""
        device = self.device if device is None else torch.device(device)
        return self.derived(("doc_start", device), lambda: document_starts(
            self.on(device), torch.arange(self.seq_len, device=device)).contiguous())

    def blocks(self, block_size: int, device=None) -> DocumentBlocks:
        """The kernels' tables for ``block_size`` on ``device`` (default: ``cu_seqlens``' device)."""
        device = self.device if device is None else torch.device(device)
        block_size = int(block_size)
        if block_size <= 0 or self.seq_len % block_size:
            raise ValueError(f"sequence length {self.seq_len} is not a multiple of block_size {block_size}")
        return self.derived(("blocks", block_size, device), lambda: self._blocks(block_size, device))

    def _blocks(self, block_size: int, device: torch.device) -> DocumentBlocks:
        doc_start = self.doc_start(device)
        first = doc_start[::block_size].contiguous()
        last = doc_start[block_size - 1::block_size].contiguous()
        return DocumentBlocks(self.on(device), self.seq_len, block_size, doc_start, first, last,
                              (first // block_size).to(torch.int32).contiguous())

    def checksum(self) -> torch.Tensor:
        return self.derived("checksum", lambda: _checksum(self.cu_seqlens))

    def check_across_ranks(self, group) -> None:
        """Over ``group``, that every rank holds the same documents: an all-reduce of a checksum
        (MIN and MAX), so every rank sees a disagreement and raises, none hangs. Synchronises:
        once per batch, where the batch is made."""
        if group is None or dist.get_world_size(group) <= 1:
            return
        device = self.device if dist.get_backend(group) == "nccl" else torch.device("cpu")
        mine = self.checksum().to(device)
        low, high = mine.clone(), mine.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
        if not torch.equal(low, high):
            raise ValueError(
                f"cu_seqlens differ across the context-parallel ranks (rank {dist.get_rank(group)} has "
                f"{self.cu_seqlens.tolist()}): every rank must pass the documents of the WHOLE packed sequence, "
                "in global positions, not those of its own shard")


def _restore(cu_seqlens: torch.Tensor, seq_len: int, values_checked: bool) -> Documents:
    documents = object.__new__(Documents)  # already checked: no second validation
    documents._fill(cu_seqlens, seq_len, values_checked)
    return documents


def as_documents(cu_seqlens, seq_len: int, block_size: int, device) -> Optional[DocumentBlocks]:
    """The kernels' tables for an optional ``cu_seqlens`` tensor or ``Documents`` (None: one
    unbroken sequence), for callers that build a plan by hand (tests, benchmarks)."""
    documents = Documents.of(cu_seqlens, seq_len)
    return None if documents is None else documents.blocks(block_size, device)
