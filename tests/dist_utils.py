"""Run a function on several CPU processes joined in a gloo process group (tests only).

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes, initialises
``torch.distributed`` (gloo, file rendezvous in a fresh temporary directory) in each, calls
``fn(rank, world_size, *args)`` and returns the list of return values in rank order. Tensors in
the results come back detached on the CPU. A worker exception is re-raised in the parent as
``WorkerError`` carrying the worker's traceback; a run that does not finish within ``timeout``
seconds is killed and raises ``TimeoutError``. Nothing here can hang the test session.

``run_distributed_outcomes`` is for fault-injection tests: it does not kill the other ranks once
one fails, but waits (up to ``timeout``) until every rank not in ``may_stay_silent`` has
finished or failed on its own, and returns one ``RankOutcome`` per rank (ok / error with its
type / died / HUNG, and the seconds from the start of ``fn`` to its end), so a test can assert
that every surviving rank ends with the expected error within a bound. ``pg_timeout`` (both
functions) is the process group's timeout, the bound of any collective or transfer.

``fn`` must be a module-level function (it is pickled by name). The workers have the tests
directory and the repository root on ``sys.path``, so test modules and the package import there.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import List, Optional

import torch
import torch.multiprocessing as mp

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)

# Once a worker has failed, the others get this long to finish (or fail) on their own before
# they are killed: they may be waiting forever in a collective with the failed one.
FAILURE_GRACE_S = 5.0
POLL_S = 0.05


class WorkerError(RuntimeError):
    """One or more worker processes raised or died; the message holds their tracebacks."""


def interpreter_works() -> bool:
    """Triton 3.6's interpreter turns 1-element arrays into scalars, an error from numpy 2.4 on."""
    import numpy as np
    return tuple(int(x) for x in np.__version__.split(".")[:2]) < (2, 4)


@dataclasses.dataclass
class RankOutcome:
    """How one rank of ``run_distributed_outcomes`` ended."""

    rank: int
    status: str                 # "ok", "error", "died" (exited without a report) or "hung" (killed at the timeout)
    error_type: str = ""        # the exception's class name, for "error"
    message: str = ""           # the exception's message ("error"), or the return value's repr ("ok")
    seconds: float = float("nan")  # from the start of fn to its return or exception
    value: object = None        # fn's return value, for "ok"


def _start(fn, world_size: int, args, timeout: float, pg_timeout: Optional[float], tmp: str):
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    payload = pickle.dumps((fn, args))  # fails here, with a clear error, if fn is not picklable
    ctx = mp.get_context("spawn")
    sys_path = [TESTS_DIR, REPO_ROOT] + [p for p in sys.path if p not in (TESTS_DIR, REPO_ROOT)]
    pg_timeout = timeout if pg_timeout is None else pg_timeout
    procs = [ctx.Process(target=_worker, args=(rank, world_size, tmp, payload, sys_path, pg_timeout),
                         name=f"dist-worker-{rank}", daemon=True)
             for rank in range(world_size)]
    for p in procs:
        p.start()
    return procs


def _stop(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join()


def run_distributed_outcomes(fn, world_size: int, *args, timeout: float = 60.0, pg_timeout: float = 10.0,
                             may_stay_silent=()) -> List[RankOutcome]:
    """One ``RankOutcome`` per rank (module docstring); never raises for a worker's failure.
    Ranks in ``may_stay_silent`` (the ones a test makes stall or die) are not waited for."""
    with tempfile.TemporaryDirectory(prefix="mtraining-dist-") as tmp:
        procs = _start(fn, world_size, args, timeout, pg_timeout, tmp)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                waiting = [rank for rank, p in enumerate(procs)
                           if rank not in may_stay_silent and p.is_alive() and _read_report(tmp, rank) is None]
                if not waiting:
                    break
                time.sleep(POLL_S)
        finally:
            alive = [p.is_alive() for p in procs]
            _stop(procs)
        outcomes = []
        for rank, p in enumerate(procs):
            report, meta = _read_report(tmp, rank), _read_meta(tmp, rank)
            seconds = meta.get("seconds", float("nan"))
            if report is None:
                outcomes.append(RankOutcome(rank, "hung" if alive[rank] else "died", seconds=seconds,
                                            message=f"exit code {p.exitcode}"))
            elif report[0] == "error":
                outcomes.append(RankOutcome(rank, "error", meta.get("type", "?"), meta.get("message", report[1]),
                                            seconds))
            else:
                outcomes.append(RankOutcome(rank, "ok", message=repr(report[1])[:200], seconds=seconds,
                                            value=report[1]))
        return outcomes


def run_distributed(fn, world_size: int, *args, timeout: float = 180.0, pg_timeout: Optional[float] = None) -> list:
    """``[fn(0, world_size, *args), ..., fn(world_size - 1, world_size, *args)]``, one process each."""
    what = f"run_distributed({getattr(fn, '__qualname__', fn)}, world_size={world_size})"
    with tempfile.TemporaryDirectory(prefix="mtraining-dist-") as tmp:
        procs = _start(fn, world_size, args, timeout, pg_timeout, tmp)
        try:
            timed_out = _wait(procs, tmp, timeout)
        finally:
            _stop(procs)
        reports = [_read_report(tmp, rank) for rank in range(world_size)]

    failures, killed = [], []
    for rank, (p, report) in enumerate(zip(procs, reports)):
        if report is not None and report[0] == "error":
            failures.append((report[2], f"--- rank {rank} raised:\n{report[1]}"))
        elif report is None and p.exitcode == -9:
            killed.append(rank)
        elif report is None:
            failures.append((float("inf"), f"--- rank {rank} exited with code {p.exitcode} without a report"))
    if failures:
        failures = [text for _, text in sorted(failures, key=lambda f: f[0])]  # the first failure first
        note = f" (ranks {killed} were still running and were killed)" if killed else ""
        raise WorkerError(f"{what} failed{note}:\n" + "\n".join(failures))
    if timed_out:
        raise TimeoutError(f"{what} did not finish within {timeout} s; ranks {killed} were still running "
                           "and were killed")
    return [report[1] for report in reports]


def _wait(procs, tmp: str, timeout: float) -> bool:
    """Wait for every worker to exit (or a failure's grace period to end); True on timeout."""
    deadline = time.monotonic() + timeout
    grace_end = None
    while any(p.is_alive() for p in procs):
        now = time.monotonic()
        if now >= deadline:
            return True
        if grace_end is None and any(os.path.exists(_report_path(tmp, rank, "error")) or p.exitcode not in (None, 0)
                                     for rank, p in enumerate(procs)):
            grace_end = now + FAILURE_GRACE_S
        if grace_end is not None and now >= grace_end:
            return False
        time.sleep(POLL_S)
    return False


def _report_path(tmp: str, rank: int, status: str) -> str:
    return os.path.join(tmp, f"rank{rank}.{status}.pkl")


def _read_report(tmp: str, rank: int):
    """``(status, value, write time)`` of ``rank``, the error report first; None if it wrote none."""
    for status in ("error", "ok"):
        path = _report_path(tmp, rank, status)
        try:
            with open(path, "rb") as f:
                return status, pickle.load(f), os.path.getmtime(path)
        except FileNotFoundError:
            pass
    return None


def _read_meta(tmp: str, rank: int) -> dict:
    try:
        with open(_report_path(tmp, rank, "meta"), "rb") as f:
            return pickle.load(f)
    except FileNotFoundError:
        return {}


def _write_meta(tmp: str, rank: int, meta: dict) -> None:
    path = _report_path(tmp, rank, "meta")
    with open(path + ".tmp", "wb") as f:
        pickle.dump(meta, f)
    os.replace(path + ".tmp", path)


def _write_report(tmp: str, rank: int, status: str, value) -> None:
    """Atomically write the report; an unpicklable result becomes this rank's error."""
    try:
        data = pickle.dumps(value)
    except Exception:
        status = "error"
        data = pickle.dumps(f"could not pickle the result of rank {rank}:\n{traceback.format_exc()}")
    path = _report_path(tmp, rank, status)
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)  # the parent never reads half a report


def _to_cpu(x):
    """Detach and move tensors to the CPU inside (nested) lists, tuples and dicts."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, dict):
        return {k: _to_cpu(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_cpu(v) for v in x)
    return x


def _worker(rank: int, world_size: int, tmp: str, payload: bytes, sys_path: list, timeout: float) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    if os.path.exists("/sys/class/net/lo"):  # every rank runs on this host: talk over loopback
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # The gloo workers compute on CPU tensors, also on GPU machines, so Triton kernels run in
    # its CPU interpreter. It must be chosen before any kernel module is imported, i.e. before
    # fn (and with it the test module and the package) is unpickled below.
    os.environ["TRITON_INTERPRET"] = "1"
    torch.set_num_threads(1)
    sys.path[:] = sys_path
    from triton_interpreter import install as patch_interpreter_once  # as in conftest.py: same computation, faster

    patch_interpreter_once()
    import torch.distributed as dist

    status, value, started = "ok", None, None
    try:
        fn, args = pickle.loads(payload)
        dist.init_process_group("gloo", init_method="file://" + os.path.join(tmp, "rendezvous"), rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout))
        started = time.monotonic()
        value = _to_cpu(fn(rank, world_size, *args))
        _write_meta(tmp, rank, {"seconds": time.monotonic() - started})
    except BaseException as err:
        seconds = time.monotonic() - started if started is not None else float("nan")
        _write_meta(tmp, rank, {"type": type(err).__name__, "message": str(err), "seconds": seconds})
        status, value = "error", traceback.format_exc()
        _write_report(tmp, rank, status, value)  # before the teardown, which may wait on stuck peers
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException:
        if status == "ok":
            status, value = "error", traceback.format_exc()
    if not (status == "error" and os.path.exists(_report_path(tmp, rank, "error"))):
        _write_report(tmp, rank, status, value)
