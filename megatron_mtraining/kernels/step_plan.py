"""Per-step index conversion (docs/design.md §5): VSIndex -> block lists for one (query chunk, key chunk).

A chunk is described by the global block id of each of its local blocks (``q_block_ids`` /
``k_block_ids``): local block ``i`` holds global tokens ``ids[i]*B .. ids[i]*B + B-1``. The
single-device case is ``arange(N/B)`` for both; a ring step passes this rank's blocks and the
source rank's blocks, whatever the layout.

The conversion yields, per (batch, query head):
  kv_count/kv_blocks [b, hq, nqb(, max_s)]  local key blocks each local query block reads through
                                            its slash offsets, in ascending global order (the
                                            diagonal block last);
  q_count/q_blocks   [b, hq, nkb(, max_s)]  the transpose: local query blocks reading each key block;
  col_count/cols     [b, hq(, max_v)]       selected columns owned by the key chunk, as local
                                            key-token indices, in the index's (ascending global)
                                            order.
Entries past a count are 0. ``convert_step_reference`` is the readable PyTorch definition;
``csrc/`` holds the C++ and CUDA versions, which must return identical tensors.
Two bounds derived in PyTorch keep the kernels off causally dead column work:
``StepPlan.col_limit`` (the columns a query block walks) and ``first_query_blocks`` (the query
blocks a column tile's gradient walks); ``StepPlan.column_words`` says which of the walked
columns each query block sees (``column_words.py``).

Packed documents (``documents.DocumentBlocks``) add lower bounds of the same kind: key blocks before
a query block's first document leave the slash lists in the conversion (``key_block_floor``),
``StepPlan.col_start`` skips the leading columns of earlier documents, and ``query_block_ends``
stops a column tile's gradient at the last query block of its columns' documents.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch

from .. import _ext
from ..block_index import BlockIndex
from ..documents import DocumentBlocks
from ..index import VSIndex
from .block_plan import compact, convert_block_step, inverse_map
from .column_words import column_words_reference, column_words_triton
from .dispatch import column_words_kernel, conversion_impl


def convert_step_reference(slash, n_slash, vertical, n_vertical, q_block_ids, k_block_ids,
                           num_blocks: int, block_size: int, key_block_floor: Optional[torch.Tensor] = None):
    """PyTorch definition of the per-step conversion; returns the six tensors in module order.
    ``key_block_floor`` (packed documents, ``documents.DocumentBlocks``): int32 ``[num_blocks]``, per
    global query block the first key block that shares a document with it; earlier blocks drop."""
    B = block_size
    # Without documents every key block is at or above block 0.
    floor = key_block_floor.long() if key_block_floor is not None else \
        torch.zeros(num_blocks, dtype=torch.long, device=slash.device)
    inv_q = inverse_map(q_block_ids, num_blocks)
    inv_k = inverse_map(k_block_ids, num_blocks)
    max_s = slash.shape[-1]
    # A negative offset would put a key block after its query block; the kernels mask the
    # diagonal block only, so such entries are dropped here (VSIndex.validate rejects them, but
    # it runs on CPU indices only: checking a GPU index would synchronise).
    s_valid = (torch.arange(max_s, device=slash.device) < n_slash[..., None]) & (slash >= 0)

    # Query block i reads key block qb - delta, for each selected delta (largest delta first).
    rev_slash, rev_valid = slash.flip(-1).long(), s_valid.flip(-1)
    kb = q_block_ids.long()[None, None, :, None] - rev_slash[:, :, None, :]
    ok = rev_valid[:, :, None, :] & (kb >= 0) & (kb < num_blocks)
    ok &= kb >= floor[q_block_ids.long()][None, None, :, None]
    local_k = inv_k[torch.where(ok, kb, num_blocks)]
    kv_count, kv_blocks = compact(local_k, ok & (local_k >= 0), max_s)

    # Key block j is read by query block kb + delta, for each selected delta (smallest first).
    qb = k_block_ids.long()[None, None, :, None] + slash.long()[:, :, None, :]
    ok = s_valid[:, :, None, :] & (qb >= 0) & (qb < num_blocks)
    ok &= floor[qb.clamp(0, num_blocks - 1)] <= k_block_ids.long()[None, None, :, None]
    local_q = inv_q[torch.where(ok, qb, num_blocks)]
    q_count, q_blocks = compact(local_q, ok & (local_q >= 0), max_s)

    # Columns owned by the key chunk, as local key-token indices.
    max_v = vertical.shape[-1]
    v_valid = torch.arange(max_v, device=vertical.device) < n_vertical[..., None]
    col = vertical.long()
    col_block = torch.where(v_valid & (col >= 0) & (col < num_blocks * B), col // B, num_blocks)
    local_blk = inv_k[col_block]
    col_count, cols = compact(local_blk * B + col % B, v_valid & (local_blk >= 0), max_v)
    return kv_count, kv_blocks, q_count, q_blocks, col_count, cols


def convert_step(slash, n_slash, vertical, n_vertical, q_block_ids, k_block_ids, num_blocks: int,
                 block_size: int, impl: str = "auto", key_block_floor: Optional[torch.Tensor] = None):
    """Per-step conversion through the compiled extension when it has this device, else PyTorch
    (``dispatch.conversion_impl``)."""
    chosen = conversion_impl(impl, slash.device)
    args = (slash, n_slash, vertical, n_vertical, q_block_ids.to(torch.int32), k_block_ids.to(torch.int32))
    if chosen == "ext":
        return tuple(_ext.module().convert_step(*args, int(num_blocks), int(block_size), key_block_floor))
    return convert_step_reference(*args, num_blocks, block_size, key_block_floor)


def column_positions(cols: torch.Tensor, col_count: torch.Tensor, k_block_ids: torch.Tensor, num_blocks: int,
                     block_size: int) -> torch.Tensor:
    """Global position of each column slot ``[b, hq, max_v]`` (int64); empty slots hold
    ``num_blocks * block_size``, after every query."""
    B = block_size
    c = cols.long()
    pos = k_block_ids.long()[c // B] * B + c % B
    slot_ok = torch.arange(cols.shape[-1], device=cols.device) < col_count[..., None]
    return torch.where(slot_ok, pos, num_blocks * B)


def column_limits(col_pos: torch.Tensor, q_block_ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """int32 ``[b, hq, nqb]``: how many leading column slots local query block ``i`` must walk.
    Every slot at or past the limit is after the block's last query. With ``suffix_min[j]`` the
    earliest position among slots ``j..``, slot ``j`` is needed iff ``suffix_min[j] <= last``;
    ``suffix_min`` never decreases, so the limit is a binary search, for any chunk order (the
    layouts' ascending block ids make ``suffix_min`` the positions themselves)."""
    if col_pos.shape[-1] == 0:
        return torch.zeros(*col_pos.shape[:-1], q_block_ids.numel(), dtype=torch.int32, device=col_pos.device)
    suffix_min = col_pos.flip(-1).cummin(-1).values.flip(-1).contiguous()
    last_query = (q_block_ids.long() * block_size + block_size - 1).expand(*col_pos.shape[:-1], -1).contiguous()
    return torch.searchsorted(suffix_min, last_query, right=True).to(torch.int32)


def column_starts(col_pos: torch.Tensor, q_block_ids: torch.Tensor, documents, block_size: int) -> torch.Tensor:
    """int32 ``[b, hq, nqb]`` (packed documents): how many leading column slots local query block
    ``i`` may skip because they hold columns of earlier documents than any of its queries'. With
    ``prefix_max[j]`` the latest position among slots ``..j``, slots ``..j`` are all before the
    block's first document iff ``prefix_max[j]`` is; ``prefix_max`` never decreases, so this is a
    binary search too. Zero without documents."""
    nqb = q_block_ids.numel()
    if documents is None or col_pos.shape[-1] == 0:
        return torch.zeros(*col_pos.shape[:-1], nqb, dtype=torch.int32, device=col_pos.device)
    prefix_max = col_pos.cummax(-1).values.contiguous()
    first_doc = documents.doc_start[q_block_ids.long() * block_size].long()
    return torch.searchsorted(prefix_max, first_doc.expand(*col_pos.shape[:-1], -1).contiguous()).to(torch.int32)


def first_query_blocks(plan: "StepPlan", block_col: int) -> torch.Tensor:
    """int32 ``[b * hq, column tiles of block_col]``: per column tile, the first local query block
    that can see one of its columns. Earlier blocks (by the running maximum of their last
    positions, so any chunk order works) end before the tile's earliest column; empty tiles get
    ``nqb``."""
    B = plan.block_size
    bh, max_v = plan.col_pos.shape[0] * plan.col_pos.shape[1], plan.col_pos.shape[-1]
    n_tiles = -(-max_v // block_col)
    col_pos = torch.nn.functional.pad(plan.col_pos.reshape(bh, max_v), (0, n_tiles * block_col - max_v),
                                      value=plan.num_blocks * B)  # padding slots: after every query
    tile_first = col_pos.view(bh, n_tiles, block_col).amin(-1).contiguous()
    last_query = torch.cummax(plan.q_block_ids.long() * B + B - 1, 0).values
    return torch.searchsorted(last_query, tile_first).to(torch.int32)


def query_block_ends(plan: "StepPlan", block_col: int) -> torch.Tensor:
    """int32 ``[b * hq, column tiles of block_col]`` (packed documents): per column tile, one past
    the last local query block that shares a document with one of its columns. Later blocks (by
    the suffix minimum of their first queries' document starts, so any chunk order works) start
    their documents after the tile's latest column. ``nqb`` without documents."""
    B, nqb = plan.block_size, plan.q_block_ids.numel()
    bh, max_v = plan.col_pos.shape[0] * plan.col_pos.shape[1], plan.col_pos.shape[-1]
    n_tiles = -(-max_v // block_col)
    if plan.documents is None:
        return torch.full((bh, n_tiles), nqb, dtype=torch.int32, device=plan.col_pos.device)
    col_pos = torch.nn.functional.pad(plan.col_pos.reshape(bh, max_v), (0, n_tiles * block_col - max_v), value=-1)
    slot_ok = col_pos < plan.num_blocks * B  # empty slots hold num_blocks * B: not a column
    tile_last = torch.where(slot_ok, col_pos, -1).view(bh, n_tiles, block_col).amax(-1).contiguous()
    first_doc = plan.documents.doc_start[plan.q_block_ids.long() * B].long()
    suffix_min = first_doc.flip(0).cummin(0).values.flip(0).contiguous()
    return torch.searchsorted(suffix_min, tile_last, right=True).to(torch.int32)


@dataclasses.dataclass
class StepPlan:
    """Everything the kernels need for one (query chunk, key chunk) pair; fixed shapes."""

    index: Union[VSIndex, BlockIndex]
    num_blocks: int               # global blocks in the full sequence
    q_block_ids: torch.Tensor     # int32 [nqb]
    k_block_ids: torch.Tensor     # int32 [nkb]
    slash_bitmap: torch.Tensor    # int8 [b, hq, num_blocks] (global, shared by all steps)
    kv_count: torch.Tensor
    kv_blocks: torch.Tensor
    q_count: torch.Tensor
    q_blocks: torch.Tensor
    col_count: torch.Tensor
    cols: torch.Tensor
    col_pos: torch.Tensor = None    # int64 [b, hq, max_v] (``column_positions``)
    col_limit: torch.Tensor = None  # int32 [b, hq, nqb] (``column_limits``)
    documents: Optional[DocumentBlocks] = None  # packed documents (``documents.DocumentBlocks``), or None
    col_start: torch.Tensor = None  # int32 [b, hq, nqb] (``column_starts``)
    _column_words: tuple = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.col_pos is None:
            self.col_pos = column_positions(self.cols, self.col_count, self.k_block_ids, self.num_blocks,
                                            self.block_size)
        if self.col_limit is None:
            self.col_limit = column_limits(self.col_pos, self.q_block_ids, self.block_size)
        if self.col_start is None:
            self.col_start = column_starts(self.col_pos, self.q_block_ids, self.documents, self.block_size)

    @property
    def block_size(self) -> int:
        return self.index.block_size

    @property
    def column_words(self) -> tuple:
        """(words, diag) of ``column_words.py``: which column slots each query block sees. Made on
        first use (only the Triton kernels need it) and kept for the step's other kernels."""
        if self._column_words is None:
            # Through Triton on a GPU, in PyTorch elsewhere (CPU tests, the interpreter).
            args = (self.col_pos, self.q_block_ids.to(torch.int32), self.slash_bitmap, self.block_size, self.documents)
            if column_words_kernel(self.col_pos.device) == "triton":
                self._column_words = column_words_triton(*args, col_count=self.col_count)
            else:
                self._column_words = column_words_reference(*args)
        return self._column_words

    @property
    def cu_seqlens(self) -> Optional[torch.Tensor]:
        return None if self.documents is None else self.documents.cu_seqlens

    def positions(self, block_ids: torch.Tensor) -> torch.Tensor:
        B = self.block_size
        return (block_ids.long()[:, None] * B + torch.arange(B, device=block_ids.device)).reshape(-1)

    @property
    def q_positions(self) -> torch.Tensor:
        return self.positions(self.q_block_ids)

    @property
    def k_positions(self) -> torch.Tensor:
        return self.positions(self.k_block_ids)


def build_step_plan(index: Union[VSIndex, BlockIndex], q_block_ids: torch.Tensor, k_block_ids: torch.Tensor,
                    num_blocks: int, slash_bitmap: Optional[torch.Tensor] = None, impl: str = "auto",
                    documents: Optional[DocumentBlocks] = None) -> StepPlan:
    """Convert ``index`` (a ``VSIndex``, or a ``BlockIndex``: ``block_plan.py``) for one step. Pass
    ``slash_bitmap`` to reuse it across the steps of a ring;
    ``documents`` (``documents.DocumentBlocks`` of the global sequence) for packed documents."""
    dev = index.device
    q_block_ids = q_block_ids.to(device=dev, dtype=torch.int32)
    k_block_ids = k_block_ids.to(device=dev, dtype=torch.int32)
    if slash_bitmap is None:
        slash_bitmap = index.slash_bitmap(num_blocks)
    floor = None if documents is None else documents.key_block_floor
    if isinstance(index, BlockIndex):  # PyTorch on every device: the extension converts slash/columns only
        if impl not in ("auto", "torch"):
            raise ValueError(f"build_step_plan: a BlockIndex is converted in PyTorch only (impl 'auto' or 'torch'), "
                             f"got impl={impl!r}")
        parts = convert_block_step(index.key_blocks, index.n_key_blocks, q_block_ids, k_block_ids, num_blocks,
                                   key_block_floor=floor)
    else:
        parts = convert_step(index.slash, index.n_slash, index.vertical, index.n_vertical, q_block_ids,
                             k_block_ids, num_blocks, index.block_size, impl=impl, key_block_floor=floor)
    return StepPlan(index, int(num_blocks), q_block_ids, k_block_ids, slash_bitmap, *parts, documents=documents)


def single_device_plan(index: Union[VSIndex, BlockIndex], seq_len: int, impl: str = "auto",
                       documents: Optional[DocumentBlocks] = None) -> StepPlan:
    """The plan of the full causal sequence on one device."""
    nb = seq_len // index.block_size
    ids = torch.arange(nb, dtype=torch.int32, device=index.device)
    return build_step_plan(index, ids, ids, nb, impl=impl, documents=documents)
