"""Sparse-attention telemetry for training logs (docs/design.md §7), every N iterations.

At a log iteration every ``MTrainingAttention`` reports its layer's index (budgets, density)
and the time of its approximator and of its attention (forward and backward), and the ring
records the compute and wait time of every step. When the next iteration starts (or on
``flush()``) the context-parallel ranks exchange their figures once and one line per log
iteration is printed on global rank 0, like Megatron's own logs:

    [MTraining] iteration 20 | density 0.061 (per layer 1.000 0.052 ...) | vertical 112.0 slash 7.9
      | approximator 3.1 ms = 4.2% of attention 73.5 ms | imbalance worker 1.01 step 1.04 | computation ratio 0.93

plus scalars under ``mtraining/`` in Megatron's TensorBoard writer when it exists. Between log
iterations nothing is recorded and nothing synchronises: ``recorder()`` returns None and the
ring's step timer stays off.

The iteration comes from ``megatron.training``'s ``args.curr_iteration`` (the Megatron training
loop), or from ``Telemetry.step(iteration)`` in a hand-written loop. Counted: training forwards
that build autograd graphs (with activation recompute, the recomputed forward; eval forwards
never). Micro-batches of one iteration add up. With pipeline parallelism each stage records its
own layers: the printed line (global rank 0) covers the first stage, Megatron's TensorBoard
writer (last rank) the last stage; per-layer tags carry global layer numbers.
"""

from __future__ import annotations

import logging
from typing import Dict, List, Optional, Union

import torch
import torch.distributed as dist

from ..block_index import BlockIndex
from ..index import VSIndex
from ..ring import instrument

logger = logging.getLogger(__name__)

__all__ = ["Telemetry", "disable_telemetry", "enable_telemetry", "get_telemetry"]

# Megatron's API: its training loop has no hook to hand our telemetry to the layers.
_TELEMETRY: Optional["Telemetry"] = None


class IterationRecord:
    """What one rank saw in one log iteration."""

    def __init__(self, iteration: int, group):
        self.iteration = iteration
        self.group = group
        self.layers: Dict[int, dict] = {}  # layer number -> index statistics (device tensors)
        self.clocks: Dict[str, List[instrument.Interval]] = {"approximator": [], "attention_fwd": [],
                                                             "attention_bwd": []}
        self.ring_timer = instrument.StepTimer()

    def timed(self, what: str, cuda: bool):
        interval = instrument.Interval(cuda)
        self.clocks[what].append(interval)
        return instrument.timed(interval)

    def time_backward(self, out: torch.Tensor, q: torch.Tensor, cuda: bool) -> None:
        """Time the attention's backward: from the gradient reaching ``out`` to it leaving ``q``."""
        if not (out.requires_grad and q.requires_grad):
            return
        clock = instrument.Interval(cuda)
        self.clocks["attention_bwd"].append(clock)
        out.register_hook(lambda g: (clock.start(), g)[1])
        q.register_hook(lambda g: (clock.stop(), g)[1])

    def record_index(self, layer_number: int, index: Union[VSIndex, BlockIndex], seq_len: int) -> None:
        """Density and budgets; a block index has no columns, and its key blocks per query block
        stand in the "slash" figure (both are block counts)."""
        if isinstance(index, BlockIndex):
            vertical = torch.zeros((), device=index.device)
            slash = index.n_key_blocks.float().mean()
        else:
            vertical, slash = index.n_vertical.float().mean(), index.n_slash.float().mean()
        self.layers[layer_number] = {"density": index.density(seq_len).float().mean(), "vertical": vertical,
                                     "slash": slash}

    # ------------------------------------------------------------------ reduction

    def summarise(self) -> Dict[str, float]:
        """Synchronise, reduce over the context-parallel group (a collective: every CP rank
        calls it at the same point) and return the log figures."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        layers = sorted(self.layers)
        out: Dict[str, float] = {"iteration": float(self.iteration)}
        for name in ("density", "vertical", "slash"):
            values = [self.layers[n][name].item() for n in layers]
            out[name] = sum(values) / max(1, len(values))
            for n, v in zip(layers, values):
                out[f"{name}/layer_{n}"] = v
        times = {k: sum(c.ms() for c in v) for k, v in self.clocks.items() if v}
        steps = self.ring_timer.summary()
        compute = [sum(x) for x in zip(*(p.get("compute_ms", []) for p in steps.values()))]
        wait = [sum(x) for x in zip(*(p.get("wait_ms", []) for p in steps.values()))]

        world = dist.get_world_size(self.group) if self.group is not None else 1
        local = torch.tensor([times.get("approximator", 0.0), times.get("attention_fwd", 0.0),
                              times.get("attention_bwd", 0.0)] + compute + wait, dtype=torch.float64)
        if world > 1:
            device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(self.group) == "nccl" \
                else torch.device("cpu")
            gathered = [torch.empty_like(local, device=device) for _ in range(world)]
            dist.all_gather(gathered, local.to(device), group=self.group)
            table = torch.stack(gathered).cpu()
        else:
            table = local[None]
        # The slowest rank sets the attention's pace: its maximum over CP ranks. The approximator's
        # clock also runs while a rank waits at its collectives for ranks still busy with earlier
        # work (skew, not approximator cost). The rank that tends to arrive last waits least, so
        # the minimum over ranks is the better estimate of the cost (an estimate: the last to
        # arrive may differ between layers); the maximum is kept beside it.
        fwd_ms, bwd_ms = (table[:, i].max().item() for i in (1, 2))
        approx_ms = table[:, 0].min().item()
        out.update(approximator_ms=approx_ms, approximator_max_ms=table[:, 0].max().item(),
                   attention_fwd_ms=fwd_ms, attention_bwd_ms=bwd_ms)
        attention_ms = fwd_ms + bwd_ms
        out["approximator_share"] = approx_ms / attention_ms if attention_ms > 0 else float("nan")
        n_steps = len(compute)
        if world > 1 and n_steps == world:
            metrics = instrument.imbalance_metrics(table[:, 3:3 + n_steps].tolist(), table[:, 3 + n_steps:].tolist())
            out.update(metrics)
        return out


class Telemetry:
    """Collects ``IterationRecord``s every ``log_interval`` iterations and logs them."""

    def __init__(self, log_interval: int, writer=None, printer=None):
        if int(log_interval) <= 0:
            raise ValueError(f"telemetry log_interval must be > 0, got {log_interval}")
        self.log_interval = int(log_interval)
        self._writer = writer
        self._printer = printer
        self._iteration: Optional[int] = None  # set by step(); else Megatron's args
        self._record: Optional[IterationRecord] = None
        self.history: List[Dict[str, float]] = []  # every logged summary (tests, benchmarks)

    # ------------------------------------------------------------------ iteration

    def step(self, iteration: int) -> None:
        """Hand-written training loops: call once per iteration (1-based) before its forward."""
        self._iteration = int(iteration)

    def _current_iteration(self) -> int:
        if self._iteration is not None:
            return self._iteration
        try:
            from megatron.training.global_vars import get_args

            # Megatron sets curr_iteration to the completed iterations before each train step
            # and logs the step as iteration curr_iteration + 1.
            return int(get_args().curr_iteration) + 1
        except Exception:
            raise RuntimeError(
                "MTraining telemetry (--mtraining-log-interval) needs the iteration number: outside "
                "megatron.training's loop call get_telemetry().step(iteration) before each iteration")

    # ------------------------------------------------------------------ recording

    def recorder(self, group) -> Optional[IterationRecord]:
        """The record of the current iteration if it is a log iteration, else None. Called by
        every MTrainingAttention forward; finishes (and logs) the previous log iteration first."""
        iteration = self._current_iteration()
        record = self._record
        if record is not None and record.iteration != iteration:
            self.flush()
            record = None
        if iteration % self.log_interval:
            return None
        if record is None:
            record = self._record = IterationRecord(iteration, group)
            instrument.activate(record.ring_timer)
        return record

    def flush(self) -> Optional[Dict[str, float]]:
        """Reduce and log the pending log iteration (a CP collective; every CP rank calls it)."""
        record, self._record = self._record, None
        if record is None:
            return None
        instrument.deactivate(record.ring_timer)
        summary = record.summarise()
        self.history.append(summary)
        self._log(summary)
        return summary

    # ------------------------------------------------------------------ output

    def _log(self, s: Dict[str, float]) -> None:
        writer = self._writer if self._writer is not None else _megatron_tensorboard_writer()
        if writer is not None:
            iteration = int(s["iteration"])
            for key, value in s.items():
                if key != "iteration" and value == value:  # skip NaN
                    writer.add_scalar(f"mtraining/{key}", value, iteration)
        if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
            return
        per_layer = " ".join(f"{s[k]:.3f}" for k in sorted((k for k in s if k.startswith("density/layer_")),
                                                           key=lambda k: int(k.rsplit("_", 1)[1])))
        line = (f" [MTraining] iteration {int(s['iteration'])} | density {s['density']:.3f} (per layer "
                f"{per_layer}) | vertical {s['vertical']:.1f} slash {s['slash']:.1f} | approximator "
                f"{s['approximator_ms']:.1f} ms = {100 * s['approximator_share']:.1f}% of attention "
                f"{s['attention_fwd_ms'] + s['attention_bwd_ms']:.1f} ms")
        if "worker_imbalance" in s:
            line += (f" | imbalance worker {s['worker_imbalance']:.2f} step {s['step_imbalance']:.2f}"
                     f" | computation ratio {s['computation_ratio']:.2f}")
        (self._printer or _print)(line)


def _print(line: str) -> None:
    print(line, flush=True)


def _megatron_tensorboard_writer():
    try:
        from megatron.training.global_vars import get_tensorboard_writer
    except Exception:
        return None
    try:
        return get_tensorboard_writer()
    except Exception:
        return None


def enable_telemetry(log_interval: int, writer=None, printer=None) -> Telemetry:
    """Turn telemetry on for every MTrainingAttention (replaces a previous one)."""
    global _TELEMETRY
    disable_telemetry()
    _TELEMETRY = Telemetry(log_interval, writer=writer, printer=printer)
    logger.info("MTraining telemetry every %d iterations", log_interval)
    return _TELEMETRY


def disable_telemetry(flush: bool = False) -> None:
    """Turn telemetry off; ``flush=True`` first logs the pending log iteration (a CP collective:
    call it on every CP rank; at the end of training, the run's last log iteration, which no next
    forward logs), else it is dropped. A record whose process group is gone is dropped with a warning."""
    global _TELEMETRY
    record = _TELEMETRY._record if _TELEMETRY is not None else None
    if record is not None:
        group_alive = record.group is None or (dist.is_available() and dist.is_initialized())
        if flush and group_alive:
            try:
                _TELEMETRY.flush()
            except (RuntimeError, ValueError) as exc:  # e.g. CP groups destroyed, the default one kept
                logger.warning("MTraining telemetry: the last log iteration was not logged: %s", exc)
        else:
            if flush:
                logger.warning("MTraining telemetry: iteration %d not logged: the process group was destroyed "
                               "first", record.iteration)
            instrument.deactivate(record.ring_timer)
    _TELEMETRY = None


def get_telemetry() -> Optional[Telemetry]:
    return _TELEMETRY
