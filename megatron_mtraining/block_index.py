"""BlockIndex: a block-sparse index (docs/design.md §1-2), plain data with fixed shapes.

For batch element ``b``, query head ``h`` and global query block ``i`` (tokens ``i*B .. i*B+B-1``):
``key_blocks[b, h, i, :n_key_blocks[b, h, i]]`` are the global key blocks it attends, strictly
ascending and ending with ``i`` itself (the diagonal block, causal inside it). Query ``n``
attends key ``m`` iff ``m <= n`` and ``m // B`` is one of the key blocks of ``(b, h, n // B)``.
Entries past a count are padding and are never read.

The index covers the whole sequence (one row per global query block), so it is built for one
sequence length; every ring step takes the key blocks of its source chunk from it
(``kernels/block_plan.py``). Patterns of this kind: MoBA's gated key blocks, XAttention's
antidiagonal-scored blocks, any FlexAttention ``BlockMask`` (``from_block_mask``).
"""

from __future__ import annotations

from typing import Optional

import torch

from .index import VSIndex, value_checks


def _is_power_of_two(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


def _pack(valid: torch.Tensor, capacity: int):
    """(counts int32 [...], ids int32 [..., capacity]): the positions along the last dim where
    ``valid`` holds, ascending, padded with 0; entries past ``capacity`` drop."""
    n = valid.shape[-1]
    slot = torch.cumsum(valid, -1, dtype=torch.int32) - 1
    target = torch.where(valid & (slot < capacity), slot, capacity).long()
    ids = torch.arange(n, dtype=torch.int32, device=valid.device).expand_as(valid)
    out = torch.zeros(*valid.shape[:-1], capacity + 1, dtype=torch.int32, device=valid.device)
    out.scatter_(-1, target, ids * valid)
    counts = valid.sum(-1, dtype=torch.int32).clamp_(max=capacity)
    return counts, out[..., :capacity].contiguous()


class BlockIndex:
    """Per-(batch, query head, query block) key block lists, int32, fixed shapes."""

    __slots__ = ("key_blocks", "n_key_blocks", "block_size")

    def __init__(self, key_blocks: torch.Tensor, n_key_blocks: torch.Tensor, block_size: int = 64):
        self.key_blocks = key_blocks
        self.n_key_blocks = n_key_blocks
        self.block_size = int(block_size)
        self.check_structure()

    # ------------------------------------------------------------------ checks
    def check_structure(self) -> None:
        """Shape, dtype and device checks; no host synchronisation, so safe on hot paths."""
        for name in ("key_blocks", "n_key_blocks"):
            x = getattr(self, name)
            if not isinstance(x, torch.Tensor):
                raise ValueError(f"BlockIndex.{name} must be a torch.Tensor, got {type(x).__name__}")
            if x.dtype != torch.int32:
                raise ValueError(f"BlockIndex.{name} must be int32, got {x.dtype}")
        if self.key_blocks.dim() != 4:
            raise ValueError("BlockIndex.key_blocks must be [batch, heads, query blocks, capacity], got "
                             f"{tuple(self.key_blocks.shape)}")
        if tuple(self.n_key_blocks.shape) != tuple(self.key_blocks.shape[:3]):
            raise ValueError(f"BlockIndex.n_key_blocks has shape {tuple(self.n_key_blocks.shape)}, expected "
                             f"{tuple(self.key_blocks.shape[:3])} (batch, heads, query blocks)")
        if self.key_blocks.shape[3] < 1:
            raise ValueError("BlockIndex.key_blocks needs capacity >= 1 (the diagonal block is mandatory)")
        if self.key_blocks.device != self.n_key_blocks.device:
            raise ValueError(f"BlockIndex tensors must share one device, got {self.key_blocks.device} and "
                             f"{self.n_key_blocks.device}")
        if not _is_power_of_two(self.block_size) or self.block_size < 16:
            raise ValueError(f"BlockIndex.block_size must be a power of two >= 16, got {self.block_size}")

    def check_matches(self, batch: int, q_heads: int) -> None:
        """Cheap check that the index was built for this batch size and head count."""
        if tuple(self.key_blocks.shape[:2]) != (batch, q_heads):
            raise ValueError(f"BlockIndex is for batch {self.batch} x {self.heads} query heads, "
                             f"but the attention has batch {batch} x {q_heads} query heads")

    def check_length(self, seq_len: int) -> None:
        """Cheap check that the index has one row per query block of a ``seq_len``-token sequence."""
        B = self.block_size
        if seq_len % B:
            raise ValueError(f"sequence length {seq_len} is not a multiple of block_size {B}")
        if self.num_blocks != seq_len // B:
            raise ValueError(f"BlockIndex has {self.num_blocks} query blocks of {B} tokens "
                             f"({self.num_blocks * B} tokens), but the sequence has {seq_len} tokens")

    def validate(self, seq_len: int) -> "BlockIndex":
        """Full check against a sequence length; synchronises with the device, so not for hot paths."""
        self.check_structure()
        self.check_length(seq_len)
        blocks, counts, cap = self.key_blocks, self.n_key_blocks, self.capacity
        if bool(((counts < 1) | (counts > cap)).any()):
            raise ValueError(f"BlockIndex.n_key_blocks out of range: counts must lie in [1, {cap}] (capacity; "
                             "at least the diagonal block)")
        valid = torch.arange(cap, device=blocks.device) < counts[..., None].long()
        query = torch.arange(self.num_blocks, device=blocks.device)[:, None]
        if bool((valid & ((blocks < 0) | (blocks > query))).any()):
            bad = (valid & ((blocks < 0) | (blocks > query))).nonzero()[0].tolist()
            raise ValueError(f"BlockIndex.key_blocks: key block out of range [0, query block] at (batch, head, "
                             f"query block) {tuple(bad[:3])}: a key block after its query block is never attended")
        if cap > 1:
            both = valid[..., 1:]
            diff = blocks[..., 1:] - blocks[..., :-1]
            if bool((both & (diff == 0)).any()):
                raise ValueError("BlockIndex.key_blocks: duplicate key blocks")
            if bool((both & (diff < 0)).any()):
                raise ValueError("BlockIndex.key_blocks: key blocks must be sorted ascending")
        last = blocks.gather(-1, (counts.long() - 1).clamp(min=0)[..., None])[..., 0]
        if bool((last != query[:, 0]).any()):
            bad = (last != query[:, 0]).nonzero()[0].tolist()
            raise ValueError(f"BlockIndex: diagonal block missing for (batch, head, query block) {tuple(bad)}: "
                             "the last key block of a query block must be the query block itself")
        return self

    # ------------------------------------------------------------ properties
    @property
    def batch(self) -> int:
        return self.key_blocks.shape[0]

    @property
    def heads(self) -> int:
        return self.key_blocks.shape[1]

    @property
    def num_blocks(self) -> int:
        """Query blocks (= blocks of the sequence) the index is built for."""
        return self.key_blocks.shape[2]

    @property
    def capacity(self) -> int:
        return self.key_blocks.shape[3]

    @property
    def device(self) -> torch.device:
        return self.key_blocks.device

    def to(self, device) -> "BlockIndex":
        return BlockIndex(self.key_blocks.to(device), self.n_key_blocks.to(device), self.block_size)

    def slash_bitmap(self, num_blocks: int) -> torch.Tensor:
        """int8 [b, hq, num_blocks] of zeros: a block index selects no slash offset (the per-step
        plan carries the bitmap for its column words, and a block index has no columns either)."""
        return torch.zeros(self.batch, self.heads, num_blocks, dtype=torch.int8, device=self.device)

    def block_rows(self, query_blocks: torch.Tensor) -> torch.Tensor:
        """bool [b, hq, len(query_blocks), num_blocks]: the key blocks each given global query block
        attends (entries after the query block select nothing)."""
        nb = self.num_blocks
        qb = query_blocks.to(self.device).long()
        rows = self.key_blocks.index_select(2, qb).long()
        counts = self.n_key_blocks.index_select(2, qb)
        valid = ((torch.arange(self.capacity, device=self.device) < counts[..., None])
                 & (rows >= 0) & (rows <= qb[:, None]))
        member = torch.zeros(*rows.shape[:3], nb + 1, dtype=torch.bool, device=self.device)
        member.scatter_(-1, torch.where(valid, rows, nb), True)
        return member[..., :nb]

    def to_mask(self) -> torch.Tensor:
        """bool [b, hq, num_blocks, num_blocks]: the block mask ``from_mask`` would rebuild this from."""
        return self.block_rows(torch.arange(self.num_blocks, device=self.device))

    def covers(self, rows: torch.Tensor, cols: torch.Tensor, seq_len: int) -> torch.Tensor:
        """bool [b, hq, P]: whether each (query ``rows[p]``, key ``cols[p]``) pair is attended (the
        key block ``cols//B`` is one of the key blocks of query block ``rows//B``; causal pairs
        only), as ``VSIndex.covers``."""
        self.check_length(seq_len)
        B = self.block_size
        rows, cols = rows.long().to(self.device), cols.long().to(self.device)
        # Only the P requested rows are expanded, never the whole block mask.
        member = self.block_rows(rows // B)                                   # [b, hq, P, num_blocks]
        key_block = (cols // B).clamp(0, self.num_blocks - 1)                  # a later col fails the causal test
        by_block = member.gather(-1, key_block.expand(*member.shape[:2], -1)[..., None])[..., 0]
        return by_block & (cols <= rows)

    def density(self, seq_len: int) -> torch.Tensor:
        """Active (query, key) pairs over causal pairs, per (batch, head), fp32."""
        self.check_length(seq_len)
        B = self.block_size
        query = torch.arange(self.num_blocks, device=self.device)[:, None]
        valid = ((torch.arange(self.capacity, device=self.device) < self.n_key_blocks[..., None])
                 & (self.key_blocks >= 0) & (self.key_blocks <= query))
        # A block below the diagonal adds B*B pairs, the diagonal block B*(B+1)/2.
        pairs = torch.where(self.key_blocks == query, B * (B + 1) / 2, float(B * B)) * valid
        return pairs.sum((-1, -2)).float() / (seq_len * (seq_len + 1) / 2)

    # ---------------------------------------------------------- constructors
    @classmethod
    def from_mask(cls, mask: torch.Tensor, block_size: int = 64, max_blocks: Optional[int] = None) -> "BlockIndex":
        """Build from a block-level bool mask ``[b, hq, n_blocks, n_blocks]`` (query block, key
        block). The query's own block is always included (causal inside it); key blocks after the
        query block are dropped (the function is causal). The capacity is ``n_blocks``, or
        ``max_blocks``: then the largest row is read on the host to check that it fits (one
        synchronisation, here where the index is made)."""
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 4:
            raise ValueError("BlockIndex.from_mask: mask must be a bool tensor [batch, heads, query blocks, "
                             f"key blocks], got {getattr(mask, 'dtype', type(mask).__name__)} "
                             f"{tuple(getattr(mask, 'shape', ()))}")
        nb = mask.shape[2]
        if mask.shape[3] != nb or nb < 1:
            raise ValueError(f"BlockIndex.from_mask: the mask must be square over the blocks of one sequence, got "
                             f"{nb} query blocks x {mask.shape[3]} key blocks")
        causal = torch.ones(nb, nb, dtype=torch.bool, device=mask.device).tril()
        full = (mask & causal) | torch.eye(nb, dtype=torch.bool, device=mask.device)
        capacity = nb
        if max_blocks is not None:
            capacity = int(max_blocks)
            widest = int(full.sum(-1).max()) if full.numel() else 0
            if capacity < 1 or widest > capacity:
                raise ValueError(f"BlockIndex.from_mask: max_blocks={max_blocks} is below the widest row of the mask "
                                 f"({widest} key blocks, diagonal included)")
        counts, blocks = _pack(full, capacity)
        return cls(blocks, counts, block_size)

    @classmethod
    def from_block_mask(cls, block_mask, batch: Optional[int] = None, heads: Optional[int] = None,
                        max_blocks: Optional[int] = None) -> "BlockIndex":
        """Build from PyTorch FlexAttention's ``BlockMask`` (``torch.nn.attention.flex_attention``):
        its key blocks per query block, partial and full alike (block level: the ``mask_mod``
        inside a block is not applied; the diagonal block is always included, causal inside it).
        Its blocks must be square (``BLOCK_SIZE = (B, B)``) and its query and key lengths equal.
        A mask made for batch or heads 1 is broadcast to ``batch`` / ``heads`` when given."""
        for field in ("kv_num_blocks", "kv_indices", "BLOCK_SIZE", "seq_lengths"):
            if not hasattr(block_mask, field):
                raise ValueError(f"BlockIndex.from_block_mask: expected a FlexAttention BlockMask, got "
                                 f"{type(block_mask).__name__} (no {field!r})")
        q_block, kv_block = (int(x) for x in block_mask.BLOCK_SIZE)
        q_len, kv_len = (int(x) for x in block_mask.seq_lengths)
        if q_block != kv_block:
            raise ValueError(f"BlockIndex.from_block_mask: blocks must be square, got BLOCK_SIZE {(q_block, kv_block)}")
        if q_len != kv_len or q_len % q_block:
            raise ValueError(f"BlockIndex.from_block_mask: query and key lengths must be equal multiples of the block "
                             f"size {q_block}, got {q_len} and {kv_len}")
        nb = q_len // q_block
        mask = None
        for counts, indices in ((block_mask.kv_num_blocks, block_mask.kv_indices),
                                (getattr(block_mask, "full_kv_num_blocks", None),
                                 getattr(block_mask, "full_kv_indices", None))):
            if counts is None:
                continue
            counts, indices = counts[..., :nb], indices[..., :nb, :]
            if indices.shape[2] != nb:
                raise ValueError(f"BlockIndex.from_block_mask: {indices.shape[2]} query block rows for {nb} blocks")
            valid = torch.arange(indices.shape[-1], device=indices.device) < counts[..., None].long()
            part = torch.zeros(*indices.shape[:3], nb + 1, dtype=torch.bool, device=indices.device)
            part.scatter_(-1, torch.where(valid, indices.long().clamp(0, nb), nb), True)
            mask = part[..., :nb] if mask is None else mask | part[..., :nb]
        b, h = mask.shape[:2]
        want = (batch if batch is not None else b, heads if heads is not None else h)
        for name, have, need in (("batch", b, want[0]), ("heads", h, want[1])):
            if have not in (1, need):
                raise ValueError(f"BlockIndex.from_block_mask: the BlockMask has {name} {have}, cannot serve {need}")
        return cls.from_mask(mask.expand(want[0], want[1], nb, nb), q_block, max_blocks)

    @classmethod
    def dense(cls, batch: int, heads: int, seq_len: int, block_size: int = 64, device=None) -> "BlockIndex":
        """Every causal block active: equals dense causal attention."""
        if seq_len % block_size:
            raise ValueError(f"sequence length {seq_len} is not a multiple of block_size {block_size}")
        nb = seq_len // block_size
        blocks = torch.arange(nb, dtype=torch.int32, device=device).expand(batch, heads, nb, nb).contiguous()
        counts = (torch.arange(nb, dtype=torch.int32, device=device) + 1).expand(batch, heads, nb).contiguous()
        return cls(blocks, counts, block_size)

    @classmethod
    def random(cls, batch: int, heads: int, seq_len: int, block_size: int = 64, density: float = 0.3,
               generator: Optional[torch.Generator] = None, device=None) -> "BlockIndex":
        """A random valid index: each causal block kept with probability ``density`` (the diagonal
        always); padding holds junk on purpose (it must never be read)."""
        if seq_len % block_size:
            raise ValueError(f"sequence length {seq_len} is not a multiple of block_size {block_size}")
        nb = seq_len // block_size
        mask = torch.rand(batch, heads, nb, nb, generator=generator) < density
        index = cls.from_mask(mask, block_size)
        pad = torch.arange(nb) >= index.n_key_blocks[..., None]
        blocks = torch.where(pad, torch.full_like(index.key_blocks, 98765), index.key_blocks)
        return cls(blocks.to(device), index.n_key_blocks.to(device), block_size)

    def __repr__(self) -> str:
        return (f"BlockIndex(batch={self.batch}, heads={self.heads}, num_blocks={self.num_blocks}, "
                f"capacity={self.capacity}, block_size={self.block_size}, device={self.device})")


def check_index(index, seq_len: int, validate: bool = False) -> None:
    """That ``index`` is a ``VSIndex`` or a ``BlockIndex`` fit for a ``seq_len``-token sequence
    (structure only: no host synchronisation); the values are checked where that is free
    (``value_checks``: the CPU, or a GPU with ``validate``)."""
    if isinstance(index, BlockIndex):
        index.check_length(seq_len)
    elif not isinstance(index, VSIndex):
        raise ValueError(f"index must be a VSIndex or a BlockIndex, got {type(index).__name__}")
    if value_checks(index.device, validate):
        index.validate(seq_len)
