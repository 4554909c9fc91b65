"""The multi-process test helper itself: results, worker errors and timeouts (never a hang)."""

import time

import pytest
import torch
import torch.distributed as dist

from dist_utils import WorkerError, run_distributed


def _all_reduce_worker(rank, world_size, scale):
    x = torch.full((3,), float(rank + 1))
    dist.all_reduce(x)
    gathered = [torch.empty(2) for _ in range(world_size)]
    dist.all_gather(gathered, torch.tensor([rank, rank * scale], dtype=torch.float32))
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": x,
            "gathered": torch.stack(gathered), "threads": torch.get_num_threads()}


def _failing_worker(rank, world_size):
    if rank == 1:
        raise ValueError("rank one is unhappy")
    dist.all_reduce(torch.zeros(1))  # waits forever for rank 1: the helper must not hang
    return rank


def _sleeping_worker(rank, world_size):
    time.sleep(600)


def test_all_reduce_and_results():
    results = run_distributed(_all_reduce_worker, 3, 10.0)
    expected_gather = torch.tensor([[0.0, 0.0], [1.0, 10.0], [2.0, 20.0]])
    for rank, r in enumerate(results):
        assert (r["rank"], r["world"], r["threads"]) == (rank, 3, 1)
        torch.testing.assert_close(r["sum"], torch.full((3,), 6.0))
        torch.testing.assert_close(r["gathered"], expected_gather)


def test_worker_error_is_reraised_with_traceback():
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        run_distributed(_failing_worker, 2, timeout=120)
    message = str(info.value)
    assert "rank 1 raised" in message and "ValueError: rank one is unhappy" in message
    assert "_failing_worker" in message  # the worker's own traceback
    assert time.monotonic() - start < 60, "a failure must not wait for the full timeout"


def test_timeout_kills_workers():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish within"):
        run_distributed(_sleeping_worker, 1, timeout=8)
    assert time.monotonic() - start < 30


def test_unpicklable_function_fails_in_parent():
    with pytest.raises(Exception):
        run_distributed(lambda rank, world_size: rank, 1)


# ---------------------------------------------------------------------------- run_distributed_outcomes


def _one_stalls_one_waits(rank, world_size):
    if rank == 1:
        time.sleep(600)  # alive and silent
    dist.all_reduce(torch.zeros(1))  # waits for rank 1 until the process group's timeout
    return rank


def test_outcomes_report_a_hang_instead_of_killing_it_early():
    from dist_utils import run_distributed_outcomes

    start = time.monotonic()
    outcomes = run_distributed_outcomes(_one_stalls_one_waits, 2, timeout=10, pg_timeout=60)
    assert [o.status for o in outcomes] == ["hung", "hung"], outcomes
    assert 10 <= time.monotonic() - start < 30


def test_outcomes_give_error_types_and_times():
    from dist_utils import run_distributed_outcomes

    start = time.monotonic()
    # The stalled rank is expected to stay silent: its peer's collective ends at the group's timeout.
    outcomes = run_distributed_outcomes(_one_stalls_one_waits, 2, timeout=60, pg_timeout=3, may_stay_silent=(1,))
    assert outcomes[0].status == "error" and 2.5 < outcomes[0].seconds < 10, outcomes
    assert outcomes[1].status == "hung"
    # A rank that raises: its type and message; its peer sees the closed connection.
    outcomes = run_distributed_outcomes(_failing_worker, 2, timeout=60, pg_timeout=30)
    assert (outcomes[1].status, outcomes[1].error_type, outcomes[1].message) == \
        ("error", "ValueError", "rank one is unhappy")
    assert outcomes[1].seconds < 1 and outcomes[0].status == "error" and outcomes[0].seconds < 10, outcomes
    ok = run_distributed_outcomes(_all_reduce_worker, 2, 3.0, timeout=60)
    assert [o.status for o in ok] == ["ok", "ok"] and ok[1].value["rank"] == 1
    assert time.monotonic() - start < 45
