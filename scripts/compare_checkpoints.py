"""Compare two Megatron torch_dist checkpoints tensor by tensor, bit for bit (exact resume).

    python scripts/compare_checkpoints.py A B [--iteration K] [--ignore KEY_PREFIX ...] [--show N]

A and B are checkpoint folders (the --save folder, whose latest_checkpointed_iteration.txt names
the iteration, or an iter_XXXXXXX folder in it); --iteration K takes iter_{K:07d} in both.
scripts/gpu_megatron_lm.sh compares the resumed run's final checkpoint with the uninterrupted
run's at the same iteration.

Why torch_dist (Megatron's default, ``--ckpt-format torch_dist``), read with
torch.distributed.checkpoint's FileSystemReader: every tensor is stored under one global key
whatever the ranks that wrote it (``.metadata`` lists them, ``__<rank>_0.distcp`` hold the bytes),
so two runs compare key by key; it reads on a CPU with torch alone (no Megatron, no GPU, no
process group); and it is the format the runs save and resume with anyway. (The legacy ``torch``
format has both CP ranks of data-parallel rank 0 write the same ``model_optim_rng.pt``.)

What is compared, each entry of A against the same entry of B:
* every tensor (model parameters, e.g. ``decoder.layers.self_attention.linear_qkv.weight``, and
  the distributed optimizer's state, ``optimizer.distributed....{param,exp_avg,exp_avg_sq}``):
  bit-equal (same dtype, shape and bytes; NaN and -0.0 compared as bits);
* every sharded object (bytes entries: RNG states, optimizer step and param groups, TE extra
  state), decoded and compared value by value (tensors in them bit-equal);
* ``common.pt`` (the unsharded rest), value by value.
Megatron's ``args`` (an ``argparse.Namespace``, in ``common.pt`` and, on Transformer Engine layers,
in the ``common_state`` sharded object too) is the run's configuration, not its state, and names
each run's own --save / --load / --exit-interval: its differing fields are printed as notes and do
not fail. Entries under an ``--ignore`` prefix are compared too, but their differences are printed
as notes and do not fail.
Objects of classes that do not import here (Megatron's) are compared by their pickled state.

One limit: megatron-core (0.19, ``dp_reshardable`` optimizer state) fills the gaps between
parameters in an optimizer bucket, where a parameter's size is not a multiple of 64 elements (the
buckets align each parameter's start to 64), with ``torch.empty``: such gaps hold whatever memory
was there and can differ between two exact runs, and show here as a difference in that bucket's
tensors. scripts/gpu_megatron_lm.sh's model has none (every parameter's size is a multiple of 64).
Entries only one side has fail. Prints the first differing tensors (``--show``, default 10) with
the number of differing elements, the first one's index and both values, then ``RESULT: PASS|FAIL``;
exits 0 only on PASS, 2 on a bad argument.
"""

from __future__ import annotations

import argparse
import io
import math
import os
import pickle
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

TRACKER = "latest_checkpointed_iteration.txt"
COMMON = "common.pt"
# Unsigned is not needed: equality of the raw bits is all that matters.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class CheckpointError(Exception):
    """A folder that is not a readable torch_dist checkpoint."""


# ------------------------------------------------------------------------------------ reading


def resolve(path: str, iteration: Optional[int]) -> str:
    """The iter_XXXXXXX folder of ``path`` (a --save folder or an iteration folder)."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such folder")
    if iteration is not None:
        if os.path.basename(os.path.normpath(path)) == f"iter_{iteration:07d}":
            return path
        folder = os.path.join(path, f"iter_{iteration:07d}")
        if not os.path.isdir(folder):
            raise CheckpointError(f"{path}: no iter_{iteration:07d} folder (iteration {iteration} was not saved there)")
        return folder
    if os.path.basename(os.path.normpath(path)).startswith("iter_"):
        return path
    tracker = os.path.join(path, TRACKER)
    if not os.path.isfile(tracker):
        raise CheckpointError(f"{path}: neither an iter_XXXXXXX folder nor a checkpoint folder with {TRACKER}")
    text = open(tracker).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{tracker}: {text!r} is not an iteration")
    return resolve(path, int(text))


def read_metadata(folder: str):
    if not os.path.isfile(os.path.join(folder, ".metadata")):
        raise CheckpointError(f"{folder}: no .metadata (not a torch_dist checkpoint; save with --ckpt-format torch_dist)")
    return dcp.FileSystemReader(folder).read_metadata()


class _RawBytesPlanner(DefaultLoadPlanner):
    """Keeps a bytes entry as bytes (the default planner unpickles it, needing every class it names)."""

    def __init__(self):
        super().__init__()
        self.raw: Dict[str, bytes] = {}

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        self.raw[read_item.dest_index.fqn] = value.read()


def load_entry(folder: str, key: str, meta) -> Any:
    """One entry of a torch_dist checkpoint: a tensor (all its shards), or the raw bytes of an object."""
    if isinstance(meta, TensorStorageMetadata):
        state = {key: torch.zeros(meta.size, dtype=meta.properties.dtype)}
    elif isinstance(meta, BytesStorageMetadata):
        state = {key: io.BytesIO()}
    else:  # pragma: no cover - DCP has only these two kinds
        raise CheckpointError(f"{folder}: entry {key!r} of unknown kind {type(meta).__name__}")
    planner = _RawBytesPlanner()
    dcp.load(state, storage_reader=dcp.FileSystemReader(folder), planner=planner, no_dist=True)
    return planner.raw[key] if isinstance(meta, BytesStorageMetadata) else state[key]


class Unresolved:
    """An object of a class that does not import here, kept as its name and pickled state."""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs, self.state = args, kwargs, None

    def __setstate__(self, state):
        self.state = state

    def __eq__(self, other):
        return type(self).__qualname__ == type(other).__qualname__ and same(self.__dict__, other.__dict__)[0]

    __hash__ = object.__hash__

    def __repr__(self):
        return f"<{type(self).__qualname__} {self.args or ''}{self.state if self.state is not None else ''}>"


_UNRESOLVED: Dict[str, type] = {}  # one stand-in class per missing class, so both sides share it


class _TolerantUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        try:
            return super().find_class(module, name)
        except (ImportError, AttributeError):
            qualname = f"{module}.{name}"
            if qualname not in _UNRESOLVED:
                _UNRESOLVED[qualname] = type(qualname, (Unresolved,), {"__qualname__": qualname})
            return _UNRESOLVED[qualname]


class _TolerantPickle:
    """A pickle module for torch.load that stands in for classes that do not import (Megatron's)."""

    Unpickler = _TolerantUnpickler
    __name__ = "pickle"

    @staticmethod
    def load(file, **kwargs):
        return _TolerantUnpickler(file, **kwargs).load()


def decode(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False, pickle_module=_TolerantPickle)


# ------------------------------------------------------------------------------------ comparing


def _bits(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(_BITS[flat.element_size()]) if flat.element_size() in _BITS else flat.view(torch.uint8)


def tensor_difference(a: torch.Tensor, b: torch.Tensor) -> Optional[str]:
    """None when bit-equal, else what differs (count, first index, both values)."""
    if a.dtype != b.dtype:
        return f"dtype {a.dtype} vs {b.dtype}"
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    if a.numel() == 0:
        return None
    if a.element_size() not in _BITS:
        return None if torch.equal(_bits(a), _bits(b)) else "bytes differ"
    diff = _bits(a) != _bits(b)
    count = int(diff.sum())
    if count == 0:
        return None
    first = int(diff.nonzero()[0, 0])
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(first), a.shape)) if a.dim() else ()
    va, vb = a.reshape(-1)[first].item(), b.reshape(-1)[first].item()
    text = f"{count} of {a.numel()} elements differ; first at {list(index)}: {va!r} vs {vb!r}"
    if a.is_floating_point():
        finite = torch.isfinite(a.float()) & torch.isfinite(b.float())
        if bool(finite.any()):
            text += f"; largest |difference| {float((a.float() - b.float()).abs()[finite].max()):.3e}"
    return text


def same(a: Any, b: Any, path: str = "", notes: Optional[List[str]] = None) -> Tuple[bool, str]:
    """Values of decoded objects: (equal, where they first differ). A run's configuration
    (``argparse.Namespace``) counts as equal; where its fields differ, that goes to ``notes``."""
    if isinstance(a, argparse.Namespace) and isinstance(b, argparse.Namespace):
        a_fields, b_fields = vars(a), vars(b)
        differing = sorted(k for k in set(a_fields) | set(b_fields)
                           if k not in a_fields or k not in b_fields or not same(a_fields[k], b_fields[k])[0])
        if differing and notes is not None:
            notes.append(f"{path}: run configuration (args) differs in {', '.join(differing)}")
        return True, ""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False, f"{path}: {type(a).__name__} vs {type(b).__name__}"
        d = tensor_difference(a, b)
        return d is None, f"{path}: {d}"
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return False, f"{path}: keys {sorted(map(str, set(a) ^ set(b)))} on one side only"
        for k in a:
            ok, where = same(a[k], b[k], f"{path}[{k!r}]", notes)
            if not ok:
                return ok, where
        return True, ""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return False, f"{path}: {type(a).__name__} of {len(a)} vs {type(b).__name__} of {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            ok, where = same(x, y, f"{path}[{i}]", notes)
            if not ok:
                return ok, where
        return True, ""
    if isinstance(a, io.BytesIO) and isinstance(b, io.BytesIO):
        a, b = a.getvalue(), b.getvalue()
    if isinstance(a, (bytes, bytearray)) and isinstance(b, (bytes, bytearray)):
        if a == b:
            return True, ""
        # Serialized state (TE's extra state is a torch.save payload): torch.save writes a fresh
        # serialization id each time, so equal values can differ as bytes; compare what they hold.
        try:
            return same(decode(a), decode(b), path, notes)
        except Exception:
            return False, f"{path}: bytes differ ({len(a)} vs {len(b)} bytes)"
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True, ""
    try:
        equal = bool(a == b) and type(a) is type(b)
    except Exception:  # e.g. an object whose == is elementwise
        equal = False
    return equal, "" if equal else f"{path}: {_short(a)} vs {_short(b)}"


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


@dataclass
class Report:
    compared: Dict[str, int] = field(default_factory=lambda: {"model": 0, "optimizer": 0, "object": 0, "common": 0})
    differences: List[Tuple[str, str, str]] = field(default_factory=list)  # (kind, key, what)
    notes: List[Tuple[str, str, str]] = field(default_factory=list)  # differences of --ignore'd entries
    configuration: List[str] = field(default_factory=list)  # where the runs' args differ (never fails)
    ignore: Tuple[str, ...] = ()

    def add(self, kind: str, key: str, what: str) -> None:
        (self.notes if key.startswith(self.ignore) else self.differences).append((kind, key, what))


def kind_of(key: str, meta) -> str:
    if isinstance(meta, BytesStorageMetadata):
        return "object"
    return "optimizer" if key.startswith("optimizer.") else "model"


def compare(a_folder: str, b_folder: str, ignore: Tuple[str, ...] = ()) -> Report:
    report = Report(ignore=ignore)
    meta_a, meta_b = read_metadata(a_folder).state_dict_metadata, read_metadata(b_folder).state_dict_metadata
    for key in sorted(set(meta_a) | set(meta_b)):
        if key not in meta_b or key not in meta_a:
            side = "B" if key not in meta_b else "A"
            report.add(kind_of(key, meta_a.get(key) or meta_b.get(key)), key, f"missing in {side}")
            continue
        kind = kind_of(key, meta_a[key])
        report.compared[kind] += 1
        if kind_of(key, meta_b[key]) != kind:
            report.add(kind, key, "a tensor on one side, an object on the other")
            continue
        a, b = load_entry(a_folder, key, meta_a[key]), load_entry(b_folder, key, meta_b[key])
        if kind == "object":  # megatron-core stores torch.save([object]): compared decoded (see same())
            entry_notes: List[str] = []
            ok, where = same(a, b, notes=entry_notes)
            report.configuration += [f"{key} {note}" for note in entry_notes]
            if not ok:
                report.add(kind, key, where.lstrip(": ") or "differs")
        else:
            what = tensor_difference(a, b)
            if what is not None:
                report.add(kind, key, what)
        del a, b
    common_a, common_b = (os.path.join(f, COMMON) for f in (a_folder, b_folder))
    if os.path.isfile(common_a) or os.path.isfile(common_b):
        if not (os.path.isfile(common_a) and os.path.isfile(common_b)):
            report.add("common", COMMON, f"missing in {'B' if os.path.isfile(common_a) else 'A'}")
        else:
            a, b = (decode(open(p, "rb").read()) for p in (common_a, common_b))
            for key in sorted(set(a) | set(b), key=str):
                report.compared["common"] += 1
                if key not in a or key not in b:
                    report.add("common", str(key), f"missing in {'B' if key not in b else 'A'}")
                    continue
                ok, where = same(a[key], b[key], str(key), report.configuration)
                if not ok:
                    report.add("common", str(key), where)
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a", help="checkpoint folder (or its iter_XXXXXXX folder), e.g. the resumed run's")
    parser.add_argument("b", help="the checkpoint to compare with, e.g. the uninterrupted run's")
    parser.add_argument("--iteration", type=int, help="compare iter_{K:07d} of both (default: each one's latest)")
    parser.add_argument("--ignore", action="append", default=[], metavar="KEY_PREFIX",
                        help="entries whose key starts with this are compared and their differences printed, "
                             "but they do not fail the comparison (repeatable)")
    parser.add_argument("--show", type=int, default=10, help="differences printed (default 10)")
    args = parser.parse_args(argv)
    if args.iteration is not None and args.iteration < 0:
        parser.error(f"--iteration {args.iteration} is negative")
    try:
        a, b = resolve(args.a, args.iteration), resolve(args.b, args.iteration)
        if os.path.basename(os.path.normpath(a)) != os.path.basename(os.path.normpath(b)):
            print(f"  FAIL different iterations: {a} vs {b}")
            print("RESULT: FAIL")
            return 1
        report = compare(a, b, tuple(args.ignore))
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    counts = ", ".join(f"{n} {kind}" for kind, n in report.compared.items())
    print(f"Checkpoints {a} (A) and {b} (B): compared {counts} entries bit for bit")
    total = sum(report.compared.values())
    if not report.differences and total:
        print(f"  ok   all {total} entries equal")
    for kind, key, what in report.differences[:args.show]:
        print(f"  FAIL {kind} {key}: {what}")
    if len(report.differences) > args.show:
        print(f"  ... and {len(report.differences) - args.show} more differing entries")
    for kind, key, what in report.notes[:args.show]:
        print(f"  note {kind} {key}: {what} (not counted: --ignore)")
    for note in report.configuration:
        print(f"  note {note} (not counted: each run's own --save / --load / ...)")
    ok = not report.differences and total > 0
    if not total:
        print("  FAIL nothing to compare")
    print("RESULT:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
