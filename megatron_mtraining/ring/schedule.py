"""The ring schedules, independent of what a step computes.

Flat and hierarchical rings are one schedule: an outer loop over nodes (the K/V of a node
arrives over the outer ring while the inner loop runs) around an inner loop over the ranks of
a node. A flat ring is the case with one node (or one rank per node).

Every wait names its place in the schedule (direction, step, whose K/V or gradients), so a
transfer that fails or times out raises ``comm.RingCommunicationError`` saying where.
"""

from __future__ import annotations

from typing import Callable, Sequence, Tuple

import torch

from . import instrument
from .comm import RingTopology

Tensors = Tuple[torch.Tensor, ...]


def ring_forward(topo: RingTopology, kv: Sequence[torch.Tensor], compute: Callable[[Tensors, int], None]) -> None:
    """Call ``compute(kv_of_source, source_rank)`` once per source rank; the next K/V is in flight
    during each call (double buffering), the next node's K/V during the whole inner loop."""
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
            with instrument.measure("forward", "compute", step):
                compute(inner_kv, topo.source(so, si))
            with instrument.measure("forward", "wait", step):
                if inner_next is not None:
                    inner_kv = inner_next.wait(("forward", step, W, "K/V", topo.source(so, si + 1)))
                if outer_next is not None and si + 1 == topo.inner_size:
                    outer_kv = outer_next.wait(("forward", step, W, "K/V", topo.source(so + 1, 0)))


def _add(a: Tensors, b: Tensors) -> Tensors:
    return tuple(x + y for x, y in zip(a, b))


def ring_backward(topo: RingTopology, kv: Sequence[torch.Tensor],
                  compute: Callable[[Tensors, int], Tensors]) -> Tensors:
    """Like ``ring_forward``, but ``compute`` returns fresh gradients for the K/V it was given.

    Gradients travel with their K/V, one hop behind it, and are added to on every rank they
    pass; after the last step one more hop brings each chunk's gradients home. In the
    hierarchical ring the inner loop sums a node's contribution first, then it joins the
    accumulator travelling on the outer ring (whose transfer overlaps the next inner loop).
    Returns the gradients of this rank's own K/V.
    """
    W = topo.world_size
    outer_kv = tuple(kv)
    outer_grads = None
    for so in range(topo.outer_size):
        outer_next = (topo.outer.exchange(outer_kv, ("backward", so * topo.inner_size, W, "K/V",
                                                     topo.source(so + 1, 0)))
                      if so + 1 < topo.outer_size else None)
        inner_kv = outer_kv
        inner_grads = None
        for si in range(topo.inner_size):
            step = so * topo.inner_size + si
            inner_next = (topo.inner.exchange(inner_kv, ("backward", step, W, "K/V", topo.source(so, si + 1)))
                          if si + 1 < topo.inner_size else None)
            with instrument.measure("backward", "compute", step):
                grads = compute(inner_kv, topo.source(so, si))
            with instrument.measure("backward", "wait", step):
                if inner_grads is not None:  # what earlier holders of this K/V contributed
                    grads = _add(inner_grads.wait(("backward", step, W, "partial dK/dV", topo.source(so, si))), grads)
                inner_grads = topo.inner.exchange(grads, ("backward", step, W, "partial dK/dV", topo.source(so, si)))
                if inner_next is not None:
                    inner_kv = inner_next.wait(("backward", step, W, "K/V", topo.source(so, si + 1)))
                if si + 1 == topo.inner_size:
                    node_grads = inner_grads.wait(("backward", step, W, "dK/dV", topo.source(so, 0)))
                    if outer_grads is not None:
                        node_grads = _add(outer_grads.wait(("backward", step, W, "dK/dV", topo.source(so, 0))),
                                          node_grads)
                    outer_grads = topo.outer.exchange(node_grads, ("backward", step, W, "dK/dV", topo.source(so, 0)))
                    if outer_next is not None:
                        outer_kv = outer_next.wait(("backward", step, W, "K/V", topo.source(so + 1, 0)))
    return outer_grads.wait(("backward", W - 1, W, "dK/dV (coming home)", topo.rank))
