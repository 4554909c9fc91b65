"""Distributed approximator on GPUs, one process per GPU: `torchrun --nproc_per_node N tests/approx_gpu_worker.py`.

For each (layout, tokens per rank): bf16 synthetic post-RoPE q/k of the full sequence, built once
on rank 0 and broadcast; each rank keeps its layout shard. The distributed `approximate_index`
(Triton statistics, NCCL collectives) must return the same index on every rank bit for bit, hold
the mandatory entries, and select what the single-device approximator selects on the full
sequence up to near-ties (its fp32 partial sums group the keys differently); a second call under
`torch.cuda.set_sync_debug_mode("error")` shows that it never synchronises with the host. Prints
one line per check; exits non-zero on any failure.
"""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(1, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from megatron_mtraining import MTrainingConfig, approximate_index, shard_sequence  # noqa: E402
from synthetic import synthetic_vs_qk  # noqa: E402

FIELDS = ("slash", "n_slash", "vertical", "n_vertical")


def full_sequence(rank, seq_len, seed):
    shapes = ((1, 16, seq_len, 128), (1, 2, seq_len, 128))
    if rank == 0:
        q, k = (x.contiguous() for x in synthetic_vs_qk(1, 16, 2, seq_len, 128, seed=seed, device="cuda",
                                                         dtype=torch.bfloat16))
    else:
        q, k = (torch.empty(s, device="cuda", dtype=torch.bfloat16) for s in shapes)
    dist.broadcast(q, 0)
    dist.broadcast(k, 0)
    return q, k


def selected(index, name, b, h):
    return set(getattr(index, name)[b, h, :int(getattr(index, f"n_{name}")[b, h])].tolist())


def check(rank, world, layout, n_local):
    seq_len = n_local * world
    cfg = MTrainingConfig(top_p=0.9, layout=layout)
    q, k = full_sequence(rank, seq_len, seed=n_local + world)
    ql, kl = (shard_sequence(x, 2, layout, world, rank, cfg.block_size).contiguous() for x in (q, k))
    group = dist.group.WORLD
    index = approximate_index(ql, kl, cfg, group=group)
    index.validate(seq_len)

    same = True
    for name in FIELDS:
        mine = getattr(index, name).contiguous()
        theirs = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(theirs, mine, group=group)
        same &= all(torch.equal(t, theirs[0]) for t in theirs)

    single = approximate_index(q, k, cfg)
    overlap = {"vertical": 1.0, "slash": 1.0}
    mandatory = True
    for h in range(16):
        for name in overlap:
            got, want = selected(index, name, 0, h), selected(single, name, 0, h)
            overlap[name] = min(overlap[name], len(got & want) / max(len(got), len(want), 1))
        mandatory &= 0 in selected(index, "slash", 0, h)
        mandatory &= set(range(cfg.sink_tokens)) <= selected(index, "vertical", 0, h)

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = approximate_index(ql, kl, cfg, group=group)
        no_sync = True
    except RuntimeError as err:
        if "synchroniz" not in str(err):
            raise  # NCCL or memory errors are failures of their own, not a host synchronisation
        no_sync = False
    finally:
        torch.cuda.set_sync_debug_mode("default")
    repeat = no_sync and all(torch.equal(getattr(again, n), getattr(index, n)) for n in FIELDS)

    ok = same and mandatory and repeat and overlap["vertical"] >= 0.95 and overlap["slash"] >= 0.9
    print(f"[rank {rank}] W={world} {layout} {n_local // 1024}K/rank: same on all ranks {same}, mandatory {mandatory}, "
          f"overlap with one device vertical {overlap['vertical']:.3f} slash {overlap['slash']:.3f}, "
          f"repeat bit-identical {repeat}, no host sync {no_sync} -> {'ok' if ok else 'FAIL'}", flush=True)
    return ok


def main():
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    torch.set_num_threads((os.cpu_count() or 1) if rank == 0 else 1)  # rank 0 builds the synthetic data
    results = [check(rank, world, layout, n_local)
               for layout, n_local in (("striped", 32768), ("zigzag", 32768), ("striped", 131072))]
    dist.destroy_process_group()
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
