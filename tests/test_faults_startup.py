"""Start-up refusals: MTraining settings the launch cannot honour, and resumes with other flags.

* ``--mtraining-inner-ring-size`` that does not divide the world size (3 on 2 ranks used to be
  ignored silently), or that splits the CP groups unevenly across nodes: ValueError from
  ``enable_mtraining``, before anything is installed.
* ``--load`` of a checkpoint saved with other ``--mtraining-*`` flags: a ``ResumeConfigWarning``
  naming each changed flag with both values, or a ValueError with MTRAINING_RESUME_CHANGES=error.
"""

import argparse
import os
import types
import warnings

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_mtraining import config  # noqa: E402
from megatron_mtraining.integration import patches, telemetry  # noqa: E402
from megatron_mtraining.integration.args import add_mtraining_args  # noqa: E402
from megatron_mtraining.integration.enable import ResumeConfigWarning, enable_mtraining, resume_changes  # noqa: E402


def parse(*argv, **attrs):
    args = add_mtraining_args(argparse.ArgumentParser()).parse_args(["--mtraining", *argv])
    for name, value in attrs.items():
        setattr(args, name, value)
    return args


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    monkeypatch.setattr(config, "ENVIRONMENT", types.MappingProxyType({}))  # as read at start-up: none set
    yield
    telemetry.disable_telemetry()
    patches.uninstall()


@pytest.mark.parametrize("size,world,cp,tp,problem", [
    (3, 2, 2, 1, "does not divide the world size 2"),
    (4, 6, 2, 1, "does not divide the world size 6"),
    (4, 12, 4, 3, "not split evenly and contiguously"),  # CP ranks 0, 3, 6, 9 on nodes 0, 0, 1, 2
])
def test_impossible_inner_ring_size_is_refused(size, world, cp, tp, problem):
    args = parse("--mtraining-inner-ring-size", str(size), world_size=world, context_parallel_size=cp,
                 tensor_model_parallel_size=tp, seq_length=128 * 2 * cp)
    with pytest.raises(ValueError, match=problem) as info:
        enable_mtraining(args)
    assert "--mtraining-inner-ring-size" in str(info.value)
    assert not patches.installed()


@pytest.mark.parametrize("size,world,cp", [(8, 8, 2), (4, 8, 8), (3, 6, 6), (2, 2, 1)])
def test_possible_inner_ring_sizes_are_accepted(size, world, cp):
    enable_mtraining(parse("--mtraining-inner-ring-size", str(size), world_size=world, context_parallel_size=cp,
                           seq_length=128 * 2 * cp))
    assert patches.installed()


def test_the_launcher_default_is_checked_too(monkeypatch):
    monkeypatch.setattr(config, "ENVIRONMENT", types.MappingProxyType({"LOCAL_WORLD_SIZE": "3"}))
    with pytest.raises(ValueError, match="default of --mtraining-inner-ring-size .* does not divide the world size 4"):
        enable_mtraining(parse(world_size=4, context_parallel_size=4, seq_length=1024))


def _checkpoint(tmp_path, saved_args, layout="common", iteration=10):
    (tmp_path / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    base = tmp_path / f"iter_{iteration:07d}"
    if layout == "common":  # torch_dist
        base.mkdir()
        torch.save({"args": saved_args}, base / "common.pt")
    else:  # legacy
        (base / "mp_rank_00").mkdir(parents=True)
        torch.save({"args": saved_args, "model": {"w": torch.zeros(2)}}, base / "mp_rank_00" / "model_optim_rng.pt")
    return str(tmp_path)


@pytest.mark.parametrize("layout", ["common", "legacy"])
def test_resume_with_other_flags_says_what_changed(tmp_path, monkeypatch, layout):
    saved = parse("--mtraining-block-size", "64", "--mtraining-top-p", "0.9", "--mtraining-log-interval", "5")
    load = _checkpoint(tmp_path, saved, layout)
    args = parse("--mtraining-block-size", "128", "--mtraining-top-p", "0.9", "--mtraining-log-interval", "7",
                 load=load)
    assert resume_changes(args) == [("--mtraining-block-size", 64, 128)]  # the log interval changes no math
    with pytest.warns(ResumeConfigWarning, match="--mtraining-block-size: 64 in the checkpoint, 128 now"):
        enable_mtraining(args)
    monkeypatch.setattr(config, "ENVIRONMENT", types.MappingProxyType({"MTRAINING_RESUME_CHANGES": "error"}))
    patches.uninstall()
    with pytest.raises(ValueError, match="--mtraining-block-size: 64 in the checkpoint, 128 now"):
        enable_mtraining(args)
    monkeypatch.setattr(config, "ENVIRONMENT", types.MappingProxyType({}))
    patches.uninstall()
    args.mtraining_resume_changes = "error"  # the flag
    with pytest.raises(ValueError, match="--mtraining-block-size: 64 in the checkpoint, 128 now"):
        enable_mtraining(args)
    patches.uninstall()
    args.mtraining_resume_changes = "warn"  # the flag wins over the variable
    monkeypatch.setattr(config, "ENVIRONMENT", types.MappingProxyType({"MTRAINING_RESUME_CHANGES": "error"}))
    with pytest.warns(ResumeConfigWarning):
        enable_mtraining(args)


def test_resume_with_the_same_flags_or_without_checkpoint_is_silent(tmp_path):
    saved = parse("--mtraining-top-p", "0.8")
    args = parse("--mtraining-top-p", "0.8", load=_checkpoint(tmp_path, saved))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResumeConfigWarning)
        enable_mtraining(args)
        patches.uninstall()
        enable_mtraining(parse(load=str(tmp_path / "nothing-here")))
    # A checkpoint saved without MTraining's flags: every flag is new (named, not an error).
    plain = tmp_path / "plain"
    plain.mkdir()
    changes = resume_changes(parse(load=_checkpoint(plain, argparse.Namespace(lr=1.0))))
    assert ("--mtraining", "(not set: saved without MTraining's flags)", True) in changes


def test_unreadable_checkpoint_args_warn_and_leave_the_error_to_megatron(tmp_path):
    load = _checkpoint(tmp_path, parse())
    path = os.path.join(load, "iter_0000010", "common.pt")
    with open(path, "r+b") as f:
        f.truncate(10)  # a truncated file
    with pytest.warns(ResumeConfigWarning, match="could not read the arguments saved in the checkpoint"):
        assert resume_changes(parse(load=load)) == []
