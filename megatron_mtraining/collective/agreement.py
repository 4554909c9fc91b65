"""Cross-rank agreement, on every call, before any transfer that depends on it (shared by the ring,
``ring/``, and the index approximator, ``approx.py``).

The context-parallel ranks of one call must agree on everything that changes the math: shapes,
dtype, layout, block size, inner ring size, softmax scale, the index contents and the packed
documents (``cu_seqlens``: presence and values). ``agree`` checks all of it in ONE all-reduce of
a fixed-length int64 vector over the CP group, on every call (no per-shape cache: a cache lets a
later disagreement through):

* one slot per rank, set by a rank whose own (local) checks failed, so its peers fail too
  instead of waiting for it in the first transfer;
* one word per item: small host-known settings as themselves, others as a 62-bit hash, and the
  index / cu_seqlens contents as a position-weighted checksum computed ON THE DEVICE (no copy
  to the host).

Host cost (it runs on every call): all the checksums of a call are computed in one pass over one
concatenation of their tensors, and added into the word vector at their slots by one
``index_add``; the position weights, validity columns and slots of a call's tensor shapes are
built once and kept (``_LAYOUTS``, a few entries), as is the device copy of its host words
(``_HOST_WORDS``): a steady-state call copies nothing from the host. About a dozen launches
instead of ~60 (docs/performance.md).

The all-reduce yields the MIN and the MAX of every word (MAX over ``[x, -x]``), so every rank
receives the same verdict and raises the same error; none is left waiting.

When the verdict is read (``Settings.ring_agreement``: ``MTRAINING_RING_AGREEMENT``,
``--mtraining-ring-agreement``):

* ``eager`` (the default on CPU tensors / gloo, and on GPUs with ``Settings.validate``): read
  at once; a disagreement raises ``RingAgreementError`` on every rank before any transfer.
* ``deferred`` (the default on GPUs with NCCL): no host synchronisation is added. The verdict
  stays on the device: a disagreement turns the call's output into NaN (never a silently wrong
  result), and the reduced words are copied asynchronously to pinned host memory. The verdict
  belongs to its call and its CP group: the error is raised by that call's backward, or by the
  next call over the same group, whichever first finds the copy complete (``check_deferred``, a
  non-blocking event query); never by a call over another group. Shapes that differ across ranks cannot be
  stopped before the transfers on this path (deciding needs the host); the Megatron path checks
  them at its consistency iterations (``integration/consistency.py``).

A peer that never joins the agreement (dead or stalled) ends it in ``RingCommunicationError``
after the transfer timeout (``Settings.ring_timeout_s``, else the process group's; ``transport.wait_work``).
"""

from __future__ import annotations

import collections
import hashlib
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from ..config import Settings
from ..index import value_checks
from .transport import RingCommunicationError, wait_work

_MASK = (1 << 62) - 1  # words in [0, 2^62): -x never overflows
ITEM_WORDS = 24  # fixed length: calls of different functions still reduce vectors of one size

_SENTINEL = 1 << 62  # the "count" of an uncounted tensor: every entry is valid
_CACHE_ENTRIES = 8  # call shapes whose layouts / host words are kept (a training run has one or two)


class Checksum(NamedTuple):
    """An item's word computed on the device: ``checksum(values, counts)`` (see there), done in
    ``agree``'s single pass together with the call's other checksums."""
    values: torch.Tensor
    counts: Optional[torch.Tensor] = None


Word = Union[int, Checksum]  # a host int, or a checksum of device tensors


class RingAgreementError(ValueError):
    """The context-parallel ranks of one call disagree (or a peer failed its own input checks)."""


def host_word(value) -> int:
    """A host value as one word: small non-negative ints as themselves, anything else hashed."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int) and 0 <= value <= _MASK:
        return value
    digest = hashlib.blake2b(repr(value).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MASK


def _weights(n: int, device=None) -> torch.Tensor:
    """Position weights in [1, 2^31): the checksum sees permutations, not only sums."""
    return (torch.arange(n, dtype=torch.int64, device=device) * 2654435761) % 2147483647 + 1


class _Layout(NamedTuple):
    """Per entry of a call's checksummed tensors, flattened and concatenated: its position weight,
    its column (position in its row; 0 if the tensor has no counts), where its row's count sits
    in the concatenation (the sentinel's position if none) and the word slot it adds to."""
    weights: torch.Tensor
    column: torch.Tensor
    count_at: torch.Tensor
    slot: torch.Tensor


# Measured cost (module docstring): a call shape's device tables, built once, bounded.
_LAYOUTS: "collections.OrderedDict[tuple, _Layout]" = collections.OrderedDict()
_SENTINELS = {}  # measured cost: (device, stream) -> a 1-element int64 tensor holding _SENTINEL


def _stream(device: torch.device):
    """The current CUDA stream's id on ``device`` (None off CUDA): cached device tensors are kept
    per stream, so a call on another stream never reads one before its copy is complete."""
    return torch.cuda.current_stream(device).stream_id if device.type == "cuda" else None


def _remember(cache: collections.OrderedDict, key, make):
    """``cache[key]``, made on a miss; the least recently used entry goes beyond _CACHE_ENTRIES."""
    if key in cache:
        cache.move_to_end(key)
        return cache[key]
    value = cache[key] = make()
    if len(cache) > _CACHE_ENTRIES:
        cache.popitem(last=False)
    return value


def _layout(parts: Sequence[Checksum], slots: Sequence[int], device, where) -> _Layout:
    """The cached ``_Layout`` of ``parts`` (their shapes and dtypes), on ``device``; slots on ``where``."""
    def cat(pieces, on):
        return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64, device=on)

    def make():
        # Built on the devices themselves: a cache miss (a new call shape, e.g. another number of
        # packed documents) copies nothing from the host, so it adds no host synchronisation.
        weights, column, count_at, slot = [], [], [], []
        counted = sum(p.values.numel() for p in parts)  # the counts follow the values
        for part, word_slot in zip(parts, slots):
            n = part.values.numel()
            weights.append(_weights(n, device))
            slot.append(torch.full((n,), word_slot, dtype=torch.int64, device=where))
            if part.counts is None:
                column.append(torch.zeros(n, dtype=torch.int64, device=device))
                count_at.append(torch.full((n,), -1, dtype=torch.int64, device=device))  # the sentinel (set below)
                continue
            length = part.values.shape[-1]
            rows = part.counts.numel()
            column.append(torch.arange(length, dtype=torch.int64, device=device).repeat(rows))
            count_at.append(counted + torch.arange(rows, dtype=torch.int64, device=device).repeat_interleave(length))
            counted += rows
        count_at = cat(count_at, device)
        count_at.masked_fill_(count_at < 0, counted)  # the sentinel is the concatenation's last entry
        return _Layout(cat(weights, device), cat(column, device), count_at, cat(slot, where))

    for part in parts:
        if part.counts is not None and (part.values.dim() == 0 or part.counts.shape != part.values.shape[:-1]):
            raise ValueError(f"checksum: counts {tuple(part.counts.shape)} must have the leading shape of the "
                             f"values {tuple(part.values.shape)} (one count per row)")
    key = (str(device), _stream(device), str(where), _stream(where), tuple(slots),
           tuple((tuple(p.values.shape), p.values.dtype, None if p.counts is None else tuple(p.counts.shape))
                 for p in parts))
    return _remember(_LAYOUTS, key, make)


def _products(parts: Sequence[Checksum], layout: _Layout) -> torch.Tensor:
    """Every entry's term of its checksum, ``(value + 1) x weight`` (0 past its row's count), in
    one pass over the concatenation of ``parts``: int64, wrapping modulo 2^64 in any order."""
    device = parts[0].values.device
    key = (str(device), _stream(device))
    if key not in _SENTINELS:
        _SENTINELS[key] = torch.full((1,), _SENTINEL, dtype=torch.int64, device=device)
    pieces = [p.values.reshape(-1) for p in parts] + [p.counts.reshape(-1) for p in parts if p.counts is not None]
    pieces = [x.long() if x.is_floating_point() else x for x in pieces]  # as .long() did: truncated
    flat = torch.cat(pieces + [_SENTINELS[key]])  # int64: the sentinel promotes the rest
    values = flat[:layout.weights.numel()]
    terms = torch.addcmul(layout.weights, values, layout.weights)  # (value + 1) x weight
    return terms.masked_fill_(layout.column >= flat.index_select(0, layout.count_at), 0)


def checksum(values: torch.Tensor, counts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """0-d int64 on ``values``' device: position-weighted sum of the entries (with ``counts``: only
    the valid ones, ``values[..., :counts]``; padding may hold anything). int64 sums wrap modulo
    2^64 identically in any order, so equal tensors give equal checksums on any device. (Within
    an agreement, pass ``Checksum(values, counts)`` as the word instead: one pass for all.)"""
    parts = [Checksum(values, counts)]
    layout = _layout(parts, [0], values.device, values.device)
    total = torch.zeros(1, dtype=torch.int64, device=values.device).index_add_(0, layout.slot, _products(parts, layout))
    return total[0] & _MASK


def mode(device: torch.device, group, settings: Settings) -> str:
    """"eager" or "deferred" for a call on ``device`` over ``group`` (module docstring)."""
    if settings.ring_agreement != "auto":
        return settings.ring_agreement
    if device.type != "cuda" or dist.get_backend(group) != "nccl" or value_checks(device, settings.validate):
        return "eager"
    return "deferred"


class Verdict:
    """The device-side outcome of a deferred agreement of one call over ``group``: ``bad`` (0-d
    bool) and the reduced words, being copied to pinned host memory (a buffer reused once its
    verdict has been read)."""

    def __init__(self, what: str, items: Sequence[tuple], reduced: torch.Tensor, world: int, group=None):
        self.what, self.items, self.world, self.group = what, items, world, group
        n = reduced.numel() // 2
        self.bad = (reduced[:n] + reduced[n:]).any()  # max + (-min): nonzero where the ranks differ
        self._ready = None
        if reduced.is_cuda:
            self._host, self._ready = _spare_copy(reduced.numel())
            self._host.copy_(reduced, non_blocking=True)
            self._ready.record()
        else:  # gloo (tests of this mode): the words are on the host already
            self._host = reduced

    def ready(self) -> bool:
        return self._ready is None or self._ready.query()

    def error(self) -> Optional[RingAgreementError]:
        """The verdict's error, if any; call once it is ``ready``: its host copy is then given back."""
        err = _verdict_error(self.what, self.items, self._host.tolist(), self.world,
                             "(found after the call returned: its output was set to NaN) ")
        if self._ready is not None and len(_SPARE) < _CACHE_ENTRIES:
            _SPARE.append((self._host, self._ready))
        self._host = self._ready = None
        return err


# Deferred verdicts not yet read, per process group (their call's CP group). Kept past the call
# because reading one needs its asynchronous copy to be complete, and waiting for it would add the
# host synchronisation that deferred mode exists to avoid (measured cost: docs/performance.md).
_PENDING: Dict[object, List[Verdict]] = {}
# Pinned host buffers (with their events) of verdicts already read: reused by later verdicts
# (measured cost: pinned allocations). A buffer returns here only after its copy completed and was
# read, never while in flight.
_SPARE: List[Tuple[torch.Tensor, "torch.cuda.Event"]] = []
_DOCUMENTS = ("cu_seqlens differ across the context-parallel ranks: every rank must pass the documents of the "
              "WHOLE packed sequence, in global positions, not those of its own shard. ")
_ADVICE = {"cu_seqlens values": _DOCUMENTS, "cu_seqlens length": _DOCUMENTS}


def _spare_copy(numel: int):
    """A pinned int64 host buffer of ``numel`` words and an event, reused where one is free."""
    for i, (host, event) in enumerate(_SPARE):
        if host.numel() == numel:
            return _SPARE.pop(i)
    return torch.empty(numel, dtype=torch.int64, pin_memory=True), torch.cuda.Event()


def check_deferred(group) -> None:
    """Raise the error of a completed deferred verdict of a call over ``group`` that found a
    disagreement (the earliest); never waits. Verdicts of other groups are left alone: a call
    never raises for a call over another group."""
    pending = _PENDING.get(group)
    while pending and pending[0].ready():
        err = pending.pop(0).error()
        if err is not None:
            pending.clear()  # later verdicts of the group follow from the same disagreement
        if not pending:
            _PENDING.pop(group, None)
        if err is not None:
            raise err


def _verdict_error(what, items, reduced: List[int], world: int, note: str = "",
                   hint: str = "") -> Optional[RingAgreementError]:
    n = len(reduced) // 2
    high = reduced[:n]
    low = [-x for x in reduced[n:]]
    failed = [r for r in range(world) if high[r]]
    if failed:
        return RingAgreementError(
            f"{what}: context-parallel rank(s) {failed} failed their own input checks {note}(their error names "
            "the problem: look in their logs); this rank stops too, rather than wait for them in a transfer.")
    differ = [i for i in range(min(len(items), n - world)) if low[world + i] != high[world + i]]
    if not differ:
        return None
    # Device checksums are only named; host words show this rank's value.
    names = [name for name, _, _ in items]
    mine = [None if isinstance(word, Checksum) else repr(shown) for _, word, shown in items]
    listed = "; ".join(names[i] if mine[i] is None else f"{names[i]} (this rank: {mine[i]})" for i in differ)
    advice = {_ADVICE[names[i]] for i in differ if names[i] in _ADVICE}
    hint = "".join(sorted(advice)) + hint
    return RingAgreementError(
        f"{what}: the context-parallel ranks disagree {note}on: {listed}. {hint}Every rank of the group must make "
        "the same call (same shapes, dtype, layout, block size, inner_size, softmax scale, the same global "
        "index and the same cu_seqlens, present on all ranks or on none). In Megatron, a data path that gives "
        "CP ranks different --seq-length or --micro-batch-size, or different --mtraining-* flags, does this. "
        "See docs/troubleshooting.md.")


# Measured cost (module docstring): a call's host words on the device, copied once, bounded.
_HOST_WORDS: "collections.OrderedDict[tuple, torch.Tensor]" = collections.OrderedDict()


def _host_words(host: List[int], where: torch.device) -> torch.Tensor:
    """``host`` as an int64 tensor on ``where``; cached (never written to), so a call whose host
    words repeat an earlier call's copies nothing from the host."""
    def make():
        words = torch.tensor(host, dtype=torch.int64)
        if where.type == "cuda":
            words = words.pin_memory().to(where, non_blocking=True)  # no host synchronisation
        return words
    return _remember(_HOST_WORDS, (str(where), _stream(where), tuple(host)), make)


def agree(group, what: str, items: Sequence[Tuple[str, Word, object]], local_error: Optional[BaseException],
          device: torch.device, settings: Settings, hint: str = "") -> Optional[Verdict]:
    """One agreement over ``group`` (module docstring). ``items``: ``(name, word, shown value)``
    (the value is shown in the error for host words; device checksums are only named);
    ``local_error``: this rank's own check failure (raised here after its peers have been told).
    Returns None, or in deferred mode the call's ``Verdict`` (the caller poisons its output with
    ``verdict.bad``, the device-side 0-d bool "the ranks disagree", and checks the group's
    verdicts in its backward). Raises RingAgreementError (eager) or RingCommunicationError."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if len(items) > ITEM_WORDS:
        raise AssertionError(f"{what}: {len(items)} agreement items, at most {ITEM_WORDS}")
    how = mode(device, group, settings)
    where = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    host = [0] * (world + ITEM_WORDS)
    parts, slots = [], []
    if local_error is not None:
        host[rank] = 1  # peers learn that this rank failed; its item words stay 0
    else:
        for i, (name, word, _) in enumerate(items):
            if isinstance(word, Checksum):
                parts.append(word)
                slots.append(world + i)
            elif isinstance(word, (bool, int)):
                host[world + i] = int(word)
            else:
                raise TypeError(f"{what}: agreement item {name!r}: a word is an int or a Checksum, got "
                                f"{type(word).__name__}")
    words = _host_words(host, where)
    if parts:  # every checksum in one pass, added at its slot (a new tensor: the cached words stay)
        layout = _layout(parts, slots, parts[0].values.device, where)
        terms = _products(parts, layout)
        terms = terms if terms.device == where else terms.to(where)
        words = torch.index_add(words, 0, layout.slot, terms).bitwise_and_(_MASK)
    both = torch.cat([words, words.neg()])
    try:
        wait_work(dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group, async_op=True), settings.ring_timeout_s)
    except Exception as err:
        # The approximator agrees too (no ring there): name the step by what it belongs to.
        owner, first = (("MTraining ring attention", "the first ring transfer") if "ring" in what
                        else ("MTraining", "its first collective"))
        raise RingCommunicationError(
            f"{owner} ({what}): the agreement step before {first} failed: "
            f"{type(err).__name__}: {err}\nA peer process died or stopped before this call, or does not make it "
            "(look for the first error in the other ranks' logs), or it is slower than the transfer timeout: "
            "Megatron's --distributed-timeout-minutes, init_process_group(timeout=...) or --mtraining-ring-timeout-s "
            "(MTRAINING_RING_TIMEOUT_S). See docs/troubleshooting.md.") from err
    if local_error is not None:
        raise local_error
    if how == "eager":
        err = _verdict_error(what, items, both.tolist(), world, hint=hint)
        if err is not None:
            raise err
        return None
    verdict = Verdict(what, items, both, world, group)
    _PENDING.setdefault(group, []).append(verdict)
    return verdict


class OwnChecks:
    """This rank's own input checks of a call over ``group`` (None: no peers), as a ``with`` block.
    A check that fails inside it is recorded when there are peers to tell, and raised by ``agree``
    after they have been told (so they fail too, instead of waiting for this rank in a transfer);
    without peers it is raised at once."""

    def __init__(self, group, settings: Settings):
        self.group, self.settings, self.error = group, settings, None

    def __enter__(self) -> "OwnChecks":
        return self

    def __exit__(self, kind, err, traceback) -> bool:
        if self.group is None or not isinstance(err, Exception):
            return False
        self.error = err
        return True  # recorded: ``agree`` raises it

    def agree(self, what: str, items: Callable[[], Sequence[tuple]], device: torch.device,
              hint: str = "") -> Optional[Verdict]:
        """``agree`` over the group (None without peers); ``items()`` is built only when this
        rank's checks passed (the call's values may be unset otherwise)."""
        if self.group is None:
            return None
        return agree(self.group, what, [] if self.error is not None else items(), self.error, device, self.settings,
                     hint)


def poison(out: torch.Tensor, bad: Optional[torch.Tensor], dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``out`` cast to ``dtype`` (default: its own), NaN everywhere when ``bad`` (a deferred
    disagreement); no host synchronisation. The poison rides in the cast: one pass that multiplies
    by 1 or NaN and writes the cast result (x * 1 is exact, so a good call's output is bit for bit
    ``out.to(dtype)``). A separate fill over the fp32 output would cost a full read and write of
    it, a few percent of the ring (docs/performance.md). On CUDA a ``[b, h, s, d]`` output goes
    through the row copy with the flag (``relayout.copy_rows``): PyTorch's multiply by a 0-d tensor
    into another dtype is not vectorised, and takes over twice as long as the cast alone."""
    dtype = out.dtype if dtype is None else dtype
    if bad is None:
        return out.to(dtype)
    if out.is_cuda and bad.device == out.device and out.dtype.is_floating_point:  # (a gloo verdict: on the CPU)
        from ..kernels.relayout import copy_rows, row_copy_applies  # (Triton: imported only where a GPU runs it)

        if row_copy_applies(out):
            return copy_rows(out, torch.empty(out.shape, dtype=dtype, device=out.device), nan_if=bad)
    factor = torch.where(bad, float("nan"), 1.0)  # 0-d fp32 on bad's device
    if dtype == out.dtype:
        return out.mul_(factor)
    return torch.mul(out, factor, out=torch.empty_like(out, dtype=dtype))


__all__ = ["Checksum", "OwnChecks", "RingAgreementError", "agree", "check_deferred", "checksum",
           "host_word", "mode", "poison"]
