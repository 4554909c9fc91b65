"""scripts/compare_checkpoints.py, the exact-resume check of scripts/gpu_megatron_lm.sh, on small
synthetic checkpoints written in Megatron's torch_dist layout: <save>/iter_XXXXXXX/ with the
tensors and sharded objects through torch.distributed.checkpoint (.metadata, __0_0.distcp), the
unsharded rest in common.pt, and latest_checkpointed_iteration.txt. Sharded objects are what
megatron-core writes for them: a BytesIO holding torch.save([object])."""

from __future__ import annotations

import enum
import importlib.util
import io
import os
import subprocess
import sys
import types
from argparse import Namespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "compare_checkpoints.py")
spec = importlib.util.spec_from_file_location("compare_checkpoints", SCRIPT)
cc = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = cc  # dataclasses look their module up
spec.loader.exec_module(cc)

ITERATION = 6
QKV = "decoder.layers.self_attention.linear_qkv.weight"
EXP_AVG = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.bfloat16, torch.float32).bucket_idx_0.exp_avg"
EXP_AVG_SQ = EXP_AVG + "_sq"
PARAM = EXP_AVG.rsplit(".", 1)[0] + ".param"
RNG = "rng_state/shard_0.0_1.2"


def _entries(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "embedding.word_embeddings.weight": torch.randn(64, 16, generator=g).bfloat16(),
        QKV: torch.randn(2, 32, 16, generator=g).bfloat16(),  # layers stacked on a prepended axis
        "decoder.final_layernorm.weight": torch.ones(16, dtype=torch.bfloat16),
        PARAM: torch.randn(2048, generator=g),
        EXP_AVG: torch.randn(2048, generator=g) * 1e-3,
        EXP_AVG_SQ: torch.rand(2048, generator=g) * 1e-6,
    }


def _sharded_object(value) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save([value], buffer)  # megatron-core's _mcore_to_torch_sharded_object
    buffer.seek(0)
    return buffer


class _MCoreLikeSavePlanner(DefaultSavePlanner):
    """Writes a BytesIO's bytes as they are, as megatron-core's MCoreSavePlanner does (the default
    planner would torch.save the BytesIO object once more)."""

    def transform_object(self, write_item, object):
        return object


class FakeModelType(enum.Enum):  # stands for megatron.core.enums.ModelType in common.pt
    encoder_or_decoder = 1


def write_checkpoint(root, tensors=None, objects=None, common=None, iteration=ITERATION, save_dir="/ckpt/a"):
    folder = os.path.join(root, f"iter_{iteration:07d}")
    os.makedirs(folder)
    tensors = _entries() if tensors is None else tensors
    objects = {RNG: {"random_rng_state": (3, tuple(range(5)), None), "cuda_rng_state": torch.arange(8, dtype=torch.uint8)},
               "optimizer.distributed.dp_group_idx_0.param_groups/shard_0_1":
                   [{"lr": 2.5e-4, "step": iteration, "params": [0, 1]}]} if objects is None else objects
    state = {**{k: v.clone() for k, v in tensors.items()}, **{k: _sharded_object(v) for k, v in objects.items()}}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(folder), planner=_MCoreLikeSavePlanner(), no_dist=True)
    base_common = {"args": Namespace(save=save_dir, load=save_dir, model_type=FakeModelType.encoder_or_decoder),
                   "iteration": iteration, "checkpoint_version": 3.0,
                   "opt_param_scheduler": {"num_steps": iteration, "max_lr": 3e-4},
                   "num_floating_point_operations_so_far": 1.5e12}
    torch.save(base_common if common is None else common, os.path.join(folder, "common.pt"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))
    return root


def run(a, b, *extra):
    out = io.StringIO()
    old = sys.stdout
    sys.stdout = out
    try:
        rc = cc.main([str(a), str(b), *extra])
    finally:
        sys.stdout = old
    return rc, out.getvalue()


def test_equal_checkpoints_pass(tmp_path):
    a = write_checkpoint(tmp_path / "a")
    b = write_checkpoint(tmp_path / "b", save_dir="/ckpt/b")  # args differ: each run's own --save
    rc, text = run(a, b)
    assert rc == 0, text
    assert "3 model, 3 optimizer, 2 object, 5 common entries" in text and "RESULT: PASS" in text
    assert "note args: run configuration (args) differs in load, save" in text, text
    rc, text = run(a / f"iter_{ITERATION:07d}", b, "--iteration", str(ITERATION))  # an iter folder, or the root
    assert rc == 0 and "RESULT: PASS" in text, text


@pytest.mark.parametrize("key, kind, index", [(QKV, "model", (1, 7, 3)), (EXP_AVG, "optimizer", (1234,)),
                                              (EXP_AVG_SQ, "optimizer", (5,)), (PARAM, "optimizer", (2047,))])
def test_one_changed_element_fails_naming_the_tensor(tmp_path, key, kind, index):
    a = write_checkpoint(tmp_path / "a")
    changed = _entries()
    before = changed[key][index].item()
    # The smallest change there is: the next representable value (one bit).
    changed[key][index] = torch.nextafter(changed[key][index].float(), torch.tensor(float("inf"))).to(changed[key].dtype) \
        if changed[key].dtype == torch.float32 else (changed[key][index].float() * 1.01).to(changed[key].dtype)
    assert changed[key][index].item() != before
    b = write_checkpoint(tmp_path / "b", tensors=changed)
    rc, text = run(a, b)
    assert rc == 1 and "RESULT: FAIL" in text, text
    fails = [line for line in text.splitlines() if "FAIL " in line and "RESULT" not in line]
    assert len(fails) == 1, text
    assert f"FAIL {kind} {key}: 1 of {changed[key].numel()} elements differ; first at {list(index)}" in fails[0]


def test_missing_tensor_fails(tmp_path):
    a = write_checkpoint(tmp_path / "a")
    fewer = _entries()
    del fewer[EXP_AVG_SQ]
    b = write_checkpoint(tmp_path / "b", tensors=fewer)
    rc, text = run(a, b)
    assert rc == 1 and f"FAIL optimizer {EXP_AVG_SQ}: missing in B" in text, text
    rc, text = run(b, a)
    assert rc == 1 and f"FAIL optimizer {EXP_AVG_SQ}: missing in A" in text, text


def test_dtype_and_shape_differences_fail(tmp_path):
    a = write_checkpoint(tmp_path / "a")
    other = _entries()
    other[QKV] = other[QKV].float()
    other["decoder.final_layernorm.weight"] = torch.ones(17, dtype=torch.bfloat16)
    b = write_checkpoint(tmp_path / "b", tensors=other)
    rc, text = run(a, b)
    assert rc == 1, text
    assert f"FAIL model {QKV}: dtype torch.bfloat16 vs torch.float32" in text
    assert "FAIL model decoder.final_layernorm.weight: shape (16,) vs (17,)" in text


def test_bits_not_values(tmp_path):
    """-0.0 == 0.0 and NaN != NaN as numbers; as bits the first differ and the second are equal."""
    zeros, negative = _entries(), _entries()
    zeros[PARAM][0], negative[PARAM][0] = 0.0, -0.0
    nan = _entries()
    nan[EXP_AVG][3] = float("nan")
    rc, text = run(write_checkpoint(tmp_path / "a", tensors=zeros), write_checkpoint(tmp_path / "b", tensors=negative))
    assert rc == 1 and f"FAIL optimizer {PARAM}: 1 of 2048 elements differ; first at [0]: 0.0 vs -0.0" in text, text
    rc, text = run(write_checkpoint(tmp_path / "c", tensors=nan), write_checkpoint(tmp_path / "d", tensors=nan))
    assert rc == 0, text


def test_sharded_objects_and_common_are_compared(tmp_path):
    a = write_checkpoint(tmp_path / "a")
    objects = {RNG: {"random_rng_state": (3, tuple(range(5)), None),
                     "cuda_rng_state": torch.tensor([0, 1, 2, 3, 4, 5, 6, 9], dtype=torch.uint8)},
               "optimizer.distributed.dp_group_idx_0.param_groups/shard_0_1":
                   [{"lr": 2.5e-4, "step": ITERATION, "params": [0, 1]}]}
    b = write_checkpoint(tmp_path / "b", objects=objects)
    rc, text = run(a, b)
    assert rc == 1 and f"FAIL object {RNG}: [0]['cuda_rng_state']: 1 of 8 elements differ; first at [7]: 7 vs 9" in text, text
    common = {"args": Namespace(), "iteration": ITERATION, "checkpoint_version": 3.0,
              "opt_param_scheduler": {"num_steps": ITERATION - 1, "max_lr": 3e-4},
              "num_floating_point_operations_so_far": 1.5e12}
    c = write_checkpoint(tmp_path / "c", common=common)
    rc, text = run(a, c)
    assert rc == 1 and "FAIL common opt_param_scheduler: opt_param_scheduler['num_steps']: 6 vs 5" in text, text
    rc, text = run(a, c, "--ignore", "opt_param_scheduler")
    assert rc == 0 and "note common opt_param_scheduler: opt_param_scheduler['num_steps']: 6 vs 5" in text, text
    rc, text = run(a, b, "--ignore", "rng_state")
    assert rc == 0 and f"note object {RNG}: [0]['cuda_rng_state']: 1 of 8" in text, text


def test_run_configuration_in_a_sharded_object_is_noted_not_failed(tmp_path):
    """On TE layers megatron-core also saves the args inside the ``common_state`` sharded object;
    they differ between the resumed and the uninterrupted run (--load, --save) and do not fail,
    while a state value beside them still does."""
    def objects(save_dir, step):
        return {"common_state/shard_0_1": {"args": Namespace(save=save_dir, load=None, seed=1234), "step": step}}
    a = write_checkpoint(tmp_path / "a", objects=objects("/ckpt/a_resume", 6))
    b = write_checkpoint(tmp_path / "b", objects=objects("/ckpt/a_full", 6))
    c = write_checkpoint(tmp_path / "c", objects=objects("/ckpt/a_full", 5))
    rc, text = run(a, b)
    assert rc == 0 and "RESULT: PASS" in text, text
    assert "note common_state/shard_0_1 [0]['args']: run configuration (args) differs in save" in text, text
    rc, text = run(a, c)
    assert rc == 1 and "FAIL object common_state/shard_0_1: [0]['step']: 6 vs 5" in text, text


def test_classes_that_do_not_import_are_compared_by_state(tmp_path):
    """common.pt pickles Megatron's classes (args.model_type, ...); the comparison runs without them."""
    ModelType = enum.Enum("ModelType", {"encoder_or_decoder": 1, "encoder_and_decoder": 2},
                          module="fake_megatron_enums")
    sys.modules["fake_megatron_enums"] = types.SimpleNamespace(ModelType=ModelType)
    try:
        common = lambda v: {"args": Namespace(model_type=ModelType(1)), "iteration": ITERATION,  # noqa: E731
                            "model_type": ModelType(v)}
        a = write_checkpoint(tmp_path / "a", common=common(1))
        b = write_checkpoint(tmp_path / "b", common=common(1))
        c = write_checkpoint(tmp_path / "c", common=common(2))
    finally:
        del sys.modules["fake_megatron_enums"]
    proc = subprocess.run([sys.executable, SCRIPT, str(a), str(b)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "RESULT: PASS" in proc.stdout, proc.stdout + proc.stderr
    proc = subprocess.run([sys.executable, SCRIPT, str(a), str(c)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "FAIL common model_type" in proc.stdout, proc.stdout + proc.stderr


def test_different_iterations_and_bad_folders(tmp_path):
    a = write_checkpoint(tmp_path / "a")
    b = write_checkpoint(tmp_path / "b", iteration=ITERATION + 1)
    rc, text = run(a, b)
    assert rc == 1 and "different iterations" in text
    rc, _ = run(a, b, "--iteration", "7")
    assert rc == 2  # a has no iter_0000007
    rc, _ = run(a, tmp_path / "nowhere")
    assert rc == 2
    legacy = tmp_path / "legacy" / f"iter_{ITERATION:07d}" / "mp_rank_00"
    legacy.mkdir(parents=True)
    torch.save({"model": {}}, legacy / "model_optim_rng.pt")
    proc = subprocess.run([sys.executable, SCRIPT, str(tmp_path / "legacy" / f"iter_{ITERATION:07d}"), str(a)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "not a torch_dist checkpoint" in proc.stderr
