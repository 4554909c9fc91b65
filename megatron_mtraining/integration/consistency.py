"""Cross-rank consistency checks: the context-parallel ranks must agree on flags and index.

Every CP rank of a layer must run with the same MTraining settings and build the same
``VSIndex`` (docs/design.md §2): the ring, the per-step index conversion and the
approximator's collectives all assume it. Ranks that disagree would otherwise hang in a
collective of another size or silently compute a different function on each rank.

``MTrainingAttention`` calls, once in the first forward of each layer and again in the first
forward of each telemetry log iteration (``--mtraining-log-interval``; the iteration is the
telemetry's, see ``telemetry.py``):

* ``check_flags(attention, group, q)`` before the indexer: one int64 per setting (a hash of its
  value: every ``MTrainingConfig`` field, the dense layers, the log interval, the layer's
  dense flag, softmax scale and indexer class) and per batch dimension (micro-batch size,
  sequence length, heads and head dim), so a disagreement is found before the approximator's
  collectives, which depend on them;
* ``check_index(index, group, layer)`` after it: the index shapes and checksums of the valid
  entries of each tensor (padding is ignored: any value may stand there).

Each check is one all-reduce of a few int64s that yields the MIN and the MAX of every entry
over the group (MAX over ``[x, -x]``), so every rank learns the same thing and every rank
raises the same ``ConsistencyError``; none is left waiting. Between the checked iterations
nothing runs here: no collective, no host synchronisation on the per-layer hot path. The ring
itself (``collective/agreement.py``) agrees on its own inputs on every call, and on CPU tensors the
approximator too.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from ..block_index import BlockIndex
from ..index import VSIndex
from ..collective.agreement import checksum
from . import telemetry

__all__ = ["ConsistencyError", "check_flags", "check_index", "due", "flag_values"]

_MASK = (1 << 62) - 1  # values in [0, 2^62): -x never overflows
_CHECKED_ATTR = "_mtraining_consistency_checked"  # on the attention module: the last checked iteration
_FIRST = -1  # marks the first forward, before any telemetry iteration


class ConsistencyError(RuntimeError):
    """Context-parallel ranks disagree on MTraining settings or on a layer's index."""


def due(attention, group, record) -> bool:
    """Whether this forward of ``attention`` checks: the first one of the layer, and the first of
    each telemetry log iteration (``record``: the telemetry's record, None between log
    iterations). Every CP rank decides alike (same forwards, same iterations), provided the ranks
    agree on the log interval, which the first check covers."""
    if group is None:
        return False
    last = getattr(attention, _CHECKED_ATTR, None)
    if last is None:
        setattr(attention, _CHECKED_ATTR, record.iteration if record is not None else _FIRST)
        return True
    if record is not None and record.iteration != last:
        setattr(attention, _CHECKED_ATTR, record.iteration)
        return True
    return False


def _hash(value) -> int:
    digest = hashlib.blake2b(repr(value).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MASK


def _device(group, like: Optional[torch.Tensor]) -> torch.device:
    if dist.get_backend(group) == "nccl":
        if like is not None and like.is_cuda:
            return like.device
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _min_max(values: torch.Tensor, group) -> Tuple[List[int], List[int]]:
    """Element-wise MIN and MAX over ``group`` of int64 ``values`` in [0, 2^62), in one all-reduce."""
    both = torch.cat([values, -values])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    n = values.numel()
    both = both.cpu().tolist()
    return [-x for x in both[n:]], both[:n]


def _rank(group) -> str:
    return f"CP rank {dist.get_rank(group)} (global rank {dist.get_rank()})"


def flag_values(attention) -> List[Tuple[str, str, object]]:
    """``(name, flag, value)`` of every setting the CP ranks of ``attention``'s layer must share."""
    cfg = attention.mtraining_config
    tele = telemetry.get_telemetry()
    fields = [(f.name, "--mtraining-" + f.name.replace("_", "-"), getattr(cfg, f.name))
              for f in dataclasses.fields(cfg)]
    fields += [
        ("dense_layers", "--mtraining-dense-layers", attention.dense_layers),
        ("log_interval", "--mtraining-log-interval (telemetry)", tele.log_interval if tele is not None else 0),
        ("dense", f"layer {attention.layer_number} dense (--mtraining-dense-layers)", attention.dense),
        ("softmax_scale", "softmax scale (--kv-channels / softmax_scale)", attention.softmax_scale),
        ("indexer", "the layer spec's indexer submodule", type(attention.indexer).__qualname__),
    ]
    return fields


def shape_values(like: Optional[torch.Tensor], group) -> List[Tuple[str, str, object]]:
    """``(name, flag, value)`` of the batch shape the CP ranks must share, from the layer's q
    ``[b, heads, s_local, head_dim]``: the approximator's collectives have sizes that depend on it."""
    if like is None or like.dim() != 4:
        return []
    world = dist.get_world_size(group)
    return [("micro_batch_size", "--micro-batch-size (the batch on this rank)", int(like.shape[0])),
            ("seq_length", "--seq-length (tokens per CP rank x CP size)", int(like.shape[2]) * world),
            ("heads_and_head_dim", "attention heads per rank and head dim (--num-attention-heads, --kv-channels, "
             "--tensor-model-parallel-size)", (int(like.shape[1]), int(like.shape[3])))]


def check_flags(attention, group, like: Optional[torch.Tensor] = None) -> None:
    """Raise ``ConsistencyError`` on every rank of ``group`` unless all of them run ``attention``'s
    layer with the same settings (``flag_values``) and, when ``like`` (the layer's q) is given, the
    same batch shape (``shape_values``): before the approximator, whose collectives depend on both.
    A collective over ``group``."""
    fields = flag_values(attention) + shape_values(like, group)
    values = torch.tensor([_hash(value) for _, _, value in fields], dtype=torch.int64,
                          device=_device(group, like))
    low, high = _min_max(values, group)
    bad = [(name, flag, value) for (name, flag, value), lo, hi in zip(fields, low, high) if lo != hi]
    if bad:
        listed = "; ".join(f"{flag} ({name}: {value!r} on this rank)" for name, flag, value in bad)
        raise ConsistencyError(
            f"MTraining: the context-parallel ranks of layer {attention.layer_number} run with different "
            f"settings: {listed} [{_rank(group)}]. Every rank of a context-parallel group must get the same "
            "--mtraining-* flags: launch every node with the same command line (and the same LOCAL_WORLD_SIZE / "
            "GPUS_PER_NODE, which set the default of --mtraining-inner-ring-size), or set the differing flag "
            "explicitly; a differing --seq-length or --micro-batch-size comes from the data path (every CP rank "
            "must get the same batch shape). See docs/troubleshooting.md.")


_checksum = checksum  # position-weighted, padding-blind (shared with the ring's per-call agreement)


def check_index(index: Union[VSIndex, BlockIndex], group, layer_number: int) -> None:
    """Raise ``ConsistencyError`` on every rank of ``group`` unless all of them hold the same
    ``index`` (kind, shapes, block size and the valid entries). A collective over ``group``."""
    if isinstance(index, BlockIndex):  # the same eight words; the kind is hashed into the first
        names = ["index kind, batch, heads and query blocks", "key-block capacity", "unused", "block size",
                 "key-block counts (n_key_blocks)", "key blocks", "unused", "unused"]
        device = _device(group, index.key_blocks)
        shape = torch.tensor([_hash(("block index",) + tuple(index.key_blocks.shape[:3])), index.capacity, 0,
                              index.block_size], dtype=torch.int64)
        sums = torch.stack([_checksum(index.n_key_blocks), _checksum(index.key_blocks, index.n_key_blocks),
                            torch.zeros((), dtype=torch.int64, device=index.device),
                            torch.zeros((), dtype=torch.int64, device=index.device)])
    else:
        names = ["batch and heads", "slash capacity", "vertical capacity", "block size", "slash counts (n_slash)",
                 "slash offsets", "vertical counts (n_vertical)", "vertical columns"]
        device = _device(group, index.slash)
        shape = torch.tensor([_hash(tuple(index.slash.shape[:2])), index.slash.shape[-1], index.vertical.shape[-1],
                              index.block_size], dtype=torch.int64)
        sums = torch.stack([_checksum(index.n_slash), _checksum(index.slash, index.n_slash),
                            _checksum(index.n_vertical), _checksum(index.vertical, index.n_vertical)])
    values = torch.cat([shape.to(device), sums.to(device)])
    low, high = _min_max(values, group)
    bad = [name for name, lo, hi in zip(names, low, high) if lo != hi]
    if bad:
        raise ConsistencyError(
            f"MTraining: layer {layer_number}'s sparse index differs across the context-parallel ranks "
            f"({', '.join(bad)}) [{_rank(group)}]. Every rank must build the same index: the built-in "
            "builders do (they combine their statistics across the CP group, deterministically); a custom "
            "indexer (MTrainingAttentionSubmodules(indexer=...)) must too. Other causes: ranks with different "
            "--mtraining-* flags or software versions (torch, triton, megatron_mtraining) within one "
            "context-parallel group. See docs/troubleshooting.md.")
