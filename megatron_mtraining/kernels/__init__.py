"""Single-device building blocks: reference, index conversion, Triton and PyTorch step kernels."""

from .step_plan import StepPlan, build_step_plan, convert_step, convert_step_reference, single_device_plan
from .reference import reference_attention, vs_mask
from .dispatch import resolve_backend
from .step import step_backward, step_forward

__all__ = [
    "StepPlan", "build_step_plan", "convert_step", "convert_step_reference", "single_device_plan",
    "reference_attention", "vs_mask", "resolve_backend", "step_backward", "step_forward",
]
