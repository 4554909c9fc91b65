"""Perplexity by position: whether the loss keeps falling deep into the context.

Documents of ``length`` tokens are scored teacher-forced (``scoring.score_tokens``): the NLL of
the token at position t given the t tokens before it, for t = 1 .. length-1, averaged over the
documents and over equal-width buckets of positions. A model whose context extension worked has a
flat or falling curve to the end; one that did not has its loss rise past the length it was
trained at.
"""

from __future__ import annotations

import math
import os
from typing import Callable, Dict, List, Optional

import torch

from .errors import EvaluationError
from .scoring import score_tokens

__all__ = ["bucket_edges", "load_documents", "position_nll", "run_perplexity"]


def load_documents(path: str, tokenizer=None, length: Optional[int] = None, max_documents: Optional[int] = None
                   ) -> torch.Tensor:
    """Token ids ``[documents, length]``: a ``.txt`` file tokenized with ``tokenizer`` and cut into
    documents of ``length`` tokens (the remainder dropped), or a ``.pt`` / ``.npy`` array of token
    ids ``[documents, tokens]`` (cut to ``length`` when given)."""
    if not os.path.isfile(path):
        raise EvaluationError(f"--ppl-data {path}: no such file")
    ext = os.path.splitext(path)[1].lower()
    if ext == ".txt":
        if tokenizer is None:
            raise EvaluationError(f"--ppl-data {path} is text and there is no tokenizer: give --tokenizer DIR, "
                                  "or token ids as a .pt / .npy file")
        if not length:
            raise EvaluationError("a .txt --ppl-data needs --ppl-length N (tokens per document)")
        with open(path, encoding="utf-8") as f:
            ids = torch.tensor(tokenizer.encode(f.read(), add_special_tokens=False), dtype=torch.long)
        docs = ids[:ids.numel() // length * length].view(-1, length)
        if not len(docs):
            raise EvaluationError(f"--ppl-data {path} has {ids.numel()} tokens, fewer than one document of "
                                  f"--ppl-length {length}: give a longer text or a shorter length")
    elif ext in (".pt", ".npy"):
        if ext == ".pt":
            docs = torch.load(path, map_location="cpu", weights_only=True)
        else:
            import numpy

            docs = torch.from_numpy(numpy.load(path))
        if not isinstance(docs, torch.Tensor) or docs.dim() != 2 or docs.is_floating_point() or docs.is_complex():
            raise EvaluationError(f"--ppl-data {path} must hold an integer tensor [documents, tokens], got "
                                  f"{getattr(docs, 'dtype', type(docs).__name__)} {tuple(getattr(docs, 'shape', ()))}")
        docs = docs.long()
        if length:
            if length > docs.shape[1]:
                raise EvaluationError(f"--ppl-length {length} exceeds the {docs.shape[1]} tokens per document of {path}")
            docs = docs[:, :length]
    else:
        raise EvaluationError(f"--ppl-data {path}: expected a .txt, .pt or .npy file")
    if docs.shape[1] < 2:
        raise EvaluationError(f"documents of {docs.shape[1]} token(s) have nothing to predict: use --ppl-length >= 2")
    return docs[:max_documents] if max_documents else docs


def position_nll(model, docs: torch.Tensor, device=None, log: Callable[[str], None] = print) -> torch.Tensor:
    """The NLL of every predicted token, ``[documents, length - 1]`` (column j: position j + 1)."""
    rows = []
    for i, doc in enumerate(docs):
        logprob, _ = score_tokens(model, doc[None].to(device), torch.arange(1, docs.shape[1]))
        rows.append(-logprob)
        log(f"[perplexity] document {i + 1}/{len(docs)}: mean NLL {float(rows[-1].mean()):.4f}")
    return torch.stack(rows)


def bucket_edges(length: int, buckets: int) -> List[int]:
    """Edges of ``buckets`` equal-width buckets over the predicted positions 1 .. length-1."""
    predicted = length - 1
    if buckets < 1 or buckets > predicted:
        raise EvaluationError(f"--ppl-buckets {buckets}: give between 1 and {predicted} (the predicted positions "
                              f"of a {length}-token document)")
    return [1 + round(b * predicted / buckets) for b in range(buckets + 1)]


def run_perplexity(model, docs: torch.Tensor, buckets: int = 8, device=None,
                   log: Callable[[str], None] = print) -> Dict:
    """Mean NLL and perplexity per position bucket and overall (``perplexity.json``)."""
    edges = bucket_edges(docs.shape[1], buckets)
    nll = position_nll(model, docs, device, log).double()
    table = []
    for start, end in zip(edges[:-1], edges[1:]):
        mean = float(nll[:, start - 1:end - 1].mean())
        table.append(dict(start=start, end=end, tokens=(end - start) * len(docs), mean_nll=mean, ppl=math.exp(mean)))
    mean = float(nll.mean())
    return dict(documents=len(docs), length=docs.shape[1], buckets=table, mean_nll=mean, ppl=math.exp(mean))
