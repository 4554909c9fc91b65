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
    "write_indexed_dataset",
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


def _distinct_keys(config: CorpusConfig, rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` pairwise distinct keys [n, key_len] of symbol tokens."""
    space = config.num_symbols ** config.key_len
    if space < 64 * n * n:
        # Collisions would be common (up to every key in use: redrawing would never end), so draw
        # distinct key codes without replacement and write them in base num_symbols.
        codes = rng.choice(space, n, replace=False)
        powers = config.num_symbols ** np.arange(config.key_len - 1, -1, -1)
        return config.symbol_start + (codes[:, None] // powers) % config.num_symbols
    keys = rng.integers(config.symbol_start, config.vocab_size, (n, config.key_len))
    while len(np.unique(keys, axis=0)) < n:  # rare (birthday bound < 1/128): redraw
        keys = rng.integers(config.symbol_start, config.vocab_size, (n, config.key_len))
    return keys


def _assemble(config: CorpusConfig, rng: np.random.Generator, filler_before: np.ndarray,
              query_order: np.ndarray, num_filler: int, filler: np.ndarray) -> RetrievalSample:
    """Splice needles into the filler and append the query block.

    ``filler_before[i]`` (ascending) is how many filler tokens precede needle ``i``; the needle then
    starts at ``1 + filler_before[i] + i * needle_len`` (after BOS and the earlier needles).
    """
    n, L = len(filler_before), config.needle_len
    if config.needle_format == "fact":
        # Symbol range: n keys, then n values, then the n * n facts (key-major).
        a = config.fact_alphabet
        key_ids, value_ids = rng.choice(a, n, replace=False), rng.integers(0, a, n)
        keys = (config.symbol_start + key_ids)[:, None]
        values = (config.symbol_start + a + value_ids)[:, None]
        records = (config.symbol_start + 2 * a + key_ids * a + value_ids)[:, None]
    else:
        keys = _distinct_keys(config, rng, n)
        values = rng.integers(config.symbol_start, config.vocab_size, (n, config.value_len))
        records = np.concatenate([keys, values], axis=1)
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
    targets = query_target_positions(config, len(query_order))
    return RetrievalSample(
        tokens=torch.from_numpy(tokens),
        target_positions=torch.from_numpy(targets.astype(np.int64)),
        needle_depths=torch.from_numpy((needle_start[query_order] / config.seq_len).astype(np.float32)),
    )


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


def make_sequence(config: CorpusConfig, index: int) -> RetrievalSample:
    """Sequence ``index``: ``num_needles`` needles at random depths, ``num_queries`` queries at the end."""
    rng = _rng(config.seed, _SEQUENCE_STREAM, index)
    n, q = config.num_needles, config.num_queries
    num_filler = config.seq_len - 1 - n * config.needle_len - q * config.query_len
    filler = _filler(config, rng, num_filler)
    # Sorted uniform cut points in the filler give non-overlapping needles, uniform over the body.
    filler_before = np.sort(rng.integers(0, num_filler + 1, n))
    query_order = rng.choice(n, size=q, replace=False)
    return _assemble(config, rng, filler_before, query_order, num_filler, filler)


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


def _sequence_tokens(config: CorpusConfig, index: int):
    # A numpy array, not a tensor: tensors leave a worker process through one shared-memory
    # segment each (torch's multiprocessing pickler), which for ~10^5 short sequences stalls the
    # writer (a GPU run made no progress in 8 minutes); numpy arrays are pickled as plain bytes.
    return make_sequence(config, index).tokens.numpy()


def write_indexed_dataset(output_prefix: str, config: CorpusConfig, num_sequences: int, start_index: int = 0,
                          workers: int = 1) -> str:
    """Write ``make_sequence(config, start_index + i)`` for ``i < num_sequences`` as a Megatron indexed
    dataset (``output_prefix.bin`` / ``.idx``), one document per sequence; returns ``output_prefix``.
    ``workers > 1`` generates the sequences in that many processes (same file: each sequence depends
    on its index only)."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder, get_bin_path, get_idx_path

    if num_sequences <= 0:
        raise ValueError(f"num_sequences must be positive, got {num_sequences}")
    # Same dtype choice as Megatron's preprocess_data.py: uint16 below 65500 ids, else int32.
    builder = IndexedDatasetBuilder(get_bin_path(output_prefix), dtype=DType.optimal_dtype(config.vocab_size))
    indices = range(start_index, start_index + num_sequences)
    pool = None
    if workers > 1 and num_sequences >= 64 * workers:
        import concurrent.futures
        import multiprocessing

        pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
        sequences = pool.map(functools.partial(_sequence_tokens, config), indices,
                             chunksize=max(16, num_sequences // (8 * workers)))
    else:
        sequences = (_sequence_tokens(config, i) for i in indices)
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
