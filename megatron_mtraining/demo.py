"""`make demo`: the main job. For now a single-device MTraining attention run on a small input.

It builds a vertical-slash index, runs sparse attention forward and backward with the default
backend (Triton on a GPU, PyTorch on the CPU), checks the result against the reference, and
prints density, error and timing. (The Megatron integration turns this into an end-to-end
training run.)
"""

from __future__ import annotations

import argparse
import logging
import time

import torch

from . import VSIndex, reference_attention, sparse_attention
from ._ext import status as extension_status


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=None, help="tokens (default 1024 on CPU, 16384 on GPU)")
    p.add_argument("--heads", type=int, default=8, help="query heads")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (GQA)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--max-slash", type=int, default=8)
    p.add_argument("--max-vertical", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n = args.seq_len or (16384 if device.type == "cuda" else 1024)
    torch.manual_seed(args.seed)
    index = VSIndex.random(1, args.heads, n, args.block_size, max_slash=args.max_slash,
                           max_vertical=args.max_vertical, generator=torch.Generator().manual_seed(args.seed),
                           device=device)
    index.validate(n)
    q, k, v = (torch.randn(1, h, n, args.head_dim, device=device, dtype=dtype, requires_grad=True)
               for h in (args.heads, args.kv_heads, args.kv_heads))
    print(f"[demo] device={device} dtype={dtype} seq_len={n} heads={args.heads}/{args.kv_heads} "
          f"head_dim={args.head_dim} block={args.block_size} extension: {extension_status()}")
    print(f"[demo] index density (active / causal pairs): {index.density(n).mean().item():.4f}")

    start = time.perf_counter()
    out = sparse_attention(q, k, v, index)
    out.float().square().mean().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start

    check_len = min(n, 2048)  # the reference is O(n^2): check on a prefix (causal, so exact)
    qs, ks, vs = (x.detach()[:, :, :check_len].float() for x in (q, k, v))
    ref, _ = reference_attention(qs, ks, vs, index, num_blocks=n // args.block_size)
    err = ((out[:, :, :check_len].float() - ref).norm() / ref.norm()).item()
    print(f"[demo] forward+backward {elapsed * 1e3:.1f} ms; relative error vs reference "
          f"(first {check_len} tokens): {err:.2e}")
    tol = 2e-2 if dtype != torch.float32 else 1e-5
    if err > tol or not all(torch.isfinite(x.grad).all() for x in (q, k, v)):
        print("[demo] FAILED: output or gradients wrong")
        return 1
    print("[demo] OK")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
