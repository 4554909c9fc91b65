"""How a transfer or collective of the context-parallel group fails, and how long it may take.

A transfer that fails raises ``RingCommunicationError`` (the ring's transfers, ``ring/comm.py``, and
the agreement's all-reduce, ``agreement.py``). One that does not complete fails after the transfer
timeout (``transfer_timeout``): ``MTRAINING_RING_TIMEOUT_S`` seconds if set, otherwise the process
group's own timeout (``init_process_group(timeout=...)``; Megatron sets it with
``--distributed-timeout-minutes``).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

_DistError = getattr(dist, "DistError", RuntimeError)


class RingCommunicationError(_DistError):
    """A ring transfer failed or timed out; the message names the ring step (a
    ``torch.distributed.DistError``, i.e. a RuntimeError; the original error is its ``__cause__``)."""


TIMEOUT_ENV = "MTRAINING_RING_TIMEOUT_S"


def transfer_timeout() -> Optional[timedelta]:
    """``MTRAINING_RING_TIMEOUT_S`` as a timedelta, or None: the process group's own timeout.
    On NCCL an explicit timeout makes each wait block the host (PyTorch's blocking wait), so
    leave it unset on GPUs except while debugging; NCCL's watchdog enforces the group's."""
    value = os.environ.get(TIMEOUT_ENV, "")
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{TIMEOUT_ENV} must be a positive number of seconds, got {value!r}")
    return timedelta(seconds=seconds)


def wait_work(work) -> None:
    """``work.wait()`` within the transfer timeout; raises the transport's own error."""
    timeout = transfer_timeout()
    if timeout is None:
        work.wait()
    else:
        work.wait(timeout)


__all__ = ["RingCommunicationError", "TIMEOUT_ENV", "transfer_timeout", "wait_work"]
