"""Sparse ring attention check across processes (`examples/demo/demo_ring.py` under torch.distributed.run).

Launched by torchrun on every GPU (NCCL) or, without a GPU, on 2 CPU processes (gloo). Each
rank takes its striped share of one sequence, runs sparse ring attention forward and backward
(Triton on GPUs, PyTorch on CPUs), and rank 0 checks the gathered result and gradients against
single-device sparse attention on the full sequence.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from megatron_mtraining import VSIndex, gather_sequence, shard_sequence, sparse_attention, sparse_ring_attention
from megatron_mtraining._ext import status as extension_status


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=None, help="total tokens (default 2048 on CPU, 32768 on GPU)")
    p.add_argument("--heads", type=int, default=8, help="query heads")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (GQA)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--layout", default="striped", choices=("striped", "zigzag"))
    p.add_argument("--inner-ring-size", type=int, default=None)
    p.add_argument("--max-slash", type=int, default=8)
    p.add_argument("--max-vertical", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def init_distributed():
    if "RANK" not in os.environ:  # plain `python examples/demo/demo_ring.py`: one process
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29531")
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    return torch.device("cuda") if use_cuda else torch.device("cpu")


def main(argv=None) -> int:
    args = parse_args(argv)
    device = init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n = args.seq_len or (32768 if device.type == "cuda" else 2048)
    B = args.block_size
    gen = torch.Generator().manual_seed(args.seed)  # same full inputs on every rank
    index = VSIndex.random(1, args.heads, n, B, max_slash=args.max_slash, max_vertical=args.max_vertical,
                           generator=gen).to(device)
    q, k, v, grad = (torch.randn(1, h, n, args.head_dim, generator=gen).to(device, dtype)
                     for h in (args.heads, args.kv_heads, args.kv_heads, args.heads))
    shard = lambda x: shard_sequence(x, 2, args.layout, world, rank, B)  # noqa: E731
    ql, kl, vl = (shard(x).requires_grad_() for x in (q, k, v))
    if rank == 0:
        print(f"[demo] {world} rank(s) on {device.type} ({'nccl' if device.type == 'cuda' else 'gloo'}), "
              f"dtype {dtype}, {n} tokens ({n // world} per rank, {args.layout}), heads {args.heads}/"
              f"{args.kv_heads}, head_dim {args.head_dim}, block {B}; extension: {extension_status()}")
        print(f"[demo] index density (active / causal pairs): {index.density(n).mean().item():.4f}")

    for _ in range(2):  # the second run is the timed one
        dist.barrier()
        start = time.perf_counter()
        out = sparse_ring_attention(ql, kl, vl, index, layout=args.layout, inner_size=args.inner_ring_size)
        out.backward(shard(grad))
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        grads = [x.grad.clone() for x in (ql, kl, vl)]
        for x in (ql, kl, vl):
            x.grad = None

    def gather(x):
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous())
        return gather_sequence(parts, 2, args.layout, B)

    full = [gather(x.detach()) for x in [out] + grads]
    status = 0
    if rank == 0:
        qf, kf, vf = (x.float().requires_grad_() for x in (q, k, v))
        ref = sparse_attention(qf, kf, vf, index, backend="torch")
        ref.backward(grad.float())
        errors = [((a.float() - b).norm() / b.norm()).item() for a, b in zip(full, (ref, qf.grad, kf.grad, vf.grad))]
        tol = 2e-2 if dtype != torch.float32 else 1e-5
        print(f"[demo] ring forward+backward {elapsed * 1e3:.1f} ms; relative error vs single-device fp32: "
              f"out {errors[0]:.1e}, dq {errors[1]:.1e}, dk {errors[2]:.1e}, dv {errors[3]:.1e}")
        status = 0 if max(errors) < tol else 1
        print("[demo] OK" if status == 0 else "[demo] FAILED: ring result differs from the reference")
    flag = torch.tensor([status], device=device)
    dist.broadcast(flag, 0)
    dist.destroy_process_group()
    return int(flag.item())


if __name__ == "__main__":
    raise SystemExit(main())
