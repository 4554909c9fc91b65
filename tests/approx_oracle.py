"""Test-only oracle: the index approximator of docs/design.md §2 (the paper's Algorithm 1 with the
contract's rules) in float64, written from the contract with plain loops over documents, heads
and candidates. It shares no code with the package: the statistics are a full softmax per
scoring query, the selection a Python ``sorted`` per head.

``statistics`` gives the vertical and slash masses and the total mass; ``selection`` the index
of one head from them. ``check_head`` compares an index the package selected with the oracle's,
tolerating only what the package's fp32 statistics cannot resolve: a budget whose cumulative
mass lies within ``eps`` of ``top_p x total``, entries whose masses differ by less than ``atol``,
and entries of mass below ``atol`` left out (fp32 underflows where float64 does not).
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch


def scored_documents(ends: Optional[Sequence[int]], seq_len: int, block_size: int,
                     max_documents: int) -> List[Tuple[int, int]]:
    """(start, end) of the documents whose last queries are scored (design §2, documents):
    without documents (or with one) the whole sequence; else those longer than one block, the
    longest ``max_documents`` of them (equal lengths: the later document first)."""
    if ends is None or len(ends) == 2:
        return [(0, seq_len)]
    ends = [int(e) for e in ends]
    docs = [(s, e) for s, e in zip(ends[:-1], ends[1:]) if e - s > block_size]
    docs.sort(key=lambda se: (se[1] - se[0], se[0]), reverse=True)
    return docs[:max_documents]


def statistics(q, k, cfg, ends=None, scale=None):
    """(vertical [b, hq, N], slash [b, hq, N/B], total): float64 masses of the scoring queries.

    Every scored document (``scored_documents``) is scored by its own last ``min(last_q, length)``
    queries, each a softmax over the keys of its document at or before it. A document's rows
    are weighted ``last_q / rows`` (each document holds ``last_q`` of mass); its slash masses
    also by its share of the scored tokens times the number of scored documents."""
    b, hq, n, d = q.shape
    group = hq // k.shape[1]
    B, L = cfg.block_size, cfg.last_q
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    docs = scored_documents(ends, n, B, cfg.max_documents)
    scored_tokens = sum(e - s for s, e in docs)
    vertical = torch.zeros(b, hq, n, dtype=torch.float64)
    slash = torch.zeros(b, hq, n // B, dtype=torch.float64)
    for s, e in docs:
        rows = list(range(max(s, e - L), e))
        weight = L / len(rows)
        share = len(docs) * (e - s) / scored_tokens
        keys = list(range(s, e))
        qpos = torch.tensor(rows)[:, None]
        kpos = torch.tensor(keys)[None, :]
        visible = kpos <= qpos
        offset = (qpos // B - kpos // B).expand(len(rows), len(keys))[visible]
        for bi in range(b):
            for h in range(hq):
                scores = (q[bi, h, rows].double() @ k[bi, h // group, s:e].double().T) * scale
                p = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1) * weight
                vertical[bi, h, s:e] += p.sum(0)
                slash[bi, h].index_add_(0, offset, p[visible] * share)
    return vertical, slash, float(L * len(docs))


def mandatory_columns(cfg, ends, seq_len: int) -> torch.Tensor:
    """bool [N]: the sink columns, positions < sink_tokens and, with documents, positions
    ``start .. start + sink_tokens - 1`` of every scored document."""
    out = torch.arange(seq_len) < cfg.sink_tokens
    if ends is not None and len(ends) > 2:
        for s, _ in scored_documents(ends, seq_len, cfg.block_size, cfg.max_documents):
            out[s:s + cfg.sink_tokens] = True
    return out


def mandatory_offsets(cfg, ends, seq_len: int) -> torch.Tensor:
    """bool [N/B]: offsets below max(1, local_window); with documents also offset 1 when a
    document of at most one block straddles a block boundary."""
    B = cfg.block_size
    out = torch.arange(seq_len // B) < max(1, cfg.local_window)
    if ends is not None and len(ends) > 2:
        ends = [int(e) for e in ends]
        if any(e - s <= B and s // B != (e - 1) // B for s, e in zip(ends[:-1], ends[1:])):
            out[1] = True
    return out


def _ranked(values: Sequence[float], mandatory: Sequence[bool]) -> List[int]:
    """Mandatory entries first (by position), then by mass, descending, equal masses by position."""
    return sorted(range(len(values)), key=lambda i: (not mandatory[i], 0.0 if mandatory[i] else -values[i], i))


def _budget(ranked_values: Sequence[float], threshold: float) -> int:
    """Smallest count (>= 1) of ranked entries whose masses sum to ``threshold``; all + 1 if none."""
    acc = 0.0
    for i, v in enumerate(ranked_values):
        acc += v
        if acc >= threshold:
            return i + 1
    return len(ranked_values) + 1


def _count(budget: int, n_mandatory: int, available: int, lo: int, hi: int, capacity: int) -> int:
    """The budget clamped as design §2 says: at least the mandatory entries, within
    [max(min, 1), hi], at most the entries holding mass or mandatory, at most the capacity, and
    never fewer than the mandatory entries that fit."""
    count = min(max(max(budget, n_mandatory), max(lo, 1)), hi)
    count = min(count, available, capacity)
    return max(count, min(n_mandatory, capacity))


def selection(values, mandatory, total: float, top_p: float, lo: int, hi: int, capacity: int) -> List[int]:
    """The selected positions (ascending) of one head: the first ``count`` ranked entries."""
    values, mandatory = [float(v) for v in values], [bool(m) for m in mandatory]
    order = _ranked(values, mandatory)
    n_mandatory = sum(mandatory)
    available = n_mandatory + sum(1 for v, m in zip(values, mandatory) if not m and v > 0)
    count = _count(_budget([values[i] for i in order], top_p * total), n_mandatory, available, lo, hi, capacity)
    return sorted(order[:count])


def check_head(chosen: Sequence[int], values, mandatory, total: float, top_p: float, lo: int, hi: int,
               capacity: int, atol: float, eps: float, what: str = "") -> bool:
    """Assert that ``chosen`` is the oracle's selection up to the fp32 tolerances of the module
    docstring; returns whether it is exactly the oracle's selection."""
    values, mandatory = [float(v) for v in values], [bool(m) for m in mandatory]
    chosen = [int(c) for c in chosen]
    assert chosen == sorted(set(chosen)), f"{what}: not ascending and unique: {chosen}"
    order = _ranked(values, mandatory)
    ranked_values = [values[i] for i in order]
    n_mandatory = sum(mandatory)
    held = sum(1 for v, m in zip(values, mandatory) if not m and v > 0)
    above = sum(1 for v, m in zip(values, mandatory) if not m and v > atol)
    c_min = _count(_budget(ranked_values, top_p * total - eps), n_mandatory, n_mandatory + above, lo, hi, capacity)
    c_max = _count(_budget(ranked_values, top_p * total + eps), n_mandatory, n_mandatory + held, lo, hi, capacity)
    assert c_min <= len(chosen) <= c_max, f"{what}: {len(chosen)} selected, the oracle's budget is {c_min}..{c_max}"
    forced = [i for i in range(len(values)) if mandatory[i]][:len(chosen)]
    assert set(forced) <= set(chosen), f"{what}: mandatory entries {sorted(set(forced) - set(chosen))} missing"
    picked = [c for c in chosen if not mandatory[c]]
    if picked:
        taken = set(chosen)
        left = [values[i] for i in range(len(values)) if not mandatory[i] and i not in taken]
        lightest = min(values[c] for c in picked)
        assert lightest > 0, f"{what}: an entry of zero mass was selected"
        if left:
            assert lightest >= max(left) - atol, \
                f"{what}: selected mass {lightest} while {max(left)} was left out"
    return chosen == selection(values, mandatory, total, top_p, lo, hi, capacity)


def check_index(index, q, k, cfg, ends=None, scale=None, atol=None, eps=None, what: str = "") -> float:
    """Assert every head of ``index`` against the oracle; returns the share of the (head, kind)
    selections that equal the oracle's exactly."""
    b, hq, n, _ = q.shape
    vertical, slash, total = statistics(q, k, cfg, ends, scale)
    atol = 1e-5 * max(total, 1.0) if atol is None else atol
    eps = 1e-5 * max(total, 1.0) if eps is None else eps
    cols, offs = mandatory_columns(cfg, ends, n), mandatory_offsets(cfg, ends, n)
    nb = n // cfg.block_size
    exact = []
    for bi in range(b):
        for h in range(hq):
            ns, nv = int(index.n_slash[bi, h]), int(index.n_vertical[bi, h])
            exact.append(check_head(index.slash[bi, h, :ns].tolist(), slash[bi, h].tolist(), offs.tolist(), total,
                                    cfg.top_p, cfg.min_slash, min(cfg.max_slash, nb), cfg.max_slash, atol, eps,
                                    f"{what} batch {bi} head {h} slash"))
            exact.append(check_head(index.vertical[bi, h, :nv].tolist(), vertical[bi, h].tolist(), cols.tolist(),
                                    total, cfg.top_p, cfg.min_vertical, min(cfg.max_vertical, n), cfg.max_vertical,
                                    atol, eps, f"{what} batch {bi} head {h} vertical"))
    return sum(exact) / len(exact)
