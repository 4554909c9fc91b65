"""megatron-mtraining: MTraining dynamic sparse context-parallel attention for Megatron-LM."""

from .attention import sparse_attention
from .config import MTrainingConfig
from .index import VSIndex
from .kernels.reference import reference_attention

__version__ = "0.1.0"

__all__ = ["MTrainingConfig", "VSIndex", "reference_attention", "sparse_attention", "__version__"]
