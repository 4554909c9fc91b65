"""The two conversions: a Hugging Face model folder into a Megatron ``torch_dist`` checkpoint, and a
Megatron checkpoint (converted, or saved by a training run) back into a Hugging Face folder.

Both write into a temporary sibling of the output folder and rename it at the end: a failed
conversion leaves no partly written output.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from typing import Dict, Iterator, List, Optional

import torch

from . import hf_io, megatron_io
from .shape import ConversionError, ModelShape, hf_dtype, padded_vocab_size
from .weights import hf_to_megatron_state, megatron_to_hf_state, vocab_tail

__all__ = ["RECORD", "TAIL", "hf_to_megatron", "megatron_to_hf", "read_record"]

RECORD = "mtraining_conversion.json"   # what the checkpoint was converted from
TAIL = "mtraining_vocab_tail.pt"       # embedding rows past Megatron's padding, restored on export


def hf_to_megatron(hf_dir: str, out: str, *, tp: int = 1, tokenizer: Optional[str] = None,
                   padded_vocab: Optional[int] = None, divisible_by: int = 128, dtype: Optional[str] = None,
                   log=print) -> Dict:
    """Convert ``hf_dir`` into a Megatron release checkpoint at ``out``; returns the record that
    is written beside it (shape, vocabulary padding, the Megatron flags to train it with)."""
    _check_output(out)
    hf_config = hf_io.read_config(hf_dir)
    shape = ModelShape.from_hf_config(hf_config)
    shape.check_tensor_parallel(tp)
    tokenizer = tokenizer or (hf_dir if hf_io.tokenizer_files(hf_dir) else None)
    tokens = None
    if tokenizer is not None:
        if not hf_io.tokenizer_files(tokenizer):
            raise ConversionError(f"no tokenizer files in {tokenizer}")
        if padded_vocab is None:
            tokens = hf_io.tokenizer_length(tokenizer)
    if padded_vocab is None:
        if tokens is None:
            raise ConversionError(
                f"no tokenizer in {hf_dir}: give --tokenizer DIR (the model's tokenizer folder), or "
                "--padded-vocab-size N for a run whose vocabulary is not a Hugging Face tokenizer's")
        padded_vocab = padded_vocab_size(tokens, divisible_by, tp)
    if padded_vocab % tp:
        raise ConversionError(f"--padded-vocab-size {padded_vocab} is not a multiple of TP {tp}")
    if tokens is not None and tokens > padded_vocab:
        raise ConversionError(f"the tokenizer has {tokens} tokens, more than the {padded_vocab} vocabulary rows")
    if tokens is not None and tokens > shape.vocab_size:
        raise ConversionError(f"the tokenizer has {tokens} tokens, the model's embedding {shape.vocab_size} rows")
    source_dtype = megatron_io.torch_dtype(shape.dtype) if dtype is None else megatron_io.torch_dtype(dtype)
    log(f"[convert] {shape.family}: {shape.num_layers} layers, hidden {shape.hidden_size}, "
        f"{shape.num_attention_heads} heads / {shape.num_query_groups} KV groups, "
        f"{'tied' if shape.tied_embeddings else 'untied'} embeddings, vocabulary {shape.vocab_size} rows -> "
        f"Megatron's padded vocabulary {padded_vocab}")

    weights = hf_io.read_weights(hf_dir)
    tail = vocab_tail(weights, shape, padded_vocab)
    state = hf_to_megatron_state(weights, shape, padded_vocab)
    state = {k: v.to(source_dtype) for k, v in state.items()}
    flags = shape.megatron_flags() + ["--make-vocab-size-divisible-by", str(divisible_by)]
    record = dict(format=1, source=os.path.abspath(hf_dir), shape=shape.to_json(), hf_config=hf_config,
                  padded_vocab_size=padded_vocab, make_vocab_size_divisible_by=divisible_by,
                  tensor_model_parallel_size=tp, tokenizer=os.path.abspath(tokenizer) if tokenizer else None,
                  tokenizer_length=tokens, megatron_flags=flags)

    with _staging(out) as staging, megatron_io.single_process_group():
        model = megatron_io.build_gpt(shape, padded_vocab, dtype=source_dtype)
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise ConversionError(f"megatron-core's GPT does not take the mapped weights: missing {missing[:4]}, "
                                  f"unexpected {unexpected[:4]}")
        megatron_io.save_release_checkpoint(staging, model, megatron_io.saved_args(shape, padded_vocab, divisible_by, tp))
        if tail:
            torch.save(tail, os.path.join(staging, TAIL))
        with open(os.path.join(staging, RECORD), "w") as f:
            json.dump(record, f, indent=1)
    log(f"[convert] wrote {out} (Megatron torch_dist, release). Train it with --pretrained-checkpoint {out} "
        f"(or --load {out} --finetune) and these model flags:\n  {' '.join(flags)}")
    if tokenizer:
        log(f"  --tokenizer-type HuggingFaceTokenizer --tokenizer-model {record['tokenizer']}")
    return record


def megatron_to_hf(ckpt: str, out: str, *, hf_base: Optional[str] = None, dtype: Optional[str] = None,
                   max_position_embeddings: Optional[int] = None, log=print) -> Dict:
    """Export the model of the Megatron checkpoint ``ckpt`` (a folder with a tracker file, or one
    iteration's folder) to a Hugging Face folder ``out``: weights, ``config.json`` with the
    checkpoint's context length and RoPE scaling, the tokenizer files."""
    _check_output(out)
    root = ckpt if os.path.isfile(os.path.join(ckpt, megatron_io.TRACKER)) else os.path.dirname(ckpt.rstrip("/"))
    record = read_record(root) or read_record(ckpt)
    if hf_base is not None:
        base_config = hf_io.read_config(hf_base)
        tokenizer = hf_base
        source_vocab = int(base_config["vocab_size"])
    elif record is not None:
        base_config, tokenizer = record["hf_config"], record.get("tokenizer") or record.get("source")
        source_vocab = int(record["shape"]["vocab_size"])
    else:
        raise ConversionError(f"{ckpt} does not say which Hugging Face model it started from (no {RECORD}): "
                              "pass --hf-base DIR, the Hugging Face folder the run was converted from")
    family = base_config.get("model_type")
    with megatron_io.single_process_group():
        args = megatron_io.read_saved_args(ckpt)
        if args is None:
            raise ConversionError(f"{ckpt} holds no saved arguments (common.pt without 'args')")
        saved_dtype = "bfloat16" if getattr(args, "bf16", False) else ("float16" if getattr(args, "fp16", False) else None)
        out_dtype = dtype or (record["shape"]["dtype"] if record else None) or saved_dtype or hf_dtype(base_config)
        shape = ModelShape.from_megatron_args(args, family=family, vocab_size=source_vocab, dtype=str(out_dtype))
        padded = int(getattr(args, "padded_vocab_size", None) or record["padded_vocab_size"])
        log(f"[export] {family}: {shape.num_layers} layers, hidden {shape.hidden_size}, vocabulary {padded} "
            f"rows in the checkpoint -> {shape.vocab_size}")
        state = megatron_io.load_megatron_state(ckpt, shape, padded, megatron_io.torch_dtype(out_dtype))
    tail = {}
    tail_path = os.path.join(root, TAIL)
    if os.path.isfile(tail_path):
        tail = torch.load(tail_path, map_location="cpu", weights_only=True)
    weights = megatron_to_hf_state(state, shape, tail)
    weights = {k: v.to(megatron_io.torch_dtype(out_dtype)) for k, v in weights.items()}
    length = max_position_embeddings or max(int(getattr(args, "seq_length", 0) or 0),
                                            int(getattr(args, "max_position_embeddings", 0) or 0),
                                            shape.max_position_embeddings)
    config = shape.hf_config(base_config, max_position_embeddings=length)
    with _staging(out) as staging:
        hf_io.write_weights(staging, weights)
        with open(os.path.join(staging, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        copied: List[str] = hf_io.copy_tokenizer(tokenizer, staging) if tokenizer else []
    log(f"[export] wrote {out}: {len(weights)} tensors, max_position_embeddings {length}, rope_scaling "
        f"{config['rope_scaling']}, tokenizer files {copied}")
    return config


def read_record(folder: str) -> Optional[Dict]:
    path = os.path.join(folder, RECORD)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def _check_output(out: str) -> None:
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ConversionError(f"{out} exists and is not an empty folder: choose a new output folder")


@contextlib.contextmanager
def _staging(out: str) -> Iterator[str]:
    """A temporary folder beside ``out`` that becomes ``out`` when the block ends without error."""
    parent = os.path.dirname(os.path.abspath(out)) or "."
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out))}.partial-", dir=parent)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if os.path.isdir(out):
        os.rmdir(out)  # empty, checked before
    os.rename(staging, out)
