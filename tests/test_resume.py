"""Checkpoint resume without loss: the demo's training loop (``examples/demo/demo.py``:
megatron-core GPTModel with MTrainingAttention, Adam, CP=2 over gloo) trained N+M iterations in
one go equals N iterations, a checkpoint, and M more in NEW processes, bit for bit (losses,
parameters and optimizer state). Deterministic kernels are the default
(``--mtraining-deterministic``)."""

import os

import pytest
import torch

pytest.importorskip("megatron.core")

from dist_utils import run_distributed  # noqa: E402

from checkpointing import checkpoint_path, read_tracker  # noqa: E402  (examples/demo/)

N, M = 3, 2
# Small and quick: 2 layers, 256 tokens (128 per rank), telemetry (and with it the cross-rank
# consistency checks) every 2 iterations, so a log iteration falls on each side of the restart.
ARGS = ["--seq-length", "256", "--micro-batch-size", "1", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--num-query-groups", "2", "--vocab-size", "64", "--log-interval", "100",
        "--mtraining-log-interval", "2"]


def _train(rank, world_size, argv):
    import demo  # examples/demo/demo.py
    demo.main(list(argv))  # its return code is the loss-went-down check: meaningless over 3 iterations
    return None


def _load(root, iteration, rank):
    return torch.load(checkpoint_path(root, iteration, rank), map_location="cpu", weights_only=False)


def _assert_tensors_equal(a, b, where):
    """Exact equality of nested state (dicts, lists, tensors, numbers)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where}: differs (max abs diff {(a.double() - b.double()).abs().max().item()})"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for key in a:
            _assert_tensors_equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_tensors_equal(x, y, f"{where}[{i}]")
    elif a is not None and not isinstance(a, (str, bytes, int, float, bool)):  # _extra_state blobs etc.
        return
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU (gloo) test of the demo loop")
def test_resume_is_bit_identical(tmp_path):
    full, first, resumed = (str(tmp_path / name) for name in ("full", "first", "resumed"))
    # One go: N + M iterations, saving at N and at the end.
    run_distributed(_train, 2, ARGS + ["--iterations", str(N + M), "--save", full, "--save-interval", str(N)],
                    timeout=120)
    # N iterations and a checkpoint; then M more in new processes from that checkpoint.
    run_distributed(_train, 2, ARGS + ["--iterations", str(N), "--save", first], timeout=120)
    assert read_tracker(first) == N
    run_distributed(_train, 2, ARGS + ["--iterations", str(N + M), "--load", first, "--save", resumed],
                    timeout=120)
    assert read_tracker(resumed) == N + M

    for rank in range(2):
        a, b = _load(full, N + M, rank), _load(resumed, N + M, rank)
        losses_a, losses_b = a["extra"]["losses"], b["extra"]["losses"]
        assert len(losses_a) == N + M and losses_a == losses_b, (losses_a, losses_b)  # exact float equality
        assert all(loss == loss for loss in losses_a)
        _assert_tensors_equal(a["model"], b["model"], f"rank {rank} model")
        _assert_tensors_equal(a["optimizer"], b["optimizer"], f"rank {rank} optimizer")
        _assert_tensors_equal(a["rng"]["torch"], b["rng"]["torch"], f"rank {rank} rng")
        # The checkpoint at N of the uninterrupted run is the one the resume started from.
        _assert_tensors_equal(_load(full, N, rank)["model"], _load(first, N, rank)["model"], f"rank {rank} at N")
        # The indexer keeps no state that a checkpoint would need (no parameters, no buffers).
        assert not [k for k in a["model"] if "indexer" in k]
    # Training moved the parameters between N and N + M (the comparison above is not vacuous).
    before, after = _load(first, N, 0)["model"], _load(resumed, N + M, 0)["model"]
    assert any(isinstance(v, torch.Tensor) and v.is_floating_point() and not torch.equal(v, before[k])
               for k, v in after.items())


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU (gloo) test of the demo loop")
def test_load_refuses_another_world_size(tmp_path):
    root = str(tmp_path / "ckpt")
    run_distributed(_train, 2, ARGS + ["--iterations", "1", "--save", root], timeout=120)
    with pytest.raises(Exception, match="saved by 2 ranks; this run has 1"):
        run_distributed(_train, 1, ARGS + ["--iterations", "2", "--load", root], timeout=120)
    assert os.path.exists(checkpoint_path(root, 1, 1))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU (gloo) test of the demo loop")
def test_truncated_checkpoint_file_fails_every_rank_before_any_restores(tmp_path):
    """One rank's file cut short: every rank raises CheckpointLoadError naming that rank (the
    other rank does not report a successful resume and then die in the first collective)."""
    from dist_utils import run_distributed_outcomes

    root = str(tmp_path / "ckpt")
    run_distributed(_train, 2, ARGS + ["--iterations", "1", "--save", root], timeout=120)
    path = checkpoint_path(root, 1, 1)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    outcomes = run_distributed_outcomes(_train, 2, ARGS + ["--iterations", "2", "--load", root], timeout=120)
    assert [o.status for o in outcomes] == ["error", "error"], outcomes
    assert all(o.error_type == "CheckpointLoadError" and "rank(s) [1] of 2" in o.message for o in outcomes)
    assert "This rank (1)" in outcomes[1].message and "cannot be read (truncated or corrupt?)" in outcomes[1].message
    assert "This rank" not in outcomes[0].message  # rank 0 read its own file; it names the rank that could not
