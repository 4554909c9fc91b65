"""The planner prices the schedule the ring runs: ``plan/model.py``'s programs (the op lists its ring
simulation times) against the operations ``ring/schedule.py`` actually performs, recorded on a fake
topology, forward and backward, flat and hierarchical, at several sizes. A change to either that the
other does not follow fails here."""

import itertools
from typing import List

import pytest
import torch

from megatron_mtraining.plan.model import _programs
from megatron_mtraining.ring import schedule


class _Handle:
    def __init__(self, log: List, number: int, tensors):
        self.log, self.number, self.tensors = log, number, tensors

    def wait(self, where):
        self.log.append(("wait", self.number))
        return self.tensors


class _Ring:
    """Records each exchange as a posting (which ring, what it carries) and hands the tensors back."""

    def __init__(self, name: str, size: int, log: List, counter):
        self.name, self.size, self.log, self.counter = name, size, log, counter

    def exchange(self, tensors, where):
        number = next(self.counter)
        what = where[3]
        self.log.append(("post", number, self.name, "kv" if what == "K/V" else "grad"))
        return _Handle(self.log, number, tuple(tensors))


class _Topology:
    def __init__(self, outer: int, inner: int, log: List):
        counter = itertools.count()
        self.world_size, self.rank = outer * inner, 0
        self.inner, self.outer = _Ring("inner", inner, log, counter), _Ring("outer", outer, log, counter)
        self.inner_size, self.outer_size = inner, outer

    def source(self, outer_step: int, inner_step: int) -> int:
        return ((0 - outer_step) % self.outer_size) * self.inner_size + (0 - inner_step) % self.inner_size


def _recorded(outer: int, inner: int, backward: bool, monkeypatch) -> List[tuple]:
    log: List[tuple] = []
    topo = _Topology(outer, inner, log)
    steps = {topo.source(so, si): so * inner + si for so in range(outer) for si in range(inner)}
    kv = (torch.zeros(1), torch.zeros(1))
    if not backward:
        schedule.ring_forward(topo, kv, lambda held, source: log.append(("compute", steps[source], "all")))
        return log
    real_add = schedule._add
    monkeypatch.setattr(schedule, "_add", lambda received, owned: (log.append(("add",)), real_add(received, owned))[1])

    def keys(held, source):
        log.append(("compute", steps[source], "keys"))
        return (torch.zeros(1), torch.zeros(1))

    schedule.ring_backward(topo, kv, keys, queries=lambda held, source: log.append(
        ("compute", steps[source], "queries")))
    return log


def _priced(outer: int, inner: int, backward: bool) -> List[tuple]:
    """The planner's program in the recorder's terms: postings numbered in order, waits by number."""
    fwd, bwd = _programs(outer, inner, queries_after_send=True)
    numbers, out = {}, []
    for op in (bwd if backward else fwd):
        if op[0] == "post":
            numbers[op[1]] = len(numbers)
            out.append(("post", numbers[op[1]], op[2], "kv" if op[3] == "kv" else "grad"))
        elif op[0] == "wait":
            out.append(("wait", numbers[op[1]]))
        else:
            out.append(op)
    return out


@pytest.mark.parametrize("outer,inner", [(1, 1), (1, 2), (1, 3), (1, 4), (2, 1), (2, 2), (2, 3), (3, 2), (4, 2),
                                         (2, 4)])
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_the_planner_prices_the_schedule_the_ring_runs(outer, inner, backward, monkeypatch):
    assert _priced(outer, inner, backward) == _recorded(outer, inner, backward, monkeypatch)


def test_the_comparison_sees_a_changed_schedule(monkeypatch):
    """The recorder is not blind: a program with its waits moved is told apart."""
    recorded = _recorded(2, 2, True, monkeypatch)
    priced = _priced(2, 2, True)
    first_wait = next(i for i, op in enumerate(priced) if op[0] == "wait")
    moved = priced[:first_wait] + priced[first_wait + 1:] + [priced[first_wait]]
    assert moved != recorded
