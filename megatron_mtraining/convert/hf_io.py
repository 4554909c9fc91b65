"""Hugging Face model folders: ``config.json``, the weights (safetensors, one file or sharded with
``model.safetensors.index.json``; or ``pytorch_model*.bin``) and the tokenizer files.

Reading and writing weights needs the ``safetensors`` package (``pip install .[hf]``);
counting a tokenizer's tokens needs ``transformers`` (the same extra). Training needs neither.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Dict, Iterable, List, Optional

import torch

from .shape import ConversionError

__all__ = ["TOKENIZER_FILES", "copy_tokenizer", "read_config", "read_weights", "tokenizer_length",
           "tokenizer_files", "write_weights"]

# The files transformers' tokenizers and generation read; copied on export.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json", "generation_config.json", "chat_template.jinja")
_VOCABULARIES = ("tokenizer.json", "tokenizer.model", "vocab.json")
_SHARD_BYTES = 5 * 1024 ** 3  # transformers' default max_shard_size


def _safetensors():
    try:
        import safetensors.torch
    except ImportError:
        raise ConversionError("reading and writing Hugging Face weights needs the safetensors package: "
                              "pip install 'megatron-mtraining[hf]' (or pip install safetensors)") from None
    return safetensors.torch


def read_config(folder: str) -> Dict:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise ConversionError(f"{folder} is not a Hugging Face model folder: it has no config.json")
    with open(path) as f:
        return json.load(f)


def read_weights(folder: str) -> Dict[str, torch.Tensor]:
    """Every tensor of the model in ``folder``, as stored (no dtype change)."""
    files = sorted(os.listdir(folder))
    index = next((f for f in ("model.safetensors.index.json", "pytorch_model.bin.index.json") if f in files), None)
    if index:
        with open(os.path.join(folder, index)) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    else:
        names = [f for f in files if f == "model.safetensors"] or [f for f in files if f == "pytorch_model.bin"]
    if not names:
        raise ConversionError(f"{folder} holds no weights (model.safetensors, its sharded index, or pytorch_model.bin)")
    weights: Dict[str, torch.Tensor] = {}
    for name in names:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise ConversionError(f"{index} names {name}, which is not in {folder}")
        if name.endswith(".safetensors"):
            weights.update(_safetensors().load_file(path))
        else:
            weights.update(torch.load(path, map_location="cpu", weights_only=True))
    return weights


def write_weights(folder: str, weights: Dict[str, torch.Tensor], shard_bytes: int = _SHARD_BYTES) -> List[str]:
    """``model.safetensors`` (or shards of at most ``shard_bytes`` with the index transformers
    reads); returns the file names."""
    st = _safetensors()
    shards: List[Dict[str, torch.Tensor]] = [{}]
    size = 0
    for key in sorted(weights, key=_natural):
        tensor = weights[key].contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += nbytes
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        st.save_file(shard, os.path.join(folder, name), metadata={"format": "pt"})
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in weights.values())
        index = {"metadata": {"total_size": total},
                 "weight_map": {key: name for name, shard in zip(names, shards) for key in shard}}
        with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
    return names


def tokenizer_files(folder: str) -> List[str]:
    """The tokenizer files in ``folder`` (none unless it holds a vocabulary)."""
    names = [name for name in TOKENIZER_FILES if os.path.isfile(os.path.join(folder, name))]
    return names if any(n in names for n in _VOCABULARIES) else []


def copy_tokenizer(source: str, destination: str) -> List[str]:
    names = tokenizer_files(source)
    if not names:
        raise ConversionError(f"no tokenizer in {source} (tokenizer.json, tokenizer.model or vocab.json): "
                              "pass --tokenizer DIR, the folder of the model's tokenizer")
    for name in names:
        shutil.copy2(os.path.join(source, name), os.path.join(destination, name))
    return names


def tokenizer_length(folder: str) -> int:
    """The number of tokens Megatron's HuggingFaceTokenizer reports for ``folder``
    (``len(tokenizer)``: the vocabulary and the added tokens), which it pads."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ConversionError("counting the tokenizer's tokens needs transformers: pip install "
                              "'megatron-mtraining[hf]', or give --padded-vocab-size") from None
    try:
        return len(AutoTokenizer.from_pretrained(folder))
    except Exception as err:
        raise ConversionError(f"the tokenizer in {folder} does not load ({type(err).__name__}: {err})") from err


def _natural(key: str) -> Iterable:
    return [int(part) if part.isdigit() else part for part in key.split(".")]
