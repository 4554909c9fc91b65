"""Ring communication: neighbour exchange on one process group, and the inner/outer ring groups.

A ``Ring`` sends to the next member and receives from the previous one with one batched P2P
call (NCCL needs the send and the receive in one group call, or a ring of blocking sends
deadlocks). The hierarchical ring uses two of them: ``inner`` (ranks of one node, contiguous in
the CP group) and ``outer`` (the ranks with the same inner index on every node), each on its
own process group, so NCCL runs them on separate communicators and streams and the outer
transfer overlaps the whole inner loop.

A transfer that fails raises ``RingCommunicationError``, naming the ring step, the direction,
whose data was on its way and the peer it was coming from, with the original error chained:
when it is posted (``batch_isend_irecv`` raises at once on a closed connection) and when it is
waited for (``Pending.wait``). A transfer that does not complete fails after the transfer
timeout: ``Settings.ring_timeout_s`` seconds if set (``MTRAINING_RING_TIMEOUT_S``,
``--mtraining-ring-timeout-s``; the topology carries it), otherwise the process group's own
timeout (``init_process_group(timeout=...)``; Megatron sets it with
``--distributed-timeout-minutes``); the error and the timeout live in ``collective/transport.py``,
shared with the agreement.

A ring may carry an arrival hook (``Settings.ring_arrival_hook``, an argument of ``ring_topology``):
called as ``hook(ring, received)`` when a transfer is posted, it may return a CUDA event that the
data is taken to arrive at (``Pending.wait`` makes the stream wait for it too). None in training;
the ring benchmark's emulated slow inter-node links (``benchmarks/slow_link.py``) give one.

Hierarchical ring groups are created once per (CP group, inner size), after the members have
agreed on the inner size (an all-reduce over the CP group), never from an argument that could
differ between ranks.
"""

from __future__ import annotations

import atexit
import copy
import dataclasses
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..collective.transport import TIMEOUT_ENV, RingCommunicationError, wait_work  # shared with the agreement

_LIKELY_CAUSE = ("A peer process died or stopped (look for the first error in the other ranks' logs), or it is "
                 "alive but slower than the transfer timeout: raise it with Megatron's "
                 "--distributed-timeout-minutes, torch.distributed.init_process_group(timeout=...) or "
                 f"--mtraining-ring-timeout-s ({TIMEOUT_ENV}). See docs/troubleshooting.md.")


class Pending:
    """Tensors being received; ``wait()`` returns them once they have arrived."""

    def __init__(self, tensors: Sequence[torch.Tensor], works=(), keep_alive=(), arrival=None, ring=None):
        self._tensors = tuple(tensors)
        self._works = list(works)
        self._keep_alive = keep_alive  # the sent tensors must outlive the transfer
        self._arrival = arrival  # the arrival hook's event (an emulated link): the data "arrives" at it
        self._ring = ring  # the Ring that posted the transfer (for error messages)

    def wait(self, context: Optional[Tuple[str, int, int, str, int]] = None) -> Tuple[torch.Tensor, ...]:
        """The received tensors. ``context``: ``(direction, step, steps, what, source)`` of the
        ring schedule, put into the error message if the transfer fails (no cost otherwise)."""
        try:
            timeout_s = None if self._ring is None else self._ring.timeout_s
            for work in self._works:
                wait_work(work, timeout_s)
        except Exception as err:
            raise RingCommunicationError(self._describe(context, err)) from err
        if self._arrival is not None:
            torch.cuda.current_stream().wait_event(self._arrival)
        self._works, self._keep_alive, self._arrival = [], (), None
        return self._tensors

    def _describe(self, context, err: BaseException) -> str:
        return describe_failure(self._ring, context, err)


def describe_failure(ring, context, err: BaseException, posting: bool = False) -> str:
    """The RingCommunicationError message: where in the schedule, which peer, the likely cause."""
    peers = (f"global rank {ring.prev_rank} (sending to global rank {ring.next_rank}) on the {ring.name} ring"
             if ring is not None else "its ring neighbours")
    how = " (posting the transfer failed)" if posting else ""
    if context is not None:
        direction, step, steps, what, source = context
        where = (f"{direction} ring step {step} of {steps} (0-based): the {what} of context-parallel rank "
                 f"{source} did not arrive from {peers}{how}")
    else:
        where = f"a ring transfer from {peers} failed{how}"
    return f"MTraining ring attention, {where}: {type(err).__name__}: {err}\n{_LIKELY_CAUSE}"


class Ring:
    """One ring over ``ranks`` (global ranks, ring order) of ``group``; ``index`` is our position."""

    def __init__(self, group, ranks: Sequence[int], index: int, name: str = "flat",
                 timeout_s: Optional[float] = None, arrival_hook: Optional[Callable] = None):
        self.group = group
        self.timeout_s = timeout_s  # a transfer's timeout (``Settings.ring_timeout_s``; None: the group's)
        self.arrival_hook = arrival_hook  # ``Settings.ring_arrival_hook`` (module docstring); None: none
        self.name = name  # "flat", "inner" (intra-node) or "outer" (inter-node): error messages
        self.size = len(ranks)
        self.index = index
        self.next_rank = ranks[(index + 1) % self.size]
        self.prev_rank = ranks[(index - 1) % self.size]
        self.global_rank = ranks[index]

    def exchange(self, tensors: Sequence[torch.Tensor], context=None) -> Pending:
        """Send ``tensors`` to the next member, receive the previous member's (same shapes).
        ``context`` as in ``Pending.wait``: named if posting the transfer fails."""
        if self.size == 1:
            return Pending(tensors)
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next_rank, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, self.prev_rank, self.group) for r in received]
        try:
            works = dist.batch_isend_irecv(ops)
        except Exception as err:  # gloo raises here at once when the peer's connection is closed
            raise RingCommunicationError(describe_failure(self, context, err, posting=True)) from err
        arrival = self.arrival_hook(self, received) if self.arrival_hook is not None else None
        return Pending(received, works, keep_alive=tuple(tensors), arrival=arrival, ring=self)


@dataclasses.dataclass
class RingTopology:
    """W = outer_size * inner_size ranks; group rank r = node * inner_size + inner index."""

    world_size: int
    rank: int
    inner: Ring
    outer: Ring

    @property
    def inner_size(self) -> int:
        return self.inner.size

    @property
    def outer_size(self) -> int:
        return self.outer.size

    def with_timeout(self, timeout_s: Optional[float]) -> "RingTopology":
        """This topology, its rings' transfers waiting at most ``timeout_s`` seconds (None: the
        process group's timeout); the same process groups, new ``Ring`` objects."""
        def timed(ring):
            timed_ring = copy.copy(ring)
            timed_ring.timeout_s = timeout_s
            return timed_ring
        return dataclasses.replace(self, inner=timed(self.inner), outer=timed(self.outer))

    def with_arrival_hook(self, hook: Optional[Callable]) -> "RingTopology":
        """This topology, its rings' transfers calling ``hook`` (module docstring; None: none);
        the same process groups, new ``Ring`` objects."""
        def hooked(ring):
            hooked_ring = copy.copy(ring)
            hooked_ring.arrival_hook = hook
            return hooked_ring
        return dataclasses.replace(self, inner=hooked(self.inner), outer=hooked(self.outer))

    def source(self, outer_step: int, inner_step: int) -> int:
        """Group rank whose K/V this rank holds at (outer step, inner step)."""
        node, i = divmod(self.rank, self.inner_size)
        return ((node - outer_step) % self.outer_size) * self.inner_size + (i - inner_step) % self.inner_size


# torch.distributed's API: subgroups (NCCL communicators) are created once per (CP group, inner size)
# by a collective of their members, not per call. Keyed by the group object too: a group destroyed and
# made again (same ranks) gets new rings, never the destroyed group's.
_SINGLE = None
_TOPOLOGIES: Dict[Tuple[object, Tuple[int, ...], int], RingTopology] = {}


def forget_topologies() -> None:
    """Drop the cached rings and with them this module's references to their process groups."""
    global _SINGLE
    _SINGLE = None
    _TOPOLOGIES.clear()


# A process group still referenced when the interpreter shuts down is destructed during finalisation,
# where gloo's worker threads can abort the process ("terminate called without an active exception",
# after a clean destroy_process_group()): the cache lets go of its groups before that.
atexit.register(forget_topologies)


def group_ranks(group) -> List[int]:
    """Global ranks of ``group`` in group-rank order."""
    return [dist.get_global_rank(group, i) for i in range(dist.get_world_size(group))]


def check_inner_size(inner_size: Optional[int], world: int) -> int:
    """The inner ring size for ``inner_size`` over ``world`` ranks (None: one flat ring)."""
    inner = world if inner_size is None else int(inner_size)
    if inner < 1 or world % inner:
        raise ValueError(f"inner_size {inner_size} must divide the context-parallel size {world}")
    return inner


def _agree_on_inner_size(group, inner: int, world: int, timeout_s: Optional[float]) -> None:
    """Before any subgroup exists: every rank of ``group`` must have asked for the same inner
    size (one all-reduce), else ValueError on every rank; never a rank stuck in ``new_group``."""
    both = torch.tensor([inner, -inner], dtype=torch.int64)
    if dist.get_backend(group) == "nccl":
        both = both.cuda()
    try:
        wait_work(dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group, async_op=True), timeout_s)
    except Exception as err:
        raise RingCommunicationError(f"MTraining ring set-up: agreeing on the inner ring size failed: "
                                     f"{type(err).__name__}: {err}\n{_LIKELY_CAUSE}") from err
    high, low = int(both[0]), -int(both[1])
    if high != low:
        raise ValueError(f"MTraining ring set-up: the context-parallel ranks ask for different inner ring sizes "
                         f"(from {low} to {high}; this rank: {inner}, of {world} ranks): every rank must pass the "
                         "same inner_size (--mtraining-inner-ring-size)")


def ring_topology(group=None, inner_size: Optional[int] = None, timeout_s: Optional[float] = None,
                  arrival_hook: Optional[Callable] = None) -> RingTopology:
    """The (cached) flat or hierarchical ring of ``group``. The first time for a (group, inner
    size) the ranks agree on the inner size (one all-reduce); subgroups are then created by
    their members only (``use_local_synchronization``), so no rank waits in ``new_group``.
    ``timeout_s``: its transfers' timeout (``Settings.ring_timeout_s``; None: the group's);
    ``arrival_hook``: its transfers' arrival hook (``Settings.ring_arrival_hook``; None: none)."""
    global _SINGLE
    if not (dist.is_available() and dist.is_initialized()):
        if inner_size not in (None, 1):
            raise ValueError(f"inner_size={inner_size} needs torch.distributed: no process group is initialised")
        if _SINGLE is None:
            _SINGLE = RingTopology(1, 0, Ring(None, [0], 0), Ring(None, [0], 0))
        return _SINGLE
    group = group if group is not None else dist.group.WORLD
    ranks = group_ranks(group)
    world, rank = len(ranks), dist.get_rank(group)
    inner = check_inner_size(inner_size, world)
    key = (group, tuple(ranks), inner)
    if key not in _TOPOLOGIES:
        if world > 1:
            _agree_on_inner_size(group, inner, world, timeout_s)
        node, i = divmod(rank, inner)
        if inner in (1, world):  # one level: the group itself is the ring
            flat = Ring(group, ranks, rank)
            single = Ring(None, [ranks[rank]], 0)
            _TOPOLOGIES[key] = RingTopology(world, rank, flat, single) if inner == world \
                else RingTopology(world, rank, single, flat)
        else:
            inner_ranks = ranks[node * inner:(node + 1) * inner]
            outer_ranks = ranks[i::inner]
            inner_group = dist.new_group(inner_ranks, use_local_synchronization=True)
            outer_group = dist.new_group(outer_ranks, use_local_synchronization=True)
            _TOPOLOGIES[key] = RingTopology(world, rank, Ring(inner_group, inner_ranks, i, "inner (intra-node)"),
                                            Ring(outer_group, outer_ranks, node, "outer (inter-node)"))
    topo = _TOPOLOGIES[key]
    topo = topo if timeout_s is None else topo.with_timeout(timeout_s)
    return topo if arrival_hook is None else topo.with_arrival_hook(arrival_hook)
