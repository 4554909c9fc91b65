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

The all-reduce yields the MIN and the MAX of every word (MAX over ``[x, -x]``), so every rank
receives the same verdict and raises the same error; none is left waiting.

When the verdict is read (``MTRAINING_RING_AGREEMENT``):

* ``eager`` (the default on CPU tensors / gloo, and on GPUs with ``MTRAINING_VALIDATE=1``): read
  at once; a disagreement raises ``RingAgreementError`` on every rank before any transfer.
* ``deferred`` (the default on GPUs with NCCL): no host synchronisation is added. The verdict
  stays on the device: a disagreement turns the call's output into NaN (never a silently wrong
  result), and the reduced words are copied asynchronously to pinned host memory; the error is
  raised by the first later ring call, or backward, that finds the copy complete
  (``check_deferred``, a non-blocking event query). Shapes that differ across ranks cannot be
  stopped before the transfers on this path (deciding needs the host); the Megatron path checks
  them at its consistency iterations (``integration/consistency.py``).

A peer that never joins the agreement (dead or stalled) ends it in ``RingCommunicationError``
after the transfer timeout (``transport.transfer_timeout``).
"""

from __future__ import annotations

import hashlib
import os
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from ..index import value_checks
from .transport import RingCommunicationError, wait_work

AGREEMENT_ENV = "MTRAINING_RING_AGREEMENT"
_MODES = ("auto", "eager", "deferred")
_MASK = (1 << 62) - 1  # words in [0, 2^62): -x never overflows
ITEM_WORDS = 24  # fixed length: calls of different functions still reduce vectors of one size

Word = Union[int, torch.Tensor]  # a host int, or a 0-d int64 tensor on the compute device


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


def _weights(n: int, device) -> torch.Tensor:
    """Position weights in [1, 2^31): the checksum sees permutations, not only sums."""
    return (torch.arange(n, dtype=torch.int64, device=device) * 2654435761) % 2147483647 + 1


def checksum(values: torch.Tensor, counts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """0-d int64 on ``values``' device: position-weighted sum of the entries (with ``counts``: only
    the valid ones, ``values[..., :counts]``; padding may hold anything). int64 sums wrap modulo
    2^64 identically in any order, so equal tensors give equal checksums on any device."""
    entries = values.long() + 1
    if counts is not None:
        valid = torch.arange(values.shape[-1], device=values.device) < counts[..., None].long()
        entries = torch.where(valid, entries, torch.zeros_like(entries))
    flat = entries.flatten()
    return (flat * _weights(flat.numel(), flat.device)).sum() & _MASK


def mode(device: torch.device, group) -> str:
    """"eager" or "deferred" for a call on ``device`` over ``group`` (module docstring)."""
    chosen = os.environ.get(AGREEMENT_ENV, "auto") or "auto"
    if chosen not in _MODES:
        raise ValueError(f"{AGREEMENT_ENV} must be one of {_MODES}, got {chosen!r}")
    if chosen != "auto":
        return chosen
    if device.type != "cuda" or dist.get_backend(group) != "nccl" or value_checks(device):
        return "eager"
    return "deferred"


class Verdict:
    """The device-side outcome of a deferred agreement: ``bad`` (0-d bool) and the reduced words,
    being copied to pinned host memory."""

    def __init__(self, what: str, names: Sequence[str], mine: Sequence[str], reduced: torch.Tensor, world: int):
        self.what, self.names, self.mine, self.world = what, list(names), list(mine), world
        n = reduced.numel() // 2
        high, low = reduced[:n], -reduced[n:]
        self.bad = (high != low).any()
        self._ready = None
        if reduced.is_cuda:
            self._host = torch.empty(reduced.shape, dtype=reduced.dtype, pin_memory=True)
            self._host.copy_(reduced, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:  # gloo (tests of this mode): the words are on the host already
            self._host = reduced

    def ready(self) -> bool:
        return self._ready is None or self._ready.query()

    def error(self) -> Optional[RingAgreementError]:
        return _verdict_error(self.what, self.names, self.mine, self._host.tolist(), self.world,
                              "(found after the call returned: its output was set to NaN) ")


_DEFERRED: List[Verdict] = []
_DOCUMENTS = ("cu_seqlens differ across the context-parallel ranks: every rank must pass the documents of the "
              "WHOLE packed sequence, in global positions, not those of its own shard. ")
_ADVICE = {"cu_seqlens values": _DOCUMENTS, "cu_seqlens length": _DOCUMENTS}


def check_deferred() -> None:
    """Raise the error of any completed deferred agreement that found a disagreement; never waits."""
    while _DEFERRED and _DEFERRED[0].ready():
        verdict = _DEFERRED.pop(0)
        err = verdict.error()
        if err is not None:
            _DEFERRED.clear()
            raise err


def _verdict_error(what, names, mine, reduced: List[int], world: int, note: str = "",
                   hint: str = "") -> Optional[RingAgreementError]:
    n = len(reduced) // 2
    high = reduced[:n]
    low = [-x for x in reduced[n:]]
    failed = [r for r in range(world) if high[r]]
    if failed:
        return RingAgreementError(
            f"{what}: context-parallel rank(s) {failed} failed their own input checks {note}(their error names "
            "the problem: look in their logs); this rank stops too, rather than wait for them in a transfer.")
    differ = [i for i in range(min(len(names), n - world)) if low[world + i] != high[world + i]]
    if not differ:
        return None
    listed = "; ".join(names[i] if mine[i] is None else f"{names[i]} (this rank: {mine[i]})" for i in differ)
    advice = {_ADVICE[names[i]] for i in differ if names[i] in _ADVICE}
    hint = "".join(sorted(advice)) + hint
    return RingAgreementError(
        f"{what}: the context-parallel ranks disagree {note}on: {listed}. {hint}Every rank of the group must make "
        "the same call (same shapes, dtype, layout, block size, inner_size, softmax scale, the same global "
        "index and the same cu_seqlens, present on all ranks or on none). In Megatron, a data path that gives "
        "CP ranks different --seq-length or --micro-batch-size, or different --mtraining-* flags, does this. "
        "See docs/troubleshooting.md.")


def agree(group, what: str, items: Sequence[Tuple[str, Word, object]], local_error: Optional[BaseException],
          device: torch.device, hint: str = "") -> Optional[torch.Tensor]:
    """One agreement over ``group`` (module docstring). ``items``: ``(name, word, shown value)``
    (the value is shown in the error for host words; device checksums are only named);
    ``local_error``: this rank's own check failure (raised here after its peers have been told).
    Returns None, or in deferred mode the device-side 0-d bool "the ranks disagree" (the caller
    poisons its output with it). Raises RingAgreementError (eager) or RingCommunicationError."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if len(items) > ITEM_WORDS:
        raise AssertionError(f"{what}: {len(items)} agreement items, at most {ITEM_WORDS}")
    try:
        how = mode(device, group)
    except ValueError as err:
        how, local_error = "eager", local_error or err
    where = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    host = [0] * (world + ITEM_WORDS)
    names = [name for name, _, _ in items]
    mine = [None if isinstance(word, torch.Tensor) else repr(shown) for _, word, shown in items]
    on_device = []
    if local_error is not None:
        host[rank] = 1  # peers learn that this rank failed; its item words stay 0
    else:
        for i, (_, word, _) in enumerate(items):
            if isinstance(word, torch.Tensor):
                on_device.append((world + i, word))
            else:
                host[world + i] = word
    words = torch.tensor(host, dtype=torch.int64)
    if where.type == "cuda":
        words = words.pin_memory().to(where, non_blocking=True)  # no host synchronisation
    if on_device:  # one stack of views and checksums: no indexing with host-built indices
        parts = list(words.unbind())
        for slot, word in on_device:
            parts[slot] = word.to(where)
        words = torch.stack(parts)
    both = torch.cat([words, -words])
    try:
        wait_work(dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group, async_op=True))
    except Exception as err:
        raise RingCommunicationError(
            f"MTraining ring attention ({what}): the agreement step before the first ring transfer failed: "
            f"{type(err).__name__}: {err}\nA peer process died or stopped before this call, or does not make it "
            "(look for the first error in the other ranks' logs), or it is slower than the transfer timeout: "
            "Megatron's --distributed-timeout-minutes, init_process_group(timeout=...) or MTRAINING_RING_TIMEOUT_S. "
            "See docs/troubleshooting.md.") from err
    if local_error is not None:
        raise local_error
    if how == "eager":
        err = _verdict_error(what, names, mine, both.tolist(), world, hint=hint)
        if err is not None:
            raise err
        return None
    verdict = Verdict(what, names, mine, both, world)
    _DEFERRED.append(verdict)
    return verdict.bad


def poison(out: torch.Tensor, bad: Optional[torch.Tensor]) -> torch.Tensor:
    """``out``, NaN everywhere when ``bad`` (a deferred disagreement); no host synchronisation."""
    if bad is None:
        return out
    return out.masked_fill_(bad, float("nan"))


__all__ = ["AGREEMENT_ENV", "RingAgreementError", "agree", "check_deferred", "checksum", "host_word", "mode",
           "poison"]
