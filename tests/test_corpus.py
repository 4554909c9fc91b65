"""Synthetic long-context retrieval corpus (benchmarks/corpus.py)."""

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from corpus import (
    ANS, BOS, KEY, NUM_SPECIAL, PAD, QUERY, VAL, CorpusConfig, _lexicon, make_batch, make_needle_probe,
    make_sequence, retrieval_accuracy, write_indexed_dataset,
)

CONFIGS = [
    CorpusConfig(),
    CorpusConfig(vocab_size=128, seq_len=300, num_needles=6, num_queries=6, key_len=2, value_len=3, seed=7),
    CorpusConfig(vocab_size=1000, seq_len=1 + 3 * 10 + 2 * 10, num_needles=3, num_queries=2),  # no filler at all
    CorpusConfig(vocab_size=2048, seq_len=400, num_needles=21, num_queries=5, key_len=1, value_len=1,
                 needle_format="fact"),  # every key in use
]


def decode_fact(token, cfg):
    """A fact token -> its (key token, value token): facts follow the n keys and n values, key-major."""
    a = cfg.fact_alphabet
    f = token - cfg.symbol_start - 2 * a
    assert 0 <= f < a * a, f"{token} is not a fact token"
    return cfg.symbol_start + f // a, cfg.symbol_start + a + f % a


def parse(tokens, cfg):
    """Parse a sequence back: (needles {key: (start, value)}, queries [(start, key, value)])."""
    t = tokens.tolist()
    K, V = cfg.key_len, cfg.value_len
    needles, queries = {}, []
    for i, tok in enumerate(t):
        if tok == KEY and cfg.needle_format == "fact":
            assert t[i + 2] == VAL
            key, value = decode_fact(t[i + 1], cfg)
            assert (key,) not in needles, "duplicate key"
            needles[(key,)] = (i, (value,))
        elif tok in (KEY, QUERY):
            key, value = tuple(t[i + 1:i + 1 + K]), tuple(t[i + 1 + K:i + 1 + K + V])
            assert t[i + 1 + K + V] == (VAL if tok == KEY else ANS)
            if tok == KEY:
                assert key not in needles, "duplicate key"
                needles[key] = (i, value)
            else:
                queries.append((i, key, value))
    return needles, queries


@pytest.mark.parametrize("cfg", CONFIGS, ids=["default", "small", "no-filler", "fact"])
def test_layout_and_answers(cfg):
    for index in range(3):
        s = make_sequence(cfg, index)
        tokens = s.tokens
        assert tokens.dtype == torch.int64 and tokens.shape == (cfg.seq_len,) and tokens[0] == BOS
        needles, queries = parse(tokens, cfg)
        assert len(needles) == cfg.num_needles and len(queries) == cfg.num_queries
        # Query block: exactly the last num_queries * query_len tokens.
        q_start = cfg.seq_len - cfg.num_queries * cfg.query_len
        assert [q[0] for q in queries] == list(range(q_start, cfg.seq_len, cfg.query_len))
        # Needles are disjoint and end before the query block.
        starts = sorted(start for start, _ in needles.values())
        assert starts[0] >= 1 and starts[-1] + cfg.needle_len <= q_start
        assert all(b - a >= cfg.needle_len for a, b in zip(starts, starts[1:]))
        # Every query asks for a distinct needle and its answer is that needle's value.
        assert len({q[1] for q in queries}) == cfg.num_queries
        for _, key, value in queries:
            assert key in needles and needles[key][1] == value
        # Targets are exactly the value tokens after each query's key; depths: needle start / seq_len.
        expected = [p + 1 + cfg.key_len + j for p, _, _ in queries for j in range(cfg.value_len)]
        assert s.target_positions.tolist() == expected
        depths = [needles[key][0] / cfg.seq_len for _, key, _ in queries]
        torch.testing.assert_close(s.needle_depths, torch.tensor(depths, dtype=torch.float32))
        # Outside needles and queries: only word-range tokens (no symbols, no specials).
        structural = torch.zeros(cfg.seq_len, dtype=torch.bool)
        structural[0] = True
        for p in starts:
            structural[p:p + cfg.needle_len] = True
        structural[q_start:] = True
        filler = tokens[~structural]
        assert ((filler >= NUM_SPECIAL) & (filler < cfg.symbol_start)).all()
        # Keys and values are symbols.
        kv = [tok for _, (_, v) in needles.items() for tok in v] + [tok for k in needles for tok in k]
        assert min(kv) >= cfg.symbol_start and max(kv) < cfg.vocab_size
        if cfg.needle_format == "fact":  # queries use key tokens and value tokens, never facts
            a = cfg.fact_alphabet
            assert all(cfg.symbol_start <= k[0] < cfg.symbol_start + a for _, k, _ in queries)
            assert all(cfg.symbol_start + a <= v[0] < cfg.symbol_start + 2 * a for _, _, v in queries)


def test_determinism_and_independence_from_global_rng():
    cfg = CorpusConfig(seq_len=2048)
    torch.manual_seed(0)
    np.random.seed(0)
    a = make_sequence(cfg, 5)
    torch.manual_seed(99)
    np.random.seed(99)
    torch.rand(10)
    b = make_sequence(cfg, 5)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.target_positions, b.target_positions)
    assert torch.equal(a.needle_depths, b.needle_depths)
    assert not torch.equal(a.tokens, make_sequence(cfg, 6).tokens)
    assert not torch.equal(a.tokens, make_sequence(CorpusConfig(seq_len=2048, seed=1235), 5).tokens)
    assert torch.equal(make_needle_probe(cfg, 2, 0.3).tokens, make_needle_probe(cfg, 2, 0.3).tokens)
    # Needle positions vary across the corpus (random depths, not a fixed slot).
    depths = torch.cat([make_sequence(cfg, i).needle_depths for i in range(20)])
    assert depths.min() < 0.25 and depths.max() > 0.75


def test_filler_is_made_of_lexicon_words():
    cfg = CorpusConfig(seq_len=1024)
    flat, offsets, lengths, probs = _lexicon(cfg.vocab_size, cfg.lexicon_size, cfg.seed)
    assert len(lengths) == cfg.lexicon_size and lengths.min() >= 2 and lengths.max() <= 6
    assert np.all(np.diff(probs) <= 0) and abs(probs.sum() - 1) < 1e-9  # Zipf: rank-decreasing
    words = {tuple(flat[o:o + n].tolist()) for o, n in zip(offsets, lengths)}
    prefixes = {w[:i] for w in words for i in range(1, len(w) + 1)}
    # Probe at depth 0: the needle follows BOS, then the filler is contiguous up to the query.
    s = make_needle_probe(cfg, 0, 0.0)
    filler = s.tokens[1 + cfg.needle_len:cfg.seq_len - cfg.query_len].tolist()
    # Segment into whole words (the last one may be cut off): dynamic programme over positions.
    reachable = [True] + [False] * len(filler)
    for i in range(len(filler)):
        if reachable[i]:
            for n in range(2, 7):
                if i + n <= len(filler) and tuple(filler[i:i + n]) in words:
                    reachable[i + n] = True
    assert any(reachable[i] and tuple(filler[i:]) in prefixes for i in range(len(filler)))
    # A different index gives a different haystack over the same lexicon.
    assert make_needle_probe(cfg, 1, 0.0).tokens.tolist() != s.tokens.tolist()


def test_needle_probe_depth():
    cfg = CorpusConfig(seq_len=4096)
    usable = cfg.seq_len - 1 - cfg.needle_len - cfg.query_len
    hay = None
    for depth in (0.0, 0.5, 0.99):
        s = make_needle_probe(cfg, 3, depth)
        needles, queries = parse(s.tokens, cfg)
        assert len(needles) == 1 and len(queries) == 1
        (key, (start, value)), = needles.items()
        assert start == 1 + round(depth * usable)
        assert queries[0] == (cfg.seq_len - cfg.query_len, key, value)
        assert s.target_positions.tolist() == list(range(cfg.seq_len - 1 - cfg.value_len, cfg.seq_len - 1))
        assert s.needle_depths.tolist() == pytest.approx([start / cfg.seq_len])
        # Same haystack and needle at every depth: only the insertion point moves.
        rest = torch.cat([s.tokens[:start], s.tokens[start + cfg.needle_len:]])
        hay = rest if hay is None else hay
        assert torch.equal(rest, hay)
    with pytest.raises(ValueError, match="depth"):
        make_needle_probe(cfg, 0, 1.0)


@pytest.mark.parametrize("kwargs, message", [
    (dict(vocab_size=100), "vocab_size must be >= 128"),
    (dict(seq_len=40), "seq_len=40 is too short"),
    (dict(num_queries=5), r"num_queries \(5\) must be <= num_needles \(4\)"),
    (dict(num_needles=0), "num_needles must be a positive integer"),
    (dict(key_len=-1), "key_len must be a positive integer"),
    (dict(num_queries=0), "num_queries must be a positive integer"),
    (dict(seed=-3), "seed must be a non-negative integer"),
    (dict(vocab_size=128, key_len=1, num_needles=40, num_queries=1, seq_len=4096), "distinct keys"),
    (dict(needle_format="facts"), "needle_format must be one of"),
    (dict(needle_format="fact"), "needs key_len=1 and value_len=1"),
    (dict(needle_format="fact", key_len=1, value_len=1, vocab_size=512, num_needles=11, num_queries=1,
          seq_len=4096), "10 distinct keys"),
])
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CorpusConfig(**kwargs)


def test_make_batch():
    cfg = CorpusConfig(seq_len=512, num_needles=3, num_queries=2)
    tokens, loss_mask, target_mask = make_batch(cfg, [4, 0, 4])
    assert tokens.shape == loss_mask.shape == target_mask.shape == (3, 512)
    assert loss_mask.dtype == torch.float32 and target_mask.dtype == torch.bool
    assert torch.equal(tokens[0], make_sequence(cfg, 4).tokens) and torch.equal(tokens[0], tokens[2])
    assert torch.equal(target_mask[1].nonzero().squeeze(1), make_sequence(cfg, 0).target_positions)
    assert torch.equal(loss_mask, (tokens != PAD).float())


def test_retrieval_accuracy():
    cfg = CorpusConfig(seq_len=256, num_needles=3, num_queries=2)
    tokens, _, target_mask = make_batch(cfg, [0, 1])
    preds = torch.full_like(tokens, PAD)
    preds[:, :-1] = tokens[:, 1:]  # preds[:, p] predicts tokens[:, p + 1]: a perfect model
    assert retrieval_accuracy(preds, tokens, target_mask) == 1.0
    # Errors outside the targets do not matter.
    noisy = preds.clone()
    noisy[:, :100] = PAD
    assert retrieval_accuracy(noisy, tokens, target_mask) == 1.0
    # One wrong value token makes that query (one of four) wrong.
    p = int(make_sequence(cfg, 1).target_positions[-1])  # last value token of row 1's last query
    wrong = preds.clone()
    wrong[1, p - 1] = tokens[1, p] + 1
    assert retrieval_accuracy(wrong, tokens, target_mask) == 0.75
    # Predictions shifted the wrong way (aligned with tokens, not with the next token) all fail.
    assert retrieval_accuracy(tokens, tokens, target_mask) == 0.0
    # Logits: argmax over the vocabulary.
    logits = torch.nn.functional.one_hot(wrong, cfg.vocab_size).float()
    assert retrieval_accuracy(logits, tokens, target_mask) == 0.75
    with pytest.raises(ValueError, match="no target"):
        retrieval_accuracy(preds, tokens, torch.zeros_like(target_mask))


@pytest.mark.parametrize("vocab_size, dtype", [(512, np.uint16), (70000, np.int32)])
def test_indexed_dataset_round_trip(tmp_path, vocab_size, dtype):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    cfg = CorpusConfig(vocab_size=vocab_size, seq_len=300, num_needles=2, num_queries=1)
    prefix = write_indexed_dataset(str(tmp_path / "corpus"), cfg, num_sequences=4, start_index=10)
    assert prefix == str(tmp_path / "corpus")
    ds = IndexedDataset(prefix)
    assert len(ds) == 4 and ds.index.dtype == dtype
    assert ds.document_indices.tolist() == [0, 1, 2, 3, 4]
    for i in range(4):
        assert ds[i].dtype == dtype
        assert np.array_equal(ds[i].astype(np.int64), make_sequence(cfg, 10 + i).tokens.numpy())


def test_cli(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefix = str(tmp_path / "cli")
    out = subprocess.run(
        [sys.executable, os.path.join(REPO, "benchmarks", "corpus.py"), "--output-prefix", prefix, "--num-sequences", "3",
         "--seq-length", "256", "--vocab-size", "256", "--num-needles", "3", "--num-queries", "1", "--seed", "9"],
        capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.count("\n") == 1 and "3 sequences" in out.stdout and prefix in out.stdout
    ds = IndexedDataset(prefix)
    cfg = CorpusConfig(vocab_size=256, seq_len=256, num_needles=3, num_queries=1, seed=9)
    assert len(ds) == 3 and np.array_equal(ds[2].astype(np.int64), make_sequence(cfg, 2).tokens.numpy())
    bad = subprocess.run(
        [sys.executable, os.path.join(REPO, "benchmarks", "corpus.py"), "--output-prefix", prefix, "--num-sequences", "1",
         "--seq-length", "10"], capture_output=True, text=True, cwd=REPO)
    assert bad.returncode == 2 and "too short" in bad.stderr
    fact = subprocess.run(
        [sys.executable, os.path.join(REPO, "benchmarks", "corpus.py"), "--output-prefix", prefix + "_fact", "--num-sequences", "2",
         "--seq-length", "256", "--vocab-size", "512", "--num-needles", "3", "--num-queries", "1",
         "--needle-format", "fact", "--key-len", "1", "--value-len", "1"], capture_output=True, text=True, cwd=REPO)
    assert fact.returncode == 0, fact.stderr
    cfg = CorpusConfig(vocab_size=512, seq_len=256, num_needles=3, num_queries=1, key_len=1, value_len=1,
                       needle_format="fact")
    fact_ds = IndexedDataset(prefix + "_fact")  # kept alive: items are views of its memory map
    assert np.array_equal(fact_ds[1].astype(np.int64), make_sequence(cfg, 1).tokens.numpy())


def test_query_target_positions_match_every_sequence_and_probe():
    from corpus import query_target_positions

    for cfg in CONFIGS:
        expected = query_target_positions(cfg)
        assert expected.dtype == np.int64 and len(expected) == cfg.num_queries * cfg.value_len
        for index in range(2):
            assert make_sequence(cfg, index).target_positions.tolist() == expected.tolist()
        probe = make_needle_probe(cfg, 0, 0.5)
        assert probe.target_positions.tolist() == query_target_positions(cfg, 1).tolist()


def test_indexed_dataset_parallel_generation_is_identical(tmp_path, monkeypatch):
    import concurrent.futures

    from megatron.core.datasets.indexed_dataset import IndexedDataset

    pools = []

    class CountingPool(concurrent.futures.ProcessPoolExecutor):
        def __init__(self, *args, **kwargs):
            pools.append(args)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", CountingPool)
    cfg = CorpusConfig(vocab_size=128, seq_len=65, num_needles=4, num_queries=2, key_len=1, value_len=1)
    serial = write_indexed_dataset(str(tmp_path / "serial"), cfg, num_sequences=128, start_index=3)
    assert pools == []
    parallel = write_indexed_dataset(str(tmp_path / "parallel"), cfg, num_sequences=128, start_index=3, workers=2)
    assert len(pools) == 1  # the worker processes really wrote this one
    a, b = IndexedDataset(serial), IndexedDataset(parallel)
    assert len(a) == len(b) == 128
    assert all(np.array_equal(a[i], b[i]) for i in range(128))


@pytest.mark.parametrize("key_len, num_needles", [(1, 32), (1, 20), (2, 200)])
def test_keys_stay_distinct_when_the_key_space_is_nearly_used_up(key_len, num_needles):
    """Every key in use (32 symbols, 32 one-token needles) must not make generation loop."""
    cfg = CorpusConfig(vocab_size=128, seq_len=8 * num_needles + 64, num_needles=num_needles, num_queries=4,
                       key_len=key_len, value_len=1)
    for index in range(3):
        tokens = make_sequence(cfg, index).tokens
        starts = torch.nonzero(tokens == KEY).flatten()
        keys = {tuple(tokens[s + 1:s + 1 + key_len].tolist()) for s in starts}
        assert len(starts) == num_needles and len(keys) == num_needles
        assert all(cfg.symbol_start <= t < cfg.vocab_size for key in keys for t in key)


@pytest.mark.parametrize("vocab_size, alphabet", [(128, 4), (512, 10), (2048, 21), (4096, 31)])
def test_fact_alphabet_is_the_largest_that_fits(vocab_size, alphabet):
    cfg = CorpusConfig(vocab_size=vocab_size, key_len=1, value_len=1, needle_format="fact")
    n = cfg.fact_alphabet
    assert n == alphabet and 2 * n + n * n <= cfg.num_symbols < 2 * (n + 1) + (n + 1) ** 2
    assert cfg.num_keys == cfg.num_values == n and cfg.needle_len == 3 and cfg.query_len == 4


def test_fact_probe_answers_its_needle():
    cfg = CorpusConfig(vocab_size=2048, seq_len=1024, num_needles=4, num_queries=2, key_len=1, value_len=1,
                       needle_format="fact")
    for depth in (0.0, 0.5, 0.99):
        s = make_needle_probe(cfg, 3, depth)
        needles, queries = parse(s.tokens, cfg)
        (start, value), = needles.values()
        assert queries[0][2] == value and s.tokens[s.target_positions[0]] == value[0]
        assert abs(start / cfg.seq_len - depth) < 0.01


# ---------------------------------------------------------------------------- packed documents

from corpus import (  # noqa: E402
    PROLONG_MIX, PackedConfig, PackedSample, answer_target_mask, document_boundaries, make_packed_probe, make_packed_sequence,
    packed_document_lengths, reset_position_ids,
)

PACKED_CONFIGS = [
    PackedConfig(vocab_size=2048, seq_len=2049, min_documents=3, max_documents=8),
    PackedConfig(vocab_size=256, seq_len=700, min_documents=2, max_documents=5, min_document_len=80, seed=3,
                 queries=3),
    PackedConfig(vocab_size=512, seq_len=1500, min_documents=3, max_documents=6, needle_format="pair", key_len=2,
                 value_len=2, needles_per_1k=16, min_document_len=128),
    PackedConfig(vocab_size=2048, seq_len=4097, document_mix=PROLONG_MIX),
]
PACKED_IDS = ["fact", "small", "pair", "prolong_mix"]


def check_packed(s: PackedSample, cfg: PackedConfig, probe_depth=None):
    """Every structural promise of a packed sample, checked against a parse of its tokens."""
    tokens, cu = s.tokens, s.cu_seqlens.tolist()
    assert tokens.shape == (cfg.seq_len,) and s.cu_seqlens.dtype == torch.int32
    assert cu[0] == 0 and cu[-1] == cfg.seq_len
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    assert all(n >= cfg.min_document_len for n in lengths)
    if cfg.document_mix:
        assert 1 <= len(lengths) <= len(cfg.document_mix)
    else:
        assert len(lengths) <= cfg.max_documents and len(lengths) >= min(cfg.min_documents,
                                                                           cfg.seq_len // cfg.min_document_len)
    # BOS opens every document and appears nowhere else: the documents can be read off the tokens.
    assert torch.nonzero(tokens == BOS).flatten().tolist() == cu[:-1]
    starts = document_boundaries(tokens)
    assert torch.nonzero(starts).flatten().tolist() == cu[:-1]
    expected_ids = torch.cat([torch.arange(n) for n in lengths])
    assert torch.equal(reset_position_ids(tokens), expected_ids)
    assert torch.equal(reset_position_ids(tokens[None].repeat(2, 1)), expected_ids[None].repeat(2, 1))
    # Documents parse on their own; every query's answer is its own document's needle.
    doc_of = torch.searchsorted(s.cu_seqlens.long(), torch.arange(cfg.seq_len), right=True) - 1
    queries = []
    for d, (a, b) in enumerate(zip(cu, cu[1:])):
        dcfg = cfg.document_config(b - a) if probe_depth is None else dataclasses.replace(
            cfg.document_config(b - a), num_needles=1, num_queries=1)
        needles, doc_queries = parse(tokens[a:b], dcfg)
        assert len(needles) == dcfg.num_needles and len(doc_queries) == dcfg.num_queries
        for q_start, key, value in doc_queries:
            assert needles[key][1] == value
            queries.append((d, a + q_start, key, value, a + needles[key][0]))
    Q, V = len(queries), cfg.value_len
    assert s.query_documents.tolist() == [q[0] for q in queries]
    assert s.answers.tolist() == [list(q[3]) for q in queries]
    targets = [p + 1 + cfg.key_len + j for _, p, _, _, _ in queries for j in range(V)]
    assert s.target_positions.tolist() == targets
    assert torch.equal(tokens[s.target_positions].view(Q, V), s.answers)
    assert torch.nonzero(answer_target_mask(tokens, V)).flatten().tolist() == targets
    column = 1 + (0 if cfg.needle_format == "fact" else cfg.key_len)
    assert s.needle_positions.tolist() == [q[4] + column for q in queries]
    assert (doc_of[s.needle_positions] == s.query_documents).all()  # the needle is in the query's own document
    # Distractors: exactly the needles with the query's key in EARLIER documents and another value.
    all_needles = []
    for d, (a, b) in enumerate(zip(cu, cu[1:])):
        for i in torch.nonzero(tokens[a:b] == KEY).flatten().tolist():
            if cfg.needle_format == "fact":
                key, value = decode_fact(int(tokens[a + i + 1]), cfg.document_config(b - a))
                key, value = (key,), (value,)
            else:
                key = tuple(tokens[a + i + 1:a + i + 1 + cfg.key_len].tolist())
                value = tuple(tokens[a + i + 1 + cfg.key_len:a + i + 1 + cfg.key_len + V].tolist())
            all_needles.append((d, key, value, a + i + column))
    for j, (d, _, key, value, _) in enumerate(queries):
        expected = [(n[3], n[2]) for n in all_needles if n[0] < d and n[1] == key and n[2] != value]
        assert s.distractor_positions[j].tolist() == [e[0] for e in expected]
        assert s.distractors[j].tolist() == [list(e[1]) for e in expected]
        assert all(doc_of[p] < d for p in s.distractor_positions[j].tolist())
    return queries


@pytest.mark.parametrize("cfg", PACKED_CONFIGS, ids=PACKED_IDS)
def test_packed_sequence_documents(cfg):
    distracted = 0
    for index in range(4):
        s = make_packed_sequence(cfg, index)
        check_packed(s, cfg)
        distracted += sum(len(d) > 0 for d in s.distractors)
    if cfg.needle_format == "fact":  # a small key space: later documents reuse keys with other values
        assert distracted > 0


def test_packed_is_deterministic_and_layouts_are_shared():
    cfg = PACKED_CONFIGS[0]
    a, b = make_packed_sequence(cfg, 5), make_packed_sequence(cfg, 5)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.cu_seqlens, b.cu_seqlens)
    assert a.cu_seqlens.tolist() == [0] + np.cumsum(packed_document_lengths(cfg, 5)).tolist()
    # One layout, other contents (the rows of a micro-batch share their documents).
    rows = [make_packed_sequence(cfg, i, layout_index=7) for i in (10, 11, 12)]
    assert all(torch.equal(r.cu_seqlens, rows[0].cu_seqlens) for r in rows)
    assert not torch.equal(rows[0].tokens, rows[1].tokens)
    counts = {len(packed_document_lengths(cfg, i)) for i in range(60)}
    assert counts == set(range(3, 9))  # 3-8 documents, every count drawn
    lengths = np.concatenate([packed_document_lengths(cfg, i) for i in range(60)])
    assert lengths.min() >= 64 and lengths.max() > 4 * lengths.min()  # varied lengths
    other = make_packed_sequence(dataclasses.replace(cfg, seed=cfg.seed + 1), 5)
    assert not torch.equal(other.tokens[:200], a.tokens[:200])


@pytest.mark.parametrize("cfg", PACKED_CONFIGS, ids=PACKED_IDS)
def test_packed_probe_plants_distractors(cfg):
    for index in range(3):
        by_depth = {}
        for depth in (0.0, 0.5, 0.95):
            s = make_packed_probe(cfg, index, depth)
            queries = check_packed(s, cfg, probe_depth=depth)
            cu = s.cu_seqlens.tolist()
            k = len(cu) - 1
            assert len(queries) == k  # one needle and one query per document
            assert len({q[2] for q in queries}) == 1  # all with the same key
            assert len({q[3] for q in queries}) == k  # pairwise different values
            for j, (d, _, _, _, needle_start) in enumerate(queries):
                # The distractors of document d: the needles of every earlier document.
                assert s.distractors[j].tolist() == s.answers[:d].tolist()
                assert s.distractor_positions[j].tolist() == s.needle_positions[:d].tolist()
                shortest = cfg.document_config(cfg.min_document_len)
                usable = cu[d + 1] - cu[d] - 1 - shortest.needle_len - shortest.query_len
                assert needle_start - cu[d] == 1 + round(depth * usable)
            by_depth[depth] = s
        # Layout, key and values do not depend on the depth.
        assert all(torch.equal(s.cu_seqlens, by_depth[0.0].cu_seqlens) and torch.equal(s.answers, by_depth[0.0].answers)
                   for s in by_depth.values())
    with pytest.raises(ValueError, match="depth"):
        make_packed_probe(PACKED_CONFIGS[0], 0, 1.0)
    crowded = PackedConfig(vocab_size=128, seq_len=1000, min_documents=6, max_documents=6)  # 4 values
    with pytest.raises(ValueError, match="distinct values"):
        make_packed_probe(crowded, 0, 0.5)


def test_document_mix_scales_merges_and_shuffles():
    """A mix at its own total is itself (in some order); scaled down, the shortest documents merge
    until every one holds min_document_len; the order is the layout's, the lengths are not."""
    full = PackedConfig(vocab_size=2048, seq_len=sum(PROLONG_MIX), document_mix=PROLONG_MIX)
    layouts = [packed_document_lengths(full, i).tolist() for i in range(6)]
    assert all(sorted(x) == sorted(PROLONG_MIX) for x in layouts)
    assert len({tuple(x) for x in layouts}) > 1  # shuffled per layout
    assert packed_document_lengths(full, 3).tolist() == layouts[3]  # a function of the layout index
    uneven = PackedConfig(vocab_size=2048, seq_len=1001, document_mix=(3, 1, 1), min_document_len=100)
    assert sorted(packed_document_lengths(uneven, 0).tolist()) == [200, 200, 601]  # remainders to the largest share
    for seq_len, want in [(513, 4), (2049, 8), (8193, 10)]:
        lengths = packed_document_lengths(dataclasses.replace(full, seq_len=seq_len), 0)
        assert lengths.sum() == seq_len and lengths.min() >= 64 and len(lengths) == want
    tiny = dataclasses.replace(full, seq_len=100, min_documents=1)
    assert packed_document_lengths(tiny, 0).tolist() == [100]  # everything merged into one document
    assert full.most_documents == 10 and PACKED_CONFIGS[0].most_documents == 8


@pytest.mark.parametrize("kwargs, message", [
    (dict(document_mix=(4, 0, 1)), "positive relative lengths"),
    (dict(document_mix=(4, float("nan"))), "positive relative lengths"),
    (dict(min_documents=4, max_documents=3), "min_documents"),
    (dict(seq_len=100, min_documents=3), "too short"),
    (dict(min_document_len=7), "raise min_document_len"),
    (dict(needles_per_1k=0), "needles_per_1k"),
    (dict(needle_format="fact", key_len=2), "key_len=1"),
])
def test_packed_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PackedConfig(**kwargs)


def test_packed_indexed_dataset_shares_layouts_per_micro_batch(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    cfg = PackedConfig(vocab_size=256, seq_len=513, min_documents=2, max_documents=4)
    prefix = write_indexed_dataset(str(tmp_path / "packed"), cfg, num_sequences=12, start_index=100,
                                   rows_per_layout=4)
    ds = IndexedDataset(prefix)
    assert len(ds) == 12
    for i in range(12):
        expected = make_packed_sequence(cfg, 100 + i, layout_index=100 + i // 4)
        assert np.array_equal(ds[i].astype(np.int64), expected.tokens.numpy())
    bos = [np.nonzero(ds[i] == BOS)[0].tolist() for i in range(12)]
    assert all(bos[i] == bos[i - i % 4] for i in range(12))  # a micro-batch of 4 rows: one layout
    assert bos[0] != bos[4] or bos[4] != bos[8]  # the next micro-batches: their own layouts


def test_unpacked_corpus_unchanged_by_the_packed_additions():
    """The packed additions split the sequence assembly into reusable parts: the unpacked
    sequences and probes must stay bit for bit what they were (digest taken before the change)."""
    import hashlib

    digest = hashlib.sha256()
    for cfg in (CorpusConfig(vocab_size=128, seq_len=300, num_needles=6, num_queries=6, key_len=2, value_len=3, seed=7),
                CorpusConfig(vocab_size=2048, seq_len=1025, num_needles=21, num_queries=6, key_len=1, value_len=1,
                             needle_format="fact")):
        for i in range(3):
            digest.update(make_sequence(cfg, i).tokens.numpy().tobytes())
            digest.update(make_needle_probe(cfg, i, 0.3).tokens.numpy().tobytes())
    assert digest.hexdigest() == "3a602e9a3adbb8cec8acb14d154b1b2be14567e8fb40c8ce6f877ccabc1e2afd"
    # answer_target_mask (packed runs read the answers off the tokens) agrees with the unpacked layout.
    for cfg in CONFIGS:
        s = make_sequence(cfg, 1)
        assert torch.nonzero(answer_target_mask(s.tokens, cfg.value_len)).flatten().tolist() == \
            s.target_positions.tolist()
