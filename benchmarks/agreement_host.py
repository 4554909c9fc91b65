"""Host cost of one ring agreement (``call_items`` + ``agree``), on CPU processes with gloo.

    python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/agreement_host.py [--json OUT]

The call is the ring's at 512K tokens, 16 query heads, block 64: the items of
``sparse_ring_attention`` on the fixed index of ``tests/faults_gpu_worker.py``'s cost case (q, k,
v are only read for their shapes and dtype, so they are zero-stride views: no memory). Two
figures per agreement mode (eager, deferred): the host time of one call (median of repetitions
of a loop, max over ranks) and the torch operators it issues (``torch.profiler`` on the CPU:
the top-level ``aten::`` / ``c10d::`` calls, and all of them with the nested ones). The host time
is also given without the collective (``local_us``: ``all_reduce`` replaced by a completed no-op,
so gloo's round trip and the other rank's scheduling do not blur the figure), and the
all-reduce alone (``allreduce_us``).
On gloo the deferred mode reads the verdict off the host copy it already has, so its GPU-only
parts (the pinned copy and the event) are not in the figures; the launches are.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import megatron_mtraining as mm  # noqa: E402
from megatron_mtraining.approx import fixed_index  # noqa: E402
from megatron_mtraining.collective import agreement  # noqa: E402
from megatron_mtraining.config import Settings  # noqa: E402
from megatron_mtraining.ring.sparse import call_items  # noqa: E402

SEQ_LEN, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 524288, 16, 4, 128, 64


def ring_call(world):
    """(q, k, v, index) of one rank's ring call at the benchmark's shape."""
    n_local = SEQ_LEN // world
    zero = torch.zeros((), dtype=torch.bfloat16)
    q = zero.expand(1, HEADS, n_local, HEAD_DIM)
    k = v = zero.expand(1, KV_HEADS, n_local, HEAD_DIM)
    cfg = mm.MTrainingConfig(max_vertical=256, max_slash=16, min_vertical=16, block_size=BLOCK)
    return q, k, v, fixed_index(1, HEADS, SEQ_LEN, cfg)


def one_agreement(group, world, q, k, v, idx, settings):
    items = call_items("sparse_ring_attention", q, k, v, "striped", world, 0.088, idx, None)
    agreement.agree(group, "sparse_ring_attention", items, None, q.device, settings)


def host_time_us(group, world, call, reps=200, rounds=5):
    for _ in range(20):
        call()
    per_round = []
    for _ in range(rounds):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(reps):
            call()
        per_round.append((time.perf_counter() - start) / reps * 1e6)
    agreement._PENDING.clear()
    mine = torch.tensor([statistics.median(per_round)], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group)
    return float(mine)


class _Done:
    def wait(self, *args):
        return True


def local_time_us(call, reps=500, rounds=5):
    """Host time of ``call`` with the collective replaced by a completed no-op (this rank alone)."""
    real = dist.all_reduce
    dist.all_reduce = lambda *args, **kwargs: _Done()
    try:
        for _ in range(20):
            call()
        per_round = []
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(reps):
                call()
            per_round.append((time.perf_counter() - start) / reps * 1e6)
    finally:
        dist.all_reduce = real
    agreement._PENDING.clear()
    return min(per_round)


def operator_counts(call):
    from torch.profiler import ProfilerActivity, profile
    call()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        call()
    agreement._PENDING.clear()
    ops = [e for e in prof.events() if e.name.startswith(("aten::", "c10d::"))]
    top = [e for e in ops if e.cpu_parent is None or not e.cpu_parent.name.startswith(("aten::", "c10d::"))]
    names = {}
    for e in top:
        names[e.name] = names.get(e.name, 0) + 1
    return {"top_level_ops": len(top), "all_ops": len(ops), "by_name": dict(sorted(names.items()))}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the figures here (rank 0)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    group, world, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    q, k, v, idx = ring_call(world)
    result = {"seq_len": SEQ_LEN, "heads": HEADS, "block_size": BLOCK, "world": world, "backend": "gloo"}
    for how in ("eager", "deferred"):
        settings = Settings(ring_agreement=how)

        def call(settings=settings):
            one_agreement(group, world, q, k, v, idx, settings)
        result[how] = {"host_us": host_time_us(group, world, call), "local_us": local_time_us(call),
                       **operator_counts(call)}
    words = torch.zeros(2 * (world + agreement.ITEM_WORDS), dtype=torch.int64)
    result["allreduce_us"] = host_time_us(group, world, lambda: dist.all_reduce(words, op=dist.ReduceOp.MAX))
    if rank == 0:
        print(json.dumps(result, indent=1))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
