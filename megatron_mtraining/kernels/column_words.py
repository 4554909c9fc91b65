"""Which column slots each query block sees, as 64-bit masks (``StepPlan.column_words``).

A column slot is live for a query block when it holds a column, its key block is not after the
query block, and that key block is not already read through a selected slash offset of the query
block (it would count twice). The kernels used to decide this per column and per tile with a
chain of three dependent gathers (column -> its key block -> the slash bitmap); a profile of the
forward put the column tiles at ~2.8x the instructions of a slash tile. Here the decision is made
once per step, for all kernels of the step, and a column tile reads one word.

  words [b, hq, nqb, n_words] int64  bit s of word w: slot ``w * 64 + s`` is live for the block
  diag  [b, hq, nqb] int8            1 where a live column lies in the query block's own key
                                     block, so the token-level causal test is needed there

``diag`` is 0 for every valid index (offset 0, the diagonal, is mandatory and covers the block's
own columns); it keeps the kernels exact for an index that lacks offset 0.

Packed documents: a slot is live only if its column is not before the document of the block's
first query, and ``diag`` is also 1 where a live column precedes the document of the block's
last query (the block straddles a boundary: the token-level test then checks documents too).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import int64_offsets
from .triton_common import wide

WORD_BITS = 64


def column_word_count(max_v: int) -> int:
    return -(-max_v // WORD_BITS)


def column_words_reference(col_pos: torch.Tensor, q_block_ids: torch.Tensor, slash_bitmap: torch.Tensor,
                           block_size: int, documents=None):
    """PyTorch definition: (words, diag) from the plan's column positions (empty slots hold a
    position after every query), the query chunk's global block ids, the slash bitmap and the
    optional ``documents.DocumentBlocks``."""
    b, hq, max_v = col_pos.shape
    nqb, nb = q_block_ids.numel(), slash_bitmap.shape[-1]
    n_words = column_word_count(max_v)
    pos = torch.nn.functional.pad(col_pos, (0, n_words * WORD_BITS - max_v), value=nb * block_size)
    delta = q_block_ids.long().view(1, 1, nqb, 1) - (pos // block_size)[:, :, None, :]  # [b, hq, nqb, slots]
    covered = torch.gather(slash_bitmap.long()[:, :, None, :].expand(b, hq, nqb, nb), -1,
                           delta.clamp(0, nb - 1)) != 0
    live = (delta >= 0) & ~covered
    needs_token_test = delta == 0
    if documents is not None:
        q_blk = q_block_ids.long().view(1, 1, nqb, 1)
        live &= pos[:, :, None, :] >= documents.block_first_start.long()[q_blk]
        needs_token_test = needs_token_test | (pos[:, :, None, :] < documents.block_last_start.long()[q_blk])
    bits = torch.ones((), dtype=torch.long, device=col_pos.device) << torch.arange(WORD_BITS, device=col_pos.device)
    # Distinct powers of two never carry, so the sum is the bitwise or (bit 63 wraps to the sign).
    words = (live.long().view(b, hq, nqb, n_words, WORD_BITS) * bits).sum(-1)
    diag = (live & needs_token_test).any(-1).to(torch.int8)
    return words.contiguous(), diag.contiguous()


@triton.jit
def _column_words_kernel(ColPos, ColCnt, QBlk, Bitmap, FirstDoc, LastDoc, Words, Diag, MAX_V, NQB, NB, N_WORDS,
                         BLOCK: tl.constexpr, WORDS_PER_ITER: tl.constexpr, QUERY_BLOCKS: tl.constexpr,
                         INT64: tl.constexpr, DOCS: tl.constexpr, COUNTS: tl.constexpr):
    pid_q = tl.program_id(0)
    bh = wide(tl.program_id(1), INT64)  # times the rows' lengths
    bit = tl.arange(0, 64)
    one = tl.full([WORDS_PER_ITER, 64], 1, tl.int64)
    diag = tl.zeros([QUERY_BLOCKS], tl.int32)
    # Words past the head's columns (a ring step holds ~1/W of the capacity) are zero: stored
    # without the gathers.
    if COUNTS:
        live_words = tl.cdiv(tl.load(ColCnt + bh), 64 * WORDS_PER_ITER) * WORDS_PER_ITER
    else:
        live_words = N_WORDS
    empty = tl.zeros([WORDS_PER_ITER], tl.int64)
    for w0 in range(live_words, N_WORDS, WORDS_PER_ITER):
        word = w0 + tl.arange(0, WORDS_PER_ITER)
        for qi in range(0, QUERY_BLOCKS):
            i = pid_q * QUERY_BLOCKS + qi
            if i < NQB:
                tl.store(Words + (bh * NQB + i) * N_WORDS + word, empty, mask=word < N_WORDS)
    # Each program serves QUERY_BLOCKS query blocks, so each chunk of column positions is read
    # once for all of them, and WORDS_PER_ITER words at a time, so the gathers overlap.
    for w0 in range(0, tl.minimum(live_words, N_WORDS), WORDS_PER_ITER):
        word = w0 + tl.arange(0, WORDS_PER_ITER)
        slot = word[:, None] * 64 + bit[None, :]
        pos = tl.load(ColPos + bh * MAX_V + slot, mask=slot < MAX_V, other=NB * BLOCK)
        c_blk = (pos // BLOCK).to(tl.int32)
        for qi in range(0, QUERY_BLOCKS):
            i = pid_q * QUERY_BLOCKS + qi
            if i < NQB:
                q_blk = tl.load(QBlk + i)
                delta = q_blk - c_blk
                covered = tl.load(Bitmap + bh * NB + delta, mask=delta >= 0, other=1)
                live = (delta >= 0) & (covered == 0)
                token_test = delta == 0
                if DOCS:
                    live = live & (pos >= tl.load(FirstDoc + q_blk))
                    token_test = token_test | (pos < tl.load(LastDoc + q_blk))
                tl.store(Words + (bh * NQB + i) * N_WORDS + word,
                         tl.sum(tl.where(live, one << bit[None, :].to(tl.int64), 0), 1), mask=word < N_WORDS)
                in_block = tl.max(tl.max((live & token_test).to(tl.int32), 1), 0)
                diag = tl.maximum(diag, tl.where(tl.arange(0, QUERY_BLOCKS) == qi, in_block, 0))
    rows = pid_q * QUERY_BLOCKS + tl.arange(0, QUERY_BLOCKS)
    tl.store(Diag + bh * NQB + rows, diag.to(tl.int8), mask=rows < NQB)


def column_words_triton(col_pos: torch.Tensor, q_block_ids: torch.Tensor, slash_bitmap: torch.Tensor,
                        block_size: int, documents=None, col_count=None):
    """The same as ``column_words_reference``; one program per (8 query blocks, batch x head).
    ``col_count`` (int32 ``[b, hq]``, the plan's): the words past a head's columns are zeroed
    without reading their positions (empty slots are never live)."""
    b, hq, max_v = col_pos.shape
    nqb, nb = q_block_ids.numel(), slash_bitmap.shape[-1]
    n_words = column_word_count(max_v)
    words = torch.empty(b, hq, nqb, n_words, dtype=torch.int64, device=col_pos.device)
    diag = torch.empty(b, hq, nqb, dtype=torch.int8, device=col_pos.device)
    if words.numel() == 0:
        diag.zero_()
        return words, diag
    col_pos, slash_bitmap = col_pos.contiguous(), slash_bitmap.contiguous()
    query_blocks = 8
    # Without documents the kernel never reads the document pointers; Triton wants storage there.
    first, last = (documents.block_first_start, documents.block_last_start) if documents is not None \
        else (q_block_ids, q_block_ids)
    counts = col_count.contiguous() if col_count is not None else q_block_ids  # (storage; COUNTS=False)
    _column_words_kernel[(triton.cdiv(nqb, query_blocks), b * hq)](
        col_pos, counts, q_block_ids, slash_bitmap, first, last, words, diag, max_v, nqb, nb, n_words,
        BLOCK=block_size, WORDS_PER_ITER=min(16, triton.next_power_of_2(n_words)), QUERY_BLOCKS=query_blocks,
        INT64=int64_offsets(col_pos, slash_bitmap, words), DOCS=documents is not None,
        COUNTS=col_count is not None, num_warps=4)
    return words, diag
