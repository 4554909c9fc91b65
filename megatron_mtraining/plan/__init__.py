"""A step-time and memory model and planner for context-parallel training with MTraining (``docs/scaling.md``).

``python -m megatron_mtraining.plan --help``. A leaf of the package: nothing else imports it, and it imports
neither torch nor the rest of the package (the package's own ``__init__`` still loads torch).
"""

from .memory import Split, fewest_recomputed_layers, memory_estimate
from .model import (Cluster, ModelShape, Prediction, Workload, approximator_ms, predict_dense_a2a_p2p,
                    predict_dense_p2p, predict_mtraining, simulate_ring, with_recompute)
from .presets import MODELS
from .profiles import Profile, available_profiles, load_profile
from .search import advice, configurations, plan

__all__ = ["Cluster", "MODELS", "ModelShape", "Prediction", "Profile", "Split", "Workload", "advice", "approximator_ms",
           "available_profiles", "configurations", "fewest_recomputed_layers", "load_profile", "memory_estimate",
           "plan", "predict_dense_a2a_p2p", "predict_dense_p2p", "predict_mtraining", "simulate_ring",
           "with_recompute"]
