"""Host-side helpers shared by every kernel family (Triton, Gluon/Hopper, PyTorch): constants, the
interpreter flag, the int64-offset test, and the plan's tensors as kernel arguments. No Triton
import here, so ``dispatch.py`` can read it on any machine.
"""

from __future__ import annotations

import math

import torch

from ..config import interpreting as _interpreting_at_start

LN2 = math.log(2.0)
LOG2E = 1.0 / LN2


# Triton's own switch, read once at start-up (config.ENVIRONMENT): Triton reads it itself where a
# kernel is defined (``triton.jit``, at import), so a value set later would not change Triton either.
INTERPRETING = _interpreting_at_start()


def interpreting() -> bool:
    """Whether Triton runs its CPU interpreter (TRITON_INTERPRET=1 at start-up)."""
    return INTERPRETING


# Rows (and keys) of the Hopper kernels' tiles: one warpgroup's m64 wgmma (``hopper_common.TILE``).
HOPPER_TILE = 64


def max_element_offset(x: torch.Tensor) -> int:
    """Offset of the last element from the first: the largest offset a kernel computes into ``x``."""
    return sum((size - 1) * stride for size, stride in zip(x.shape, x.stride()) if size > 0)


def int64_offsets(*tensors: torch.Tensor) -> bool:
    """The kernels' INT64 flag: whether an element offset into one of these tensors can pass
    2^31 - 1 (a [b, heads, s, d] view of Megatron's [s, b, heads, d] spans the whole tensor). Only
    then are offsets computed in int64: that costs the forward ~26% and the backward ~13% at
    64-token blocks (~2% at 128; H100), and int32 ones provably suffice everywhere else."""
    return any(max_element_offset(x) >= 2 ** 31 for x in tensors)


def plan_tensors(plan) -> tuple:
    """The plan's tensors that the kernels index per (batch, head) row, for ``int64_offsets``."""
    return plan.kv_blocks, plan.q_blocks, plan.cols, plan.col_pos, plan.col_limit, plan.col_start, *plan.column_words


def document_arguments(plan) -> tuple:
    """(doc_start, block_last_start, col_start, DOCS) for the kernels' packed-document masks.
    Without documents the kernels never read the first two (compiled out), but Triton wants
    storage behind every pointer."""
    docs = plan.documents
    if docs is None:
        return plan.q_block_ids, plan.q_block_ids, plan.col_start, False
    return docs.doc_start, docs.block_last_start, plan.col_start, True


def column_arguments(plan) -> tuple:
    """(cols, col_pos, words, diag, words per query block) for the kernels' column part. With no
    column capacity the kernels never read the tensors, but Triton wants storage behind every
    pointer."""
    words, diag = plan.column_words
    n_words = words.shape[-1]
    if plan.cols.shape[-1] == 0:
        return plan.col_count, plan.col_count, diag, diag, n_words
    return plan.cols, plan.col_pos, words, diag, n_words
