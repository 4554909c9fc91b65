"""Long-context evaluation of a trained model: does the extended context work?

    python -m megatron_mtraining.evaluate --hf DIR --out DIR [--attention mtraining] [--ppl-data FILE]
    python -m megatron_mtraining.evaluate --ckpt CKPT [--hf-base DIR] --out DIR ...

``needle`` builds and scores passkey-retrieval samples over lengths and depths (teacher-forced,
no generation), ``perplexity`` the loss by position in long documents, ``heatmap`` draws the
needle grid, ``attention`` runs MTraining's sparse attention inside a transformers model,
``model`` loads a Hugging Face folder or a Megatron checkpoint (exported by ``convert``).
Needs ``transformers`` and ``safetensors`` (``pip install .[hf]``); docs/evaluation.md.
"""

from .attention import (enable_mtraining_attention, index_densities, mtraining_attention_config,
                        mtraining_attention_forward)
from .errors import EvaluationError
from .heatmap import write_heatmap, write_png
from .model import LoadedModel, open_model
from .needle import (NeedlePieces, NeedleSample, build_sample, parse_depths, parse_length, parse_lengths, run_needle,
                     score_sample, text_pieces, token_pieces)
from .perplexity import bucket_edges, load_documents, run_perplexity
from .scoring import score_tokens

__all__ = ["EvaluationError", "LoadedModel", "NeedlePieces", "NeedleSample", "bucket_edges", "build_sample",
           "enable_mtraining_attention", "index_densities", "load_documents", "mtraining_attention_config",
           "mtraining_attention_forward", "open_model", "parse_depths", "parse_length", "parse_lengths", "run_needle",
           "run_perplexity", "score_sample", "score_tokens", "text_pieces", "token_pieces", "write_heatmap", "write_png"]
