"""The ring schedules, independent of what a step computes.

Flat and hierarchical rings are one schedule: an outer loop over nodes (the K/V of a node
arrives over the outer ring while the inner loop runs) around an inner loop over the ranks of
a node. A flat ring is the case with one node (or one rank per node).

Every wait names its place in the schedule (direction, step, whose K/V or gradients), so a
transfer that fails or times out raises ``comm.RingCommunicationError`` saying where.

With step timing on (``instrument.py``) every step records its ``compute`` and ``wait``; the
forward's ``prepare`` (the step's plan, built just before its compute so that the host enqueues
it while the GPU still runs the previous step) as ``plan``, and the backward's addition of the
partial dK/dV that arrived into this step's as ``merge``.

These two functions are the only statement of the schedule: ``program.py`` records the operations
they perform as data, which the planner prices (``plan/model.py``).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

import torch

from . import instrument
from .comm import RingTopology

Tensors = Tuple[torch.Tensor, ...]

# What the last hop of the backward carries: each chunk's complete dK/dV, on its way to its owner
# (in K/V's dtype; ``program.py`` tells this transfer apart by the name).
HOME = "dK/dV (going home)"


def ring_forward(topo: RingTopology, kv: Sequence[torch.Tensor], compute: Callable[[Tensors, int], None],
                 prepare: Optional[Callable[[int], None]] = None) -> None:
    """Call ``compute(kv_of_source, source_rank)`` once per source rank; the next K/V is in flight
    during each call (double buffering), the next node's K/V during the whole inner loop.
    ``prepare(source_rank)``, if given, runs just before each compute (timed as ``plan``)."""
    W = topo.world_size
    outer_kv = tuple(kv)
    for so in range(topo.outer_size):
        outer_next = (topo.outer.exchange(outer_kv, ("forward", so * topo.inner_size, W, "K/V", topo.source(so + 1, 0)))
                      if so + 1 < topo.outer_size else None)
        inner_kv = outer_kv
        for si in range(topo.inner_size):
            step = so * topo.inner_size + si
            inner_next = (topo.inner.exchange(inner_kv, ("forward", step, W, "K/V", topo.source(so, si + 1)))
                          if si + 1 < topo.inner_size else None)
            if prepare is not None:
                with instrument.measure("forward", "plan", step):
                    prepare(topo.source(so, si))
            with instrument.measure("forward", "compute", step):
                compute(inner_kv, topo.source(so, si))
            with instrument.measure("forward", "wait", step):
                if inner_next is not None:
                    inner_kv = inner_next.wait(("forward", step, W, "K/V", topo.source(so, si + 1)))
                if outer_next is not None and si + 1 == topo.inner_size:
                    outer_kv = outer_next.wait(("forward", step, W, "K/V", topo.source(so + 1, 0)))


def _add(received: Tensors, owned: Tensors) -> Tensors:
    """``received + owned``, added in place into ``owned`` (gradients this rank made or received
    and holds alone): no allocation, and one fused launch for dK and dV on a GPU
    (``_foreach_add_``). x + y == y + x exactly, so the sums are those of the out-of-place add."""
    if owned[0].is_cuda:
        torch._foreach_add_(list(owned), list(received))
    else:
        for x, y in zip(received, owned):
            y.add_(x)
    return tuple(owned)


def _narrowed(grads: Tensors, dtype: Optional[torch.dtype]) -> Tensors:
    """``grads`` in ``dtype`` where that is narrower (fewer bytes to send), else as they are."""
    if dtype is None:
        return tuple(grads)
    return tuple(g.to(dtype) if dtype.itemsize < g.element_size() else g for g in grads)


def ring_backward(topo: RingTopology, kv: Sequence[torch.Tensor], keys: Callable[[Tensors, int], Tensors],
                  home_dtype: Optional[torch.dtype] = None,
                  queries: Optional[Callable[[Tensors, int], None]] = None) -> Tensors:
    """Like ``ring_forward``, for the gradients: per step ``keys(kv, source)`` returns fresh
    gradients of the K/V it was given, and ``queries(kv, source)`` (if given) computes the ones
    that stay on this rank (dQ).

    Gradients travel with their K/V, one hop behind it, and are added to on every rank they
    pass; after the last step one more hop brings each chunk's gradients home. In the
    hierarchical ring the inner loop sums a node's contribution first, then it joins the
    accumulator travelling on the outer ring (whose transfer overlaps the next inner loop).
    Returns the gradients of this rank's own K/V, in ``home_dtype`` if given.

    A step runs ``keys``, adds what earlier holders contributed and sends the sums on, and only
    then runs ``queries``: the transfer flies during it. That matters most for the last hop, which
    otherwise nothing would hide (over several nodes it is the outer transfer, so the last step's
    ``queries`` waits until that one is posted). It carries complete sums: where ``home_dtype`` is
    narrower than the accumulators they are cast before it rather than after, the same values in
    fewer bytes (half of fp32's for bf16 K/V; the additions before it stay in fp32). (Waiting for the partial
    sums before ``keys``, to add into them in place, was measured slower: the slack before they
    are needed shrinks from a whole step to ``queries``, docs/performance.md.)
    """
    W, nodes = topo.world_size, topo.outer_size
    outer_kv = tuple(kv)
    from_prev_node = None  # the sums of the previous node's ranks, arriving on the outer ring
    for so in range(nodes):
        outer_next = (topo.outer.exchange(outer_kv, ("backward", so * topo.inner_size, W, "K/V",
                                                     topo.source(so + 1, 0)))
                      if so + 1 < nodes else None)
        inner_kv = outer_kv
        from_prev_rank = None  # the partial sums of the previous rank, arriving on the inner ring
        for si in range(topo.inner_size):
            # keys(s) -> wait partial(s-1) -> add -> send(s) -> queries(s) -> wait K/V(s+1); at a node's
            # last step also: wait its sums -> add the previous node's -> send on the outer ring.
            step, source, held = so * topo.inner_size + si, topo.source(so, si), inner_kv
            last = step == W - 1  # this step completes the sums: next is the hop home
            node_done = si + 1 == topo.inner_size
            # Over several nodes the hop home is the outer transfer: the last dQ waits until it is posted.
            queries_after_outer = last and nodes > 1
            inner_next = (topo.inner.exchange(inner_kv, ("backward", step, W, "K/V", topo.source(so, si + 1)))
                          if not node_done else None)
            with instrument.measure("backward", "compute", step):
                grads = keys(held, source)
            if from_prev_rank is not None:  # what earlier holders of this K/V contributed
                with instrument.measure("backward", "wait", step):
                    partial = from_prev_rank.wait(("backward", step, W, "partial dK/dV", source))
                with instrument.measure("backward", "merge", step):
                    grads = _add(partial, grads)
            if last and nodes == 1:  # one level: the inner transfer below is the hop home
                grads = _narrowed(grads, home_dtype)
            with instrument.measure("backward", "wait", step):
                what = HOME if last and nodes == 1 else "partial dK/dV"
                from_prev_rank = topo.inner.exchange(grads, ("backward", step, W, what, source))
            if queries is not None and not queries_after_outer:  # while the sums just sent travel
                with instrument.measure("backward", "compute", step):
                    queries(held, source)
            if inner_next is not None:
                with instrument.measure("backward", "wait", step):
                    inner_kv = inner_next.wait(("backward", step, W, "K/V", topo.source(so, si + 1)))
            if not node_done:
                continue
            with instrument.measure("backward", "wait", step):
                node_grads = from_prev_rank.wait(("backward", step, W, "dK/dV", topo.source(so, 0)))
                if from_prev_node is not None:
                    partial = from_prev_node.wait(("backward", step, W, "dK/dV", topo.source(so, 0)))
            if from_prev_node is not None:
                with instrument.measure("backward", "merge", step):
                    node_grads = _add(partial, node_grads)
            if last:  # the outer transfer below is the hop home (a no-op on one node)
                node_grads = _narrowed(node_grads, home_dtype)
            with instrument.measure("backward", "wait", step):
                what = HOME if last else "dK/dV"
                from_prev_node = topo.outer.exchange(node_grads, ("backward", step, W, what, topo.source(so, 0)))
            if queries is not None and queries_after_outer:
                with instrument.measure("backward", "compute", step):
                    queries(held, source)
            if outer_next is not None:
                with instrument.measure("backward", "wait", step):
                    outer_kv = outer_next.wait(("backward", step, W, "K/V", topo.source(so + 1, 0)))
    home = from_prev_node.wait(("backward", W - 1, W, HOME, topo.rank))
    return tuple(home) if home_dtype is None else tuple(g.to(home_dtype) for g in home)
