"""Needle in a haystack (passkey retrieval), scored without generation.

A sample is ``header + filler[:i] + needle + filler[i:] + question + answer``, exactly ``length``
tokens, with the needle's first token at ``i`` = ``depth`` x the filler's length, rounded (0: right after the
header, 1: right before the question). The model reads the whole sample once (teacher forcing):
the needle counts as retrieved when its argmax at every answer position is the answer token (exact
match); the mean log-probability of the answer tokens says how sure it was.

Two ways to make the pieces, both working on token ids:

* text (``text_pieces``): the passkey-retrieval prompt of the papers, tokenized by the model's
  tokenizer. Filler: a fixed paragraph, repeated ("The grass is green. The sky is blue. ...");
  needle: "The secret passkey is NNNNN."; question: "What is the secret passkey? The secret
  passkey is", answer: the five digits. The needle goes in at a paragraph boundary.
* tokens (``token_pieces``): tokenizer-agnostic. Filler: random tokens of the vocabulary (seeded);
  needle: a fixed marker of a few tokens followed by the passkey, a few distinct random tokens;
  question: the marker again, answer: the passkey. The model must find the marker and copy what
  followed it (an induction task), with no language in it.
"""

from __future__ import annotations

import dataclasses
import math
import random
import re
from typing import Callable, Dict, List, Optional, Sequence

import torch

from .errors import EvaluationError
from .scoring import score_tokens

__all__ = ["FILLER", "NeedlePieces", "NeedleSample", "build_sample", "parse_depths", "parse_length", "parse_lengths",
           "run_needle", "score_sample", "text_pieces", "token_pieces"]

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
HEADER = ("There is an important piece of information hidden inside a lot of irrelevant text. Find it and "
          "memorize it. I will quiz you about it.")
NEEDLE = "The secret passkey is {passkey}."
QUESTION = "What is the secret passkey? The secret passkey is"

_SUFFIXES = {"": 1, "k": 1024, "m": 1024 ** 2}


def parse_length(text: str) -> int:
    """A token count: ``4096``, ``4k`` (4096), ``1.5k`` (1536), ``1M`` (1048576)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*", text)
    value = float(match.group(1)) * _SUFFIXES[match.group(2).lower()] if match else math.nan
    if not match or value != int(value) or value < 1:
        raise EvaluationError(f"cannot read {text!r} as a length in tokens: write an integer with an optional "
                              "k (x1024) or M (x1024^2) suffix, e.g. 4k, 32k, 1M")
    return int(value)


def parse_lengths(text: str) -> List[int]:
    """A comma-separated list of lengths (``parse_length``), e.g. ``1k,2k,4k``."""
    return [parse_length(part) for part in text.split(",")]


def parse_depths(text: str) -> List[float]:
    """A comma-separated list of depths, fractions of the haystack in [0, 1], e.g. ``0,0.5,1``."""
    depths = []
    for part in text.split(","):
        try:
            depth = float(part)
        except ValueError:
            raise EvaluationError(f"cannot read {part!r} as a needle depth: give fractions in [0, 1], "
                                  "e.g. 0,0.25,0.5,0.75,1") from None
        if not 0.0 <= depth <= 1.0:
            raise EvaluationError(f"needle depth {part} is outside [0, 1]: depths are fractions of the haystack "
                                  "(0: its start, 1: its end)")
        depths.append(depth)
    return depths


@dataclasses.dataclass
class NeedlePieces:
    """The token ids of one trial's pieces. ``filler(count)`` gives ``count`` filler tokens; the
    needle goes in at a multiple of ``unit`` filler tokens (or at the very end)."""

    header: List[int]
    needle: List[int]
    question: List[int]
    answer: List[int]
    filler: Callable[[int], List[int]]
    passkey: str
    unit: int = 1

    @property
    def fixed_length(self) -> int:
        """Tokens besides the filler."""
        return len(self.header) + len(self.needle) + len(self.question) + len(self.answer)


@dataclasses.dataclass(frozen=True)
class NeedleSample:
    ids: List[int]          # the sample, ``length`` tokens: prompt, then the answer
    needle_start: int       # position of the needle's first token
    needle_length: int
    answer_start: int       # position of the answer's first token
    answer: List[int]
    length: int
    depth: float
    passkey: str

    @property
    def targets(self) -> torch.Tensor:
        """Positions of the answer tokens (what the scoring reads)."""
        return torch.arange(self.answer_start, self.answer_start + len(self.answer))


def build_sample(length: int, depth: float, pieces: NeedlePieces) -> NeedleSample:
    """The sample of ``length`` tokens with the needle at ``depth`` (module docstring)."""
    body = length - pieces.fixed_length
    if body < 0:
        raise EvaluationError(f"needle length {length} is too short: header, needle, question and answer take "
                              f"{pieces.fixed_length} tokens; use lengths of at least {pieces.fixed_length}")
    filler = list(pieces.filler(body))
    if len(filler) != body:
        raise ValueError(f"the filler gave {len(filler)} tokens, {body} were asked for")
    unit, target = max(1, pieces.unit), depth * body
    boundaries = {b for b in (math.floor(target / unit) * unit, math.ceil(target / unit) * unit) if b <= body} | {body}
    insert = min(boundaries, key=lambda b: (abs(b - target), b))
    ids = pieces.header + filler[:insert] + pieces.needle + filler[insert:] + pieces.question + pieces.answer
    return NeedleSample(ids=ids, needle_start=len(pieces.header) + insert, needle_length=len(pieces.needle),
                        answer_start=length - len(pieces.answer), answer=list(pieces.answer), length=length,
                        depth=depth, passkey=pieces.passkey)


def token_pieces(vocabulary: Sequence[int], trial: int, seed: int = 0, marker_length: int = 4,
                 passkey_length: int = 5) -> NeedlePieces:
    """Tokenizer-agnostic pieces over the token ids ``vocabulary`` (without special tokens): the
    marker is the same for every trial of a seed, the passkey and the filler are the trial's."""
    vocabulary = sorted(set(int(v) for v in vocabulary))
    if len(vocabulary) < 2 * (marker_length + passkey_length):
        raise EvaluationError(f"a vocabulary of {len(vocabulary)} tokens is too small for token needles")
    marker = random.Random(seed).sample(vocabulary, marker_length)
    rng = random.Random(seed * 1_000_003 + trial + 1)
    passkey = rng.sample([v for v in vocabulary if v not in marker], passkey_length)
    allowed = torch.tensor([v for v in vocabulary if v not in marker and v not in passkey])
    generator = torch.Generator().manual_seed(seed * 1_000_003 + trial + 1)

    def filler(count: int) -> List[int]:
        return allowed[torch.randint(0, len(allowed), (count,), generator=generator)].tolist()

    return NeedlePieces(header=[], needle=marker + passkey, question=list(marker), answer=passkey, filler=filler,
                        passkey=" ".join(map(str, passkey)))


def text_pieces(tokenizer, trial: int, seed: int = 0) -> NeedlePieces:
    """The passkey prompt in words, tokenized by ``tokenizer`` (module docstring)."""
    passkey = str(random.Random(seed * 1_000_003 + trial + 1).randint(10000, 99999))
    encode = lambda text: list(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    bos = getattr(tokenizer, "bos_token_id", None)
    adds_bos = bos is not None and list(tokenizer.encode("a", add_special_tokens=True))[:1] == [bos]
    header = ([bos] if adds_bos else []) + encode(HEADER)
    question = encode(" " + QUESTION)
    both = encode(" " + QUESTION + " " + passkey)
    answer = both[len(question):] if both[:len(question)] == question else encode(" " + passkey)
    unit = encode(" " + FILLER)
    pieces = NeedlePieces(header=header, needle=encode(" " + NEEDLE.format(passkey=passkey)), question=question,
                          answer=answer, filler=lambda count: (unit * (count // len(unit) + 1))[:count],
                          passkey=passkey, unit=len(unit))
    unk = getattr(tokenizer, "unk_token_id", None)
    words = pieces.header + pieces.needle + pieces.question + pieces.answer + unit
    if not pieces.answer or not unit or (unk is not None and unk in words):
        raise EvaluationError("the tokenizer cannot spell the needle text (unknown tokens): use --needle-mode "
                              "tokens (random tokens, no words) for this tokenizer")
    return pieces


def score_sample(model, sample: NeedleSample, device=None) -> Dict:
    """Teacher-forced: retrieved (every answer token is the argmax), the mean log-probability of
    the answer tokens, and the tokens the model ranked first."""
    ids = torch.tensor([sample.ids], device=device)
    logprob, argmax = score_tokens(model, ids, sample.targets)
    return dict(passkey=sample.passkey, needle_position=sample.needle_start,
                retrieved=bool(argmax.tolist() == sample.answer), logprob=float(logprob.mean()),
                predicted=argmax.tolist())


def run_needle(model, pieces: Callable[[int], NeedlePieces], lengths: Sequence[int], depths: Sequence[float],
               trials: int, device=None, densities: Optional[Callable[[], List[float]]] = None,
               log: Callable[[str], None] = print) -> Dict:
    """Every (length, depth) cell, ``trials`` samples each (``pieces(trial)``, the same passkeys
    in every cell). ``densities`` (optional) returns the attention index densities since its last
    call. Returns the cells and the totals (``needle.json``)."""
    cells = []
    for length in lengths:
        for depth in depths:
            results = []
            for trial in range(trials):
                sample = build_sample(length, depth, pieces(trial))
                results.append(score_sample(model, sample, device))
            cell = dict(length=length, depth=depth, accuracy=sum(r["retrieved"] for r in results) / trials,
                        mean_logprob=sum(r["logprob"] for r in results) / trials, trials=results)
            if densities is not None:
                values = densities()
                cell["index_density"] = sum(values) / len(values) if values else None
            cells.append(cell)
            log(f"[needle] length {length:>7}  depth {depth:4.2f}  accuracy {cell['accuracy']:.2f}  "
                f"answer log-prob {cell['mean_logprob']:8.3f}")
    return dict(cells=cells, accuracy=sum(c["accuracy"] for c in cells) / len(cells),
                mean_logprob=sum(c["mean_logprob"] for c in cells) / len(cells))
