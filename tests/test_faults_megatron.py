"""Fault injection on the Megatron path (CPU, gloo, 2 ranks): CP ranks whose batches differ.

A data path that gives the CP ranks of a layer different ``--seq-length`` or
``--micro-batch-size`` used to end in SIGABRT inside the approximator's all-reduce (gloo's
"Received data size doesn't match expected size"). Now it is caught before that collective:

* in the first forward of a layer (and at telemetry log iterations) by the consistency check,
  ``ConsistencyError`` naming ``--seq-length`` / ``--micro-batch-size``, on every backend;
* on any later forward, on CPU tensors (gloo), by the approximator's per-call agreement,
  ``RingAgreementError`` naming them too (on GPUs with NCCL that check would need a host
  synchronisation: there the consistency iterations catch it).

Every rank raises, within ``BOUND_S``, and the group keeps working afterwards.
"""

from __future__ import annotations

import time
import types

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed_outcomes

from megatron_mtraining import MTrainingConfig, shard_sequence

B = 64
BOUND_S = 5.0
APPROX = dict(last_q=64, max_vertical=64, max_slash=8, min_vertical=16)


def _attention(cfg):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_mtraining.integration.core_attention import MTrainingAttention

    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                               use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0)
    return MTrainingAttention(config, 1, AttnMaskType.causal, "self", mtraining_config=cfg,
                              pg_collection=types.SimpleNamespace(cp=dist.group.WORLD))


def _inputs(rank, world, n=256, b=1):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, b, h, 16, generator=g) for h in (4, 2, 2))  # [s, b, heads, hn]
    return [shard_sequence(x, 0, "striped", world, rank, B) for x in (q, k, v)]


def _megatron_worker(rank, world):
    from megatron_mtraining.integration.consistency import ConsistencyError
    from megatron_mtraining.collective.agreement import RingAgreementError

    cfg = MTrainingConfig(**APPROX)
    results = []

    def run(name, layer, n, b):
        start = time.monotonic()
        try:
            out = layer(*_inputs(rank, world, n, b), None)
            outcome = f"ok {tuple(out.shape)}"
        except ConsistencyError as err:
            outcome = f"ConsistencyError: {err}"
        except RingAgreementError as err:
            outcome = f"RingAgreementError: {err}"
        results.append((name, outcome, time.monotonic() - start))

    run("first forward: --seq-length", _attention(cfg), 512 if rank else 256, 1)
    run("first forward: --micro-batch-size", _attention(cfg), 256, 2 if rank else 1)
    layer = _attention(cfg)
    layer(*_inputs(rank, world), None)  # its first forward (checked), with equal shapes
    run("later forward: --seq-length", layer, 512 if rank else 256, 1)
    run("later forward: --micro-batch-size", layer, 256, 2 if rank else 1)
    run("later forward: same shapes", layer, 256, 1)
    return results


def test_cp_ranks_with_different_batch_shapes_fail_before_the_approximator():
    pytest.importorskip("megatron.core")
    outcomes = run_distributed_outcomes(_megatron_worker, 2, timeout=120, pg_timeout=10.0)
    for o in outcomes:
        assert o.status == "ok", (o.rank, o.status, o.error_type, o.message)
        got = {name: (outcome, seconds) for name, outcome, seconds in o.value}
        print(f"\nrank {o.rank}: " + "; ".join(f"{k}: {v[0].split(':')[0]} {v[1]:.2f} s" for k, v in got.items()))
        assert all(seconds < BOUND_S for _, seconds in got.values()), got
        seq, mbs = got["first forward: --seq-length"][0], got["first forward: --micro-batch-size"][0]
        # The listed settings: only the one that differs (the advice names both).
        seq_flag, mbs_flag = "--seq-length (tokens per CP rank", "--micro-batch-size (the batch on this rank)"
        assert seq.startswith("ConsistencyError") and seq_flag in seq and mbs_flag not in seq, seq
        assert mbs.startswith("ConsistencyError") and mbs_flag in mbs and seq_flag not in mbs, mbs
        for name in ("later forward: --seq-length", "later forward: --micro-batch-size"):
            later = got[name][0]
            assert later.startswith("RingAgreementError: approximate_index"), (name, later)
            assert "q shape" in later and "--seq-length" in later and "--micro-batch-size" in later, later
        assert got["later forward: same shapes"][0] == "ok (128, 1, 64)"
