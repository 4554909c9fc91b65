"""`make demo`: the main job, a small end-to-end MTraining run with megatron-core.

A tiny GPT (megatron-core ``GPTModel``, RoPE, GQA) whose core attention is
``MTrainingAttention`` trains for a few iterations with context parallelism over every GPU
(NCCL) or, without a GPU, over 2 CPU processes (gloo, with the CPU shims). Each rank feeds its
striped share of every sequence; in every layer the index approximator builds the
vertical-slash index from the layer's q and k and the sparse ring attention runs over the CP
group. Logs look like Megatron's; the run fails if the loss does not go down.

    python -m torch.distributed.run --nproc_per_node N examples/demo/demo.py [--iterations 30] [--seq-length 2048]

Checkpoints take Megatron's flag names: ``--save DIR`` writes one at the end (and every
``--save-interval`` iterations), ``--load DIR`` resumes from the latest one in new processes;
``--iterations`` counts from the start of training, like ``--train-iters``. With the default
``--mtraining-deterministic`` a resumed run reproduces the uninterrupted run bit for bit
(``checkpointing.py``; ``tests/test_resume.py``).
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

import torch
import torch.distributed as dist

from megatron_mtraining import MTrainingConfig, shard_sequence
from megatron_mtraining.integration.args import add_mtraining_args


# megatron-core's notices that a demo user cannot act on: optional packages the demo does not
# need (Transformer Engine, Apex; it falls back to torch), and a deprecation raised by the defaults
# of its own TransformerConfig. Other warnings still show.
QUIET_WARNINGS = ("Transformer Engine and Apex are not installed", "Apex is not installed",
                  "full scope is deprecated")


def quiet_megatron_warnings() -> None:
    for message in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--iterations", type=int, default=30)
    p.add_argument("--seq-length", type=int, default=None, help="default 1024 on CPU, 16384 on GPUs")
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--num-query-groups", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--log-interval", type=int, default=5)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--save", type=str, default=None, help="checkpoint directory to save to (at the end of "
                   "training and every --save-interval iterations)")
    p.add_argument("--save-interval", type=int, default=0, help="iterations between checkpoints (0: only at the end)")
    p.add_argument("--load", type=str, default=None, help="checkpoint directory to resume from (its latest "
                   "checkpoint: model, optimizer, RNG state, iteration and loss history)")
    add_mtraining_args(p)
    # Short demo sequences stay sparse; sparse-attention telemetry every 10 iterations.
    p.set_defaults(mtraining_max_slash=8, mtraining_max_vertical=64, mtraining_min_vertical=16,
                   mtraining_log_interval=10)
    return p.parse_args(argv)


def synthetic_batch(step: int, batch: int, seq: int, vocab: int, seed: int) -> torch.Tensor:
    """Token streams with something to learn: a fixed low-entropy bigram "language" (the next
    token follows from the previous one 90% of the time), so the loss falls within a few dozen
    iterations. Long-range retrieval training is the quality benchmark's job."""
    table = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))  # the fixed language
    g = torch.Generator().manual_seed(seed * 100003 + step)
    tokens = torch.empty(batch, seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
    noise = torch.rand(batch, seq + 1, generator=g) < 0.1
    random_tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    for t in range(1, seq + 1):
        tokens[:, t] = torch.where(noise[:, t], random_tokens[:, t], table[tokens[:, t - 1]])
    return tokens


def main(argv=None) -> int:
    args = parse_args(argv)
    quiet_megatron_warnings()  # before megatron.core is imported
    use_cuda = torch.cuda.is_available()
    owns_group = not dist.is_initialized()  # else the caller's process group (tests)
    if owns_group:
        if "RANK" not in os.environ:  # plain `python examples/demo/demo.py`: one process
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda" if use_cuda else "cpu")

    from megatron.core import parallel_state

    from checkpointing import load_checkpoint, save_checkpoint
    from megatron_mtraining.integration import telemetry
    from megatron_mtraining.integration.args import integration_options
    from megatron_mtraining.integration.patches import install, uninstall
    from megatron_mtraining.testing.cpu_shims import apply_cpu_shims
    from megatron_mtraining.testing.gpt import build_small_gpt

    shims = None if use_cuda else apply_cpu_shims()
    cfg = MTrainingConfig.from_args(args)
    if cfg.inner_ring_size is not None and world % cfg.inner_ring_size:
        cfg = MTrainingConfig(**{**cfg.__dict__, "inner_ring_size": None})
    seq = args.seq_length or (16384 if use_cuda else 1024)
    install(cfg)  # RoPE tables sliced in the MTraining layout
    parallel_state.initialize_model_parallel(context_parallel_size=world)
    torch.manual_seed(args.seed)
    if use_cuda:  # megatron-core's CUDA RNG tracker (the CPU shims stand in for it on CPUs)
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        model_parallel_cuda_manual_seed(args.seed)
    model = build_small_gpt(cfg, num_layers=args.num_layers, hidden_size=args.hidden_size,
                            num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
                            vocab_size=args.vocab_size, seq_length=seq, context_parallel_size=world).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    cp_group = parallel_state.get_context_parallel_group()
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(f"[demo] megatron-core GPT: {args.num_layers} layers, hidden {args.hidden_size}, heads "
              f"{args.num_attention_heads}/{args.num_query_groups}, {params / 1e6:.2f}M parameters; "
              f"context parallel {world} ({'nccl' if use_cuda else 'gloo'}), {seq} tokens/sequence, "
              f"layout {cfg.layout}, index {cfg.index} top-p {cfg.top_p}", flush=True)

    start_iteration, losses = 0, []
    if args.load:
        start_iteration, extra = load_checkpoint(args.load, model, optimizer)
        losses = list(extra.get("losses", []))
        if rank == 0:
            print(f"[demo] resumed from {args.load} at iteration {start_iteration}", flush=True)

    log_interval = integration_options(args)["log_interval"]
    tele = telemetry.enable_telemetry(log_interval) if log_interval > 0 else None
    start = time.perf_counter()
    for it in range(start_iteration + 1, args.iterations + 1):
        if tele is not None:
            tele.step(it)  # megatron.training's loop provides this; a hand-written loop says it
        stream = synthetic_batch(it, args.micro_batch_size, seq, args.vocab_size, args.seed)
        tokens, labels = stream[:, :-1], stream[:, 1:]
        position_ids = torch.arange(seq).expand(args.micro_batch_size, seq)
        tokens, labels, position_ids = (shard_sequence(x, 1, cfg.layout, world, rank, cfg.block_size).to(device)
                                        for x in (tokens, labels, position_ids))
        per_token = model(tokens, position_ids, None, labels=labels)
        local_sum = per_token.float().sum()
        loss = local_sum / (args.micro_batch_size * seq)  # summed over CP ranks below, like Megatron
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=cp_group)
        optimizer.step()
        total = local_sum.detach().clone()
        dist.all_reduce(total, group=cp_group)
        losses.append(total.item() / (args.micro_batch_size * seq))
        if rank == 0 and (it % args.log_interval == 0 or it == 1):
            elapsed = time.perf_counter() - start
            density = [m.last_index.density(seq).mean().item() for m in model.modules()
                       if getattr(m, "last_index", None) is not None]
            print(f" iteration {it:>4}/{args.iterations} | lm loss {losses[-1]:.4f} | "
                  f"tokens/s {(it - start_iteration) * args.micro_batch_size * seq / elapsed:,.0f} | index "
                  "density per layer " + " ".join(f"{d:.3f}" for d in density), flush=True)
        if args.save and (it == args.iterations or (args.save_interval > 0 and it % args.save_interval == 0)):
            save_checkpoint(args.save, it, model, optimizer, extra={"losses": losses})
            if rank == 0:
                print(f"[demo] saved checkpoint of iteration {it} to {args.save}", flush=True)

    if tele is not None:
        tele.flush()  # the last log iteration
        telemetry.disable_telemetry()
    ok = len(losses) > 1 and losses[-1] < losses[0] - 0.5 and all(l == l for l in losses)
    if rank == 0 and losses:
        print(f"[demo] loss {losses[0]:.3f} -> {losses[-1]:.3f}: {'OK' if ok else 'FAILED (loss did not go down)'}",
              flush=True)
    parallel_state.destroy_model_parallel()
    uninstall()
    if shims is not None:
        shims.remove()
    if owns_group:
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
