"""Distributed (context-parallel) sparse ring attention."""

from .attention import sparse_ring_attention
from .comm import Ring, RingTopology, ring_topology

__all__ = ["sparse_ring_attention", "Ring", "RingTopology", "ring_topology"]
