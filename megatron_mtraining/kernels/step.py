"""One entry point per direction for a (query chunk, key chunk) step, whatever the backend.

Ring attention calls ``step_forward`` and the backward's two halves (``step_backward_keys``, then
``step_backward_queries``) once per ring step with that step's plan; single-device attention is the
one-step case (``step_backward``: both halves). What runs is ``dispatch.py``'s choice (the
backend, the Triton or the Hopper kernels, their schedule); this module runs it, and holds the
backward's host side shared by both kernel families (``vs_attention_backward``).
"""

from __future__ import annotations

import functools

import torch

from ..config import Settings
from .column_partials import add_column_partials, empty_column_partials
from .common import HOPPER_TILE, LOG2E, column_arguments, document_arguments, int64_offsets, plan_tensors
from .dispatch import BackwardParts, backward_kernel, backward_parts, forward_kernel, hopper_forward_rows
from .step_plan import first_query_blocks, query_block_ends
from .torch_step import vs_attention_bwd_torch, vs_attention_fwd_torch
from .triton_common import tile_config

AUTO = Settings()  # the kernels' choice for a caller that gives none: "auto" both ways


def step_forward(backend: str, q, k, v, plan, out, lse, softmax_scale: float, accumulate: bool,
                 settings: Settings = AUTO) -> None:
    """Write (or merge, with ``accumulate``) this step's attention into ``out`` and fp32 ``lse``;
    ``settings.forward_kernel`` picks the kernel on the "triton" backend."""
    if backend == "triton" and forward_kernel(q, k, v, plan, out, settings.forward_kernel) == "hopper":
        from .hopper_fwd import vs_attention_fwd_hopper
        vs_attention_fwd_hopper(q, k, v, plan, out, lse, softmax_scale, accumulate,
                                rows=hopper_forward_rows(plan.block_size))
    elif backend == "triton":
        from .triton_fwd import vs_attention_fwd_triton
        vs_attention_fwd_triton(q, k, v, plan, out, lse, softmax_scale, accumulate, settings.kernel_launch)
    else:
        vs_attention_fwd_torch(q, k, v, plan, out, lse, softmax_scale, accumulate)


def backward_delta(backend: str, out: torch.Tensor, d_out: torch.Tensor) -> torch.Tensor:
    """``rowsum(out * d_out)`` ``[b, h, n]`` for the backward, in fp32 (fp64 for fp64 inputs on the
    PyTorch backend); the same for every ring step, so computed once per backward."""
    if backend == "triton":
        from .triton_delta import attention_delta_triton
        return attention_delta_triton(out, d_out)
    acc = torch.float64 if out.dtype == torch.float64 else torch.float32
    return (d_out.to(acc) * out.to(acc)).sum(-1)


def step_backward(backend: str, q, k, v, do, lse, delta, plan, dq, dk, dv, softmax_scale: float,
                  accumulate_dq: bool = True, settings: Settings = AUTO) -> None:
    """Add this step's gradients into fp32 ``dq``, ``dk``, ``dv`` (final ``lse`` and ``delta``);
    ``accumulate_dq=False`` (a ring's first step) writes ``dq`` instead, which may then be uninitialised.
    The two halves, ``step_backward_queries`` then ``step_backward_keys``, may also be called apart."""
    if backend != "triton" and not accumulate_dq:
        dq.zero_()  # the PyTorch path adds dQ with the key side
    step_backward_queries(backend, q, k, v, do, lse, delta, plan, dq, softmax_scale, accumulate_dq, settings)
    step_backward_keys(backend, q, k, v, do, lse, delta, plan, dq, dk, dv, softmax_scale, settings)


def step_backward_queries(backend: str, q, k, v, do, lse, delta, plan, dq, softmax_scale: float,
                          accumulate_dq: bool = True, settings: Settings = AUTO) -> None:
    """The step's dQ, added into (or with ``accumulate_dq=False`` written in) ``dq``: the half of a
    step's backward whose result stays on this rank, so a ring runs it after sending the step's
    dK/dV on, while they travel. Nothing on the PyTorch path, which computes all three gradients
    together in ``step_backward_keys`` (adding dQ: give it a zeroed ``dq`` for a first step)."""
    if backend == "triton":
        vs_attention_backward(q, k, v, do, lse, delta, plan, dq, None, None, softmax_scale,
                              backward_parts(backward_kernel(q, k, v, do, plan, settings.backward_kernel),
                                             plan.block_size),
                              accumulate_dq=accumulate_dq, kernel_launch=settings.kernel_launch)


def step_backward_keys(backend: str, q, k, v, do, lse, delta, plan, dq, dk, dv, softmax_scale: float,
                       settings: Settings = AUTO) -> None:
    """The step's dK/dV, added into fp32 ``dk``/``dv``; before or after ``step_backward_queries``
    (they are independent). On the PyTorch path also dQ, added into ``dq``."""
    if backend == "triton":
        vs_attention_backward(q, k, v, do, lse, delta, plan, None, dk, dv, softmax_scale,
                              backward_parts(backward_kernel(q, k, v, do, plan, settings.backward_kernel),
                                             plan.block_size), kernel_launch=settings.kernel_launch)
    else:
        vs_attention_bwd_torch(q, k, v, do, lse, delta, plan, dq, dk, dv, softmax_scale)


def single_step_backward(backend: str, q, k, v, do, lse, delta, plan, softmax_scale: float,
                         settings: Settings = AUTO):
    """(dq, dk, dv) in the inputs' dtypes for a one-step attention. The Triton dQ kernel is then
    the only writer of each dq row and stores it directly in q's dtype: no fp32 dq buffer to
    fill, add into and cast (at 128K tokens and 16 heads, 1 GB of fp32)."""
    acc = delta.dtype
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc, device=q.device)
    if backend == "triton":
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        vs_attention_backward(q, k, v, do, lse, delta, plan, dq, dk, dv, softmax_scale,
                              backward_parts(backward_kernel(q, k, v, do, plan, settings.backward_kernel),
                                             plan.block_size),
                              accumulate_dq=False, kernel_launch=settings.kernel_launch)
    else:
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        step_backward(backend, q, k, v, do, lse, delta, plan, dq, dk, dv, softmax_scale, settings=settings)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _launchers(kernel: str, kernel_launch: tuple = ()) -> tuple:
    """The (dQ, key-block dK/dV, column dK/dV) launchers of one kernel family: the same arguments
    in ``triton_bwd.py`` and ``hopper_bwd.py``; the Triton ones take ``kernel_launch``
    (``Settings.kernel_launch``; the Hopper kernels' tiles are fixed)."""
    if kernel == "hopper":
        from .hopper_bwd import block_gradients_hopper, column_gradients_hopper, query_gradients_hopper  # Gluon

        return query_gradients_hopper, block_gradients_hopper, column_gradients_hopper
    from .triton_bwd import block_gradients_triton, column_gradients_triton, query_gradients_triton

    return tuple(functools.partial(launcher, kernel_launch=kernel_launch)
                 for launcher in (query_gradients_triton, block_gradients_triton, column_gradients_triton))


def _column_splits(nqb: int, programs_per_split: int, target: int) -> int:
    """Query-range splits per tile of the column capacity: about ``target`` column programs, to
    fill a large GPU (more splits: shorter programs, more fp32 partials to sum). At run time the
    programs are dealt to the live tiles, which then get more splits each (``column_partials``)."""
    return max(1, min(nqb, -(-target // max(1, programs_per_split))))


def vs_attention_backward(q, k, v, do, lse, delta, plan, dq, dk, dv, softmax_scale: float, parts: BackwardParts,
                          accumulate_dq: bool = True, kernel_launch: tuple = ()) -> None:
    """Add this plan's gradients into fp32 ``dq`` ``[b,hq,nq,d]`` and ``dk``/``dv`` ``[b,hkv,nk,d]``,
    each part (dQ, the key blocks' dK/dV, the columns' dK/dV) on the kernels ``parts`` names
    ("triton": ``triton_bwd.py``, "hopper": ``hopper_bwd.py``, sm_90; ``dispatch.backward_parts``).
    ``accumulate_dq=False`` (a single step) writes ``dq`` in its own dtype instead of adding.
    ``dq=None`` skips the dQ part, ``dk=dv=None`` the dK/dV parts (a ring step runs them apart).
    ``kernel_launch``: ``Settings.kernel_launch`` (the Triton kernels' launch settings).
    The column gradients go through fp32 partials per query-range split, summed in a fixed order
    (``column_partials``): the backward is deterministic on either kernels.

    ``lse`` and ``delta`` (fp32 ``[b, hq, nq]``, same strides) belong to the FINAL output.
    """
    b, hq, nq, d = q.shape
    B = plan.block_size
    nqb = nq // B
    max_v = plan.cols.shape[-1]
    qk_scale = softmax_scale * LOG2E
    if delta.stride() != lse.stride():
        delta = delta.contiguous()
        lse = lse.contiguous()
    int64 = int64_offsets(q, k, v, do, lse, delta, *(x for x in (dq, dk, dv) if x is not None), *plan_tensors(plan))
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
               v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2),
               lse.stride(0), lse.stride(1))
    cols, col_pos, words, diag, _ = column_arguments(plan)
    doc_start, doc_last, _, docs = document_arguments(plan)

    if dq is not None:
        query_gradients = _launchers(parts.query, kernel_launch)[0]
        query_gradients(q, k, v, do, lse, delta, dq, plan, accumulate_dq, int64, strides, qk_scale, softmax_scale)
    if dk is None:
        return
    block_gradients = _launchers(parts.blocks, kernel_launch)[1]
    block_gradients(q, k, v, do, lse, delta, dk, dv, plan, doc_start, doc_last, docs, int64, strides, qk_scale,
                    softmax_scale)

    if max_v == 0:
        return
    # The column tiles' width: the Hopper kernel's 64-row tile, or the Triton kernel's BLOCK_COL.
    block_col = HOPPER_TILE if parts.columns == "hopper" else tile_config(B, q.dtype, "bwd", kernel_launch)["BLOCK_COL"]
    n_tiles = -(-max_v // block_col)
    splits = _column_splits(nqb, n_tiles * b * hq, tile_config(B, q.dtype, "bwd", kernel_launch)["COLUMN_PROGRAMS"])
    q_first = first_query_blocks(plan, block_col)
    q_end = query_block_ends(plan, block_col) if docs else q_first  # read only with DOCS
    # n_tiles x splits programs per head, dealt out to its live tiles (``column_partials``).
    dk_part, dv_part = empty_column_partials(b, hq, n_tiles, splits, block_col, d, q.device)
    head_diag = diag.amax(-1).contiguous()
    column_gradients = _launchers(parts.columns, kernel_launch)[2]
    column_gradients(q, k, v, do, lse, delta, dk_part, dv_part, plan, cols, col_pos, words, head_diag, q_first, q_end,
                     doc_start, docs, int64, strides, qk_scale, softmax_scale, splits)
    add_column_partials(dk_part, dv_part, plan.col_count, plan.cols, dk, dv)
