"""VSIndex: the vertical-slash sparse index (docs/design.md §2), plain data with fixed shapes.

For batch element ``b`` and query head ``h``:
  * ``slash[b, h, :n_slash[b, h]]`` are block offsets ``delta >= 0``, strictly ascending and
    starting with 0 (the diagonal block). Block pair (qb, kb) is active iff ``qb - kb`` is one.
  * ``vertical[b, h, :n_vertical[b, h]]`` are global key positions, strictly ascending.
    Key ``m`` is active for every query ``n >= m``.
Entries past a count are padding and are never read.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch


def value_checks(device: torch.device, validate: bool = False) -> bool:
    """Whether to check an index's or cu_seqlens' values: always on the CPU, where it costs no
    device synchronisation; on a GPU only with ``validate`` (``Settings.validate``,
    MTRAINING_VALIDATE=1): a wrong index there, such as a duplicate offset, otherwise gives wrong
    numbers rather than an error."""
    return device.type == "cpu" or bool(validate)


# The block sizes an index may have: 64 (the paper's) and 128, the sizes the GPU kernels are built
# and tuned for (MTrainingConfig.block_size takes those), and 16, the smallest tile of Triton's
# dot product, which keeps shapes small where the kernels run on the CPU.
BLOCK_SIZES = (16, 64, 128)


def checked_device(device, where: str):
    """``device`` as given, or a ValueError naming ``where`` when it is a CUDA device and CUDA is
    not available (torch's own error is a bare AssertionError from deep inside)."""
    if device is not None and torch.device(device).type == "cuda" and not torch.cuda.is_available():
        built = "torch has no CUDA support" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise ValueError(f"{where}: device={str(device)!r}, but CUDA is not available here ({built}); "
                         "use device='cpu' (the PyTorch path) or run where a GPU is visible")
    return device


class VSIndex:
    """Per-(batch, query head) slash offsets and vertical columns, int32, fixed shapes."""

    __slots__ = ("slash", "n_slash", "vertical", "n_vertical", "block_size")

    def __init__(self, slash: torch.Tensor, n_slash: torch.Tensor, vertical: torch.Tensor,
                 n_vertical: torch.Tensor, block_size: int = 64):
        self.slash = slash
        self.n_slash = n_slash
        self.vertical = vertical
        self.n_vertical = n_vertical
        self.block_size = int(block_size)
        self.check_structure()

    # ------------------------------------------------------------------ checks
    def check_structure(self) -> None:
        """Shape, dtype and device checks; no host synchronisation, so safe on hot paths."""
        t = {"slash": self.slash, "n_slash": self.n_slash, "vertical": self.vertical,
             "n_vertical": self.n_vertical}
        for name, x in t.items():
            if not isinstance(x, torch.Tensor):
                raise ValueError(f"VSIndex.{name} must be a torch.Tensor, got {type(x).__name__}")
            if x.dtype != torch.int32:
                raise ValueError(f"VSIndex.{name} must be int32, got {x.dtype}")
        if self.slash.dim() != 3 or self.vertical.dim() != 3:
            raise ValueError(
                "VSIndex.slash and VSIndex.vertical must be [batch, heads, capacity], got "
                f"{tuple(self.slash.shape)} and {tuple(self.vertical.shape)}")
        bh = tuple(self.slash.shape[:2])
        for name in ("n_slash", "vertical", "n_vertical"):
            shape = tuple(t[name].shape[:2])
            if shape != bh or (name.startswith("n_") and t[name].dim() != 2):
                raise ValueError(f"VSIndex.{name} has shape {tuple(t[name].shape)}, expected "
                                 f"[{bh[0]}, {bh[1]}{'' if name.startswith('n_') else ', capacity'}]")
        if self.slash.shape[2] < 1:
            raise ValueError("VSIndex.slash needs capacity >= 1 (offset 0, the diagonal, is mandatory)")
        devices = {x.device for x in t.values()}
        if len(devices) != 1:
            raise ValueError(f"VSIndex tensors must share one device, got {sorted(map(str, devices))}")
        self._check_block_size(self.block_size)

    @staticmethod
    def _check_block_size(block_size) -> None:
        if block_size not in BLOCK_SIZES:
            raise ValueError(f"VSIndex.block_size must be 64 or 128 (or 16, for small shapes on the CPU), "
                             f"got {block_size!r}")

    def check_matches(self, batch: int, q_heads: int) -> None:
        """Cheap check that the index was built for this batch size and head count."""
        if tuple(self.slash.shape[:2]) != (batch, q_heads):
            raise ValueError(f"VSIndex is for batch {self.slash.shape[0]} x {self.slash.shape[1]} query heads, "
                             f"but the attention has batch {batch} x {q_heads} query heads (q is [batch, heads, "
                             "tokens, head_dim])")

    def validate(self, seq_len: int) -> "VSIndex":
        """Full check against a sequence length; synchronises with the device, so not for hot paths."""
        self.check_structure()
        B = self.block_size
        if seq_len % B != 0:
            raise ValueError(f"sequence length {seq_len} is not a multiple of block_size {B}")
        nb = seq_len // B
        self._check_sorted_entries("slash", self.slash, self.n_slash, nb, "block offsets")
        self._check_sorted_entries("vertical", self.vertical, self.n_vertical, seq_len, "columns")
        if bool((self.n_slash < 1).any()):
            raise ValueError("VSIndex: every (batch, head) needs at least one slash offset (the diagonal 0)")
        if bool((self.slash[..., 0] != 0).any()):
            bad = (self.slash[..., 0] != 0).nonzero()[0].tolist()
            raise ValueError(f"VSIndex: diagonal offset 0 missing for (batch, head) {tuple(bad)}: "
                             "the first slash entry must be 0")
        return self

    @staticmethod
    def _check_sorted_entries(name, values, counts, upper, what):
        cap = values.shape[-1]
        if bool(((counts < 0) | (counts > cap)).any()):
            raise ValueError(f"VSIndex.n_{name} out of range: counts must lie in [0, {cap}] (capacity)")
        valid = torch.arange(cap, device=values.device) < counts[..., None].long()
        if bool((valid & ((values < 0) | (values >= upper))).any()):
            raise ValueError(f"VSIndex.{name}: {what} out of range [0, {upper})")
        if cap > 1:
            both = valid[..., 1:]
            diff = values[..., 1:] - values[..., :-1]
            if bool((both & (diff == 0)).any()):
                raise ValueError(f"VSIndex.{name}: duplicate {what}")
            if bool((both & (diff < 0)).any()):
                raise ValueError(f"VSIndex.{name}: {what} must be sorted ascending")

    # ------------------------------------------------------------ properties
    @property
    def batch(self) -> int:
        return self.slash.shape[0]

    @property
    def heads(self) -> int:
        return self.slash.shape[1]

    @property
    def device(self) -> torch.device:
        return self.slash.device

    def to(self, device) -> "VSIndex":
        checked_device(device, "VSIndex.to")
        return VSIndex(self.slash.to(device), self.n_slash.to(device), self.vertical.to(device),
                       self.n_vertical.to(device), self.block_size)

    def slash_bitmap(self, num_blocks: int) -> torch.Tensor:
        """int8 [b, hq, num_blocks]: 1 where the block offset is selected. Offsets outside
        [0, num_blocks) select nothing, as in the per-step conversion (a negative one would put a
        key block after its query block; ``validate`` rejects both, but does not run on GPUs)."""
        slash = self.slash.long()
        valid = ((torch.arange(self.slash.shape[-1], device=self.device) < self.n_slash[..., None])
                 & (slash >= 0) & (slash < num_blocks))
        target = torch.where(valid, slash, num_blocks)
        bitmap = torch.zeros(*self.slash.shape[:2], num_blocks + 1, dtype=torch.int8, device=self.device)
        bitmap.scatter_(2, target, 1)
        return bitmap[..., :num_blocks].contiguous()

    def column_mask(self, seq_len: int) -> torch.Tensor:
        """bool [b, hq, seq_len]: True at the selected vertical columns."""
        valid = torch.arange(self.vertical.shape[-1], device=self.device) < self.n_vertical[..., None]
        target = torch.where(valid, self.vertical.long().clamp(0, seq_len - 1), seq_len)
        mask = torch.zeros(*self.vertical.shape[:2], seq_len + 1, dtype=torch.bool, device=self.device)
        mask.scatter_(2, target, True)
        return mask[..., :seq_len]

    def covers(self, rows: torch.Tensor, cols: torch.Tensor, seq_len: int) -> torch.Tensor:
        """bool [b, hq, P]: whether each (query ``rows[p]``, key ``cols[p]``) pair is attended (a
        selected column, or a selected block offset ``rows//B - cols//B``; causal pairs only)."""
        B = self.block_size
        if seq_len % B:
            raise ValueError(f"sequence length {seq_len} is not a multiple of block_size {B}")
        rows, cols = rows.long().to(self.device), cols.long().to(self.device)
        offset = (rows // B - cols // B).clamp(min=0)
        by_slash = self.slash_bitmap(seq_len // B).bool()[..., offset]
        return (by_slash | self.column_mask(seq_len)[..., cols]) & (cols <= rows)

    def density(self, seq_len: int) -> torch.Tensor:
        """Active (query, key) pairs over causal pairs, per (batch, head), fp32 (O(seq_len) memory)."""
        B = self.block_size
        nb = seq_len // B
        bitmap = self.slash_bitmap(nb).bool()
        # Pairs from slash offsets: offset 0 gives B*(B+1)/2 pairs per block, offset d > 0 gives B*B.
        per_offset = torch.full((nb,), float(B * B), device=self.device)
        per_offset[0] = B * (B + 1) / 2
        per_offset *= (nb - torch.arange(nb, device=self.device)).float()
        slash_pairs = (bitmap.float() * per_offset).sum(-1)
        # Column m (block mb, offset o inside it) adds the queries n >= m whose block offset
        # d = n//B - mb is not selected: (B - o) rows at d = 0 and B rows for each d in [1, nb-1-mb].
        cols = self.column_mask(seq_len).float()
        pos = torch.arange(seq_len, device=self.device)
        last_offset = (nb - 1 - pos // B)
        selected_upto = torch.cumsum(bitmap.float(), -1)  # selected offsets in [0, d]
        selected_in_range = selected_upto.index_select(-1, last_offset) - selected_upto[..., :1]
        uncovered = (B - pos % B).float() * (1.0 - bitmap[..., :1].float()) \
            + B * (last_offset.float() - selected_in_range)
        col_pairs = (cols * uncovered).sum(-1)
        causal = seq_len * (seq_len + 1) / 2
        return (slash_pairs + col_pairs) / causal

    # ---------------------------------------------------------- constructors
    @classmethod
    def from_lists(cls, slash: Sequence[Sequence[Sequence[int]]], vertical: Sequence[Sequence[Sequence[int]]],
                   block_size: int = 64, device=None, max_slash: Optional[int] = None,
                   max_vertical: Optional[int] = None) -> "VSIndex":
        """Build from nested Python lists ``[batch][head] -> sorted entries`` (tests and examples)."""
        checked_device(device, "VSIndex.from_lists")
        cls._check_block_size(block_size)
        b, h = len(slash), len(slash[0])
        ms = max_slash or max(1, max(len(x) for row in slash for x in row))
        mv = max_vertical if max_vertical is not None else max([len(x) for row in vertical for x in row] + [0])
        s = torch.zeros(b, h, ms, dtype=torch.int32)
        v = torch.zeros(b, h, mv, dtype=torch.int32)
        ns = torch.zeros(b, h, dtype=torch.int32)
        nv = torch.zeros(b, h, dtype=torch.int32)
        for i in range(b):
            for j in range(h):
                ss, vv = list(slash[i][j]), list(vertical[i][j])
                if len(ss) > ms or len(vv) > mv:
                    raise ValueError(f"VSIndex.from_lists: entries for ({i}, {j}) exceed capacity")
                # Checked here, on the host, for free: on a GPU the kernels never check the order,
                # and a duplicate entry would count its pairs twice.
                _check_ascending("slash", "block offsets", ss, (i, j))
                _check_ascending("vertical", "columns", vv, (i, j))
                s[i, j, :len(ss)] = torch.tensor(ss, dtype=torch.int32)
                v[i, j, :len(vv)] = torch.tensor(vv, dtype=torch.int32)
                ns[i, j], nv[i, j] = len(ss), len(vv)
        return cls(s.to(device), ns.to(device), v.to(device), nv.to(device), block_size)

    @classmethod
    def dense(cls, batch: int, heads: int, seq_len: int, block_size: int = 64, device=None) -> "VSIndex":
        """Every causal block active: equals dense causal attention."""
        checked_device(device, "VSIndex.dense")
        cls._check_block_size(block_size)
        if seq_len % block_size:
            raise ValueError(f"sequence length {seq_len} is not a multiple of block_size {block_size}")
        nb = seq_len // block_size
        slash = torch.arange(nb, dtype=torch.int32, device=device).expand(batch, heads, nb).contiguous()
        n_slash = torch.full((batch, heads), nb, dtype=torch.int32, device=device)
        vertical = torch.zeros(batch, heads, 0, dtype=torch.int32, device=device)
        n_vertical = torch.zeros(batch, heads, dtype=torch.int32, device=device)
        return cls(slash, n_slash, vertical, n_vertical, block_size)

    @classmethod
    def random(cls, batch: int, heads: int, seq_len: int, block_size: int = 64, max_slash: int = 8,
               max_vertical: int = 32, generator: Optional[torch.Generator] = None, device=None) -> "VSIndex":
        """A random valid index (diagonal always present), counts anywhere in [1|0, capacity]."""
        checked_device(device, "VSIndex.random")
        cls._check_block_size(block_size)
        nb = seq_len // block_size
        if seq_len % block_size:
            raise ValueError(f"sequence length {seq_len} is not a multiple of block_size {block_size}")
        g = generator
        ms, mv = max(1, min(max_slash, nb)), min(max_vertical, seq_len)
        s = torch.zeros(batch, heads, max_slash, dtype=torch.int32)
        v = torch.zeros(batch, heads, max_vertical, dtype=torch.int32)
        ns = torch.zeros(batch, heads, dtype=torch.int32)
        nv = torch.zeros(batch, heads, dtype=torch.int32)
        for i in range(batch):
            for j in range(heads):
                k_s = int(torch.randint(1, ms + 1, (1,), generator=g))
                off = torch.randperm(nb - 1, generator=g)[: k_s - 1] + 1 if nb > 1 else torch.zeros(0, dtype=torch.long)
                off = torch.sort(torch.cat([torch.zeros(1, dtype=torch.long), off]))[0]
                k_v = int(torch.randint(0, mv + 1, (1,), generator=g))
                cols = torch.sort(torch.randperm(seq_len, generator=g)[:k_v])[0]
                s[i, j, : len(off)] = off.int()
                v[i, j, : len(cols)] = cols.int()
                ns[i, j], nv[i, j] = len(off), len(cols)
        # Padding gets junk values on purpose: it must never be read.
        s = torch.where(torch.arange(max_slash) < ns[..., None], s, torch.full_like(s, 123456))
        v = torch.where(torch.arange(max_vertical) < nv[..., None], v, torch.full_like(v, -7))
        return cls(s.to(device), ns.to(device), v.to(device), nv.to(device), block_size)

    def __repr__(self) -> str:
        return (f"VSIndex(batch={self.batch}, heads={self.heads}, max_slash={self.slash.shape[-1]}, "
                f"max_vertical={self.vertical.shape[-1]}, block_size={self.block_size}, device={self.device})")


def _check_ascending(name: str, what: str, entries: Sequence[int], where) -> None:
    """Host-side check of one (batch, head)'s entries: strictly ascending (sorted, no duplicates)."""
    for a, b in zip(entries, entries[1:]):
        if b == a:
            raise ValueError(f"VSIndex.{name}: duplicate {what} for (batch, head) {where}: {a} twice")
        if b < a:
            raise ValueError(f"VSIndex.{name}: {what} must be sorted ascending, got {b} after {a} for "
                             f"(batch, head) {where}")
