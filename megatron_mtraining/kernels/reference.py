"""Plain-PyTorch sparse attention: the oracle every kernel and ring schedule is tested against.

It computes docs/design.md §1 literally: query ``n`` attends key ``m`` iff ``m <= n`` and, for a
``VSIndex``, (``n//B - m//B`` is a selected slash offset or ``m`` is a selected column), for a
``BlockIndex``, ``m//B`` is one of the key blocks of ``n//B``; and, for packed documents
(``cu_seqlens``), both lie in one document; softmax over the active keys only, in fp32 (fp64 if
the inputs are fp64).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import torch

from ..block_index import BlockIndex
from ..documents import Documents
from ..index import VSIndex


def document_ids(cu_seqlens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Which document (0, 1, ...) each global position lies in."""
    return torch.searchsorted(cu_seqlens.to(positions.device, torch.int64), positions, right=True)


def vs_mask(index: VSIndex, q_positions: torch.Tensor, k_positions: torch.Tensor,
            num_blocks: Optional[int] = None, cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """bool [b, hq, nq, nk]: which (query, key) pairs are active, for arbitrary global positions
    (and, with ``cu_seqlens``, only pairs within one document)."""
    B = index.block_size
    q_positions = q_positions.to(index.device).long()
    k_positions = k_positions.to(index.device).long()
    if num_blocks is None:  # enough blocks to hold every position given
        num_blocks = int(torch.maximum(q_positions.max(), k_positions.max())) // B + 1
    seq_len = num_blocks * B
    delta = q_positions[:, None] // B - k_positions[None, :] // B
    causal = k_positions[None, :] <= q_positions[:, None]
    bitmap = index.slash_bitmap(num_blocks).bool()  # [b, h, nb]
    slash_hit = bitmap[:, :, delta.clamp(0, num_blocks - 1)] & (delta >= 0)
    column_hit = index.column_mask(seq_len)[:, :, k_positions][:, :, None, :]
    if cu_seqlens is not None:
        same_doc = document_ids(cu_seqlens, q_positions)[:, None] == document_ids(cu_seqlens, k_positions)[None, :]
        causal = causal & same_doc
    return causal & (slash_hit | column_hit)


def block_mask(index: BlockIndex, q_positions: torch.Tensor, k_positions: torch.Tensor,
               num_blocks: Optional[int] = None, cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``vs_mask`` for a ``BlockIndex``: bool [b, hq, nq, nk], key ``m`` active for query ``n`` iff
    ``m <= n`` and ``m//B`` is a key block of ``n//B`` (and, with ``cu_seqlens``, one document)."""
    B = index.block_size
    if num_blocks is not None and num_blocks != index.num_blocks:
        raise ValueError(f"the BlockIndex has {index.num_blocks} blocks, the call asks for {num_blocks}")
    q_positions = q_positions.to(index.device).long()
    k_positions = k_positions.to(index.device).long()
    rows = index.block_rows(q_positions // B)  # [b, h, nq, num_blocks]
    hit = rows.index_select(-1, k_positions // B)
    causal = k_positions[None, :] <= q_positions[:, None]
    if cu_seqlens is not None:
        causal = causal & (document_ids(cu_seqlens, q_positions)[:, None]
                           == document_ids(cu_seqlens, k_positions)[None, :])
    return causal & hit


def index_mask(index: Union[VSIndex, BlockIndex], q_positions: torch.Tensor, k_positions: torch.Tensor,
               num_blocks: Optional[int] = None, cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The active pairs of either index kind (``vs_mask`` or ``block_mask``)."""
    if isinstance(index, BlockIndex):
        return block_mask(index, q_positions, k_positions, num_blocks, cu_seqlens)
    return vs_mask(index, q_positions, k_positions, num_blocks, cu_seqlens)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: Union[VSIndex, BlockIndex],
                        q_positions: Optional[torch.Tensor] = None,
                        k_positions: Optional[torch.Tensor] = None,
                        softmax_scale: Optional[float] = None,
                        num_blocks: Optional[int] = None,
                        cu_seqlens: Union[Documents, torch.Tensor, None] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Masked attention of docs/design.md §1 in fp32; differentiable through autograd.

    q ``[b, hq, nq, d]``, k/v ``[b, hkv, nk, d]``, ``index`` a ``VSIndex`` or a ``BlockIndex``.
    ``q_positions`` / ``k_positions`` (int, ``[nq]`` / ``[nk]``) are the tokens' global positions,
    so any (query chunk, key chunk) pair of any layout can be checked; by default both are
    ``0..n-1`` (the full sequence).
    ``cu_seqlens`` (int32 ``[0, e1, ..., N]``, global positions, or a ``documents.Documents``)
    masks pairs across documents.
    Returns ``(out, lse)``: out fp32 ``[b, hq, nq, d]`` and lse fp32 ``[b, hq, nq]``. Rows
    without an active key give out 0 and lse ``-inf``. Memory is O(nq * nk): a test oracle.
    """
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    if q_positions is None:
        q_positions = torch.arange(nq, device=q.device)
    if k_positions is None:
        k_positions = torch.arange(nk, device=q.device)
    if isinstance(cu_seqlens, Documents):
        cu_seqlens = cu_seqlens.cu_seqlens
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    group = hq // hkv
    kf = k.to(dtype).repeat_interleave(group, dim=1)
    vf = v.to(dtype).repeat_interleave(group, dim=1)
    scores = torch.matmul(q.to(dtype), kf.transpose(-1, -2)) * scale
    mask = index_mask(index, q_positions, k_positions, num_blocks, cu_seqlens).to(q.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    # Max-shifted softmax that stays finite (also in autograd) for rows with no active key.
    row_max = scores.amax(dim=-1, keepdim=True).detach()
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - row_max)
    total = weights.sum(dim=-1, keepdim=True)
    has_key = total > 0
    probs = weights / torch.where(has_key, total, torch.ones_like(total))
    lse = torch.where(has_key, row_max + torch.log(torch.where(has_key, total, torch.ones_like(total))),
                      torch.full_like(total, float("-inf"))).squeeze(-1)
    out = torch.matmul(probs, vf)
    return out, lse
