"""The ring schedule as data: the operations ``schedule.py`` performs on a rank, in order.

The schedule is written once, as the code the ring runs (``ring_forward``, ``ring_backward``).
``ring_program`` runs that code on a topology whose rings move nothing and record what they are
asked to do, with computations that record themselves, so the planner (``plan/model.py``)
prices exactly the steps the ring takes: a change to the schedule reaches the planner with no
second copy to keep in step.

Operations (the same on every rank; steps are numbered 0 .. W-1 in the order the rank runs them):

- ``("post", n, ring, payload)``: transfer ``n`` posted on the ``"inner"`` or ``"outer"`` ring,
  carrying ``"kv"`` (K/V), ``"grad"`` (partial dK/dV sums, in the accumulators' dtype) or
  ``"grad_home"`` (the complete dK/dV on its last hop, in K/V's dtype);
- ``("wait", n)``: the rank waits for transfer ``n`` to arrive;
- ``("compute", step, part)``: the forward's step (``"all"``), or the backward's dK/dV
  (``"keys"``) and dQ (``"queries"``) of a step;
- ``("add",)``: partial sums that arrived added into this rank's.
"""

from __future__ import annotations

import functools
import itertools
from typing import List, Tuple

from . import schedule
from .comm import RingTopology

Op = Tuple


class _Handle:
    def __init__(self, ops: List[Op], number: int, tensors: Tuple):
        self.ops, self.number, self.tensors = ops, number, tensors

    def wait(self, where) -> Tuple:
        self.ops.append(("wait", self.number))
        return self.tensors


class _RecordingRing:
    """A ring of ``size`` ranks that records each exchange instead of performing it."""

    def __init__(self, name: str, size: int, ops: List[Op], numbers):
        self.name, self.size, self.ops, self.numbers = name, size, ops, numbers

    def exchange(self, tensors, where) -> _Handle:
        number = next(self.numbers)
        what = where[3]  # schedule.py's name for what travels: "K/V", "... dK/dV", or schedule.HOME
        payload = "kv" if what == "K/V" else "grad_home" if what == schedule.HOME else "grad"
        self.ops.append(("post", number, self.name, payload))
        return _Handle(self.ops, number, tuple(tensors))


class _Sums:
    """Stands for a rank's dK/dV sums: adding received sums into it is recorded as one ``add``."""

    is_cuda = False

    def __init__(self, ops: List[Op]):
        self.ops = ops

    def add_(self, other: "_Sums") -> "_Sums":
        self.ops.append(("add",))
        return self


@functools.lru_cache(maxsize=None)
def ring_program(outer: int, inner: int, backward: bool) -> Tuple[Op, ...]:
    """The operations of one forward (or backward) pass of the ring of ``outer`` nodes of
    ``inner`` ranks, as ``schedule.py`` performs them (module docstring)."""
    if outer < 1 or inner < 1:
        raise ValueError(f"a ring needs at least one node of one rank, got {outer} x {inner}")
    ops: List[Op] = []
    numbers = itertools.count()
    topo = RingTopology(outer * inner, 0, _RecordingRing("inner", inner, ops, numbers),
                        _RecordingRing("outer", outer, ops, numbers))
    step_of = {topo.source(so, si): so * inner + si for so in range(outer) for si in range(inner)}
    kv = (_Sums(ops),)
    if not backward:
        schedule.ring_forward(topo, kv, lambda held, source: ops.append(("compute", step_of[source], "all")))
        return tuple(ops)

    def keys(held, source):
        ops.append(("compute", step_of[source], "keys"))
        return (_Sums(ops),)

    def queries(held, source):
        ops.append(("compute", step_of[source], "queries"))

    schedule.ring_backward(topo, kv, keys, queries=queries)
    return tuple(ops)
