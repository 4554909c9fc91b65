"""Megatron-LM / megatron-core integration of MTraining sparse attention.

Nothing here imports megatron at package import time: import the submodules
(``attention``, ``spec``, ``args``, ``launch``) explicitly.
"""

from .args import add_mtraining_args, integration_options  # no megatron imports

__all__ = ["add_mtraining_args", "integration_options"]
