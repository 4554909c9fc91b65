"""Model presets for ``--model``: the published shapes of the models the launchers and the converter
know (the models' ``config.json`` on the Hugging Face Hub: layers, hidden size, FFN size, query
heads, key/value heads, head dim, vocabulary, QKV bias, tied embeddings).

Every preset is a SwiGLU decoder with RMSNorm and RoPE, as ``ModelShape`` describes it."""

from __future__ import annotations

from typing import Dict, Optional

from .model import ModelShape

MODELS: Dict[str, ModelShape] = {
    # Qwen2.5-3B: tie_word_embeddings true (its output layer is the input embedding): 3.09B parameters.
    "qwen2.5-3b": ModelShape(hidden=2048, heads=16, kv_groups=2, head_dim=128, layers=36, ffn=11008, vocab=151936,
                             qkv_bias=True, untied_embeddings=False),
    "qwen2.5-7b": ModelShape(hidden=3584, heads=28, kv_groups=4, head_dim=128, layers=28, ffn=18944, vocab=152064,
                             qkv_bias=True, untied_embeddings=True),
    "llama3.1-8b": ModelShape(hidden=4096, heads=32, kv_groups=8, head_dim=128, layers=32, ffn=14336, vocab=128256,
                              qkv_bias=False, untied_embeddings=True),
    "llama3.1-70b": ModelShape(hidden=8192, heads=64, kv_groups=8, head_dim=128, layers=80, ffn=28672, vocab=128256,
                               qkv_bias=False, untied_embeddings=True),
}
TITLES = {"qwen2.5-3b": "Qwen2.5-3B", "qwen2.5-7b": "Qwen2.5-7B", "llama3.1-8b": "Llama-3.1-8B",
          "llama3.1-70b": "Llama-3.1-70B"}
DEFAULT_MODEL = "qwen2.5-3b"


def preset_key(name: str) -> str:
    """The preset a name means (``Qwen2.5-3B``, ``qwen2.5_3b``, ``llama-3.1-8b`` all work), or ValueError."""
    key = name.strip().lower().replace("_", "-").replace("llama-", "llama")
    if key not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)} (or give the shape with Megatron's "
                         "flags: --num-layers, --hidden-size, ...)")
    return key


def preset_of(shape: ModelShape) -> Optional[str]:
    """The preset with exactly this shape, if any."""
    return next((key for key, preset in MODELS.items() if preset == shape), None)


def describe(shape: ModelShape) -> str:
    """A model's name when it is a preset's shape, else "custom model"."""
    key = preset_of(shape)
    return TITLES[key] if key else "custom model"
