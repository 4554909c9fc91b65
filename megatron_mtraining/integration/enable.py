"""``enable_mtraining(args)``: everything ``--mtraining`` turns on in a Megatron run, in one call.

Shared by the three ways in (the launcher, the fork patch and ``examples/pretrain_gpt_mtraining.py``)
so that they cannot drift apart. From the parsed Megatron arguments it

1. builds ``MTrainingConfig.from_args(args)`` and the hook options (dense layers, log interval),
   and runs the start-up validation (``patches.validate_megatron_config``: sequence length,
   attention dropout, hierarchical or hybrid CP, packed or per-document masking, MTP with CP,
   Transformer Engine CP options) on the parsed arguments, whose names match megatron-core's
   ``TransformerConfig`` fields, and, on TE layers, the TE version (``transformer_engine.py``),
2. calls ``patches.install(config)`` (striped batch split, RoPE slicing),
3. turns on the training telemetry when ``--mtraining-log-interval`` > 0,

and returns the GPT layer-spec hook (``spec -> spec`` with MTrainingAttention as core attention)
that the caller applies to the spec every ``GPTModel`` is built with.
"""

from __future__ import annotations

from typing import Callable

from ..config import MTrainingConfig
from . import patches, telemetry
from .transformer_engine import check_transformer_engine
from .args import integration_options
from .spec import get_gpt_layer_spec

__all__ = ["SpecHook", "enable_mtraining"]


class SpecHook:
    """``hook(spec)``: ``get_gpt_layer_spec(config, base_spec=spec, dense_layers=...)``."""

    def __init__(self, config: MTrainingConfig, dense_layers: int):
        self.config = config
        self.dense_layers = dense_layers

    def __call__(self, spec):
        return get_gpt_layer_spec(self.config, base_spec=spec, dense_layers=self.dense_layers)


def enable_mtraining(args) -> Callable:
    """Install MTraining for a run with these parsed arguments; returns the layer-spec hook.
    Idempotent (a second call re-installs with the same settings). ValueError on bad flags."""
    config = MTrainingConfig.from_args(args)
    options = integration_options(args)
    patches.validate_megatron_config(args, config, seq_length=getattr(args, "seq_length", None))
    if getattr(args, "transformer_impl", "local") == "transformer_engine":
        check_transformer_engine(required=True)
    patches.install(config)
    if options["log_interval"] > 0:
        telemetry.enable_telemetry(options["log_interval"])
    else:
        telemetry.disable_telemetry()
    return SpecHook(config, options["dense_layers"])
