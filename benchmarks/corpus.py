"""Deterministic synthetic long-context corpus: local language modelling plus far-back retrieval.

Used to show that sparse attention learns long-range retrieval as well as dense attention. Every
sequence is exactly ``seq_len`` tokens and is laid out as::

    BOS  filler .. KEY k1..kK v1..vV VAL .. filler .. KEY ... VAL .. filler   QUERY k v ANS  QUERY k v ANS
         \\________________________ body (needles at random depths) ______/   \\__ query block __/

Token ids (``V = vocab_size``, at least 128):

* ``0..5`` are special: ``PAD BOS KEY VAL QUERY ANS``.
* ``[6, V - V // 4)`` is the *word* range, used only by filler.
* ``[V - V // 4, V)`` (the top quarter) is the *symbol* range, used only by needle keys and values,
  so a needle can never be confused with filler.

Filler is the local signal: a fixed lexicon of ``lexicon_size`` words (each 2-6 word tokens, drawn
from the corpus seed alone, so every sequence shares it) and a text of words drawn i.i.d. from a
Zipf(1) distribution. Within a word the next token is determined; across words it is not, so a
model learns to complete words, not to predict the next word.

Two needle formats (``needle_format``):

* ``"pair"``: a needle is ``KEY k.. v.. VAL`` and a query ``QUERY k.. v.. ANS``; keys and values are
  strings of symbols. Answering is the classic induction pattern (find the earlier key, copy the
  token after it), which small models learn only after a long plateau.
* ``"fact"``: a needle is ``KEY f VAL`` with one *fact* token ``f`` that stands for a (key, value)
  pair; a query is ``QUERY k v ANS`` with a key token and a value token. The symbol range is split
  into ``n`` key tokens, ``n`` value tokens and ``n * n`` fact tokens (the largest ``n`` that fits),
  so one attention head that matches the query's key against the facts answers it: the same
  far-back retrieval without the induction plateau.

Needles are the long-range signal: ``num_needles`` key-value pairs with distinct keys, spliced into
the filler at uniformly random, non-overlapping positions of the body. The query block asks for
``num_queries`` of them (random choice and order). The value tokens after a query's key are the
*retrieval targets*: predicting ``tokens[p]`` from ``tokens[:p]`` for such a ``p`` needs the needle,
which only attention far back can reach. A needle's *depth* is its start position / ``seq_len``.

Packed documents (``PackedConfig``): a sequence of several documents of varied lengths, each a
self-contained sequence as above (``BOS``, its own needles, its own query block at its end), so a
query's needle is in its own document, and a same-key needle of an earlier document (another
value) is a distractor that attention masked at the document boundaries (``cu_seqlens``) cannot
see. ``make_packed_probe`` is the packed needle-in-a-haystack probe: every document holds one
needle with the same key and its own value.

Randomness comes from NumPy ``Generator`` s seeded by ``SeedSequence([seed, stream, index])``: the
result depends only on the config and the index (not on global RNG state, process or machine) for a
given NumPy version.
"""

from __future__ import annotations

import argparse
import functools
import math
from dataclasses import dataclass
from typing import Sequence, Tuple

import numpy as np
import torch

__all__ = [
    "PAD", "BOS", "KEY", "VAL", "QUERY", "ANS", "NUM_SPECIAL", "NEEDLE_FORMATS", "CorpusConfig", "RetrievalSample",
    "make_sequence", "make_needle_probe", "make_batch", "query_target_positions", "retrieval_accuracy",
    "write_indexed_dataset", "PackedConfig", "PackedSample", "packed_document_lengths", "make_packed_sequence",
    "make_packed_probe", "document_boundaries", "reset_position_ids", "answer_target_mask", "PROLONG_MIX",
]

PAD, BOS, KEY, VAL, QUERY, ANS = 0, 1, 2, 3, 4, 5
NUM_SPECIAL = 6
NEEDLE_FORMATS = ("pair", "fact")
_MIN_WORD, _MAX_WORD = 2, 6  # word length range in tokens
_ZIPF_EXPONENT = 1.0
# SeedSequence streams, so that lexicon, sequences and probes never share random draws.
_LEXICON_STREAM, _SEQUENCE_STREAM, _PROBE_STREAM = 0, 1, 2


@dataclass(frozen=True)
class CorpusConfig:
    """Shape of the corpus; two equal configs generate identical sequences."""

    vocab_size: int = 512
    seq_len: int = 4096
    num_needles: int = 4
    num_queries: int = 2
    key_len: int = 4
    value_len: int = 4
    lexicon_size: int = 256
    seed: int = 1234
    needle_format: str = "pair"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "num_needles", "num_queries", "key_len", "value_len", "lexicon_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        if self.vocab_size < 128:
            raise ValueError(f"vocab_size must be >= 128, got {self.vocab_size}")
        if self.needle_format not in NEEDLE_FORMATS:
            raise ValueError(f"needle_format must be one of {NEEDLE_FORMATS}, got {self.needle_format!r}")
        if self.needle_format == "fact" and (self.key_len, self.value_len) != (1, 1):
            raise ValueError(f"needle_format='fact' needs key_len=1 and value_len=1, got {self.key_len}, {self.value_len}")
        if self.num_queries > self.num_needles:
            raise ValueError(f"num_queries ({self.num_queries}) must be <= num_needles ({self.num_needles})")
        if self.num_keys < self.num_needles:
            raise ValueError(f"{self.num_keys} distinct keys (needle_format={self.needle_format!r}, "
                             f"key_len={self.key_len}) are fewer than num_needles={self.num_needles}")
        needed = 1 + self.num_needles * self.needle_len + self.num_queries * self.query_len
        if self.seq_len < needed:
            raise ValueError(
                f"seq_len={self.seq_len} is too short: BOS + {self.num_needles} needles + {self.num_queries} queries "
                f"need {needed} tokens"
            )

    @property
    def symbol_start(self) -> int:
        """First id of the symbol range (keys and values); the word range is ``[NUM_SPECIAL, symbol_start)``."""
        return self.vocab_size - self.vocab_size // 4

    @property
    def num_symbols(self) -> int:
        return self.vocab_size - self.symbol_start

    @property
    def fact_alphabet(self) -> int:
        """``n`` of the fact format: the largest with ``n`` keys + ``n`` values + ``n * n`` facts <= symbols."""
        return math.isqrt(self.num_symbols + 1) - 1

    @property
    def most_documents(self) -> int:
        """The most documents one sequence can hold."""
        return len(self.document_mix) if self.document_mix else self.max_documents

    @property
    def num_keys(self) -> int:
        """Distinct keys a sequence can hold."""
        return self.fact_alphabet if self.needle_format == "fact" else self.num_symbols ** self.key_len

    @property
    def num_values(self) -> int:
        """Choices for each answer token (chance accuracy is ``num_values ** -value_len``)."""
        return self.fact_alphabet if self.needle_format == "fact" else self.num_symbols

    @property
    def needle_len(self) -> int:
        """Tokens of one needle: ``KEY k.. v.. VAL`` (pair) or ``KEY f VAL`` (fact)."""
        return 3 if self.needle_format == "fact" else 2 + self.key_len + self.value_len

    @property
    def query_len(self) -> int:
        """Tokens of one ``QUERY k.. v.. ANS`` query."""
        return 2 + self.key_len + self.value_len


@dataclass
class RetrievalSample:
    """One sequence: ``tokens`` int64 [seq_len]; ``target_positions`` int64 [num_queries * value_len],
    ascending, positions of the answer value tokens; ``needle_depths`` float32 [num_queries], the
    start position / seq_len of each query's needle, in query order."""

    tokens: torch.Tensor
    target_positions: torch.Tensor
    needle_depths: torch.Tensor


def _rng(seed: int, stream: int, index: int) -> np.random.Generator:
    if index < 0:
        raise ValueError(f"index must be >= 0, got {index}")
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, stream, int(index)])))


@functools.lru_cache(maxsize=16)
def _lexicon(vocab_size: int, lexicon_size: int, seed: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(flat tokens of all words, word start offsets, word lengths, Zipf word probabilities)."""
    rng = _rng(seed, _LEXICON_STREAM, 0)
    lengths = rng.integers(_MIN_WORD, _MAX_WORD + 1, lexicon_size)
    symbol_start = vocab_size - vocab_size // 4  # as CorpusConfig.symbol_start
    flat = rng.integers(NUM_SPECIAL, symbol_start, int(lengths.sum()))
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    probs = 1.0 / np.arange(1, lexicon_size + 1) ** _ZIPF_EXPONENT
    return flat, offsets, lengths, probs / probs.sum()


def _filler(config: CorpusConfig, rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` filler tokens: whole lexicon words drawn i.i.d. from Zipf, concatenated, truncated to ``n``."""
    flat, offsets, lengths, probs = _lexicon(config.vocab_size, config.lexicon_size, config.seed)
    # Every word has >= _MIN_WORD tokens, so this many words always cover n tokens.
    words = rng.choice(len(lengths), size=n // _MIN_WORD + 1, p=probs)
    word_len = lengths[words]
    word_of_token = np.repeat(np.arange(len(words)), word_len)[:n]
    starts = np.cumsum(word_len) - word_len  # start of each word in the filler text
    within = np.arange(n) - starts[word_of_token]
    return flat[offsets[words[word_of_token]] + within]


def _distinct_strings(config: CorpusConfig, rng: np.random.Generator, n: int, length: int) -> np.ndarray:
    """``n`` pairwise distinct strings [n, length] of symbol tokens."""
    space = config.num_symbols ** length
    if space < 64 * n * n:
        # Collisions would be common (up to every string in use: redrawing would never end), so draw
        # distinct codes without replacement and write them in base num_symbols.
        codes = rng.choice(space, n, replace=False)
        powers = config.num_symbols ** np.arange(length - 1, -1, -1)
        return config.symbol_start + (codes[:, None] // powers) % config.num_symbols
    strings = rng.integers(config.symbol_start, config.vocab_size, (n, length))
    while len(np.unique(strings, axis=0)) < n:  # rare (birthday bound < 1/128): redraw
        strings = rng.integers(config.symbol_start, config.vocab_size, (n, length))
    return strings


def _distinct_keys(config: CorpusConfig, rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` pairwise distinct keys [n, key_len] of symbol tokens."""
    return _distinct_strings(config, rng, n, config.key_len)


def _records(config: CorpusConfig, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The tokens between KEY and VAL of needles with these keys and values: the fact token
    (fact format: the n keys, then the n values, then the n * n facts, key-major), else key.. value.."""
    if config.needle_format == "fact":
        a = config.fact_alphabet
        key_ids, value_ids = keys[:, :1] - config.symbol_start, values[:, :1] - config.symbol_start - a
        return config.symbol_start + 2 * a + key_ids * a + value_ids
    return np.concatenate([keys, values], axis=1)


@dataclass
class _Parts:
    """A sequence with what it was made of: ``tokens`` int64 [seq_len]; ``keys`` [n, key_len] and
    ``values`` [n, value_len] of its needles; ``needle_start`` [n] (each needle's KEY position);
    ``query_order`` [q] (the needle each query asks for, in query order)."""

    tokens: np.ndarray
    keys: np.ndarray
    values: np.ndarray
    needle_start: np.ndarray
    query_order: np.ndarray


def _draw_needles(config: CorpusConfig, rng: np.random.Generator, n: int) -> Tuple[np.ndarray, np.ndarray]:
    """Keys [n, key_len] (pairwise distinct) and values [n, value_len] of ``n`` needles."""
    if config.needle_format == "fact":
        # Symbol range: n keys, then n values, then the n * n facts (key-major).
        a = config.fact_alphabet
        key_ids, value_ids = rng.choice(a, n, replace=False), rng.integers(0, a, n)
        return (config.symbol_start + key_ids)[:, None], (config.symbol_start + a + value_ids)[:, None]
    keys = _distinct_keys(config, rng, n)
    return keys, rng.integers(config.symbol_start, config.vocab_size, (n, config.value_len))


def _assemble_parts(config: CorpusConfig, filler_before: np.ndarray, query_order: np.ndarray, num_filler: int,
                    filler: np.ndarray, keys: np.ndarray, values: np.ndarray) -> _Parts:
    """Splice needles into the filler and append the query block.

    ``filler_before[i]`` (ascending) is how many filler tokens precede needle ``i``; the needle then
    starts at ``1 + filler_before[i] + i * needle_len`` (after BOS and the earlier needles).
    """
    n, L = len(filler_before), config.needle_len
    records = _records(config, keys, values)
    tokens = np.empty(config.seq_len, dtype=np.int64)
    tokens[0] = BOS
    # Filler token j lands after BOS, after j earlier filler tokens and after every needle whose
    # filler_before <= j.
    j = np.arange(num_filler)
    tokens[1 + j + L * np.searchsorted(filler_before, j, side="right")] = filler
    needle_start = 1 + filler_before + L * np.arange(n)
    # The value follows its key directly in queries (and in pair needles), so the answer's first
    # token is predicted at the key's last token; KEY/VAL and QUERY/ANS open and close each record.
    needles = np.concatenate([np.full((n, 1), KEY), records, np.full((n, 1), VAL)], axis=1)
    tokens[needle_start[:, None] + np.arange(L)] = needles
    queries = np.concatenate(
        [np.full((len(query_order), 1), QUERY), keys[query_order], values[query_order],
         np.full((len(query_order), 1), ANS)], axis=1)
    q_start = config.seq_len - queries.size
    tokens[q_start:] = queries.reshape(-1)
    return _Parts(tokens, keys, values, needle_start, query_order)


def _sample(config: CorpusConfig, parts: _Parts) -> RetrievalSample:
    targets = query_target_positions(config, len(parts.query_order))
    return RetrievalSample(
        tokens=torch.from_numpy(parts.tokens),
        target_positions=torch.from_numpy(targets.astype(np.int64)),
        needle_depths=torch.from_numpy((parts.needle_start[parts.query_order] / config.seq_len).astype(np.float32)),
    )


def _assemble(config: CorpusConfig, rng: np.random.Generator, filler_before: np.ndarray,
              query_order: np.ndarray, num_filler: int, filler: np.ndarray) -> RetrievalSample:
    """Draw ``len(filler_before)`` needles from ``rng``, then ``_assemble_parts``."""
    keys, values = _draw_needles(config, rng, len(filler_before))
    return _sample(config, _assemble_parts(config, filler_before, query_order, num_filler, filler, keys, values))


def query_target_positions(config: CorpusConfig, num_queries: int | None = None) -> np.ndarray:
    """Positions (ascending, int64) of the answer value tokens when the query block of
    ``num_queries`` (default ``config.num_queries``) queries ends the sequence, as in every
    sequence and probe: the same for all indices, so a trainer can mask (or weight) the answer
    tokens of stored sequences without the samples."""
    q = config.num_queries if num_queries is None else int(num_queries)
    q_start = config.seq_len - q * config.query_len
    # Values follow the key in every query row.
    return (q_start + np.arange(q)[:, None] * config.query_len
            + (1 + config.key_len) + np.arange(config.value_len)).reshape(-1).astype(np.int64)


def _sequence_parts(config: CorpusConfig, rng: np.random.Generator) -> _Parts:
    """The draws of ``make_sequence`` from ``rng`` (a packed document draws the same from its own)."""
    n, q = config.num_needles, config.num_queries
    num_filler = config.seq_len - 1 - n * config.needle_len - q * config.query_len
    filler = _filler(config, rng, num_filler)
    # Sorted uniform cut points in the filler give non-overlapping needles, uniform over the body.
    filler_before = np.sort(rng.integers(0, num_filler + 1, n))
    query_order = rng.choice(n, size=q, replace=False)
    keys, values = _draw_needles(config, rng, n)
    return _assemble_parts(config, filler_before, query_order, num_filler, filler, keys, values)


def make_sequence(config: CorpusConfig, index: int) -> RetrievalSample:
    """Sequence ``index``: ``num_needles`` needles at random depths, ``num_queries`` queries at the end."""
    return _sample(config, _sequence_parts(config, _rng(config.seed, _SEQUENCE_STREAM, index)))


def make_needle_probe(config: CorpusConfig, index: int, depth: float) -> RetrievalSample:
    """Needle-in-a-haystack probe: one needle at ``depth`` in [0, 1), one query at the end.

    With ``usable = seq_len - 1 - needle_len - query_len`` filler tokens, the needle is preceded by
    ``round(depth * usable)`` of them, i.e. starts at token ``1 + round(depth * usable)``. Haystack,
    key and value depend on ``(seed, index)`` only, not on ``depth``, so a depth sweep moves the
    same needle through the same haystack. Uses its own random stream (differs from ``make_sequence``).
    """
    if not 0.0 <= depth < 1.0:
        raise ValueError(f"depth must be in [0, 1), got {depth}")
    rng = _rng(config.seed, _PROBE_STREAM, index)
    usable = config.seq_len - 1 - config.needle_len - config.query_len
    filler = _filler(config, rng, usable)
    return _assemble(config, rng, np.array([round(depth * usable)]), np.array([0]), usable, filler)


def make_batch(config: CorpusConfig, indices: Sequence[int]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(tokens [b, seq_len] int64, loss_mask [b, seq_len] float, target_mask [b, seq_len] bool)``.

    Masks are aligned with ``tokens``: ``loss_mask[:, p]`` (0 only at PAD) and ``target_mask[:, p]``
    (retrieval target) describe ``tokens[:, p]`` as a prediction target; with Megatron-style
    ``labels = tokens[:, 1:]`` use ``loss_mask[:, 1:]``.
    """
    samples = [make_sequence(config, int(i)) for i in indices]
    tokens = torch.stack([s.tokens for s in samples])
    target_mask = torch.zeros_like(tokens, dtype=torch.bool)
    for row, s in enumerate(samples):
        target_mask[row, s.target_positions] = True
    return tokens, (tokens != PAD).float(), target_mask


def retrieval_accuracy(logits_or_predictions: torch.Tensor, tokens: torch.Tensor, target_mask: torch.Tensor) -> float:
    """Fraction of queries whose value tokens are all predicted exactly (greedy).

    Convention (a causal LM's output on ``tokens``): ``logits_or_predictions[:, p]`` predicts
    ``tokens[:, p + 1]``; it is either logits ``[b, s, V]`` (argmax is taken) or token ids ``[b, s]``.
    ``target_mask [b, s]`` marks target positions of ``tokens`` (as from :func:`make_batch`); every
    maximal run of consecutive ``True`` in a row is one query's answer.
    """
    preds = logits_or_predictions.argmax(-1) if logits_or_predictions.dim() == 3 else logits_or_predictions
    if preds.shape != tokens.shape or target_mask.shape != tokens.shape:
        raise ValueError(f"shape mismatch: predictions {tuple(preds.shape)}, tokens {tuple(tokens.shape)}, "
                         f"target_mask {tuple(target_mask.shape)}")
    mask = target_mask.bool().clone()
    mask[:, 0] = False  # nothing predicts the first token
    # correct[:, p] compares the prediction made at p - 1 with tokens[:, p].
    correct = torch.zeros_like(mask)
    correct[:, 1:] = preds[:, :-1].to(tokens.dtype) == tokens[:, 1:]
    run_start = mask.clone()
    run_start[:, 1:] &= ~mask[:, :-1]
    num_queries = int(run_start.sum())
    if num_queries == 0:
        raise ValueError("target_mask marks no target positions")
    query_id = torch.cumsum(run_start.reshape(-1).long(), 0) - 1
    flat_mask = mask.reshape(-1)
    wrong = torch.zeros(num_queries, dtype=torch.long, device=mask.device)
    wrong.index_add_(0, query_id[flat_mask], (~correct.reshape(-1)[flat_mask]).long())
    return float((wrong == 0).float().mean())


# ---------------------------------------------------------------------------- packed documents


# The packed benchmark mix at 128K tokens (ProLong-like: long documents hold most of the
# pairs), as relative lengths for ``PackedConfig.document_mix``.
PROLONG_MIX = (49152, 32768, 16384, 12288, 8192, 4096, 4096, 2048, 1024, 1024)


@dataclass(frozen=True)
class PackedConfig:
    """Packed sequences: each sequence of ``seq_len`` tokens is several DOCUMENTS, each a
    self-contained corpus sequence (``BOS``, filler with its own needles, its own query block at
    its end; ``document_config``), so a query is answered from a needle of its own document.

    A sequence holds ``min_documents..max_documents`` documents (uniform; fewer when
    ``seq_len < max_documents * min_document_len``) of varied lengths: ``min_document_len`` each
    plus a uniform random split of the rest. Documents are independent draws over the same small
    key space, so a later document usually holds needles with the same key as an earlier one and
    (mostly) another value: a DISTRACTOR, which only attention across documents could reach.
    A document of ``L`` tokens has ``needles_per_1k * L / 1024`` needles (at least 2 where two
    fit, at most one per distinct key, never more than fit) and ``min(queries, needles)`` queries. ``BOS`` opens
    every document and appears nowhere else, so the documents can be read off the tokens
    (``document_boundaries``).

    ``document_mix`` (relative lengths, e.g. ``PROLONG_MIX``) replaces the random draw: every
    sequence is that mix scaled to ``seq_len``, in a random order (``min_documents`` and
    ``max_documents`` are then unused); where the scaled mix has documents shorter than
    ``min_document_len``, the two shortest merge until none is, so short sequences hold fewer,
    longer documents."""

    vocab_size: int = 512
    seq_len: int = 4096
    min_documents: int = 3
    max_documents: int = 8
    min_document_len: int = 64
    needles_per_1k: float = 48.0
    queries: int = 6
    key_len: int = 1
    value_len: int = 1
    lexicon_size: int = 256
    seed: int = 1234
    needle_format: str = "fact"
    document_mix: Tuple[float, ...] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "min_documents", "max_documents", "min_document_len", "queries",
                     "key_len", "value_len", "lexicon_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not self.needles_per_1k > 0:
            raise ValueError(f"needles_per_1k must be positive, got {self.needles_per_1k!r}")
        object.__setattr__(self, "document_mix", tuple(float(x) for x in self.document_mix))
        if not all(math.isfinite(x) and x > 0 for x in self.document_mix):
            raise ValueError(f"document_mix must hold positive relative lengths, got {self.document_mix}")
        if self.min_documents > self.max_documents:
            raise ValueError(f"min_documents ({self.min_documents}) must be <= max_documents ({self.max_documents})")
        if self.seq_len < self.min_documents * self.min_document_len:
            raise ValueError(f"seq_len={self.seq_len} is too short for {self.min_documents} documents of at least "
                             f"{self.min_document_len} tokens")
        self.document_config(self.min_document_len)  # the shortest document must be valid (ValueError otherwise)

    def _corpus(self, seq_len: int, num_needles: int, num_queries: int) -> CorpusConfig:
        return CorpusConfig(vocab_size=self.vocab_size, seq_len=seq_len, num_needles=num_needles,
                            num_queries=num_queries, key_len=self.key_len, value_len=self.value_len,
                            lexicon_size=self.lexicon_size, seed=self.seed, needle_format=self.needle_format)

    @property
    def most_documents(self) -> int:
        """The most documents one sequence can hold."""
        return len(self.document_mix) if self.document_mix else self.max_documents

    @property
    def num_keys(self) -> int:
        """Distinct keys of the corpus (as ``CorpusConfig.num_keys``)."""
        return self._corpus(1 << 20, 1, 1).num_keys

    @property
    def num_values(self) -> int:
        """Choices for each answer token (as ``CorpusConfig.num_values``)."""
        return self._corpus(1 << 20, 1, 1).num_values

    def document_config(self, length: int) -> CorpusConfig:
        """The corpus config of one document of ``length`` tokens (ValueError if none fits)."""
        template = self._corpus(1 << 20, 1, 1)
        needles = min(max(2, int(self.needles_per_1k * length / 1024)), template.num_keys)
        fits = lambda n: 1 + n * template.needle_len + min(self.queries, n) * template.query_len <= length  # noqa: E731
        while needles > 1 and not fits(needles):
            needles -= 1
        try:
            return self._corpus(length, needles, min(self.queries, needles))
        except ValueError as err:
            raise ValueError(f"a document of {length} tokens holds no needle and query ({err}); raise "
                             "min_document_len") from None


@dataclass
class PackedSample:
    """One packed sequence (or probe) of several documents.

    ``tokens`` int64 [seq_len]; ``cu_seqlens`` int32 [documents + 1], ``[0, e1, ..., seq_len]``
    (document ``d`` is ``tokens[cu[d]:cu[d+1]]``); per query, in position order (every document's
    queries end it): ``target_positions`` int64 [Q * value_len] (ascending, its answer tokens),
    ``query_documents`` int64 [Q], ``answers`` int64 [Q, value_len] (the value of its needle, in
    its own document), ``needle_positions`` int64 [Q] (the token of that needle holding the
    answer: its fact token, or its first value token), ``distractors`` (a list of Q int64
    tensors [n_q, value_len]: the values of needles with the query's key in EARLIER documents
    whose value differs from the answer) and ``distractor_positions`` (list of int64 [n_q], their
    answer-holding tokens)."""

    tokens: torch.Tensor
    cu_seqlens: torch.Tensor
    target_positions: torch.Tensor
    query_documents: torch.Tensor
    answers: torch.Tensor
    needle_positions: torch.Tensor
    distractors: list
    distractor_positions: list


_PACKED_LAYOUT_STREAM, _PACKED_STREAM, _PACKED_PROBE_STREAM = 3, 4, 5


def _document_rng(seed: int, stream: int, index: int, document: int) -> np.random.Generator:
    if index < 0:
        raise ValueError(f"index must be >= 0, got {index}")
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, stream, int(index), int(document)])))


def _mix_lengths(config: PackedConfig, rng: np.random.Generator) -> np.ndarray:
    """``config.document_mix`` scaled to ``seq_len`` (largest remainders get the rounding), the two
    shortest documents merged while one is below ``min_document_len``, in a random order."""
    share = np.asarray(config.document_mix) / sum(config.document_mix) * config.seq_len
    lengths = np.floor(share).astype(np.int64)
    short = config.seq_len - int(lengths.sum())
    lengths[np.argsort(lengths - share, kind="stable")[:short]] += 1
    while len(lengths) > 1 and lengths.min() < config.min_document_len:
        two = np.argsort(lengths, kind="stable")[:2]
        lengths = np.append(np.delete(lengths, two), lengths[two].sum())
    return rng.permutation(lengths)


def _draw_lengths(config: PackedConfig, rng: np.random.Generator) -> np.ndarray:
    if config.document_mix:
        return _mix_lengths(config, rng)
    k = int(rng.integers(config.min_documents, config.max_documents + 1))
    k = min(k, config.seq_len // config.min_document_len)
    free = config.seq_len - k * config.min_document_len
    cuts = np.sort(rng.integers(0, free + 1, k - 1))
    return config.min_document_len + np.diff(np.concatenate([[0], cuts, [free]])).astype(np.int64)


def packed_document_lengths(config: PackedConfig, layout_index: int) -> np.ndarray:
    """Document lengths (int64, summing to ``seq_len``) of layout ``layout_index``: a function of
    ``(config, layout_index)`` only, so the rows of a micro-batch can share their documents
    (MTraining's ``cu_seqlens`` is shared by the micro-batch) while their contents differ."""
    return _draw_lengths(config, _rng(config.seed, _PACKED_LAYOUT_STREAM, layout_index))


def _answer_column(config: CorpusConfig) -> int:
    """Offset from a needle's KEY to the token holding its answer (fact token, or first value token)."""
    return 1 + (0 if config.needle_format == "fact" else config.key_len)


def _packed_sample(documents, lengths) -> PackedSample:
    """Concatenate documents ``[(CorpusConfig, _Parts)]`` and collect the per-query records."""
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    tokens, targets, query_docs, answers, query_keys, needle_pos = [], [], [], [], [], []
    needle_doc, needle_keys, needle_values, needle_at = [], [], [], []
    for d, ((cfg, parts), start) in enumerate(zip(documents, starts)):
        tokens.append(parts.tokens)
        order = parts.query_order
        targets.append(start + query_target_positions(cfg, len(order)))
        query_docs.append(np.full(len(order), d, dtype=np.int64))
        answers.append(parts.values[order])
        query_keys.append(parts.keys[order])
        held = start + parts.needle_start + _answer_column(cfg)
        needle_pos.append(held[order])
        needle_doc.append(np.full(len(parts.needle_start), d, dtype=np.int64))
        needle_keys.append(parts.keys)
        needle_values.append(parts.values)
        needle_at.append(held)
    query_docs, answers, query_keys = np.concatenate(query_docs), np.concatenate(answers), np.concatenate(query_keys)
    needle_doc, needle_keys = np.concatenate(needle_doc), np.concatenate(needle_keys)
    needle_values, needle_at = np.concatenate(needle_values), np.concatenate(needle_at)
    # [Q, needles]: same key, earlier document, another value.
    same_key = (query_keys[:, None, :] == needle_keys[None, :, :]).all(-1)
    other_value = (answers[:, None, :] != needle_values[None, :, :]).any(-1)
    distractor = same_key & other_value & (needle_doc[None, :] < query_docs[:, None])
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return PackedSample(
        tokens=torch.from_numpy(np.concatenate(tokens)),
        cu_seqlens=torch.from_numpy(cu),
        target_positions=torch.from_numpy(np.concatenate(targets).astype(np.int64)),
        query_documents=torch.from_numpy(query_docs),
        answers=torch.from_numpy(answers.astype(np.int64)),
        needle_positions=torch.from_numpy(np.concatenate(needle_pos).astype(np.int64)),
        distractors=[torch.from_numpy(needle_values[row].astype(np.int64)) for row in distractor],
        distractor_positions=[torch.from_numpy(needle_at[row].astype(np.int64)) for row in distractor],
    )


def make_packed_sequence(config: PackedConfig, index: int, layout_index: int | None = None) -> PackedSample:
    """Packed sequence ``index``: the documents of layout ``layout_index`` (default ``index``; see
    ``packed_document_lengths``), document ``d`` drawn as ``make_sequence`` draws a sequence, from
    its own stream ``(seed, index, d)``."""
    lengths = packed_document_lengths(config, index if layout_index is None else layout_index)
    documents = []
    for d, length in enumerate(lengths):
        cfg = config.document_config(int(length))
        documents.append((cfg, _sequence_parts(cfg, _document_rng(config.seed, _PACKED_STREAM, index, d))))
    return _packed_sample(documents, lengths)


def make_packed_probe(config: PackedConfig, index: int, depth: float) -> PackedSample:
    """Packed needle-in-a-haystack probe: the documents of a layout drawn for this probe, each a
    needle probe (``make_needle_probe``: one needle at ``depth`` of its own document, its query at
    the document's end), all with the SAME key and pairwise DIFFERENT values. So every document
    after the first has distractors: the same-key needles of all earlier documents. Layout,
    haystacks, key and values depend on ``(seed, index)`` only, not on ``depth``. ValueError when
    the layout has more documents than there are values."""
    if not 0.0 <= depth < 1.0:
        raise ValueError(f"depth must be in [0, 1), got {depth}")
    rng = _rng(config.seed, _PACKED_PROBE_STREAM, index)
    lengths = _draw_lengths(config, rng)
    k = len(lengths)
    if k > config.num_values:
        raise ValueError(f"a probe of {k} documents needs {k} distinct values, the corpus has {config.num_values}; "
                         "lower max_documents (or use a shorter document_mix)")
    cfgs = [config._corpus(int(length), 1, 1) for length in lengths]
    usable = [cfg.seq_len - 1 - cfg.needle_len - cfg.query_len for cfg in cfgs]
    fillers = [_filler(cfg, rng, n) for cfg, n in zip(cfgs, usable)]
    template = cfgs[0]
    if config.needle_format == "fact":
        a = template.fact_alphabet
        key = np.full((k, 1), template.symbol_start + int(rng.integers(0, a)))
        values = (template.symbol_start + a + rng.choice(a, k, replace=False))[:, None]
    else:
        key = np.repeat(_distinct_keys(template, rng, 1), k, axis=0)
        values = _distinct_strings(template, rng, k, config.value_len)
    documents = [(cfg, _assemble_parts(cfg, np.array([round(depth * n)]), np.array([0]), n, filler,
                                       key[d:d + 1], values[d:d + 1]))
                 for d, (cfg, n, filler) in enumerate(zip(cfgs, usable, fillers))]
    return _packed_sample(documents, lengths)


def document_boundaries(tokens: torch.Tensor) -> torch.Tensor:
    """bool, the shape of ``tokens``: True where a document starts (a ``BOS`` token, and position 0)."""
    starts = tokens == BOS
    starts[..., 0] = True
    return starts


def reset_position_ids(tokens: torch.Tensor) -> torch.Tensor:
    """int64 position ids that restart at 0 at every document start (``document_boundaries``), as
    Megatron's ``--reset-position-ids`` gives them: how the packed documents travel with a batch."""
    starts = document_boundaries(tokens)
    positions = torch.arange(tokens.shape[-1], device=tokens.device).expand_as(tokens)
    first = torch.cummax(torch.where(starts, positions, torch.zeros_like(positions)), dim=-1).values
    return positions - first


def answer_target_mask(tokens: torch.Tensor, value_len: int) -> torch.Tensor:
    """bool, the shape of ``tokens``: True at the answer (value) tokens of every query, i.e. the
    ``value_len`` tokens before each ``ANS`` (which closes a query and appears nowhere else)."""
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    for v in range(1, value_len + 1):
        mask[..., :-v] |= tokens[..., v:] == ANS
    return mask


def _sequence_tokens(config, index: int, rows_per_layout: int = 1, start_index: int = 0):
    # A numpy array, not a tensor: tensors leave a worker process through one shared-memory
    # segment each (torch's multiprocessing pickler), which for ~10^5 short sequences stalls the
    # writer (a GPU run made no progress in 8 minutes); numpy arrays are pickled as plain bytes.
    if isinstance(config, PackedConfig):
        layout = start_index + (index - start_index) // rows_per_layout
        return make_packed_sequence(config, index, layout).tokens.numpy()
    return make_sequence(config, index).tokens.numpy()


def write_indexed_dataset(output_prefix: str, config, num_sequences: int, start_index: int = 0,
                          workers: int = 1, rows_per_layout: int = 1) -> str:
    """Write ``make_sequence(config, start_index + i)`` for ``i < num_sequences`` as a Megatron indexed
    dataset (``output_prefix.bin`` / ``.idx``), one document per sequence; returns ``output_prefix``.
    ``workers > 1`` generates the sequences in that many processes (same file: each sequence depends
    on its index only). A ``PackedConfig`` writes ``make_packed_sequence(config, start_index + i,
    start_index + i // rows_per_layout)`` instead: each run of ``rows_per_layout`` consecutive
    sequences (a micro-batch) shares one layout of documents, which ``BOS`` tokens mark."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder, get_bin_path, get_idx_path

    if num_sequences <= 0:
        raise ValueError(f"num_sequences must be positive, got {num_sequences}")
    if rows_per_layout <= 0:
        raise ValueError(f"rows_per_layout must be positive, got {rows_per_layout}")
    # Same dtype choice as Megatron's preprocess_data.py: uint16 below 65500 ids, else int32.
    builder = IndexedDatasetBuilder(get_bin_path(output_prefix), dtype=DType.optimal_dtype(config.vocab_size))
    indices = range(start_index, start_index + num_sequences)
    make = functools.partial(_sequence_tokens, config, rows_per_layout=rows_per_layout, start_index=start_index)
    pool = None
    if workers > 1 and num_sequences >= 64 * workers:
        import concurrent.futures
        import multiprocessing

        pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
        sequences = pool.map(make, indices, chunksize=max(16, num_sequences // (8 * workers)))
    else:
        sequences = (make(i) for i in indices)
    try:
        for tokens in sequences:
            builder.add_item(torch.as_tensor(tokens))
            builder.end_document()
    finally:
        if pool is not None:
            pool.shutdown()
    builder.finalize(get_idx_path(output_prefix))
    return output_prefix


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write the synthetic retrieval corpus as a Megatron indexed dataset.")
    parser.add_argument("--output-prefix", required=True)
    parser.add_argument("--num-sequences", type=int, required=True)
    parser.add_argument("--seq-length", type=int, required=True)
    parser.add_argument("--vocab-size", type=int, default=CorpusConfig.vocab_size)
    parser.add_argument("--num-needles", type=int, default=CorpusConfig.num_needles)
    parser.add_argument("--num-queries", type=int, default=CorpusConfig.num_queries)
    parser.add_argument("--needle-format", choices=NEEDLE_FORMATS, default=CorpusConfig.needle_format,
                        help="fact needles need --key-len 1 --value-len 1")
    parser.add_argument("--key-len", type=int, default=CorpusConfig.key_len)
    parser.add_argument("--value-len", type=int, default=CorpusConfig.value_len)
    parser.add_argument("--seed", type=int, default=CorpusConfig.seed)
    parser.add_argument("--start-index", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        config = CorpusConfig(vocab_size=args.vocab_size, seq_len=args.seq_length, num_needles=args.num_needles,
                              num_queries=args.num_queries, seed=args.seed, needle_format=args.needle_format,
                              key_len=args.key_len, value_len=args.value_len)
    except ValueError as e:
        parser.error(str(e))
    prefix = write_indexed_dataset(args.output_prefix, config, args.num_sequences, args.start_index)
    print(f"wrote {args.num_sequences} sequences x {config.seq_len} tokens (vocab {config.vocab_size}, "
          f"{config.num_needles} needles, {config.num_queries} queries, seed {config.seed}) to {prefix}.bin/.idx")


if __name__ == "__main__":
    main()
