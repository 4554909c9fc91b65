"""Synthetic post-RoPE q/k with a vertical-slash attention structure, and recall measurement.

Random Gaussian q/k give nearly uniform attention, which no sparse index can approximate, so
they say nothing about the quality of an index. :func:`synthetic_vs_qk` builds q and k whose
causal softmax attention looks like that of a RoPE LLM (paper section 3, Theorem 1): most of
every query's mass sits on a few slash lines (constant ``n - m``) and a few vertical lines
(fixed key ``m``). Each part of the construction produces one part of the pattern:

* **Slash lines, RoPE locality.** q and k share a per-kv-head content vector ``mu`` (constant)
  plus a slowly varying drift ``c(t)``, and then get standard RoPE. The shared part gives
  ``q_n . k_m = A * sum_j w_j cos((n - m) theta_j)``: a function of ``n - m`` only (the
  Theorem's ``A_i`` terms), largest at ``n - m = 0`` and decaying as the RoPE frequencies
  ``theta_j = 10000^(-2j/d)`` dephase. With energy spread over all frequencies the logit falls
  roughly like ``log(n - m)``, so attention decays like a power of the distance: the diagonal
  block and its neighbours. A couple of "resonant" frequency pairs with extra energy bring the
  phases back in line every ``2 pi / theta`` tokens: weaker periodic slash lines further out.
  The drift ``c(t)`` (correlation length ~ tens of tokens) widens the band and makes it vary
  along the sequence. ``locality`` scales the strength of this part (0 switches it off).
* **Vertical lines, outlier keys.** A few random key positions per kv head get a large
  component along a direction ``u`` that almost every query also carries (with per-query
  jitter), so those keys are attended from everywhere after them. ``u`` lives in the lowest-
  frequency RoPE pairs, which ``mu`` and ``c`` leave empty, and is added after RoPE: this is
  the "massive activation" of real models, sitting in dimensions RoPE hardly rotates.
* **Attention sink.** Key 0 gets the strongest component along ``u``.
* **Diffuse rest.** i.i.d. noise on q and k spreads a few percent of the mass everywhere, so a
  finite index never reaches recall 1, as in real attention.

Heads differ: every query head draws its own locality strength and ``u`` strength, every kv
head its own ``mu``, resonant frequencies, drift and outlier positions. Everything is drawn
from one CPU ``torch.Generator`` seeded with ``seed`` (identical on every machine), computed in
float64 and only then cast to ``dtype`` and moved to ``device``.

:func:`attention_recall` measures an index against the true dense attention; it and
:func:`oracle_index` (the best-by-mass index at a given density, an upper reference for the
approximator) work over query chunks, so memory is O(chunk x n).
"""

from __future__ import annotations

import math
from typing import Dict, Optional

import torch

from megatron_mtraining.index import VSIndex
from megatron_mtraining.kernels.reference import vs_mask

__all__ = ["apply_rope", "synthetic_vs_qk", "attention_recall", "oracle_index"]


def apply_rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Standard rotary embedding, rotate-half convention: pair ``j`` is dims (j, j + d/2), angle pos * base^(-2j/d)."""
    d = x.shape[-1]
    half = d // 2
    inv_freq = base ** (-torch.arange(half, dtype=torch.float64) * 2.0 / d)
    angle = positions.to(torch.float64)[:, None] * inv_freq[None, :]  # [n, half]
    cos = torch.cat([angle.cos(), angle.cos()], -1).to(x.dtype)
    sin = torch.cat([angle.sin(), angle.sin()], -1).to(x.dtype)
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def _smooth_noise(shape, length: float, g: torch.Generator) -> torch.Tensor:
    """Gaussian noise along dim -2 low-passed with a Gaussian kernel of width ``length``, unit variance."""
    *lead, n, d = shape
    radius = int(3 * length)
    t = torch.arange(-radius, radius + 1, dtype=torch.float64)
    kernel = torch.exp(-0.5 * (t / length) ** 2)
    kernel = kernel / kernel.norm()  # keeps unit variance for i.i.d. unit input
    white = torch.randn(*lead, n + 2 * radius, d, generator=g, dtype=torch.float64)
    flat = white.movedim(-1, -2).reshape(-1, 1, n + 2 * radius)
    out = torch.nn.functional.conv1d(flat, kernel.view(1, 1, -1))
    return out.reshape(*lead, d, n).movedim(-2, -1)


def synthetic_vs_qk(batch: int, q_heads: int, kv_heads: int, seq_len: int, head_dim: int, *, seed: int = 0,
                    device=None, dtype: torch.dtype = torch.float32, sink: bool = True,
                    n_outliers: Optional[int] = None, locality: float = 1.0):
    """Post-RoPE ``q [b, hq, n, d]`` and ``k [b, hkv, n, d]`` whose causal attention is vertical-slash.

    See the module docstring for what each component contributes. ``n_outliers`` is the mean
    number of vertical-line keys per kv head (default ``seq_len // 256``, at least 1; 0 for
    none); ``sink`` makes key 0 an attention sink; ``locality`` scales the RoPE slash strength.
    Deterministic in ``seed``. Softmax scale is meant to be ``1/sqrt(head_dim)``.
    """
    if q_heads % kv_heads:
        raise ValueError(f"q_heads ({q_heads}) must be a multiple of kv_heads ({kv_heads})")
    if head_dim % 2 or head_dim < 16:
        raise ValueError(f"head_dim must be even and >= 16, got {head_dim}")
    if locality < 0:
        raise ValueError(f"locality must be >= 0, got {locality}")
    b, hq, hkv, n, d = batch, q_heads, kv_heads, seq_len, head_dim
    group, half = hq // hkv, head_dim // 2
    n_out = max(1, n // 256) if n_outliers is None else int(n_outliers)
    g = torch.Generator().manual_seed(int(seed))
    f64 = dict(dtype=torch.float64)
    # Amplitudes are in logit units: a q-part of size x * d^(1/4) against a k-part of size
    # y * d^(1/4) adds x * y * cosine(q-part, k-part) to the logit once scaled by 1/sqrt(d).
    unit = d ** 0.25

    # Frequency pairs: the lowest n_low carry the sink/outlier direction u, the rest carry mu, c.
    n_low = max(1, half // 8)
    n_rot = half - n_low

    def pair_vector(weights: torch.Tensor) -> torch.Tensor:
        """[..., n_rot] energy per pair -> [..., d] vector with random phase in each pair, unit norm."""
        phase = torch.rand(*weights.shape, generator=g, **f64) * 2 * math.pi
        amp = weights.clamp_min(0).sqrt()
        v = torch.zeros(*weights.shape[:-1], d, **f64)
        v[..., :n_rot] = amp * phase.cos()
        v[..., half:half + n_rot] = amp * phase.sin()
        return v / v.norm(dim=-1, keepdim=True)

    # --- slash part: shared content mu (+ resonant pairs) and drift c(t), then RoPE ---------------
    weights = 0.5 + torch.rand(b, hkv, n_rot, generator=g, **f64)  # energy per frequency pair
    inv_freq = 10000.0 ** (-torch.arange(n_rot, **f64) * 2.0 / d)
    period = 2 * math.pi / inv_freq
    resonant = torch.nonzero((period >= 128) & (period <= max(256.0, n / 2))).flatten()
    if len(resonant):
        for _ in range(2):
            pick = resonant[torch.randint(len(resonant), (b, hkv), generator=g)]
            boost = torch.rand(b, hkv, generator=g, **f64) * 0.15 * weights.sum(-1)
            weights.scatter_add_(-1, pick[..., None], boost[..., None])
    mu = pair_vector(weights)[:, :, None, :]  # [b, hkv, 1, d]
    drift = _smooth_noise((b, hkv, n, d), length=24.0, g=g)
    drift[..., n_rot:half] = 0
    drift[..., half + n_rot:] = 0
    drift = drift / math.sqrt(2 * n_rot)  # unit norm per token on average

    # Logit at distance 0: 8 from mu (decaying ~ log-distance) + 3 from the drift, times a per
    # query head factor in [0.7, 1.3]: heads range from very local to broad.
    shared = (math.sqrt(8.0) * mu + math.sqrt(3.0) * drift) * unit * math.sqrt(float(locality))
    loc_head = 0.7 + 0.6 * torch.rand(b, hq, generator=g, **f64)
    k_pre = shared
    q_pre = shared.repeat_interleave(group, 1) * loc_head[..., None, None]
    noise = 0.25  # diffuse part: ~0.5-1 logit of random scatter per pair
    q_pre = q_pre + noise * unit * torch.randn(b, hq, n, d, generator=g, **f64)
    k_pre = k_pre + noise * unit * torch.randn(b, hkv, n, d, generator=g, **f64)
    pos = torch.arange(n)
    q = apply_rope(q_pre, pos)
    k = apply_rope(k_pre, pos)

    # --- vertical part: sink and outlier keys along u, which (almost) every query carries --------
    phase = torch.rand(b, hkv, n_low, generator=g, **f64) * 2 * math.pi
    u = torch.zeros(b, hkv, d, **f64)
    u[..., n_rot:half] = phase.cos()
    u[..., half + n_rot:] = phase.sin()
    u = u / u.norm(dim=-1, keepdim=True)
    k_u = 0.5 * torch.randn(b, hkv, n, generator=g, **f64)  # ordinary keys: small, random
    for i in range(b):
        for h in range(hkv):
            count = 0 if n_out == 0 else int(torch.randint(max(1, n_out // 2), n_out + n_out // 2 + 1, (1,),
                                                           generator=g))
            cols = torch.randperm(n - 1, generator=g)[:count] + 1
            k_u[i, h, cols] = 7.0 + 3.0 * torch.rand(len(cols), generator=g, **f64)
            if sink:
                k_u[i, h, 0] = 11.0 + 2.0 * torch.rand((), generator=g, **f64)
    q_u = (0.8 + 0.4 * torch.rand(b, hq, 1, generator=g, **f64)) \
        * (1.0 + 0.15 * torch.randn(b, hq, n, generator=g, **f64))
    # Logit bonus q_u * k_u: ~6-12 for outliers, ~9-16 for the sink, +-0.5 for ordinary keys.
    k = k + (k_u[..., None] * unit) * u[:, :, None, :]
    q = q + (q_u[..., None] * unit) * u.repeat_interleave(group, 1)[:, :, None, :]
    return q.to(device=device, dtype=dtype), k.to(device=device, dtype=dtype)


def _causal_probs(q: torch.Tensor, kf: torch.Tensor, start: int, end: int, scale: float) -> torch.Tensor:
    """fp32 softmax probabilities of queries [start, end) over keys [0, end), causal."""
    scores = torch.matmul(q[:, :, start:end].float(), kf[:, :, :end].transpose(-1, -2)) * scale
    qpos = torch.arange(start, end, device=q.device)
    kpos = torch.arange(end, device=q.device)
    scores.masked_fill_(kpos[None, :] > qpos[:, None], float("-inf"))
    return torch.softmax(scores, dim=-1)


def _check(q, k, index: Optional[VSIndex] = None):
    b, hq, n, d = q.shape
    if k.shape[0] != b or k.shape[2] != n or k.shape[3] != d or hq % k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} do not match")
    if index is not None:
        index.check_matches(b, hq)
        if n % index.block_size:
            raise ValueError(f"sequence length {n} is not a multiple of block_size {index.block_size}")


def attention_recall(q: torch.Tensor, k: torch.Tensor, index: VSIndex, softmax_scale: Optional[float] = None,
                     query_chunk: int = 256) -> Dict[str, object]:
    """Share of the true dense causal attention mass that the index's active pairs hold.

    q ``[b, hq, n, d]``, k ``[b, hkv, n, d]`` (GQA by repeat_interleave). Returns ``recall``
    (fp32 ``[b, hq]``: per query, the softmax mass on active pairs, averaged over all ``n``
    queries), ``mean_recall`` (float), ``density`` (``index.density(n)``, ``[b, hq]``) and
    ``mean_density``. fp32 math over query chunks (memory O(chunk x n)); a measurement tool.
    """
    _check(q, k, index)
    b, hq, n, d = q.shape
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    kf = k.float().repeat_interleave(hq // k.shape[1], dim=1)
    index = index.to(q.device)
    nb = n // index.block_size
    hit = torch.zeros(b, hq, dtype=torch.float64, device=q.device)
    for start in range(0, n, query_chunk):
        end = min(n, start + query_chunk)
        p = _causal_probs(q, kf, start, end, scale)
        mask = vs_mask(index, torch.arange(start, end, device=q.device), torch.arange(end, device=q.device), nb)
        hit += (p * mask).sum((-1, -2)).double()
    recall = (hit / n).float()
    density = index.density(n).to(recall.device)
    return {"recall": recall, "mean_recall": float(recall.mean()), "density": density,
            "mean_density": float(density.mean())}


def oracle_index(q: torch.Tensor, k: torch.Tensor, block_size: int = 64, density: float = 0.1,
                 softmax_scale: Optional[float] = None, query_chunk: int = 256) -> VSIndex:
    """The index a mass-greedy oracle picks from the TRUE attention, at about ``density``.

    Per (batch, head): the total attention mass of every slash block offset and every column
    (over all queries) is measured; candidates are taken in order of mass per (query, key)
    pair they add until the nominal pair budget ``density * n(n+1)/2`` is spent (the diagonal
    always first). Columns' overlap with chosen slashes is ignored when budgeting, so the
    realised density (``index.density``) is at most the target. A reference point for the
    approximator (which only sees the last queries), not a hot-path tool.
    """
    _check(q, k)
    b, hq, n, d = q.shape
    B = block_size
    if n % B:
        raise ValueError(f"sequence length {n} is not a multiple of block_size {B}")
    nb = n // B
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    kf = k.float().repeat_interleave(hq // k.shape[1], dim=1)
    slash_mass = torch.zeros(b, hq, nb, dtype=torch.float64, device=q.device)
    col_mass = torch.zeros(b, hq, n, dtype=torch.float64, device=q.device)
    for start in range(0, n, query_chunk):
        end = min(n, start + query_chunk)
        p = _causal_probs(q, kf, start, end, scale).double()
        col_mass[..., :end] += p.sum(-2)
        delta = (torch.arange(start, end, device=q.device)[:, None] // B
                 - torch.arange(end, device=q.device)[None, :] // B).clamp_min(0)
        slash_mass.index_add_(-1, delta.flatten(), p.flatten(-2))
    pairs_slash = torch.full((nb,), float(B * B), dtype=torch.float64)
    pairs_slash[0] = B * (B + 1) / 2
    pairs_slash *= (nb - torch.arange(nb)).double()
    pairs_col = (n - torch.arange(n)).double()
    budget = density * n * (n + 1) / 2
    slash_lists, col_lists = [], []
    for i in range(b):
        srow, crow = [], []
        for h in range(hq):
            gain = torch.cat([slash_mass[i, h].cpu() / pairs_slash, col_mass[i, h].cpu() / pairs_col])
            gain[0] = float("inf")  # the diagonal is mandatory
            cost = torch.cat([pairs_slash, pairs_col])
            take, left, costs = [], budget, cost.tolist()
            for t in torch.argsort(gain, descending=True, stable=True).tolist():
                if costs[t] <= left or not take:  # greedy knapsack: skip what no longer fits
                    take.append(t)
                    left -= costs[t]
            srow.append(sorted(int(t) for t in take if t < nb))
            crow.append(sorted(int(t) - nb for t in take if t >= nb))
        slash_lists.append(srow)
        col_lists.append(crow)
    return VSIndex.from_lists(slash_lists, col_lists, block_size=B, device=q.device)
