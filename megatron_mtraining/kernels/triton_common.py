"""What the Triton kernels (``triton_fwd``, ``triton_bwd``, ``triton_delta``, ``column_words``,
``triton_approx``) share: compile-time flags, tile shapes and launch settings, and the
``@triton.jit`` helpers for offsets, column tiles and the causal / document masks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import interpreting

def kernel_flags(dtype: torch.dtype) -> dict:
    """Compile-time flags shared by all kernels for an input dtype."""
    return dict(
        # Triton's CPU interpreter multiplies bf16 tiles wrongly: compute in fp32 there.
        UPCAST=interpreting() and dtype == torch.bfloat16,
        # fp32 inputs get full-precision products (tf32 would cost ~3e-4 relative error).
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
    )


def tile_config(block: int, dtype: torch.dtype, family: str = "fwd", kernel_launch: tuple = ()) -> dict:
    """Tile shapes and launch settings. Tiles divide the index block: a 128-block runs as 64-row
    tiles where 128-row fp32 tiles would not fit in shared memory. ``kernel_launch``: the call's
    ``Settings.kernel_launch``, whose ``family`` entry replaces these defaults (benchmarks)."""
    tile = min(block, 64) if dtype == torch.float32 else min(block, 128)
    cfg = dict(BLOCK_M=tile, BLOCK_N=tile, BLOCK_COL=min(tile, 64),
               num_warps=8 if tile >= 128 else 4,
               num_stages=1 if (tile >= 128 or dtype == torch.float32) else 2,
               MASK_EVERY_TILE=False,
               COLUMN_PROGRAMS=1024)  # backward's column-gradient kernel: programs to aim for
    cfg.update(dict(kernel_launch).get(family, ()))
    if 64 % cfg["BLOCK_COL"]:
        raise ValueError(f"tile_config: BLOCK_COL {cfg['BLOCK_COL']} must divide 64 (a column tile reads one "
                         "64-bit column word)")
    return cfg


@triton.jit
def wide(x, INT64: tl.constexpr):
    """``x`` (an index that multiplies a stride) in int64 when offsets can pass 2^31 (``int64_offsets``)."""
    if INT64:
        x = tl.cast(x, tl.int64)  # tl.cast: the interpreter's loop indices are Python ints
    return x


@triton.jit
def head_offset(b, h, stride_b, stride_h, INT64: tl.constexpr):
    """Offset of (batch ``b``, head ``h``)."""
    return wide(b, INT64) * stride_b + wide(h, INT64) * stride_h


@triton.jit
def tile_ptrs(base, rows, stride, offs_d, INT64: tl.constexpr):
    """Pointers of the [rows, d] tile of the (batch, head) at ``base``."""
    return base + wide(rows, INT64)[:, None] * stride + offs_d[None, :]


@triton.jit
def word_bits(word, first, COUNT: tl.constexpr):
    """Bits ``first .. first + COUNT - 1`` of a 64-bit column word, as booleans."""
    return ((word >> (tl.arange(0, COUNT) + first).to(tl.int64)) & 1) != 0


@triton.jit
def column_tile(Cols, Words, k_base, v_base, col_row, word_row, c0, n_cols, stride_kn, stride_vn, offs_d,
                BLOCK_COL: tl.constexpr, INT64: tl.constexpr, UPCAST: tl.constexpr):
    """Gather one tile of the plan's columns: K, V and which columns are live for the query block
    (one word of the step's column words, instead of a gather chain per column)."""
    tl.static_assert(64 % BLOCK_COL == 0, "a column tile must lie within one 64-bit word")
    offs_c = c0 + tl.arange(0, BLOCK_COL)
    # Past the limit: row 0, never live (its p is 0; only a non-finite row 0 would leak, as any
    # gathered non-live column would).
    col = tl.load(Cols + col_row + offs_c, mask=offs_c < n_cols, other=0)
    live = word_bits(tl.load(Words + word_row + c0 // 64), c0 % 64, BLOCK_COL)
    k = tl.load(tile_ptrs(k_base, col, stride_kn, offs_d, INT64))
    v = tl.load(tile_ptrs(v_base, col, stride_vn, offs_d, INT64))
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v, live


@triton.jit
def causal_columns(x, fill, ColPos, col_row, c0, n_cols, q_pos, q_doc, BLOCK_COL: tl.constexpr,
                   DOCS: tl.constexpr):
    """``x`` with ``fill`` where a column is after the query (or, with DOCS, before the query's
    document ``q_doc``): needed only where a live column shares the query block or the block
    straddles a document boundary (``column_words``' diag), so the kernels run a separate copy of
    their column loop there."""
    offs_c = c0 + tl.arange(0, BLOCK_COL)
    c_pos = tl.load(ColPos + col_row + offs_c, mask=offs_c < n_cols, other=0)
    keep = c_pos[None, :] <= q_pos[:, None]
    if DOCS:
        keep = keep & (c_pos[None, :] >= q_doc[:, None])
    return tl.where(keep, x, fill)


@triton.jit
def token_mask(k_pos, q_pos, q_doc, DOCS: tl.constexpr):
    """[queries, keys] pairs that are causal (and, with DOCS, in the query's document)."""
    keep = k_pos[None, :] <= q_pos[:, None]
    if DOCS:
        keep = keep & (k_pos[None, :] >= q_doc[:, None])
    return keep


@triton.jit
def needs_token_mask(k_blk, q_blk, doc_mask_below, BLOCK: tl.constexpr, DOCS: tl.constexpr):
    """Whether a key block needs the token-level mask for this query block: the diagonal block,
    and, with DOCS, key blocks that start before the document of the block's last query."""
    needs = k_blk == q_blk
    if DOCS:
        needs = needs | (k_blk * BLOCK < doc_mask_below)
    return needs


@triton.jit
def token_mask_t(k_pos, q_pos, q_doc, DOCS: tl.constexpr):
    """``token_mask`` key-major ([keys, queries]), for the backward's key-side kernels."""
    keep = k_pos[:, None] <= q_pos[None, :]
    if DOCS:
        keep = keep & (k_pos[:, None] >= q_doc[None, :])
    return keep


@triton.jit
def document_starts(DocStart, q_pos, DOCS: tl.constexpr):
    """The document start of each query row (DOCS); without documents, a placeholder never read."""
    if DOCS:
        return tl.load(DocStart + q_pos)
    else:
        return q_pos


@triton.jit
def query_documents(DocStart, DocLast, q_pos, q_blk, DOCS: tl.constexpr):
    """(document start per query row, the block's token-mask bound); unused without DOCS."""
    if DOCS:
        return tl.load(DocStart + q_pos), tl.load(DocLast + q_blk)
    else:
        return q_pos, q_blk


@triton.jit
def column_begin(ColStart, plan_row, BLOCK_COL: tl.constexpr, DOCS: tl.constexpr):
    """First column slot a query block walks, on a tile boundary (DOCS: past earlier documents)."""
    if DOCS:
        return (tl.load(ColStart + plan_row) // BLOCK_COL) * BLOCK_COL
    else:
        return 0
