"""Dense attention for one ring step, with the log-sum-exp, for the dense context-parallel baseline.

The dense zigzag ring (what Transformer Engine does) runs one dense attention per step, merges
the partial outputs with their log-sum-exps, and in the backward hands every step the FINAL
(merged) output and lse. Flash-style backward kernels rebuild P = exp(S - lse) and
D = rowsum(dO * O) from the out/lse they are given, so with the merged ones each step yields its
exact share of the gradient.

Layouts: q ``[b, hq, nq, d]``, k/v ``[b, hkv, nk, d]`` with hq a multiple of hkv (GQA: query head
i uses kv head i // (hq // hkv), as ``repeat_interleave`` and SDPA's ``enable_gqa``). ``causal``
is the top-left causal mask with nq == nk. The lse is fp32 ``[b, hq, nq]``, natural log.

Implementations:
  "cudnn"  torch.ops.aten._scaled_dot_product_cudnn_attention(_backward)   CUDA, fp16/bf16
  "flash"  torch.ops.aten._scaled_dot_product_flash_attention(_backward)   CUDA, fp16/bf16
  "torch"  explicit fp32 PyTorch math, any device/dtype (the CPU path and the oracle)
  "auto"   cuDNN on CUDA for fp16/bf16, falling back to flash if cuDNN is missing or raises (for
           the rest of that call: a ``DenseFallback`` that a ring call's steps and backward
           share; the next call tries cuDNN again); "torch" otherwise (``dispatch.dense_impl``
           decides; ``dispatch.dense_impls_available`` lists what a device has).
Nothing here reads device memory on the host, so no path synchronises with the GPU.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import torch

from .dispatch import dense_impl

logger = logging.getLogger("megatron_mtraining")
_LOGGED = set()  # log-once: the cuDNN errors already warned of (a failing shape fails every step)


@dataclasses.dataclass
class DenseFallback:
    """One call's memory of a cuDNN failure under "auto": once cuDNN raised, the call's later
    kernels (a ring's other steps and its backward) run flash attention without trying cuDNN
    again. Owned by the call (``DenseZigzagSteps``), so one call's failure changes no other."""

    cudnn_failed: bool = False


def _check(q, k, v, causal):
    assert q.dim() == k.dim() == v.dim() == 4, "expected [b, h, n, d] tensors"
    assert k.shape == v.shape and q.shape[0] == k.shape[0] and q.shape[3] == k.shape[3]
    assert q.shape[1] % k.shape[1] == 0, "query heads must be a multiple of kv heads"
    assert not causal or q.shape[2] == k.shape[2], "causal needs nq == nk (top-left mask)"


def expand_kv(x, group):
    """GQA K/V for every query head: [b, hkv, n, d] -> [b, hq, n, d]. The fused aten ops are called
    with equal head counts: their forwards take unequal ones, but their GQA backwards were not
    checked (``MTrainingAttention``'s SDPA path expands for the same reason)."""
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def _reduce_kv(dx, group):
    """Sum a gradient over the GQA group: [b, hq, n, d] -> [b, hkv, n, d], in fp32."""
    dx = dx.float()
    if group == 1:
        return dx
    b, hq, n, d = dx.shape
    return dx.view(b, hq // group, group, n, d).sum(2)


def _with_fallback(impl, cudnn_fn, flash_fn, torch_fn, auto, fallback: Optional[DenseFallback] = None):
    """Run the chosen implementation; under "auto" a cuDNN error falls back to flash (for the rest
    of the call when ``fallback`` is given: it records the failure)."""
    if impl == "cudnn":
        try:
            return cudnn_fn()
        except RuntimeError as exc:
            if not auto:
                raise
            if fallback is not None:
                fallback.cudnn_failed = True
            if str(exc) not in _LOGGED:
                _LOGGED.add(str(exc))
                logger.warning("megatron_mtraining: cuDNN attention failed (%s); using flash attention "
                               "(impl='flash' skips the attempt)", exc)
            return flash_fn()
    return flash_fn() if impl == "flash" else torch_fn()


# ---------------------------------------------------------------------------------------- torch


def _scores(q, k, causal, scale):
    """fp32 scores [b, hq, nq, nk] with the causal mask applied as -inf."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        n = q.shape[2]
        upper = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        s = s.masked_fill(upper, float("-inf"))
    return s


def _torch_forward(q, k, v, causal, scale):
    group = q.shape[1] // k.shape[1]
    k, v = expand_kv(k, group), expand_kv(v, group)
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    return torch.matmul(p, v.float()).to(q.dtype), lse


def _torch_backward(do, q, k, v, out, lse, causal, scale):
    group = q.shape[1] // k.shape[1]
    ke, ve = expand_kv(k, group).float(), expand_kv(v, group).float()
    do, qf = do.float(), q.float()
    # P from the GIVEN lse (the merged one in a ring), as the fused kernels do.
    p = torch.exp(_scores(q, ke, causal, scale) - lse.float().unsqueeze(-1))
    dp = torch.matmul(do, ve.transpose(-1, -2))
    delta = (do * out.float()).sum(-1, keepdim=True)  # D = rowsum(dO * O), again from the given out
    ds = p * (dp - delta)
    dq = torch.matmul(ds, ke) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qf) * scale
    dv = torch.matmul(p.transpose(-1, -2), do)
    return dq, _reduce_kv(dk, group), _reduce_kv(dv, group)


# ---------------------------------------------------------------------------------------- cuDNN
# aten::_scaled_dot_product_cudnn_attention(Tensor query, Tensor key, Tensor value, Tensor? attn_bias,
#     bool compute_log_sumexp, float dropout_p=0., bool is_causal=False, bool return_debug_mask=False,
#     *, float? scale=None) -> (output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
#     philox_seed, philox_offset, debug_attn_mask)
# aten::_scaled_dot_product_cudnn_attention_backward(Tensor grad_out, Tensor query, Tensor key,
#     Tensor value, Tensor out, Tensor logsumexp, Tensor philox_seed, Tensor philox_offset,
#     Tensor attn_bias, Tensor cum_seq_q, Tensor cum_seq_k, SymInt max_q, SymInt max_k,
#     float dropout_p, bool is_causal, *, float? scale=None) -> (Tensor, Tensor, Tensor)
# K/V are expanded for GQA (see expand_kv). The lse is [b, h, n, 1] (torch 2.11; some versions
# [b, h, n]); the backward reads it with that layout, so it gets a contiguous [b, h, n, 1].
# max_q / max_k are the sequence lengths the backward graph is built for.


def _cudnn_forward(q, k, v, causal, scale):
    group = q.shape[1] // k.shape[1]
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, expand_kv(k, group), expand_kv(v, group), None, True, 0.0, causal, False, scale=scale)[:2]
    return out, lse.reshape(q.shape[:3])


def _cudnn_backward(do, q, k, v, out, lse, causal, scale):
    group = q.shape[1] // k.shape[1]
    ke, ve = expand_kv(k, group), expand_kv(v, group)
    # Dropout is off, so the philox seed/offset are never read; the op still wants tensors.
    seed = torch.empty((), dtype=torch.int64, device=q.device)
    lse4 = lse.float().reshape(*q.shape[:3], 1).contiguous()
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        do.to(q.dtype).contiguous(), q, ke, ve, out.to(q.dtype).contiguous(), lse4, seed, seed,
        None, None, None, q.shape[2], k.shape[2], 0.0, causal, scale=scale)
    return dq.float(), _reduce_kv(dk, group), _reduce_kv(dv, group)


# ---------------------------------------------------------------------------------------- flash
# aten::_scaled_dot_product_flash_attention(Tensor query, Tensor key, Tensor value, float dropout_p=0.,
#     bool is_causal=False, bool return_debug_mask=False, *, float? scale=None) -> (output,
#     logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused, debug_attn_mask)
# aten::_scaled_dot_product_flash_attention_backward(Tensor grad_out, Tensor query, Tensor key,
#     Tensor value, Tensor out, Tensor logsumexp, Tensor cum_seq_q, Tensor cum_seq_k, SymInt max_q,
#     SymInt max_k, float dropout_p, bool is_causal, Tensor philox_seed, Tensor philox_offset,
#     *, float? scale=None) -> (grad_query, grad_key, grad_value)
# cum_seq_q/k = None selects the dense (non-varlen) kernels. The flash lse is [b, h, nq] fp32.
# K/V are expanded for GQA here too (see expand_kv).


def _flash_forward(q, k, v, causal, scale):
    group = q.shape[1] // k.shape[1]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
        q, expand_kv(k, group), expand_kv(v, group), 0.0, causal, False, scale=scale)[:2]
    return out, lse[..., : q.shape[2]].reshape(q.shape[:3])


def _flash_backward(do, q, k, v, out, lse, causal, scale):
    group = q.shape[1] // k.shape[1]
    ke, ve = expand_kv(k, group), expand_kv(v, group)
    # Dropout is off, so the rng state is never read; shapes/dtypes as the forward returns them.
    rng_state = torch.empty(2, dtype=torch.uint64, device=q.device)
    unused = torch.empty((), dtype=torch.uint64, device=q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        do.to(q.dtype).contiguous(), q, ke, ve, out.to(q.dtype).contiguous(), lse.float().contiguous(),
        None, None, q.shape[2], k.shape[2], 0.0, causal, rng_state, unused, scale=scale)
    return dq.float(), _reduce_kv(dk, group), _reduce_kv(dv, group)


# ---------------------------------------------------------------------------------------- API


def dense_attention_forward(q, k, v, causal: bool, softmax_scale: float, impl: str = "auto",
                            fallback: Optional[DenseFallback] = None):
    """Dense attention -> (out in q's dtype [b, hq, nq, d], lse fp32 [b, hq, nq]). ``fallback``:
    the call's ``DenseFallback`` (None: this kernel alone)."""
    _check(q, k, v, causal)
    chosen = dense_impl(impl, q, fallback is not None and fallback.cudnn_failed)
    if chosen != "torch":
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out, lse = _with_fallback(
        chosen,
        lambda: _cudnn_forward(q, k, v, causal, softmax_scale),
        lambda: _flash_forward(q, k, v, causal, softmax_scale),
        lambda: _torch_forward(q, k, v, causal, softmax_scale),
        auto=impl == "auto", fallback=fallback)
    return out, lse.float()


def dense_attention_backward(do, q, k, v, out, lse, causal: bool, softmax_scale: float, impl: str = "auto",
                             fallback: Optional[DenseFallback] = None):
    """Gradients of dense attention given the (possibly ring-merged) out and lse; ``fallback`` as
    in ``dense_attention_forward``.

    Returns fp32 (dq [b, hq, nq, d], dk, dv [b, hkv, nk, d]); dk/dv are summed over the GQA group.
    """
    _check(q, k, v, causal)
    assert out.shape == q.shape[:3] + v.shape[3:] and lse.shape == q.shape[:3]
    chosen = dense_impl(impl, q, fallback is not None and fallback.cudnn_failed)
    if chosen != "torch":
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return _with_fallback(
        chosen,
        lambda: _cudnn_backward(do, q, k, v, out, lse, causal, softmax_scale),
        lambda: _flash_backward(do, q, k, v, out, lse, causal, softmax_scale),
        lambda: _torch_backward(do, q, k, v, out, lse, causal, softmax_scale),
        auto=impl == "auto", fallback=fallback)
