"""Megatron's public context-parallel batch split, called as its training loop calls it, on every
megatron-core the tests run on (0.17 added ``is_hybrid_cp``). With ``patches.install`` it follows
MTraining's layout; without, Megatron's zigzag."""

import inspect

from megatron.core import utils as core_utils


def cp_split(batch, cp_group=None, **kwargs):
    if "is_hybrid_cp" in inspect.signature(core_utils.get_batch_on_this_cp_rank).parameters:
        kwargs.setdefault("is_hybrid_cp", False)
    return core_utils.get_batch_on_this_cp_rank(batch, cp_group=cp_group, **kwargs)
