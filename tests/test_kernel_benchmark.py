"""benchmarks/kernel.py on the CPU: the smoke run, launch-setting overrides and the sweep mode.

The smoke runs use the PyTorch kernels, so they test the script's plumbing (settings parsed,
recorded, every candidate timed); that the settings reach the Triton launches is tested on
``tile_config`` directly, and the GPU sweep itself is scripts/gpu_kernel_sweep.sh."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import kernel  # noqa: E402


def run_kernel_py(*args):
    return subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "kernel.py"), "--smoke", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_parse_launch():
    assert kernel.parse_launch("") == {}
    assert kernel.parse_launch("fwd:4x3,bwd:8X2") == {"fwd": {"num_warps": 4, "num_stages": 3},
                                                      "bwd": {"num_warps": 8, "num_stages": 2}}
    assert kernel.parse_launch("fwd:4x2m") == {"fwd": {"num_warps": 4, "num_stages": 2, "MASK_EVERY_TILE": True}}
    assert kernel.parse_launch("bwd:8x1cm") == {"bwd": {"num_warps": 8, "num_stages": 1, "MASK_EVERY_TILE": True,
                                                        "COLUMN_PROGRAMS": 4096}}

    import torch

    from megatron_mtraining.kernels import triton_common
    assert {key for key, _ in kernel.LAUNCH_OPTIONS.values()} <= set(triton_common.tile_config(64, torch.bfloat16))
    assert kernel.parse_launch("bwd:4x2c")["bwd"]["COLUMN_PROGRAMS"] == 4096


@pytest.mark.parametrize("text", ["fwd:3x2", "fwd:4x0", "dq:4x2", "fwd4x2", "fwd:4", "fwd:4x2g", "fwd:4x2h"])
def test_bad_launch_settings_are_rejected(text):
    with pytest.raises(SystemExit, match="bad --launch item"):
        kernel.parse_launch(text)


def test_launch_overrides_reach_the_tile_config():
    import torch

    from megatron_mtraining.kernels import triton_common
    default = triton_common.tile_config(64, torch.bfloat16, "bwd")
    default_fwd = triton_common.tile_config(64, torch.bfloat16, "fwd")
    assert (default["num_warps"], default["num_stages"]) != (8, 3)  # else the override below shows nothing
    try:
        triton_common.LAUNCH_OVERRIDES.update(kernel.parse_launch("bwd:8x3"))
        assert triton_common.tile_config(64, torch.bfloat16, "bwd") == {**default, "num_warps": 8, "num_stages": 3}
        assert triton_common.tile_config(64, torch.bfloat16, "fwd") == default_fwd  # the other family keeps its own
    finally:
        triton_common.LAUNCH_OVERRIDES.clear()
    assert triton_common.tile_config(64, torch.bfloat16, "bwd") == default


def test_smoke_sweep_times_every_setting_of_both_families(tmp_path):
    out = tmp_path / "sweep.json"
    proc = run_kernel_py("--sweep", "4x2,8x3", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["benchmark"] == "kernel_sweep"
    assert [(r["family"], r["launch"]) for r in data["rows"]] == [("fwd", "4x2"), ("fwd", "8x3"), ("bwd", "4x2"),
                                                                  ("bwd", "8x3")]
    assert all(r["fwd_ms"] > 0 and r["fwdbwd_ms"] > 0 for r in data["rows"])


def test_smoke_run_records_its_launch_settings(tmp_path):
    out = tmp_path / "kernel.json"
    proc = run_kernel_py("--launch", "fwd:8x3", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["config"]["launch"] == "fwd:8x3" and data["check"]["ours"]["pass"]


def test_sweep_does_not_combine_with_launch():
    proc = run_kernel_py("--sweep", "4x2", "--launch", "bwd:8x2")
    assert proc.returncode != 0 and "does not combine with --launch" in proc.stderr


@pytest.mark.parametrize("letters", ["", "mc"])
def test_forward_launch_keywords_are_kernel_arguments(letters):
    """Triton's interpreter ignores unknown launch keywords, the compiled kernel refuses them: every
    key the forward passes, with any launch option set, must be one of the kernel's arguments."""
    import torch

    from megatron_mtraining.kernels import triton_common, triton_fwd
    try:
        triton_common.LAUNCH_OVERRIDES.update(kernel.parse_launch(f"fwd:4x2{letters}"))
        for dtype in (torch.bfloat16, torch.float32):
            cfg = triton_fwd.forward_launch_config(64, dtype)
            assert set(cfg) - {"num_warps", "num_stages"} <= set(triton_fwd._vs_attn_fwd_kernel.arg_names)
    finally:
        triton_common.LAUNCH_OVERRIDES.clear()


def test_column_tiles_wider_than_a_word_are_refused(monkeypatch):
    """A column tile reads one 64-bit column word: a launch override past 64 columns is an error."""
    import torch

    from megatron_mtraining.kernels import triton_common

    monkeypatch.setitem(triton_common.LAUNCH_OVERRIDES, "fwd", {"BLOCK_COL": 128})
    with pytest.raises(ValueError, match="must divide 64"):
        triton_common.tile_config(128, torch.bfloat16)
