"""megatron-mtraining: MTraining dynamic sparse context-parallel attention for Megatron-LM."""

from .approx import approximate_index
from .attention import sparse_attention
from .block_index import BlockIndex
from .config import MTrainingConfig, Settings
from .documents import Documents
from .index import VSIndex
from .kernels.reference import reference_attention
from .layout import gather_sequence, local_positions, shard_sequence
from .ring import dense_ring_attention, sparse_ring_attention

__version__ = "0.1.0"

__all__ = [
    "BlockIndex", "Documents", "MTrainingConfig", "Settings", "VSIndex", "approximate_index", "dense_ring_attention",
    "gather_sequence", "local_positions", "reference_attention", "shard_sequence", "sparse_attention",
    "sparse_ring_attention", "__version__",
]
