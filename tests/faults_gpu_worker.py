"""One fault-injection case on GPUs with NCCL, one process per GPU (``scripts/gpu_faults.sh``):

    torchrun --nproc_per_node N tests/faults_gpu_worker.py CASE OUTDIR

Each rank writes ``OUTDIR/rank<R>.json`` when it starts the case (``{"status": "started"}``) and
again when it ends: ``ok``, or ``error`` with the exception type, message and seconds since the
start; the faulty rank records ``fault injected (die|stall)``. A rank that NCCL's watchdog tears
down (``TORCH_NCCL_ASYNC_ERROR_HANDLING``) writes no end record: the script reports it from the
process's exit and the wall time. A dying rank exits with code 0 and a stalled one returns after
the timeout + 30 s, so that torchrun neither tears the other ranks down nor waits forever.

Cases (rank 1 is the faulty one; ``FAULT_PG_TIMEOUT_S``, default 30, is the process group's
timeout, i.e. the NCCL watchdog's bound):

* ``disagree_index``: the ranks' indices differ in contents (deferred agreement: NaN output,
  then ``RingAgreementError`` in the backward, without any host synchronisation added);
* ``disagree_length_eager``: ``MTRAINING_RING_AGREEMENT=eager``, rank 1 has a longer sequence:
  ``RingAgreementError`` on every rank before any transfer;
* ``local_failure_eager``: rank 1's own check fails (eager): its ValueError, the others'
  ``RingAgreementError``;
* ``die_before_forward`` / ``die_between_forward_and_backward``: rank 1 exits;
* ``stall_between_forward_and_backward``: rank 1 sleeps;
* ``stall_blocking_wait``: as above with ``TORCH_NCCL_BLOCKING_WAIT=1`` and
  ``MTRAINING_RING_TIMEOUT_S=10`` (set by the script): ``RingCommunicationError`` naming the step;
* ``cost``: no fault; one ring forward+backward at ``COST_SEQ_LEN`` (default 512K) tokens with its
  agreement and without it (``agreement.agree`` a no-op), for the "at most 1% of the ring" budget,
  and the host time of one agreement alone (in steady state: each call first reads the verdicts
  that are ready, as a ring call does). ``COST_INDEX``: ``benchmark`` (default: the ring
  benchmark's configuration, 16/2 heads and its ~5% fixed index, the ring whose time the budget
  is of) or ``sparse`` (16/4 heads and this worker's test index: a short, host-bound ring, the
  worst case for a per-call cost).
"""

import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import megatron_mtraining as mm  # noqa: E402
from megatron_mtraining.approx import fixed_index  # noqa: E402
from megatron_mtraining.collective import agreement  # noqa: E402
from megatron_mtraining.config import environment_settings  # noqa: E402
from megatron_mtraining.ring.sparse import call_items  # noqa: E402

NOTES = {}  # observations recorded before an expected error
START = 0.0  # time.monotonic() at the start of the case

FAULTY = 1
B = 64
# FAULT_CPU=1 runs the cases' logic on CPU processes with gloo (a dry run of this worker; the
# semantics under test are NCCL's, so the script never sets it).
CPU = os.environ.get("FAULT_CPU") == "1"
DEVICE = "cpu" if CPU else "cuda"
DTYPE = torch.float32 if CPU else torch.bfloat16
SEQ_LEN = int(os.environ.get("FAULT_SEQ_LEN", 2048 if CPU else 16384))


def write(outdir, rank, record):
    path = os.path.join(outdir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


def inputs(rank, world, seq_len, hq=8, hkv=2, d=128, grad=True):
    g = torch.Generator(device=DEVICE).manual_seed(seq_len)
    q, k, v = (torch.randn(1, h, seq_len, d, device=DEVICE, generator=g, dtype=DTYPE) for h in (hq, hkv, hkv))
    return [mm.shard_sequence(x, 2, "striped", world, rank, B).contiguous().requires_grad_(grad) for x in (q, k, v)]


def index(seq_len, hq=8, fewer_columns=False):
    cfg = mm.MTrainingConfig(max_vertical=256, max_slash=16, min_vertical=16)
    idx = fixed_index(1, hq, seq_len, cfg, device=DEVICE)
    if fewer_columns:  # same capacity, one valid column fewer per head: still a valid index
        idx = mm.VSIndex(idx.slash, idx.n_slash, idx.vertical, idx.n_vertical - 1, idx.block_size)
    return idx


def fault(outdir, rank, how):
    """Record the injected fault, then die (exit code 0, so that torchrun does not tear the other
    ranks down: their own handling is under test) or stall past the process group's timeout."""
    write(outdir, rank, {"status": f"fault injected ({how})", "seconds": round(time.monotonic() - START, 3)})
    if how == "stall":
        time.sleep(float(os.environ.get("FAULT_PG_TIMEOUT_S", 30)) + 30)
    os._exit(0)


def synchronize():
    if not CPU:
        torch.cuda.synchronize()


def run_case(case, rank, world, outdir):
    n = SEQ_LEN
    if case == "disagree_index":
        q, k, v = inputs(rank, world, n)
        out = mm.sparse_ring_attention(q, k, v, index(n, fewer_columns=rank == FAULTY))
        NOTES["nan_output"] = bool(torch.isnan(out).all())  # (this test's own synchronisation)
        out.float().sum().backward()  # the verdict is complete by now: raised here
        mm.sparse_ring_attention(q, k, v, index(n))
        return {}
    if case == "disagree_length_eager":
        q, k, v = inputs(rank, world, 2 * n if rank == FAULTY else n)
        mm.sparse_ring_attention(q, k, v, index(2 * n if rank == FAULTY else n))
        return {}
    if case == "local_failure_eager":
        q, k, v = inputs(rank, world, n)
        mm.sparse_ring_attention(q, k, v, index(n), inner_size=3 if rank == FAULTY else None)
        return {}
    q, k, v = inputs(rank, world, n)
    mm.sparse_ring_attention(q, k, v, index(n)).float().sum().backward()  # one good call
    synchronize()
    how = "die" if case.startswith("die") else "stall"
    if rank == FAULTY and case.endswith("before_forward"):
        fault(outdir, rank, how)
    out = mm.sparse_ring_attention(q, k, v, index(n))
    if rank == FAULTY:
        fault(outdir, rank, how)
    out.float().sum().backward()
    synchronize()  # where a stalled transfer shows on the host without blocking wait
    # Reached by a survivor only when nothing raised on the host: with NCCL's asynchronous error
    # handling the watchdog then tears the process down (gpu_faults.sh reports it from the exit).
    return {"returned_after_peer_fault": rank != FAULTY}


def cost(rank, world):
    """The agreement's cost inside the ring, A/B in one process: the ring's forward+backward with
    its agreement and with ``agreement.agree`` replaced by a no-op (CUDA-event timed back to back,
    so the GPU time the agreement adds is what shows, not host time that a training step overlaps
    with earlier GPU work); and, apart, one agreement alone in a loop (its host time)."""
    seq_len = int(os.environ.get("COST_SEQ_LEN", SEQ_LEN if CPU else 524288))
    kind = os.environ.get("COST_INDEX", "benchmark")
    if kind == "benchmark":
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
        from common import fixed_vs_index  # the ring benchmark's index

        q, k, v = inputs(rank, world, seq_len, hq=16, hkv=2)
        idx = fixed_vs_index(1, 16, seq_len, B, 0.05, DEVICE, seed=0)
    elif kind == "sparse":
        q, k, v = inputs(rank, world, seq_len, hq=16, hkv=4)
        idx = index(seq_len, hq=16)
    else:
        raise ValueError(f"COST_INDEX must be 'benchmark' or 'sparse', got {kind!r}")
    items = call_items("sparse_ring_attention", q, k, v, "striped", world, 0.088, idx, None)
    group = dist.group.WORLD

    def timed(fn, reps):
        for _ in range(2):
            fn()
        synchronize()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        synchronize()
        return (time.perf_counter() - start) / reps

    def ring():
        mm.sparse_ring_attention(q, k, v, idx).sum().backward()

    def agree_only():
        agreement.check_deferred(group)  # as a ring call does: ready verdicts give their host buffers back
        items = call_items("sparse_ring_attention", q, k, v, "striped", world, 0.088, idx, None)
        agreement.agree(group, "cost", items, None, q.device, environment_settings())

    real_agree = agreement.agree
    with_s, without_s = [], []
    for _ in range(3):  # interleaved, so drift (clocks, other work) falls on both sides
        with_s.append(timed(ring, 3))
        agreement.agree = lambda *args, **kwargs: None
        try:
            without_s.append(timed(ring, 3))
        finally:
            agreement.agree = real_agree
    ring_s, bare_s = min(with_s), min(without_s)
    agree_s = timed(agree_only, 50)
    agreement._PENDING.clear()
    return {"seq_len": seq_len, "index": kind, "index_density": float(idx.density(seq_len).mean()),
            "heads": [q.shape[1], k.shape[1]], "ring_fwd_bwd_ms": ring_s * 1e3,
            "ring_without_agreement_ms": bare_s * 1e3,
            "agreement_share_of_ring": (ring_s - bare_s) / bare_s, "agreement_us": agree_s * 1e6,
            "agreement_host_share_of_ring": agree_s / ring_s,
            "mode": agreement.mode(q.device, group, environment_settings()),
            "items": len(items)}


def main():
    case, outdir = sys.argv[1], sys.argv[2]
    os.makedirs(outdir, exist_ok=True)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = timedelta(seconds=float(os.environ.get("FAULT_PG_TIMEOUT_S", 30)))
    if CPU:
        dist.init_process_group("gloo", timeout=timeout)
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dist.init_process_group("nccl", timeout=timeout, device_id=torch.device("cuda", torch.cuda.current_device()))
    global START
    write(outdir, rank, {"status": "started", "wall_start": time.time()})
    START = start = time.monotonic()
    try:
        extra = cost(rank, world) if case == "cost" else run_case(case, rank, world, outdir)
        record = {"status": "ok", **extra}
    except Exception as err:
        record = {"status": "error", "type": type(err).__name__, "message": str(err)[:2000], **NOTES}
    record["seconds"] = round(time.monotonic() - start, 3)
    record["wall_start"] = time.time() - record["seconds"]
    write(outdir, rank, record)
    print(f"[rank {rank}] {case}: {record['status']} {record.get('type', '')} {record['seconds']} s", flush=True)
    if record["status"] == "ok" or case in ("disagree_length_eager", "local_failure_eager", "disagree_index"):
        try:
            dist.destroy_process_group()
        except Exception:
            pass
    os._exit(0)  # after a transport failure, the NCCL teardown may wait on the dead peer


if __name__ == "__main__":
    main()
