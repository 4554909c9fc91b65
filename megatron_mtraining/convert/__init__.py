"""Hugging Face <-> Megatron checkpoints for the models MTraining extends (Qwen2 / Qwen2.5, Llama 3.x).

    python -m megatron_mtraining.convert hf-to-megatron --hf DIR --out CKPT [--tp N]
    python -m megatron_mtraining.convert megatron-to-hf --ckpt CKPT --out DIR [--hf-base DIR]

``shape`` describes the model once (config.json <-> Megatron flags), ``weights`` maps the tensors,
``hf_io`` and ``megatron_io`` read and write the two formats, ``pipeline`` chains them.
Needs ``safetensors`` and ``transformers`` (``pip install .[hf]``); training does not.
"""

from .pipeline import RECORD, hf_to_megatron, megatron_to_hf, read_record
from .shape import ConversionError, ModelShape, padded_vocab_size

__all__ = ["ConversionError", "ModelShape", "RECORD", "hf_to_megatron", "megatron_to_hf", "padded_vocab_size",
           "read_record"]
