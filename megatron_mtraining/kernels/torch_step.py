"""PyTorch forward/backward of one (query chunk, key chunk) step: the CPU path.

Same contract as the Triton step functions (accumulate into fp32 buffers, gradients from the
final lse), computed from the mask of ``reference.index_mask`` in query chunks so memory stays
O(chunk * keys). Formulas are written out (not autograd) so the gradient path is independent
of the reference it is tested against.
"""

from __future__ import annotations

import torch

from .reference import index_mask

QUERY_CHUNK = 1024


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _expand_kv(x: torch.Tensor, group: int, dtype) -> torch.Tensor:
    return x.to(dtype).repeat_interleave(group, dim=1)


def vs_attention_fwd_torch(q, k, v, plan, out, lse, softmax_scale: float, accumulate: bool) -> None:
    dtype = _compute_dtype(q)
    group = q.shape[1] // k.shape[1]
    kf, vf = _expand_kv(k, group, dtype), _expand_kv(v, group, dtype)
    q_pos, k_pos = plan.q_positions, plan.k_positions
    for start in range(0, q.shape[2], QUERY_CHUNK):
        rows = slice(start, start + QUERY_CHUNK)
        mask = index_mask(plan.index, q_pos[rows], k_pos, plan.num_blocks, plan.cu_seqlens)
        s = torch.matmul(q[:, :, rows].to(dtype), kf.transpose(-1, -2)) * softmax_scale
        s = s.masked_fill(~mask, float("-inf"))
        m = s.amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        w = torch.exp(s - m)
        total = w.sum(-1, keepdim=True)
        has = total > 0
        part_out = torch.matmul(w, vf) / torch.where(has, total, torch.ones_like(total))
        part_lse = torch.where(has, m + torch.log(torch.where(has, total, torch.ones_like(total))),
                               torch.full_like(total, float("-inf"))).squeeze(-1)
        if accumulate:
            part_out, part_lse = merge_partials(out[:, :, rows].to(dtype), lse[:, :, rows].to(dtype),
                                                part_out, part_lse)
        out[:, :, rows] = part_out.to(out.dtype)
        lse[:, :, rows] = part_lse.to(lse.dtype)


def merge_partials(out_a, lse_a, out_b, lse_b):
    """Log-sum-exp merge of two partial attention results over disjoint key sets."""
    mx = torch.maximum(lse_a, lse_b)
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
    wa, wb = torch.exp(lse_a - mx), torch.exp(lse_b - mx)
    total = wa + wb
    has = total > 0
    safe = torch.where(has, total, torch.ones_like(total))
    out = (out_a * wa[..., None] + out_b * wb[..., None]) / safe[..., None]
    return out, torch.where(has, mx + torch.log(safe), torch.full_like(total, float("-inf")))


def vs_attention_bwd_torch(q, k, v, do, lse, delta, plan, dq, dk, dv, softmax_scale: float) -> None:
    dtype = _compute_dtype(q)
    b, hq, _, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    group = hq // hkv
    kf, vf = _expand_kv(k, group, dtype), _expand_kv(v, group, dtype)
    dk_h = torch.zeros(b, hq, nk, d, dtype=dtype, device=q.device)
    dv_h = torch.zeros_like(dk_h)
    q_pos, k_pos = plan.q_positions, plan.k_positions
    for start in range(0, q.shape[2], QUERY_CHUNK):
        rows = slice(start, start + QUERY_CHUNK)
        qc, doc = q[:, :, rows].to(dtype), do[:, :, rows].to(dtype)
        lse_c = lse[:, :, rows].to(dtype)
        mask = index_mask(plan.index, q_pos[rows], k_pos, plan.num_blocks, plan.cu_seqlens)
        s = torch.matmul(qc, kf.transpose(-1, -2)) * softmax_scale
        # lse = -inf only for rows with no key at all: their p is 0.
        lse_safe = torch.where(torch.isfinite(lse_c), lse_c, torch.full_like(lse_c, float("inf")))
        p = torch.where(mask, torch.exp(s - lse_safe[..., None]), torch.zeros_like(s))
        dp = torch.matmul(doc, vf.transpose(-1, -2))
        ds = p * (dp - delta[:, :, rows].to(dtype)[..., None])
        dq[:, :, rows] += (torch.matmul(ds, kf) * softmax_scale).to(dq.dtype)
        dk_h += torch.matmul(ds.transpose(-1, -2), qc) * softmax_scale
        dv_h += torch.matmul(p.transpose(-1, -2), doc)
    dk += dk_h.view(b, hkv, group, nk, d).sum(2).to(dk.dtype)
    dv += dv_h.view(b, hkv, group, nk, d).sum(2).to(dv.dtype)
