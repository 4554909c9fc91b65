"""How a transfer or collective of the context-parallel group fails, and how long it may take.

A transfer that fails raises ``RingCommunicationError`` (the ring's transfers, ``ring/comm.py``, and
the agreement's all-reduce, ``agreement.py``). One that does not complete fails after the transfer
timeout: ``Settings.ring_timeout_s`` seconds if set (``MTRAINING_RING_TIMEOUT_S``,
``--mtraining-ring-timeout-s``), otherwise the process group's own timeout
(``init_process_group(timeout=...)``; Megatron sets it with ``--distributed-timeout-minutes``).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Optional

import torch.distributed as dist

_DistError = getattr(dist, "DistError", RuntimeError)


class RingCommunicationError(_DistError):
    """A ring transfer failed or timed out; the message names the ring step (a
    ``torch.distributed.DistError``, i.e. a RuntimeError; the original error is its ``__cause__``)."""


TIMEOUT_ENV = "MTRAINING_RING_TIMEOUT_S"  # named in error messages; read by config.py


def wait_work(work, timeout_s: Optional[float] = None) -> None:
    """``work.wait()`` within ``timeout_s`` seconds (``Settings.ring_timeout_s``; None: the process
    group's own timeout). On NCCL an explicit timeout makes each wait block the host (PyTorch's
    blocking wait), so leave it unset on GPUs except while debugging; NCCL's watchdog enforces
    the group's. Raises the transport's own error."""
    if timeout_s is None:
        work.wait()
    else:
        work.wait(timedelta(seconds=timeout_s))


__all__ = ["RingCommunicationError", "TIMEOUT_ENV", "wait_work"]
