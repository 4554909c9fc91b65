"""Test-only oracle: the attention function of docs/design.md §1 in float64, mask built
entry by entry from Python sets (independent of the package's vectorised mask code)."""

import math

import torch


def index_sets(index):
    """VSIndex -> per (batch, head) (set of slash offsets, set of columns), read on the host."""
    out = []
    for b in range(index.batch):
        row = []
        for h in range(index.heads):
            ns, nv = int(index.n_slash[b, h]), int(index.n_vertical[b, h])
            row.append((set(index.slash[b, h, :ns].tolist()), set(index.vertical[b, h, :nv].tolist())))
        out.append(row)
    return out


def dense_mask(index, n, q_positions=None, k_positions=None, cu_seqlens=None):
    """bool [b, h, nq, nk]; ``cu_seqlens`` (a list or tensor of document ends) keeps pairs of one
    document only."""
    q_positions = list(range(n)) if q_positions is None else [int(x) for x in q_positions]
    k_positions = list(range(n)) if k_positions is None else [int(x) for x in k_positions]
    B = index.block_size
    sets = index_sets(index)
    ends = None if cu_seqlens is None else [int(x) for x in cu_seqlens]

    def doc(p):
        return 0 if ends is None else sum(1 for e in ends[1:] if e <= p)

    mask = torch.zeros(index.batch, index.heads, len(q_positions), len(k_positions), dtype=torch.bool)
    for b in range(index.batch):
        for h in range(index.heads):
            slash, vertical = sets[b][h]
            for i, qp in enumerate(q_positions):
                for j, kp in enumerate(k_positions):
                    mask[b, h, i, j] = kp <= qp and doc(kp) == doc(qp) and \
                        ((qp // B - kp // B) in slash or kp in vertical)
    return mask


def attention_f64(q, k, v, mask, scale=None):
    """Masked softmax attention in float64 with autograd; rows must have at least one key."""
    group = q.shape[1] // k.shape[1]
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    kf = k.double().repeat_interleave(group, 1)
    vf = v.double().repeat_interleave(group, 1)
    s = (q.double() @ kf.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, -1) @ vf


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
