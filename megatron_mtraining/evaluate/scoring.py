"""Teacher-forced scoring: the log-probability (and the argmax) the model gives each token of a
sequence, from one forward pass and no generation.

For a transformers causal LM the decoder runs once and the output head is applied only at the
scored positions, in chunks, so that no ``[tokens, vocabulary]`` logits tensor of the whole
sequence is held (at 128K tokens and a 150K vocabulary that alone would be 77 GB in fp32).
Any other module called as ``model(input_ids=ids)`` returning ``.logits`` is scored from those.
"""

from __future__ import annotations

from typing import Tuple

import torch

__all__ = ["score_tokens"]

CHUNK = 1024  # positions per output-head chunk


@torch.no_grad()
def score_tokens(model, ids: torch.Tensor, targets: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``ids`` ``[1, n]``; ``targets``: positions ``t`` (1 <= t < n) whose tokens are scored given
    the tokens before them. Returns ``(logprob, argmax)``, each ``[len(targets)]``: log p(ids[t] |
    ids[:t]) in fp32 and the model's most likely token at t."""
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"score_tokens takes one sequence [1, n], got {tuple(ids.shape)}")
    targets = targets.to(device=ids.device, dtype=torch.long)
    if targets.numel() and (int(targets.min()) < 1 or int(targets.max()) >= ids.shape[1]):
        raise ValueError(f"score_tokens: target positions must be in [1, {ids.shape[1]}), got "
                         f"{int(targets.min())}..{int(targets.max())}")
    head = _output_head(model)
    if head is not None:
        hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state[0]
        rows = lambda sel: head(hidden.index_select(0, sel - 1))  # noqa: E731
    else:
        logits = model(input_ids=ids).logits[0]
        rows = lambda sel: logits.index_select(0, sel - 1)  # noqa: E731
    logprob, argmax = [], []
    for start in range(0, targets.numel(), CHUNK):
        sel = targets[start:start + CHUNK]
        chunk = rows(sel).float()
        logprob.append(chunk.gather(1, ids[0, sel][:, None])[:, 0] - torch.logsumexp(chunk, -1))
        argmax.append(chunk.argmax(-1))
    if not logprob:
        return torch.empty(0), torch.empty(0, dtype=torch.long)
    return torch.cat(logprob).cpu(), torch.cat(argmax).cpu()


def _output_head(model):
    """The output projection of a transformers causal LM whose logits are ``head(decoder(ids))``;
    None for other modules (and for models that scale or cap their logits)."""
    if not (hasattr(model, "get_decoder") and hasattr(model, "get_output_embeddings")):
        return None
    config = getattr(model, "config", None)
    if any(getattr(config, name, None) not in (None, 1, 1.0) for name in ("final_logit_softcapping", "logit_scale")):
        return None
    try:
        decoder, head = model.get_decoder(), model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    return head if decoder is not None and head is not None and decoder is not model else None
