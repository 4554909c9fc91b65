"""Checkpoint resume of megatron-core's DistributedOptimizer without Apex or Transformer Engine.

The GPU machines have neither, so Megatron's DistributedOptimizer holds torch's AdamW. A resume of
the real Megatron-LM tree (--use-distributed-optimizer --bf16 --ckpt-format torch_dist) gave
iteration 3 equal to an uninterrupted run and iteration 4 far off: the resumed optimizer's ``step``
was wrong (the dummy step's 1 instead of the checkpoint's, then one tensor shared by every
parameter and incremented once per parameter). ``integration/patches/optimizer.py`` (patches 5 to 7, on
DistributedOptimizer) fixes it; here, on the CPU, as Megatron's checkpointing.py does it:

train 2 steps, save (torch_dist: ``sharded_state_dict`` of the model and of the optimizer with the
content metadata training passes, ``dist_checkpointing.save``; torch: ``state_dict`` and
``save_parameter_state``), build a fresh model and optimizer, load (``sharded_state_dict(...,
is_loading=True)``, ``dist_checkpointing.load``, ``load_state_dict``; torch: ``load_state_dict``
and ``load_parameter_state``), and compare the main params, exp_avg, exp_avg_sq and step after the
load, and everything after one more step, bit for bit with the uninterrupted run. A tiny bf16
GPTModel in Float16Module and DistributedDataParallel, Adam with weight decay, DP 1 and 2 (gloo).

megatron-core's optimizer and checkpoint code assume CUDA beyond what ``cpu_shims`` covers
(``device='cuda'`` tensors, ``param.type() == 'torch.cuda.BFloat16Tensor'``, CUDA streams);
``tests/megatron_cpu_checkpointing.py`` covers them, in the spawned worker processes only.

tests/test_megatron_core_0_19.py runs this file again on megatron-core 0.19.1 from the Megatron-LM
tree (the GPU machines' version); it skips without the tarball.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("megatron.core")

from dist_utils import run_distributed  # noqa: E402

VOCAB, SEQ, BATCH = 128, 32, 2
TIMEOUT = 240


from megatron_cpu_checkpointing import apply_checkpoint_cpu_shims as _apply_optimizer_cpu_shims  # noqa: E402


# ---------------------------------------------------------------------------- model, optimizer, training

def _build():
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    torch.manual_seed(1234)
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
                               gradient_accumulation_fusion=False, bias_dropout_fusion=False,
                               masked_softmax_fusion=False, apply_rope_fusion=False, attention_dropout=0.0,
                               hidden_dropout=0.0, bf16=True, params_dtype=torch.bfloat16)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                     max_sequence_length=SEQ, position_embedding_type="rope")
    model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True,
                                               overlap_grad_reduce=False, bucket_size=None)
    model = DistributedDataParallel(config, ddp_config, model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95,
                        clip_grad=1.0, bf16=True, use_distributed_optimizer=True), [model])
    return model, optimizer


def _train_step(model, optimizer, iteration: int, rank: int):
    g = torch.Generator().manual_seed(1000 * iteration + rank)  # each DP rank its own micro-batch
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    model.zero_grad_buffer()
    optimizer.zero_grad()
    loss = model(tokens, torch.arange(SEQ)[None].expand(BATCH, SEQ), None, labels=labels).float().mean()
    loss.backward()
    model.finish_grad_sync()
    update_successful, grad_norm, _ = optimizer.step()
    assert update_successful
    return torch.tensor([loss.item(), float(grad_norm)], dtype=torch.float64)


def _sharded_state_dict(model, optimizer, sharding: str, is_loading: bool):
    """As megatron/training/checkpointing.py builds it for torch_dist (generate_state_dict with the
    content metadata of _build_sharded_state_dict_metadata)."""
    from megatron.core import parallel_state
    from megatron.core.utils import unwrap_model

    metadata = {"distrib_optim_sharding_type": sharding, "singleton_local_shards": False,
                "chained_optim_avoid_prefix": True,
                "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    if sharding == "fully_reshardable":
        metadata["distrib_optim_fully_reshardable_mem_efficient"] = True  # its gloo path
    state_dict = {"model": unwrap_model(model).sharded_state_dict(metadata=metadata)}
    kwargs = dict(metadata=metadata, is_loading=True) if is_loading else dict(metadata=metadata)
    state_dict["optimizer"] = optimizer.sharded_state_dict(state_dict, **kwargs)
    return state_dict


def _optimizer_state(optimizer):
    """Every inner optimizer's main params and states, by (optimizer, group, index, key)."""
    out = {}
    for c, inner in enumerate(getattr(optimizer, "chained_optimizers", [optimizer])):
        for g, group in enumerate(inner.optimizer.param_groups):
            for i, param in enumerate(group["params"]):
                out[f"{c}.{g}.{i}.param"] = param.detach().clone()
                for key, value in inner.optimizer.state[param].items():
                    if torch.is_tensor(value):
                        out[f"{c}.{g}.{i}.{key}"] = value.detach().clone()
    return out


def _step_tensors(optimizer):
    """(number of states with a step tensor, number of distinct step tensors)."""
    steps = [inner.optimizer.state[p]["step"] for inner in getattr(optimizer, "chained_optimizers", [optimizer])
             for group in inner.optimizer.param_groups for p in group["params"]]
    return len(steps), len({id(s) for s in steps})


def _model_params(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _resume_worker(rank, world_size, ckpt_root, cases):
    from megatron.core import parallel_state
    from megatron.core.optimizer import distrib_optimizer

    from megatron_mtraining import MTrainingConfig
    from megatron_mtraining.integration import patches
    from megatron_mtraining.testing.cpu_shims import apply_cpu_shims

    shims = apply_cpu_shims()
    _apply_optimizer_cpu_shims()
    parallel_state.initialize_model_parallel()
    patches.install(MTrainingConfig())  # as the launcher does, before anything is built
    try:
        assert not distrib_optimizer.HAVE_APEX_OR_TE
        assert parallel_state.get_data_parallel_world_size() == world_size
        return [_resume_case(rank, os.path.join(ckpt_root, f"{fmt}-{sharding}"), fmt, sharding)
                for fmt, sharding in cases]
    finally:
        patches.uninstall()
        parallel_state.destroy_model_parallel()
        shims.remove()


def _resume_case(rank, ckpt_dir, ckpt_format, sharding):
    """Train 2 iterations, save, train 2 more; a fresh model and optimizer load the checkpoint and
    train iterations 3 and 4 (what each run holds after the load and after iteration 3)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.utils import unwrap_model

    if rank == 0:
        os.makedirs(ckpt_dir)
    dist.barrier()
    out = {}
    # The uninterrupted run, saving after iteration 2.
    model, optimizer = _build()
    out["ref_iters"] = [_train_step(model, optimizer, it, rank) for it in (1, 2)]
    out["ref_loaded"] = _optimizer_state(optimizer)
    if ckpt_format == "torch_dist":
        dist_checkpointing.save(_sharded_state_dict(model, optimizer, sharding, False), ckpt_dir)
    else:  # legacy torch: the optimizer's state_dict beside the model, the parameter state apart
        if rank == 0:
            torch.save({"model": unwrap_model(model).state_dict_for_save_checkpoint(),
                        "optimizer": optimizer.state_dict()}, os.path.join(ckpt_dir, "model_optim_rng.pt"))
        optimizer.save_parameter_state(os.path.join(ckpt_dir, "distrib_optim.pt"))
    dist.barrier()
    out["ref_iters"] += [_train_step(model, optimizer, 3, rank)]
    out["ref_stepped"], out["ref_model"] = _optimizer_state(optimizer), _model_params(model)
    out["ref_iters"] += [_train_step(model, optimizer, 4, rank)]

    # The resumed run: a fresh model and an unstepped optimizer, loaded as checkpointing.py does.
    model, optimizer = _build()
    if ckpt_format == "torch_dist":
        state_dict = dist_checkpointing.load(_sharded_state_dict(model, optimizer, sharding, True), ckpt_dir)
        model.load_state_dict(state_dict["model"])
        optimizer.load_state_dict(state_dict["optimizer"])
    else:
        state_dict = torch.load(os.path.join(ckpt_dir, "model_optim_rng.pt"), weights_only=False)
        model.load_state_dict(state_dict["model"])
        optimizer.load_state_dict(state_dict["optimizer"])
        optimizer.load_parameter_state(os.path.join(ckpt_dir, "distrib_optim.pt"))
    out["res_loaded"], out["res_steps"] = _optimizer_state(optimizer), _step_tensors(optimizer)
    out["res_iters"] = [_train_step(model, optimizer, 3, rank)]
    out["res_stepped"], out["res_model"] = _optimizer_state(optimizer), _model_params(model)
    out["res_iters"] += [_train_step(model, optimizer, 4, rank)]
    return out


def _differences(ref, res):
    keys = sorted(set(ref) | set(res))
    return [(k, None if k not in ref or k not in res else (ref[k].double() - res[k].double()).abs().max().item())
            for k in keys if k not in ref or k not in res or not torch.equal(ref[k], res[k])]


def _check(out, what):
    assert len(out["ref_loaded"]) == len(out["res_loaded"]) > 0, what
    assert any(k.endswith(".exp_avg_sq") for k in out["ref_loaded"]), what
    diffs = _differences(out["ref_loaded"], out["res_loaded"])
    assert not diffs, f"{what}: main params / optimizer states after the load differ (key, max |diff|): {diffs[:6]}"
    n_states, n_distinct = out["res_steps"]
    assert n_distinct == n_states, f"{what}: {n_states} parameter states share {n_distinct} step tensor(s)"
    diffs = _differences(out["ref_stepped"], out["res_stepped"])
    assert not diffs, f"{what}: main params / optimizer states one step after the resume differ: {diffs[:6]}"
    diffs = _differences(out["ref_model"], out["res_model"])
    assert not diffs, f"{what}: model params one step after the resume differ: {diffs[:6]}"
    # Iterations 3 and 4: lm loss and grad norm.
    assert torch.equal(torch.stack(out["ref_iters"][2:]), torch.stack(out["res_iters"])), \
        (what, out["ref_iters"][2:], out["res_iters"])


def _run(tmp_path, world_size, cases):
    results = run_distributed(_resume_worker, world_size, str(tmp_path), cases, timeout=TIMEOUT)
    for rank, outs in enumerate(results):
        for (ckpt_format, sharding), out in zip(cases, outs):
            _check(out, f"{ckpt_format}/{sharding} DP={world_size} rank {rank}")


def test_resume_equals_uninterrupted_run_one_rank(tmp_path):
    """The GPU run's settings (torch_dist, its default dp_reshardable sharding, one rank): resumed
    after iteration 2, the optimizer holds the uninterrupted run's main params, exp_avg, exp_avg_sq
    and step (one step tensor per parameter), and iterations 3 and 4 are bit-identical."""
    _run(tmp_path, 1, [("torch_dist", "dp_reshardable")])


def test_resume_equals_uninterrupted_run_two_ranks(tmp_path):
    """The same over DP = 2 (each rank one half of the optimizer state), for torch_dist's
    dp_reshardable and fully_reshardable (--dist-ckpt-optim-fully-reshardable) and the legacy torch
    format (whose load raised KeyError: 'step' on the GPU machines)."""
    _run(tmp_path, 2, [("torch_dist", "dp_reshardable"), ("torch_dist", "fully_reshardable"),
                       ("torch", "dp_zero_gather_scatter")])
