"""Megatron test helpers: the public context-parallel batch split, called as its training loop
calls it, on every megatron-core the tests run on (0.17 added ``is_hybrid_cp``; with
``patches.install`` it follows MTraining's layout, without, Megatron's zigzag), and a stand-in for
the CP process group where only its size and rank are read."""

import inspect

from megatron.core import utils as core_utils


def cp_split(batch, cp_group=None, **kwargs):
    if "is_hybrid_cp" in inspect.signature(core_utils.get_batch_on_this_cp_rank).parameters:
        kwargs.setdefault("is_hybrid_cp", False)
    return core_utils.get_batch_on_this_cp_rank(batch, cp_group=cp_group, **kwargs)


class FakeGroup:
    """What Megatron's RoPE and batch-split code reads from a CP process group: size and rank."""

    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank
