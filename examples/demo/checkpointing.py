"""Checkpoints of the demo's training loop (``demo.py``): save, then resume bit-identically.

Megatron-LM's ``megatron.training`` saves and loads its own checkpoints (``--save`` / ``--load``);
MTraining adds nothing to them: the index is rebuilt from each layer's q and k in every forward
(``integration/indexer.py`` keeps no state, no buffers and no parameters), so model, optimizer,
RNG and iteration are everything a resume needs. This module does the same for a hand-written
loop, with Megatron's names: one ``torch.save`` per rank under ``<root>/iter_<7 digits>/`` and
the tracker file ``latest_checkpointed_iteration.txt`` that ``--load`` reads.

    save_checkpoint(args.save, iteration, model, optimizer, extra={"losses": losses})
    iteration, extra = load_checkpoint(args.load, model, optimizer)

Each rank writes its own file (``rank_<NNN>.pt``, the rank in the default process group): the
context-parallel ranks hold the same parameters but their own RNG states. A checkpoint loads
only into a run with the same world size. Checkpoints are trusted files (``torch.load`` with
``weights_only=False``, as Megatron does): never load one from an unknown source.
"""

from __future__ import annotations

import os
import random
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist

__all__ = ["CheckpointLoadError", "TRACKER_FILENAME", "checkpoint_path", "get_rng_state", "load_checkpoint",
           "read_tracker", "save_checkpoint", "set_rng_state"]

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"  # Megatron's name
FORMAT_VERSION = 1


class CheckpointLoadError(RuntimeError):
    """A rank could not read its checkpoint file (missing, truncated, another world size): raised
    on every rank, before any of them restores anything."""


def _rank_world() -> Tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def checkpoint_path(root: str, iteration: int, rank: int) -> str:
    return os.path.join(root, f"iter_{int(iteration):07d}", f"rank_{int(rank):03d}.pt")


def get_rng_state() -> Dict[str, Any]:
    """Every random generator a training step may draw from: Python, NumPy, torch's CPU and
    CUDA generators and megatron-core's CUDA RNG tracker (model-parallel dropout streams)."""
    state: Dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np
        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    try:
        from megatron.core import tensor_parallel
        tracker_states = tensor_parallel.get_cuda_rng_tracker().get_states()
        if tracker_states:
            state["megatron_tracker"] = tracker_states
    except Exception:  # no megatron-core, or a tracker without states (CPU)
        pass
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np
        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "megatron_tracker" in state:
        from megatron.core import tensor_parallel
        tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron_tracker"])


def save_checkpoint(root: str, iteration: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    extra: Optional[Dict[str, Any]] = None) -> str:
    """Write this rank's model, optimizer, RNG state, ``iteration`` and ``extra`` (picklable
    data, e.g. the loss history) and, once every rank has written, the tracker file. A collective
    over the default group: every rank calls it at the same iteration. Returns this rank's file."""
    rank, world = _rank_world()
    path = checkpoint_path(root, iteration, rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    state = {"format": FORMAT_VERSION, "iteration": int(iteration), "rank": rank, "world_size": world,
             "model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": get_rng_state(),
             "extra": dict(extra or {})}
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)  # never half a file under the final name
    if world > 1:
        dist.barrier()  # every rank's file exists before the tracker points at them
    if rank == 0:
        tracker = os.path.join(root, TRACKER_FILENAME)
        with open(tracker + ".tmp", "w") as f:
            f.write(f"{int(iteration)}\n")
        os.replace(tracker + ".tmp", tracker)
    return path


def read_tracker(root: str) -> int:
    """The iteration of the latest checkpoint under ``root``."""
    tracker = os.path.join(root, TRACKER_FILENAME)
    try:
        with open(tracker) as f:
            return int(f.read().strip())
    except FileNotFoundError:
        raise FileNotFoundError(f"no checkpoint to load: {tracker} does not exist (save one with --save "
                                f"{root})") from None


def load_checkpoint(root: str, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                    iteration: Optional[int] = None) -> Tuple[int, Dict[str, Any]]:
    """Restore this rank's model, optimizer and RNG state from ``root`` (the latest checkpoint,
    or ``iteration``); returns ``(iteration, extra)``. Call it after building the model and the
    optimizer, before the first training step. A collective over the default group: every rank
    first reads its file, then the ranks agree; if any rank could not (a missing or truncated file,
    another world size, another iteration), every rank raises ``CheckpointLoadError`` naming the
    ranks that failed (and its own reason), and none restores anything."""
    rank, world = _rank_world()
    state, problem = None, None
    try:
        if iteration is None:
            iteration = read_tracker(root)
        path = checkpoint_path(root, iteration, rank)
        if not os.path.exists(path):
            raise FileNotFoundError(f"checkpoint {path} is missing: was it saved by a run of {world} ranks?")
        try:
            state = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as err:  # EOFError, UnpicklingError, RuntimeError: a cut or corrupt file
            raise ValueError(f"checkpoint {path} cannot be read (truncated or corrupt?): "
                             f"{type(err).__name__}: {err}") from None
        if state.get("world_size") != world:
            raise ValueError(f"checkpoint {os.path.dirname(path)} was saved by {state.get('world_size')} ranks; "
                             f"this run has {world}. Resume with the same number of ranks.")
        if int(state.get("iteration", -1)) != int(iteration):
            raise ValueError(f"checkpoint {path} holds iteration {state.get('iteration')}, not {iteration}")
    except (OSError, ValueError) as err:
        problem = str(err)
    failed = _ranks_that_failed(problem is not None, rank, world)
    if failed:
        own = f" This rank ({rank}): {problem}" if problem else ""
        raise CheckpointLoadError(f"cannot resume from {root}: rank(s) {failed} of {world} could not read their "
                                  f"checkpoint file, so no rank restored anything.{own}")
    model.load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    set_rng_state(state["rng"])
    return int(state["iteration"]), state.get("extra", {})


def _ranks_that_failed(failed: bool, rank: int, world: int) -> list:
    """Every rank's verdict on every rank (one all-reduce of a slot per rank over the default group)."""
    if world == 1:
        return [rank] if failed else []
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    slots = torch.zeros(world, dtype=torch.int32, device=device)
    slots[rank] = int(failed)
    dist.all_reduce(slots)
    return [r for r, bad in enumerate(slots.tolist()) if bad]
