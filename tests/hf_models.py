"""Tiny random Hugging Face models and tokenizers for the conversion and evaluation tests: built
from a config with ``transformers`` (no download), their norms and biases perturbed away from
their initial values (ones, zeros) so that a norm or bias left out of a mapping shows in the logits."""

from __future__ import annotations

import os
from typing import Dict, Optional

import torch

VOCAB = 200          # rows of the models' embeddings
TOKENS = 150         # words of the tokenizer (plus <unk>, <s>, </s>)

# name -> (family, config overrides)
MODELS: Dict[str, tuple] = {
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen2-untied": ("qwen2", dict(tie_word_embeddings=False)),
    "qwen2-yarn": ("qwen2", dict(tie_word_embeddings=True, rope_scaling=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=64))),
    "qwen2-yarn-factor": ("qwen2", dict(tie_word_embeddings=False, rope_scaling=dict(
        rope_type="yarn", factor=8.0, original_max_position_embeddings=32, attention_factor=1.3, beta_fast=16.0))),
    "llama3.1": ("llama", dict(tie_word_embeddings=False, head_dim=24, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=8192))),
}


def hf_config(name: str):
    from transformers import LlamaConfig, Qwen2Config

    family, overrides = MODELS[name]
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6, initializer_range=0.2, bos_token_id=TOKENS + 1, eos_token_id=TOKENS + 2)
    common.update(overrides)
    if family == "qwen2":
        return Qwen2Config(rope_theta=10000.0, **common)
    return LlamaConfig(rope_theta=500000.0, **common)


def build_model(name: str, seed: int = 0):
    """The model, fp32, eval mode, with perturbed norms and biases."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(name)).float().eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname or pname.endswith("bias"):
                p.add_(0.5 * torch.randn_like(p))
    return model


def save_tokenizer(folder: str) -> None:
    """A word-level tokenizer of TOKENS words ``w0 ...`` plus <unk>, <s>, </s>."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(TOKENS)}
    vocab.update({"<unk>": TOKENS, "<s>": TOKENS + 1, "</s>": TOKENS + 2})
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(folder)


def save_model(name: str, folder: str, tokenizer: bool = True, seed: int = 0, model=None) -> str:
    model = model if model is not None else build_model(name, seed)
    model.save_pretrained(folder)
    if tokenizer:
        save_tokenizer(folder)
    return folder


def logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits.float()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def tokenizer_dir(tmp: str) -> Optional[str]:
    folder = os.path.join(tmp, "tokenizer")
    save_tokenizer(folder)
    return folder
