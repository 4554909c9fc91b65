"""Hugging Face <-> Megatron conversion (megatron_mtraining.convert) against Hugging Face's own model.

The reference is ``transformers``' forward of the same tiny random model (``tests/hf_models.py``):
the converted checkpoint, read back into megatron-core's GPTModel, gives the same logits (fp32,
relative error measured ~4e-7, bound 1e-5), with megatron-core's local attention, with MTraining's
dense index, and with MTraining's vertical-slash index at a length where it selects every block.
Negative controls break one piece of the mapping each and must fail the same comparison. The round
trip HF -> Megatron -> HF returns every tensor bit for bit.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers", reason="the conversion tests build their models with transformers (pip install .[hf])")
pytest.importorskip("megatron.core")

import hf_models  # noqa: E402
from hf_models import MODELS, VOCAB, build_model, logits, rel_err, save_model  # noqa: E402

from megatron_mtraining.convert import ConversionError, ModelShape, hf_to_megatron, megatron_to_hf  # noqa: E402
from megatron_mtraining.convert import megatron_io, weights  # noqa: E402
from megatron_mtraining.convert.hf_io import read_weights  # noqa: E402

SEQ = 128
TOL = 1e-5


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """name -> (HF model, HF folder, checkpoint folder, record) for every model of hf_models."""
    out = {}
    for name in MODELS:
        root = tmp_path_factory.mktemp(name.replace(".", "_"))
        model = build_model(name)
        hf_dir = save_model(name, str(root / "hf"), model=model)
        record = hf_to_megatron(hf_dir, str(root / "ckpt"), dtype="float32", log=lambda *a: None)
        out[name] = (model, hf_dir, str(root / "ckpt"), record)
    return out


def tokens(seed=0, length=SEQ):
    return torch.randint(0, hf_models.TOKENS, (1, length), generator=torch.Generator().manual_seed(seed))


def megatron_logits(shape: ModelShape, padded: int, state, ids, layer_spec=None):
    model = megatron_io.build_gpt(shape, padded, dtype=torch.float32, layer_spec=layer_spec).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
    length = ids.shape[1]
    mask = torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1)[None, None]
    with torch.no_grad():
        out = model(ids, torch.arange(length)[None], mask)
    return out[..., :VOCAB].float(), model


def checkpoint_state(record, ckpt):
    shape = ModelShape.from_json(record["shape"])
    return shape, record["padded_vocab_size"], megatron_io.load_megatron_state(
        ckpt, shape, record["padded_vocab_size"], torch.float32)


# ---------------------------------------------------------------------------- logits


@pytest.mark.parametrize("name", list(MODELS))
def test_converted_checkpoint_gives_hugging_face_logits(megatron_cpu, converted, name):
    model, _, ckpt, record = converted[name]
    shape, padded, state = checkpoint_state(record, ckpt)
    ids = tokens()
    ours, _ = megatron_logits(shape, padded, state, ids)
    assert rel_err(ours, logits(model, ids)) < TOL


@pytest.mark.parametrize("name", ["qwen2-tied", "llama3.1"])
def test_mtraining_attention_on_the_converted_model(megatron_cpu, converted, name):
    """MTraining's dense index is exact causal attention; its vertical-slash index, at a length of
    two 64-token blocks with top-p 0.9, selects both blocks and is exact too."""
    from megatron_mtraining import MTrainingConfig
    from megatron_mtraining.integration.spec import get_gpt_layer_spec

    model, _, ckpt, record = converted[name]
    shape, padded, state = checkpoint_state(record, ckpt)
    ids = tokens(1)
    reference = logits(model, ids)
    dense, _ = megatron_logits(shape, padded, state, ids,
                               get_gpt_layer_spec(MTrainingConfig(index="dense", block_size=64)))
    assert rel_err(dense, reference) < TOL
    sparse, gpt = megatron_logits(shape, padded, state, ids,
                                  get_gpt_layer_spec(MTrainingConfig(index="vs", top_p=0.9, block_size=64, last_q=64)))
    for layer in gpt.decoder.layers:
        index = layer.self_attention.core_attention.last_index
        assert index is not None and torch.all(index.density(SEQ) == 1.0)
    assert rel_err(sparse, reference) < TOL


def _broken_qkv(q, k, v, shape):  # q, k, v one after the other instead of grouped per KV head
    return torch.cat([q, k, v], dim=0)


@pytest.mark.parametrize("break_", ["qkv-not-grouped", "gate-up-swapped", "rope-interleaved", "post-norm-as-input-norm"])
def test_negative_controls_fail_the_comparison(megatron_cpu, converted, monkeypatch, break_):
    model, hf_dir, _, record = converted["qwen2-untied"]
    shape = ModelShape.from_json(record["shape"])
    hf = read_weights(hf_dir)
    overrides = {}
    if break_ == "qkv-not-grouped":
        monkeypatch.setattr(weights, "_fuse_qkv", _broken_qkv)
    elif break_ == "gate-up-swapped":
        for layer in range(shape.num_layers):
            p = f"model.layers.{layer}.mlp."
            hf[p + "gate_proj.weight"], hf[p + "up_proj.weight"] = hf[p + "up_proj.weight"], hf[p + "gate_proj.weight"]
    elif break_ == "post-norm-as-input-norm":
        for layer in range(shape.num_layers):
            p = f"model.layers.{layer}."
            hf[p + "post_attention_layernorm.weight"] = hf[p + "input_layernorm.weight"]
    state = weights.hf_to_megatron_state(hf, shape, record["padded_vocab_size"])
    if break_ == "rope-interleaved":
        overrides["rotary_interleaved"] = True
    gpt = megatron_io.build_gpt(shape, record["padded_vocab_size"], dtype=torch.float32, **overrides).eval()
    gpt.load_state_dict(state, strict=False)
    ids = tokens(2)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    with torch.no_grad():
        ours = gpt(ids, torch.arange(SEQ)[None], mask)[..., :VOCAB]
    error = rel_err(ours, logits(model, ids))
    assert error > 1e-2, error


# ---------------------------------------------------------------------------- round trip and export


@pytest.mark.parametrize("name", list(MODELS))
def test_round_trip_is_bit_exact(converted, tmp_path, name):
    _, hf_dir, ckpt, _ = converted[name]
    out = tmp_path / "exported"
    megatron_to_hf(ckpt, str(out), log=lambda *a: None)
    before, after = read_weights(hf_dir), read_weights(str(out))
    if MODELS[name][1]["tie_word_embeddings"]:
        before.pop("lm_head.weight", None)
    assert sorted(after) == sorted(before)
    for key, tensor in before.items():
        assert after[key].dtype == tensor.dtype and torch.equal(after[key], tensor), key


@pytest.mark.parametrize("divisible_by", [64, 128])
def test_vocabulary_padding_follows_megatron_and_the_export_restores_the_rows(tmp_path, divisible_by):
    """The tokenizer has 154 tokens (as transformers loads it beside a Qwen2 config, which adds
    <|endoftext|>; Megatron's HuggingFaceTokenizer loads it the same way): Megatron pads them to
    192 (by 64: fewer rows than the model's 200, the last 8 are kept beside the checkpoint) or 256
    (by 128: zero rows added)."""
    from transformers import AutoTokenizer

    name = "qwen2-untied"
    hf_dir = save_model(name, str(tmp_path / "hf"))
    record = hf_to_megatron(hf_dir, str(tmp_path / "ckpt"), divisible_by=divisible_by, log=lambda *a: None)
    assert record["tokenizer_length"] == len(AutoTokenizer.from_pretrained(hf_dir)) == hf_models.TOKENS + 4
    assert record["padded_vocab_size"] == {64: 192, 128: 256}[divisible_by]
    assert record["megatron_flags"][-2:] == ["--make-vocab-size-divisible-by", str(divisible_by)]
    assert os.path.isfile(tmp_path / "ckpt" / "mtraining_vocab_tail.pt") == (divisible_by == 64)
    megatron_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "back"), log=lambda *a: None)
    before, after = read_weights(hf_dir), read_weights(str(tmp_path / "back"))
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        assert torch.equal(after[key], before[key]), key


def test_export_reloads_in_transformers_with_the_extended_context(megatron_cpu, converted, tmp_path):
    """A run at 1024 tokens with YaRN (factor 16 over 64) exports a config that transformers loads
    with that context, the tokenizer beside it, and the same logits as the checkpoint."""
    from megatron.core import dist_checkpointing  # noqa: F401  (megatron-core present)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, hf_dir, ckpt, record = converted["qwen2-tied"]
    shape = dataclasses.replace(ModelShape.from_json(record["shape"]), max_position_embeddings=1024,
                                rope_scaling=megatron_io.YarnRopeScaling(factor=16.0, original_max_position_embeddings=64))
    padded = record["padded_vocab_size"]
    state = megatron_io.load_megatron_state(ckpt, shape, padded, torch.float32)
    extended = tmp_path / "extended"
    gpt = megatron_io.build_gpt(shape, padded, dtype=torch.float32)
    gpt.load_state_dict(state, strict=False)
    args = megatron_io.saved_args(shape, padded, 128, 1)
    args.seq_length = 1024
    os.makedirs(extended)
    megatron_io.save_release_checkpoint(str(extended), gpt, args)
    out = tmp_path / "hf_extended"
    megatron_to_hf(str(extended), str(out), hf_base=hf_dir, log=lambda *a: None)
    config = json.load(open(out / "config.json"))
    assert config["max_position_embeddings"] == 1024
    assert config["rope_scaling"]["rope_type"] == "yarn" and config["rope_scaling"]["factor"] == 16.0
    assert config["rope_scaling"]["original_max_position_embeddings"] == 64
    assert config["tie_word_embeddings"] is True and config["architectures"] == ["Qwen2ForCausalLM"]
    reloaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    assert len(tokenizer) == len(AutoTokenizer.from_pretrained(hf_dir))
    ids = tokens(3, 256)
    ours, _ = megatron_logits(shape, padded, state, ids)
    assert rel_err(ours, logits(reloaded, ids)) < TOL


# ---------------------------------------------------------------------------- bad input


def test_unsupported_architecture_is_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConversionError, match="unsupported architecture.*gpt2"):
        hf_to_megatron(str(tmp_path), str(tmp_path / "out"), padded_vocab=256)
    assert not (tmp_path / "out").exists()


def test_tensor_parallelism_must_divide_the_heads(tmp_path):
    hf_dir = save_model("qwen2-tied", str(tmp_path / "hf"))
    with pytest.raises(ConversionError, match="tensor parallelism 4 does not divide the 2 key/value heads"):
        hf_to_megatron(hf_dir, str(tmp_path / "out"), tp=4)
    assert not (tmp_path / "out").exists()


def test_a_missing_tokenizer_is_named(tmp_path):
    hf_dir = save_model("qwen2-tied", str(tmp_path / "hf"), tokenizer=False)
    with pytest.raises(ConversionError, match="no tokenizer.*--tokenizer DIR.*--padded-vocab-size"):
        hf_to_megatron(hf_dir, str(tmp_path / "out"))
    with pytest.raises(ConversionError, match="pass --tokenizer DIR"):
        from megatron_mtraining.convert.hf_io import copy_tokenizer
        copy_tokenizer(hf_dir, str(tmp_path))


def test_weights_that_disagree_with_the_config_leave_no_output(tmp_path):
    hf_dir = save_model("qwen2-untied", str(tmp_path / "hf"))
    from megatron_mtraining.convert.hf_io import write_weights

    tensors = read_weights(hf_dir)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    write_weights(hf_dir, tensors)
    with pytest.raises(ConversionError, match="missing model.layers.1.mlp.up_proj.weight"):
        hf_to_megatron(hf_dir, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    assert not [p for p in os.listdir(tmp_path) if ".partial-" in p]


def test_an_existing_output_folder_is_not_overwritten(converted, tmp_path):
    _, hf_dir, ckpt, _ = converted["qwen2-tied"]
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    with pytest.raises(ConversionError, match="exists and is not an empty folder"):
        hf_to_megatron(hf_dir, str(tmp_path / "taken"))
    with pytest.raises(ConversionError, match="exists and is not an empty folder"):
        megatron_to_hf(ckpt, str(tmp_path / "taken"))


def test_a_checkpoint_whose_shapes_disagree_with_its_arguments_is_named(converted):
    _, _, ckpt, record = converted["qwen2-tied"]
    shape = dataclasses.replace(ModelShape.from_json(record["shape"]), ffn_hidden_size=128)
    with pytest.raises(ConversionError, match="linear_fc1.weight is .*the model needs"):
        megatron_io.load_megatron_state(ckpt, shape, record["padded_vocab_size"], torch.float32)


def test_megatron_arguments_are_checked_against_the_shape(converted):
    import argparse

    shape = ModelShape.from_json(converted["qwen2-tied"][3]["shape"])
    args = argparse.Namespace(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                              group_query_attention=True, num_query_groups=2, kv_channels=16, add_qkv_bias=True,
                              untie_embeddings_and_output_weights=False, rotary_base=10000, padded_vocab_size=256)
    assert shape.check_megatron_args(args, padded_vocab=256) == []
    args.num_query_groups, args.untie_embeddings_and_output_weights, args.padded_vocab_size = 4, True, 384
    problems = shape.check_megatron_args(args, padded_vocab=256)
    assert len(problems) == 3 and any("--num-query-groups" in p for p in problems)
    assert any("untie" in p for p in problems) and any("padded vocabulary" in p for p in problems)


def test_megatron_flags_describe_the_shape():
    shape = ModelShape.from_hf_config(hf_models.hf_config("qwen2-yarn-factor").to_dict())
    flags = shape.megatron_flags()
    assert "--untie-embeddings-and-output-weights" in flags and "--add-qkv-bias" in flags
    at = flags.index("--position-embedding-type")
    assert flags[at + 1] == "yarn" and flags[flags.index("--rotary-scaling-factor") + 1] == "8"
    assert flags[flags.index("--yarn-beta-fast") + 1] == "16"
    assert abs(shape.rope_scaling.attention_factor - 1.3) < 1e-12
    tied = ModelShape.from_hf_config(hf_models.hf_config("qwen2-tied").to_dict()).megatron_flags()
    assert "--untie-embeddings-and-output-weights" not in tied
    llama = ModelShape.from_hf_config(hf_models.hf_config("llama3.1").to_dict())
    assert "--use-rope-scaling" in llama.megatron_flags() and not llama.qkv_bias and llama.kv_channels == 24


def test_command_line_converts_and_reports_errors(tmp_path):
    hf_dir = save_model("qwen2-tied", str(tmp_path / "hf"))
    run = [sys.executable, "-m", "megatron_mtraining.convert"]
    done = subprocess.run(run + ["hf-to-megatron", "--hf", hf_dir, "--out", str(tmp_path / "ckpt")],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--pretrained-checkpoint" in done.stdout and "--tokenizer-model" in done.stdout
    bad = subprocess.run(run + ["hf-to-megatron", "--hf", hf_dir, "--out", str(tmp_path / "x"), "--tp", "3"],
                         capture_output=True, text=True, timeout=240)
    assert bad.returncode == 2 and bad.stderr.startswith("error: tensor parallelism 3")
    back = subprocess.run(run + ["megatron-to-hf", "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "back")],
                          capture_output=True, text=True, timeout=240)
    assert back.returncode == 0, back.stderr[-2000:]
    assert os.path.isfile(tmp_path / "back" / "tokenizer.json")


def test_a_run_from_a_converted_checkpoint_is_checked_at_start_up(converted, tmp_path):
    """MTraining's start-up names every model flag that disagrees with --pretrained-checkpoint, and
    copies the conversion record into --save, so the run's own checkpoints export without --hf-base."""
    import argparse

    from megatron_mtraining.convert.pretrained import check_pretrained_run

    _, _, ckpt, record = converted["qwen2-tied"]
    args = argparse.Namespace(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                              group_query_attention=True, num_query_groups=2, kv_channels=16, add_qkv_bias=True,
                              untie_embeddings_and_output_weights=True, rotary_base=10000,
                              padded_vocab_size=record["padded_vocab_size"], pretrained_checkpoint=ckpt,
                              save=str(tmp_path / "run"), rank=0)
    with pytest.raises(ValueError, match="untie-embeddings-and-output-weights: the run has True, the checkpoint False"):
        check_pretrained_run(args)
    assert not (tmp_path / "run").exists()
    args.untie_embeddings_and_output_weights = False
    assert check_pretrained_run(args)["padded_vocab_size"] == record["padded_vocab_size"]
    assert json.load(open(tmp_path / "run" / "mtraining_conversion.json")) == record
    args.pretrained_checkpoint = str(tmp_path)  # not a converted checkpoint: nothing to check
    assert check_pretrained_run(args) is None
