"""The ring schedule as data (``ring/program.py``): the operations ``ring/schedule.py`` performs, recorded
from the code the ring runs, which the planner prices. Checked against the schedule as docs/design.md §4
states it, written out here by hand, forward and backward, flat and hierarchical, at several sizes; and
for what any ring program must satisfy (each transfer waited for once, after it is posted; every step
computed once, in order)."""

from typing import List

import pytest

from megatron_mtraining.plan.model import simulate_ring
from megatron_mtraining.ring.program import ring_program

SIZES = [(1, 1), (1, 2), (1, 3), (1, 4), (2, 1), (2, 2), (2, 3), (3, 2), (4, 2), (2, 4)]


def stated_program(outer: int, inner: int, backward: bool) -> List[tuple]:
    """The schedule of design §4, op by op: K/V of the next rank (and, at a node's start, of the next
    node) posted before a step's compute and waited for after it; in the backward, each step's dK/dV
    first, then the partial sums of the previous holder added and sent on, then dQ while they travel;
    at a node's end its sums join the outer ring's, and the last transfer brings them home."""
    ops: List[tuple] = []
    names = {}

    def post(name, ring, payload):
        names[name] = len(names)
        ops.append(("post", names[name], ring, payload))

    def wait(name):
        ops.append(("wait", names[name]))

    W = outer * inner
    for so in range(outer):
        if so + 1 < outer:
            post(("okv", so), "outer", "kv")
        for si in range(inner):
            step = so * inner + si
            node_done = si + 1 == inner
            if not node_done:
                post(("ikv", step), "inner", "kv")
            if not backward:
                ops.append(("compute", step, "all"))
                if not node_done:
                    wait(("ikv", step))
                if so + 1 < outer and node_done:
                    wait(("okv", so))
                continue
            ops.append(("compute", step, "keys"))
            if si > 0:
                wait(("ig", step - 1))
                ops.append(("add",))
            post(("ig", step), "inner", "grad_home" if outer == 1 and step == W - 1 else "grad")
            last_over_nodes = outer > 1 and step == W - 1  # the hop home is the outer transfer: dQ after it
            if not last_over_nodes:
                ops.append(("compute", step, "queries"))
            if not node_done:
                wait(("ikv", step))
                continue
            wait(("ig", step))
            if so > 0:
                wait(("og", so - 1))
                ops.append(("add",))
            post(("og", so), "outer", "grad_home" if so + 1 == outer else "grad")
            if last_over_nodes:
                ops.append(("compute", step, "queries"))
            if so + 1 < outer:
                wait(("okv", so))
    if backward:
        wait(("og", outer - 1))
    return ops


@pytest.mark.parametrize("outer,inner", SIZES)
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_the_recorded_program_is_the_stated_schedule(outer, inner, backward):
    assert list(ring_program(outer, inner, backward)) == stated_program(outer, inner, backward)


@pytest.mark.parametrize("outer,inner", SIZES + [(3, 3), (1, 8), (8, 1)])
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_every_transfer_is_waited_for_once_after_it_is_posted_and_every_step_computed_once(outer, inner, backward):
    ops = ring_program(outer, inner, backward)
    posted = [op[1] for op in ops if op[0] == "post"]
    waited = [op[1] for op in ops if op[0] == "wait"]
    assert sorted(waited) == sorted(posted) == list(range(len(posted)))
    for number in posted:
        assert ops.index(("wait", number)) > next(i for i, op in enumerate(ops) if op[:2] == ("post", number))
    parts = ["keys", "queries"] if backward else ["all"]
    computed = [(op[1], op[2]) for op in ops if op[0] == "compute"]
    assert sorted(computed) == [(s, p) for s in range(outer * inner) for p in parts]
    assert [s for s, _ in computed] == sorted(s for s, _ in computed)  # steps in order
    # One hop home, and only on a ring of more than one rank does it cross a link.
    assert sum(op[0] == "post" and op[3] == "grad_home" for op in ops) == (2 if backward and outer == 1 else
                                                                           1 if backward else 0)


def test_the_comparison_sees_a_changed_schedule():
    """The check is not blind: a program with one wait moved is told apart from the stated one."""
    stated = stated_program(2, 2, True)
    first_wait = next(i for i, op in enumerate(stated) if op[0] == "wait")
    moved = stated[:first_wait] + stated[first_wait + 1:] + [stated[first_wait]]
    assert moved != list(ring_program(2, 2, True))


def test_the_planner_times_the_recorded_program():
    """simulate_ring walks ring_program: on a flat ring of free links, the forward is the compute
    of every step; the backward adds one merge per step after the first (W - 1 adds)."""
    free = lambda s, d: (1e9, 0.0)  # noqa: E731
    assert simulate_ring(4, 4, [1.0, 2.0, 3.0, 4.0], {"kv": 1.0, "grad": 1.0}, free) == pytest.approx(10.0)
    assert simulate_ring(4, 4, [1.0] * 4, {"kv": 1.0, "grad": 1.0}, free, add_ms=0.5,
                         backward=True) == pytest.approx(4.0 + 3 * 0.5)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="at least one node"):
        ring_program(0, 2, False)
