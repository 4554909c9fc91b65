"""Run a function on several CPU processes joined in a gloo process group (tests only).

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes, initialises
``torch.distributed`` (gloo, file rendezvous in a fresh temporary directory) in each, calls
``fn(rank, world_size, *args)`` and returns the list of return values in rank order. Tensors in
the results come back detached on the CPU. A worker exception is re-raised in the parent as
``WorkerError`` carrying the worker's traceback; a run that does not finish within ``timeout``
seconds is killed and raises ``TimeoutError``. Nothing here can hang the test session.

``fn`` must be a module-level function (it is pickled by name). The workers have the tests
directory and the repository root on ``sys.path``, so test modules and the package import there.
"""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
import time
import traceback
from datetime import timedelta

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


def run_distributed(fn, world_size: int, *args, timeout: float = 180.0) -> list:
    """``[fn(0, world_size, *args), ..., fn(world_size - 1, world_size, *args)]``, one process each."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    payload = pickle.dumps((fn, args))  # fails here, with a clear error, if fn is not picklable
    what = f"run_distributed({getattr(fn, '__qualname__', fn)}, world_size={world_size})"
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="mtraining-dist-") as tmp:
        sys_path = [TESTS_DIR, REPO_ROOT] + [p for p in sys.path if p not in (TESTS_DIR, REPO_ROOT)]
        procs = [ctx.Process(target=_worker, args=(rank, world_size, tmp, payload, sys_path, timeout),
                             name=f"dist-worker-{rank}", daemon=True)
                 for rank in range(world_size)]
        for p in procs:
            p.start()
        try:
            timed_out = _wait(procs, tmp, timeout)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join()
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
    import torch.distributed as dist

    status, value = "ok", None
    try:
        fn, args = pickle.loads(payload)
        dist.init_process_group("gloo", init_method="file://" + os.path.join(tmp, "rendezvous"), rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout))
        value = _to_cpu(fn(rank, world_size, *args))
    except BaseException:
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
