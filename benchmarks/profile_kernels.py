"""One profiled forward+backward of the sparse attention kernels, for Nsight Compute.

Builds the kernel benchmark's canonical problem (fixed index, Qwen2.5-3B attention shape),
warms up (compiles), then runs one forward+backward between ``cudaProfilerStart/Stop`` so that
``ncu --profile-from-start off`` sees exactly one launch of each kernel. It also prints what the
compiler gave each kernel (registers, spills, shared memory), which ncu's launch section does
not break down per compile variant.

    ncu --profile-from-start off --section SpeedOfLight ... python benchmarks/profile_kernels.py
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernel import Config, forward_and_backward, index_and_inputs, parse_launch  # noqa: E402

from megatron_mtraining import sparse_attention  # noqa: E402
from megatron_mtraining.config import environment_settings  # noqa: E402
from megatron_mtraining.kernels import column_words, triton_bwd, triton_delta, triton_fwd  # noqa: E402


def compiled_variants():
    """(kernel name, registers, spills, shared bytes) of every compiled variant of our kernels."""
    from megatron_mtraining.kernels import hopper_bwd, hopper_fwd  # Gluon: on the GPU only

    for module in (triton_fwd, triton_bwd, triton_delta, column_words, hopper_fwd, hopper_bwd):
        for name in dir(module):
            fn = getattr(module, name)
            caches = getattr(fn, "device_caches", None)
            if not name.endswith("_kernel") or caches is None:
                continue
            for cache in caches.values():
                for compiled in cache[0].values():
                    yield (name, getattr(compiled, "n_regs", None), getattr(compiled, "n_spills", None),
                           getattr(compiled.metadata, "shared", None))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=65536)
    parser.add_argument("--launch", default="", help="as benchmarks/kernel.py --launch, e.g. fwd:4x2,bwd:4x2")
    parser.add_argument("--block-size", type=int, default=64, help="index block size (128: the ping-pong forward)")
    # The kernels that run: MTRAINING_FORWARD_KERNEL / MTRAINING_BACKWARD_KERNEL (read at start-up into
    # config.Settings, the default of sparse_attention's settings) choose between the Hopper and the
    # Triton ones, as in training.
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("profile_kernels.py needs a CUDA device")
    settings = dataclasses.replace(environment_settings(), kernel_launch=parse_launch(args.launch))
    cfg = Config(seq_lens=[args.seq_len], block_size=args.block_size)
    device = torch.device("cuda")
    index, arg_sets = index_and_inputs(cfg, args.seq_len, device)
    scale = 1.0 / math.sqrt(cfg.head_dim)
    run = forward_and_backward(lambda q, k, v: sparse_attention(q, k, v, index, scale, "triton", settings=settings))
    for _ in range(2):
        run(*arg_sets[0])
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    run(*arg_sets[0])
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    for name, regs, spills, shared in compiled_variants():
        print(f"compiled {name}: registers {regs}, spills {spills}, shared {shared}")


if __name__ == "__main__":
    main()
