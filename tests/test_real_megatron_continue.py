"""Continued pretraining of a converted Hugging Face model on the real Megatron-LM tree (branch
core_r0.19.0, megatron-core 0.19.1), on the CPU: 2 gloo ranks, CP = 2, MTraining attention.

1. A tiny Qwen2 (tied embeddings, QKV bias; ``tests/hf_models.py``) is converted with
   ``python -m megatron_mtraining.convert hf-to-megatron``.
2. ``tests/real_tree_continue_worker.py`` parses the converter's model flags with Megatron-LM's own
   parser plus ``--pretrained-checkpoint CKPT --load SAVE --save SAVE``; Megatron's
   ``load_checkpoint`` finds nothing in SAVE and loads CKPT as --finetune (iteration 0); the
   loaded tensors equal the Hugging Face model's, mapped; 2 iterations train (losses finite) and
   Megatron's ``save_checkpoint`` writes iteration 2.
3. The same command again resumes from SAVE (iteration 2, not --finetune) with the tensors the
   first run saved, trains 2 more and saves iteration 4.
4. ``megatron-to-hf`` exports iteration 4 (saved by megatron-core 0.19.1, read here with the
   converter) and returns exactly the trained tensors.

Skips without the tree's tarball (``tests/megatron_lm_tree.py`` says where it looks).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the tiny source model is built with transformers (pip install .[hf])")
pytest.importorskip("megatron.core")

import hf_models  # noqa: E402
from megatron_lm_tree import REPO, require_tarball, unpack  # noqa: E402

from megatron_mtraining.convert import hf_to_megatron, megatron_to_hf  # noqa: E402
from megatron_mtraining.convert.hf_io import read_weights  # noqa: E402
from megatron_mtraining.convert.shape import ModelShape  # noqa: E402
from megatron_mtraining.convert.weights import hf_to_megatron_state  # noqa: E402

WORKER = REPO / "tests" / "real_tree_continue_worker.py"
TIMEOUT = 300


def _run(tree: Path, report: Path, iterations: int, flags, tmp_path: Path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(REPO / "tests"), str(REPO)]),
           "CUDA_DEVICE_MAX_CONNECTIONS": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "0",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", str(WORKER), str(report), str(iterations), *flags]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-6000:])
    return json.loads(report.read_text()), torch.load(str(report) + ".pt", weights_only=True)


def _flags(record, ckpt, save, parallel):
    seq = 256
    return [*record["megatron_flags"], "--seq-length", str(seq), "--max-position-embeddings", str(seq),
            "--micro-batch-size", "1", "--global-batch-size", "1", *parallel,
            "--transformer-impl", "local", "--no-rope-fusion", "--no-persist-layer-norm",
            "--no-gradient-accumulation-fusion", "--attention-dropout", "0", "--hidden-dropout", "0",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", str(record["padded_vocab_size"]),
            "--lr", "1e-3", "--train-iters", "4", "--ckpt-format", "torch_dist",
            "--pretrained-checkpoint", str(ckpt), "--load", str(save), "--save", str(save), "--save-interval", "2",
            "--no-save-optim", "--no-load-optim", "--no-save-rng", "--no-load-rng",
            "--mtraining", "--mtraining-block-size", "64", "--mtraining-layout", "striped"]


def _converted(tmp_path):
    tarball = require_tarball("a converted model's continued pretraining and resume on Megatron-LM core_r0.19.0")
    tree = unpack(tarball, tmp_path / "tree")
    hf_dir = hf_models.save_model("qwen2-tied", str(tmp_path / "hf"))
    record = hf_to_megatron(hf_dir, str(tmp_path / "ckpt"), dtype="float32", log=lambda *a: None)
    return tree, hf_dir, tmp_path / "ckpt", record


def test_converted_model_continues_pretraining_and_resumes_on_the_real_tree(tmp_path):
    tree, hf_dir, ckpt, record = _converted(tmp_path)
    save = tmp_path / "run"
    flags = _flags(record, ckpt, save, ["--context-parallel-size", "2"])

    first, first_state = _run(tree, tmp_path / "first.json", 2, flags, tmp_path)
    assert first["iteration"] == 0 and first["finetune"] and first["world"] == 2
    shape = ModelShape.from_json(record["shape"])
    expected = hf_to_megatron_state(read_weights(hf_dir), shape, record["padded_vocab_size"])
    assert sorted(first_state["loaded"]) == sorted(expected)
    for key, tensor in expected.items():
        assert torch.equal(first_state["loaded"][key], tensor), key
    assert len(first["losses"]) == 2 and all(torch.isfinite(torch.tensor(first["losses"])))
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert json.loads((save / "mtraining_conversion.json").read_text()) == record

    second, second_state = _run(tree, tmp_path / "second.json", 2, flags, tmp_path)
    assert second["iteration"] == 2 and not second["finetune"]
    for key, tensor in first_state["trained"].items():
        assert torch.equal(second_state["loaded"][key], tensor), key
    assert all(torch.isfinite(torch.tensor(second["losses"])))
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "4"

    megatron_to_hf(str(save), str(tmp_path / "exported"), log=lambda *a: None)
    exported = read_weights(str(tmp_path / "exported"))
    back = hf_to_megatron_state(exported, shape, record["padded_vocab_size"])
    for key, tensor in second_state["trained"].items():
        rows = min(tensor.shape[0], shape.vocab_size) if key.startswith("embedding") else tensor.shape[0]
        assert torch.equal(back[key][:rows], tensor[:rows]), key
    assert os.path.isfile(tmp_path / "exported" / "tokenizer.json")


def test_tensor_parallel_load_and_save_of_a_converted_model(tmp_path):
    """TP 2: Megatron-LM splits the converted (whole-tensor) checkpoint at load and saves its shards;
    the export of that TP-2 checkpoint returns the Hugging Face model bit for bit."""
    tree, hf_dir, ckpt, record = _converted(tmp_path)
    save = tmp_path / "run"
    report, _ = _run(tree, tmp_path / "tp.json", 0,
                     _flags(record, ckpt, save, ["--tensor-model-parallel-size", "2", "--context-parallel-size", "1"]),
                     tmp_path)
    assert report["iteration"] == 0 and report["finetune"]
    megatron_to_hf(str(save), str(tmp_path / "exported"), log=lambda *a: None)
    before, after = read_weights(hf_dir), read_weights(str(tmp_path / "exported"))
    before.pop("lm_head.weight", None)  # tied
    assert sorted(after) == sorted(before)
    for key, tensor in before.items():
        assert torch.equal(after[key], tensor), key
