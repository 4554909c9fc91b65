"""The model under evaluation: a Hugging Face folder loaded with transformers, or a Megatron
``torch_dist`` checkpoint exported first (``convert.megatron_to_hf``) into a temporary folder and
loaded from there, so that both take one code path and the checkpoint is read exactly as the
converter exports it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
from typing import Any, Callable, Iterator, Optional

import torch

from .errors import EvaluationError

__all__ = ["DTYPES", "LoadedModel", "open_model", "resolve_device", "resolve_dtype"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass
class LoadedModel:
    model: Any                      # a transformers causal LM, eval mode, on ``device``
    tokenizer: Optional[Any]        # None where the folder has no tokenizer
    folder: str                     # the Hugging Face folder it was loaded from
    source: str                     # what the user named: "--hf DIR" or "--ckpt CKPT"
    device: torch.device
    dtype: torch.dtype

    @property
    def max_positions(self) -> Optional[int]:
        value = getattr(self.model.config, "max_position_embeddings", None)
        return int(value) if value else None

    @property
    def vocab_size(self) -> int:
        size = int(self.model.config.vocab_size)
        return min(size, len(self.tokenizer)) if self.tokenizer is not None else size


def resolve_device(device: Optional[str]) -> torch.device:
    """``device``, or CUDA where available, else the CPU."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except RuntimeError:
        raise EvaluationError(f"--device {device!r} is not a device: use cpu, cuda or cuda:N") from None


def resolve_dtype(dtype: Optional[str], device: torch.device) -> torch.dtype:
    """``dtype`` by name, or float32 on the CPU and bfloat16 on a GPU."""
    if dtype in (None, "auto"):
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if dtype not in DTYPES:
        raise EvaluationError(f"--dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


@contextlib.contextmanager
def open_model(hf: Optional[str] = None, ckpt: Optional[str] = None, *, hf_base: Optional[str] = None,
               tokenizer: Optional[str] = None, dtype: Optional[str] = None, device: Optional[str] = None,
               log: Callable[[str], None] = print) -> Iterator[LoadedModel]:
    """The model of ``hf`` (a Hugging Face folder) or ``ckpt`` (a Megatron checkpoint; ``hf_base``:
    the Hugging Face folder its run started from, where the checkpoint does not record it), loaded
    for the duration of the block. ``tokenizer``: a tokenizer folder other than the model's."""
    if (hf is None) == (ckpt is None):
        raise EvaluationError("give the model as exactly one of --hf DIR (a Hugging Face folder) or --ckpt CKPT "
                              "(a Megatron checkpoint)")
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    with contextlib.ExitStack() as stack:
        if hf is not None:
            if not os.path.isfile(os.path.join(hf, "config.json")):
                raise EvaluationError(f"--hf {hf}: no Hugging Face model there (no config.json): give the folder "
                                      "that holds config.json and the weights")
            folder, source = hf, f"--hf {hf}"
        else:
            if not os.path.isdir(ckpt):
                raise EvaluationError(f"--ckpt {ckpt}: no such folder: give a Megatron checkpoint folder (with "
                                      "latest_checkpointed_iteration.txt) or one iteration's folder")
            from ..convert import ConversionError, megatron_to_hf

            folder = os.path.join(stack.enter_context(tempfile.TemporaryDirectory(prefix="mtraining-evaluate-")), "hf")
            source = f"--ckpt {ckpt}"
            log(f"[evaluate] exporting {ckpt} to a temporary Hugging Face folder")
            try:
                megatron_to_hf(ckpt, folder, hf_base=hf_base, log=log)
            except ConversionError as err:
                raise EvaluationError(f"--ckpt {ckpt}: {err}") from None
        from transformers import AutoModelForCausalLM

        tokenizer = _load_tokenizer(tokenizer or folder, explicit=tokenizer is not None)
        try:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype)
        except (OSError, ValueError) as err:
            raise EvaluationError(f"{source}: transformers cannot load the model: {err}") from None
        model = model.to(torch_device).eval()
        log(f"[evaluate] loaded {type(model).__name__} from {source}: {torch_dtype}, {torch_device}, "
            f"max_position_embeddings {getattr(model.config, 'max_position_embeddings', None)}")
        yield LoadedModel(model=model, tokenizer=tokenizer, folder=folder, source=source, device=torch_device,
                          dtype=torch_dtype)


def _load_tokenizer(folder: str, explicit: bool):
    from transformers import AutoTokenizer

    from ..convert.hf_io import tokenizer_files

    if not os.path.isdir(folder) or not tokenizer_files(folder):
        if explicit:
            raise EvaluationError(f"--tokenizer {folder}: no tokenizer there (tokenizer.json, tokenizer.model or "
                                  "vocab.json)")
        return None
    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as err:
        raise EvaluationError(f"the tokenizer in {folder} does not load: {err}") from None
