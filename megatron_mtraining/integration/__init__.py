"""Megatron-LM / megatron-core integration of MTraining sparse attention.

Nothing here imports megatron at package import time: import the submodules
(``core_attention``, ``spec``, ``args``) explicitly. The launcher that runs an unmodified Megatron-LM
script with them is ``megatron_mtraining.launch``.
"""

from .args import add_mtraining_args, integration_options  # no megatron imports

__all__ = ["add_mtraining_args", "integration_options"]
