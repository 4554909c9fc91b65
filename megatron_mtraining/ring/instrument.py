"""Optional per-step timing of the ring: compute and wait time of every step on this rank.

Off by default: the schedule looks up ``current()`` once per step and does nothing else when it
is None. Turn it on around the calls to measure:

    with record_ring_steps() as timer:
        out = sparse_ring_attention(...); out.backward(g)
    steps = timer.summary()   # synchronises; {"forward": {"compute_ms": [...], "wait_ms": [...]}, ...}

On CUDA the intervals are CUDA events on the current stream (no host synchronisation until
``summary``); on the CPU they are host clock readings.
"""

from __future__ import annotations

import contextlib
import time
from typing import Dict, List, Optional

import torch

# Megatron's API: the telemetry's step timer, on while a log iteration runs; Megatron's forward
# passes no argument of ours down to the ring's steps.
_active: Optional["StepTimer"] = None

# The kind of an interval whose time belongs to every step of its phase (``StepTimer.summary``).
SPREAD = "spread"


class Interval:
    """One timed interval: CUDA events on the current stream (no host sync until ``ms``), or host
    clock readings without CUDA. ``start``/``stop`` may be called from different places (e.g.
    autograd hooks), which a context manager cannot span."""

    def __init__(self, cuda: Optional[bool] = None):
        self.cuda = (torch.cuda.is_available() and torch.cuda.is_initialized()) if cuda is None else cuda
        if self.cuda:
            self._start, self._end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        if self.cuda:
            self._start.record()
        else:
            self._start = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            self._end.record()
        else:
            self._end = time.perf_counter()

    def ms(self) -> float:
        """Elapsed milliseconds (on CUDA: after a synchronisation)."""
        return self._start.elapsed_time(self._end) if self.cuda else (self._end - self._start) * 1e3


@contextlib.contextmanager
def timed(interval: Interval):
    interval.start()
    yield interval
    interval.stop()


class StepTimer:
    def __init__(self):
        self._intervals: List[tuple] = []  # (phase, kind, step, Interval)

    def measure(self, phase: str, kind: str, step: int):
        interval = Interval()
        self._intervals.append((phase, kind, step, interval))
        return timed(interval)

    def summary(self) -> Dict[str, Dict[str, List[float]]]:
        """Milliseconds per step, per phase ("forward"/"backward") and kind ("compute"/"wait");
        repeated calls of one phase are summed step by step. A ``SPREAD`` interval (timed inside
        one step's compute: work done there for every step, such as the backward's one-pass dQ
        over every source's K/V) is moved out of that step's compute and shared evenly among the
        phase's steps, so the per-step compute compares the steps' work (the step-level imbalance)
        and still sums to the phase's compute."""
        if any(x[3].cuda for x in self._intervals):
            torch.cuda.synchronize()
        out: Dict[str, Dict[str, List[float]]] = {}
        for phase, kind, step, interval in self._intervals:
            series = out.setdefault(phase, {}).setdefault(f"{kind}_ms", [])
            series.extend([0.0] * (step + 1 - len(series)))
            series[step] += interval.ms()
        for kinds in out.values():
            spread = kinds.pop(f"{SPREAD}_ms", None)
            compute = kinds.get("compute_ms")
            if spread and compute:
                share = sum(spread) / len(compute)
                kinds["compute_ms"] = [c - (spread[i] if i < len(spread) else 0.0) + share
                                       for i, c in enumerate(compute)]
        return out


def current() -> Optional[StepTimer]:
    return _active


@contextlib.contextmanager
def record_ring_steps():
    """Time every ring step run inside the block (this rank only)."""
    global _active
    previous, _active = _active, StepTimer()
    try:
        yield _active
    finally:
        _active = previous


def activate(timer: StepTimer) -> None:
    """Record ring steps into ``timer`` until ``deactivate(timer)`` (spans forward and backward,
    unlike ``record_ring_steps``; used by the training telemetry)."""
    global _active
    _active = timer


def deactivate(timer: StepTimer) -> None:
    global _active
    if _active is timer:
        _active = None


@contextlib.contextmanager
def suspended():
    """No step timing inside the block (eval forwards, the no-grad first pass of a recompute)."""
    global _active
    previous, _active = _active, None
    try:
        yield
    finally:
        _active = previous


def measure(phase: str, kind: str, step: int):
    """A timing context when instrumentation is on, else a no-op."""
    timer = _active
    return timer.measure(phase, kind, step) if timer is not None else contextlib.nullcontext()


def imbalance_metrics(per_rank_compute: List[List[float]], per_rank_wait: List[List[float]]) -> Dict[str, float]:
    """The paper's appendix table from every rank's per-step times (ms).

    worker-level: max / mean over ranks of one step's compute time, averaged over steps;
    step-level:   max / mean over steps of one rank's compute time, averaged over ranks;
    computation ratio: compute time / (compute + wait) time, summed over ranks and steps.
    """
    compute = torch.tensor(per_rank_compute, dtype=torch.float64)   # [ranks, steps]
    wait = torch.tensor(per_rank_wait, dtype=torch.float64)
    worker = (compute.max(0).values / compute.mean(0)).mean().item()
    step = (compute.max(1).values / compute.mean(1)).mean().item()
    ratio = (compute.sum() / (compute.sum() + wait.sum())).item()
    return {"worker_imbalance": worker, "step_imbalance": step, "computation_ratio": ratio}
