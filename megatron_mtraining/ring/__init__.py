"""Distributed (context-parallel) sparse ring attention."""

from ..collective.agreement import RingAgreementError
from .sparse import sparse_ring_attention
from .comm import Ring, RingCommunicationError, RingTopology, ring_topology
from .dense import dense_ring_attention
from .instrument import imbalance_metrics, record_ring_steps

__all__ = [
    "sparse_ring_attention", "dense_ring_attention", "Ring", "RingTopology", "ring_topology",
    "imbalance_metrics", "record_ring_steps", "RingAgreementError", "RingCommunicationError",
]
