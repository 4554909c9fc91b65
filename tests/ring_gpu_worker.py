"""GPU ring checks, one process per GPU: `torchrun --nproc_per_node N tests/ring_gpu_worker.py`.

For each configuration: bf16 ring attention (Triton kernels, NCCL) against an fp32 reference of
the full sequence computed on every rank; then one forward+backward under
torch.cuda.set_sync_debug_mode("error") to show that a steady-state ring step does not
synchronise with the host. Prints one line per check; exits non-zero on any failure.
"""

import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import megatron_mtraining as mm  # noqa: E402


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def megatron_views(x):
    """x ``[b, h, s, d]`` as the Megatron layer hands it to the ring: a permuted view of an [s, b, h, d]
    leaf (whose .grad is then the gradient in that layout)."""
    leaf = x.permute(2, 0, 1, 3).contiguous().requires_grad_()
    return leaf, leaf.permute(1, 2, 0, 3)


def check(rank, world, layout, inner, seq_len, hq=8, hkv=2, d=128, B=64, batch=1, megatron_layout=False):
    g = torch.Generator(device="cuda").manual_seed(seq_len + world)
    q, k, v, do = (torch.randn(batch, h, seq_len, d, device="cuda", generator=g) for h in (hq, hkv, hkv, hq))
    index = mm.VSIndex.random(batch, hq, seq_len, B, max_slash=24, max_vertical=256,
                              generator=torch.Generator().manual_seed(seq_len), device="cuda")
    shard = lambda x: mm.shard_sequence(x, 2, layout, world, rank, B)
    if megatron_layout:  # strided q/k/v in (Megatron's views), gradients in the leaves' layout
        leaves, views = zip(*(megatron_views(shard(x).bfloat16()) for x in (q, k, v)))
        out = mm.sparse_ring_attention(*views, index, layout=layout, inner_size=inner, sequence_major_grads=True)
        # autograd.grad, not .backward: a leaf's .grad is copied into the leaf's layout when it is not.
        grads = torch.autograd.grad(out, leaves, shard(do).bfloat16())
        # The gradients came back in [s, b, h, d] memory: contiguous as Megatron's tensors, no copy made.
        in_place = all(g.is_contiguous() for g in grads)
        ql, kl, vl = (SimpleNamespace(grad=g.permute(1, 2, 0, 3)) for g in grads)
    else:
        ql, kl, vl = (shard(x).bfloat16().requires_grad_() for x in (q, k, v))
        out = mm.sparse_ring_attention(ql, kl, vl, index, layout=layout, inner_size=inner)
        out.backward(shard(do).bfloat16())
        in_place = True
    qf, kf, vf = (x.bfloat16().float().requires_grad_() for x in (q, k, v))
    ref = mm.sparse_attention(qf, kf, vf, index, backend="torch")
    ref.backward(do.bfloat16().float())
    errs = [rel(out, shard(ref)), rel(ql.grad, shard(qf.grad)), rel(kl.grad, shard(kf.grad)),
            rel(vl.grad, shard(vf.grad))]
    ok = max(errs) < 2e-2 and in_place
    # Steady state: no host synchronisation inside a ring forward+backward.
    grad = shard(do).bfloat16()  # sharding copies positions to the GPU: outside the checked region
    inputs = views if megatron_layout else (ql, kl, vl)
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out2 = mm.sparse_ring_attention(*inputs, index, layout=layout, inner_size=inner,
                                        sequence_major_grads=megatron_layout)
        out2.backward(grad)
        sync_ok = True
    except RuntimeError as exc:
        sync_ok = False
        print(f"[rank {rank}] host sync detected: {exc}", flush=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    what = f"{layout} inner={inner} N={seq_len}" + (f" b={batch} Megatron's [s, b, h, d] views" if megatron_layout else "")
    print(f"[rank {rank}] W={world} {what}: out/dq/dk/dv rel err "
          + " ".join(f"{e:.2e}" for e in errs) + ("" if in_place else "; gradients NOT in [s, b, h, d] memory")
          + f" -> {'ok' if ok else 'FAIL'}; no host sync: {sync_ok}",
          flush=True)
    return ok and sync_ok


def main():
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    configs = [("striped", None), ("zigzag", None)]
    if world == 4:
        configs += [("striped", 2), ("zigzag", 2)]
    results = [check(rank, world, layout, inner, 8192 * world // 2) for layout, inner in configs]
    results.append(check(rank, world, "striped", None, 4096 * world, batch=2, megatron_layout=True))
    # Above, 8 query heads over 2 K/V heads: the whole K/V fit where the fp32 dQ would be, so dQ is one
    # pass after the ring (SparseSteps.dq_in_one_pass). Over 8 K/V heads it is added step by step.
    results.append(check(rank, world, "striped", None, 8192 * world // 2, hkv=8))
    results.append(check(rank, world, "striped", None, 4096 * world, hkv=8, batch=2, megatron_layout=True))
    flag = torch.tensor([int(all(results))], device="cuda")
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    dist.destroy_process_group()
    sys.exit(0 if flag.item() == 1 else 1)


if __name__ == "__main__":
    main()
