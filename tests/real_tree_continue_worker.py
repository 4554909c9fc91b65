"""One process of a continued-pretraining run on the real Megatron-LM tree, on the CPU with gloo
(``tests/test_real_megatron_continue.py`` starts it with ``torch.distributed.run``, the tree first
on ``PYTHONPATH``).

Megatron-LM's own argument parser, ``validate_args``, global variables, ``load_checkpoint`` and
``save_checkpoint`` run as in ``pretrain_gpt.py``; the model is megatron-core's GPTModel from
``core_transformer_config_from_args`` with the layer spec MTraining's start-up returns; the
training step is a small loop (``pretrain()`` itself puts tensors on CUDA): striped CP shards,
Adam, gradients summed over the CP group as Megatron's DDP does (with TP instead of CP, each
rank holds its shard of the weights and the whole sequence).

argv: REPORT_JSON CKPT SAVE ITERATIONS [MEGATRON ARGS...]. The report: the iteration the load
returned, whether Megatron took the checkpoint as --finetune, the losses, and (rank 0) the model's
tensors before and after training, saved beside the report.
"""

from __future__ import annotations

import json
import os
import sys
import typing

import torch
import torch.distributed as dist

if not hasattr(typing, "override"):  # Python < 3.12; the tree's megatron/training/models import it
    typing.override = lambda function: function


def main() -> None:
    report_path, iterations, *argv = sys.argv[1:]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    from megatron_cpu_checkpointing import apply_checkpoint_cpu_shims, read_objects_in_place

    from megatron_mtraining.testing.cpu_shims import apply_cpu_shims

    apply_cpu_shims()
    apply_checkpoint_cpu_shims(extra_modules=("megatron.training.checkpointing", "megatron.training.utils",
                                              "megatron.core.dist_checkpointing.serialization"))
    read_objects_in_place()

    import megatron.training.arguments as arguments
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.training import global_vars
    from megatron.training.checkpointing import load_checkpoint, save_checkpoint

    from megatron_mtraining import shard_sequence
    from megatron_mtraining.integration.args import add_mtraining_args
    from megatron_mtraining.integration.enable import enable_mtraining

    arguments.get_device_arch_version = lambda: 9  # validate_args asks the GPU (Hopper) when CP > 1
    sys.argv = ["pretrain_gpt.py", *argv]
    args = arguments.parse_args(extra_args_provider=add_mtraining_args)
    arguments.validate_args(args, {})
    args.padded_vocab_size = args.vocab_size  # NullTokenizer's rows, as _build_tokenizer sets it
    global_vars.set_global_variables(args, build_tokenizer=False)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tensor_model_parallel_size,
                                             context_parallel_size=args.context_parallel_size)
    spec_hook = enable_mtraining(args)
    config = arguments.core_transformer_config_from_args(args)
    config.use_cpu_initialization = True
    model = GPTModel(config=config, transformer_layer_spec=spec_hook(get_gpt_layer_local_spec(normalization="RMSNorm")),
                     vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                     position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
                     share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights)

    iteration, _ = load_checkpoint([model], None, None)
    loaded = {k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    cp_group = parallel_state.get_context_parallel_group()
    cp, cp_rank = parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()
    seq, losses = args.seq_length, []
    for step in range(iteration + 1, iteration + 1 + int(iterations)):
        stream = torch.randint(0, 150, (1, seq + 1), generator=torch.Generator().manual_seed(step))
        tokens, labels, positions = stream[:, :-1], stream[:, 1:], torch.arange(seq)[None]
        tokens, labels, positions = (shard_sequence(x, 1, args.mtraining_layout, cp, cp_rank, args.mtraining_block_size)
                                     for x in (tokens, labels, positions))
        local = model(tokens, positions, None, labels=labels).float().sum()
        optimizer.zero_grad(set_to_none=True)
        (local / seq).backward()
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=cp_group)
        optimizer.step()
        total = local.detach().clone()
        dist.all_reduce(total, group=cp_group)
        losses.append(total.item() / seq)
    save_checkpoint(iteration + int(iterations), [model], None, None, 0)
    if rank == 0:
        trained = {k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
        torch.save({"loaded": loaded, "trained": trained}, report_path + ".pt")
        with open(report_path, "w") as f:
            json.dump({"iteration": iteration, "finetune": bool(args.finetune), "losses": losses,
                       "world": world}, f)
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
