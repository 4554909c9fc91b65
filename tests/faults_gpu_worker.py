"""One fault-injection case on GPUs with NCCL, one process per GPU (``scripts/gpu_faults.sh``):

    torchrun --nproc_per_node N tests/faults_gpu_worker.py CASE OUTDIR

Each rank writes ``OUTDIR/rank<R>.json`` when it starts the case (``{"status": "started"}``) and
again when it ends: ``ok``, or ``error`` with the exception type, message and seconds since the
start. A rank that NCCL's watchdog tears down (``TORCH_NCCL_ASYNC_ERROR_HANDLING``) writes no
end record: the script reports it from the process's exit and the wall time.

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
* ``cost``: no fault; the agreement's own time per call against one ring forward+backward at
  ``COST_SEQ_LEN`` (default 512K) tokens, for the "at most 1% of the ring" budget.
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
from megatron_mtraining.ring import agreement  # noqa: E402
from megatron_mtraining.ring.attention import call_items  # noqa: E402

NOTES = {}  # observations recorded before an expected error

FAULTY = 1
B = 64


def write(outdir, rank, record):
    path = os.path.join(outdir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


def inputs(rank, world, seq_len, hq=8, hkv=2, d=128, grad=True):
    g = torch.Generator(device="cuda").manual_seed(seq_len)
    q, k, v = (torch.randn(1, h, seq_len, d, device="cuda", generator=g, dtype=torch.bfloat16) for h in (hq, hkv, hkv))
    return [mm.shard_sequence(x, 2, "striped", world, rank, B).contiguous().requires_grad_(grad) for x in (q, k, v)]


def index(seq_len, hq=8, shift=0):
    cfg = mm.MTrainingConfig(max_vertical=256, max_slash=16, min_vertical=16)
    idx = fixed_index(1, hq, seq_len, cfg, device="cuda")
    if shift:  # same capacity and counts, other columns
        idx = mm.VSIndex(idx.slash, idx.n_slash, idx.vertical + shift * (idx.vertical > 100).int(), idx.n_vertical,
                         idx.block_size)
    return idx


def fault(how):
    if how == "die":
        os._exit(1)
    time.sleep(3600)


def run_case(case, rank, world):
    n = 16384
    if case == "disagree_index":
        q, k, v = inputs(rank, world, n)
        out = mm.sparse_ring_attention(q, k, v, index(n, shift=1 if rank == FAULTY else 0))
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
    torch.cuda.synchronize()
    how = "die" if case.startswith("die") else "stall"
    if rank == FAULTY and case.endswith("before_forward"):
        fault(how)
    out = mm.sparse_ring_attention(q, k, v, index(n))
    if rank == FAULTY:
        fault(how)
    out.float().sum().backward()
    torch.cuda.synchronize()  # where a stalled transfer shows on the host without blocking wait
    return {}


def cost(rank, world):
    seq_len = int(os.environ.get("COST_SEQ_LEN", 524288))
    q, k, v = inputs(rank, world, seq_len, hq=16, hkv=4)
    idx = index(seq_len, hq=16)
    items = call_items("sparse_ring_attention", q, k, v, "striped", world, 0.088, idx, None)
    group = dist.group.WORLD

    def timed(fn, reps):
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / reps

    def ring():
        mm.sparse_ring_attention(q, k, v, idx).sum().backward()

    def agree_only():
        items = call_items("sparse_ring_attention", q, k, v, "striped", world, 0.088, idx, None)
        agreement.agree(group, "cost", items, None, q.device)

    ring_s = timed(ring, 3)
    agree_s = timed(agree_only, 50)
    agreement._DEFERRED.clear()
    return {"seq_len": seq_len, "ring_fwd_bwd_ms": ring_s * 1e3, "agreement_us": agree_s * 1e6,
            "agreement_share_of_ring": agree_s / ring_s, "mode": agreement.mode(q.device, group),
            "items": len(items)}


def main():
    case, outdir = sys.argv[1], sys.argv[2]
    os.makedirs(outdir, exist_ok=True)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl", timeout=timedelta(seconds=float(os.environ.get("FAULT_PG_TIMEOUT_S", 30))),
                            device_id=torch.device("cuda", torch.cuda.current_device()))
    write(outdir, rank, {"status": "started", "wall_start": time.time()})
    start = time.monotonic()
    try:
        extra = cost(rank, world) if case == "cost" else run_case(case, rank, world)
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
