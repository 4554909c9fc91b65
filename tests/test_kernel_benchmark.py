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


def test_launch_settings_reach_the_tile_config():
    """--launch becomes the calls' ``Settings.kernel_launch`` (``kernel_settings``); the kernels'
    module holds no overrides of its own."""
    import torch

    from megatron_mtraining.kernels import triton_common
    default = triton_common.tile_config(64, torch.bfloat16, "bwd")
    default_fwd = triton_common.tile_config(64, torch.bfloat16, "fwd")
    assert (default["num_warps"], default["num_stages"]) != (8, 3)  # else the override below shows nothing
    launch = kernel.kernel_settings(kernel.Config(seq_lens=[256], launch="bwd:8x3")).kernel_launch
    assert triton_common.tile_config(64, torch.bfloat16, "bwd", launch) == {**default, "num_warps": 8, "num_stages": 3}
    assert triton_common.tile_config(64, torch.bfloat16, "fwd", launch) == default_fwd  # the other family's own
    assert triton_common.tile_config(64, torch.bfloat16, "bwd") == default
    assert not hasattr(triton_common, "LAUNCH_OVERRIDES")


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

    from megatron_mtraining import Settings
    from megatron_mtraining.kernels import triton_fwd
    launch = Settings(kernel_launch=kernel.parse_launch(f"fwd:4x2{letters}")).kernel_launch
    for dtype in (torch.bfloat16, torch.float32):
        cfg = triton_fwd.forward_launch_config(64, dtype, launch)
        assert set(cfg) - {"num_warps", "num_stages"} <= set(triton_fwd._vs_attn_fwd_kernel.arg_names)


def test_column_tiles_wider_than_a_word_are_refused():
    """A column tile reads one 64-bit column word: a launch override past 64 columns is an error."""
    import torch

    from megatron_mtraining import Settings
    from megatron_mtraining.kernels import triton_common

    wide = Settings(kernel_launch={"fwd": {"BLOCK_COL": 128}})
    with pytest.raises(ValueError, match="must divide 64"):
        triton_common.tile_config(128, torch.bfloat16, "fwd", wide.kernel_launch)


@pytest.mark.parametrize("pattern", ["moba", "random"])
def test_smoke_block_index_times_the_block_kernel_against_the_vs_rate(tmp_path, pattern):
    """--index block: the block index runs through our kernels beside the VS index, its rate is
    put over the VS rate (block_kernel_rate_ratio_128k's figure), and it passes the spot check."""
    out = tmp_path / "kernel.json"
    proc = run_kernel_py("--index", "block", "--block-pattern", pattern, "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["config"]["index"] == "block" and data["config"]["block_pattern"] == pattern
    block = data["runs"][0]["block"]
    assert block["pattern"] == pattern and "errors" not in block and "errors" not in block["ours"]
    assert block["index"]["active_pairs"] > 0 and block["ours"]["fwdbwd_ms"] > 0
    vs_rate = data["runs"][0]["ours"]["fwdbwd_tflops"]
    assert block["rate_ratio_over_vs"]["fwdbwd"] == pytest.approx(block["ours"]["fwdbwd_tflops"] / vs_rate, rel=1e-4)
    assert block["flex"] == {"skipped": "no CUDA"}
    assert data["check"]["block"]["ours"]["pass"] and data["check"]["block"]["pattern"] == pattern
    assert "block " + pattern in proc.stdout


def test_moba_density_and_top_k_follow_the_target_density():
    """The MoBA pattern's top-k is the one whose density (the same whatever the gate picks) is
    closest to --density; the density formula matches a built index."""
    import torch

    from common import fixed_moba_index, moba_density

    from megatron_mtraining import MTrainingConfig
    from megatron_mtraining.block_approx import moba_index

    cfg = kernel.Config(seq_lens=[131072])
    top_k = kernel.moba_top_k_for(131072, cfg)
    assert abs(moba_density(131072, 64, 512, top_k) - 0.05) < 0.005
    q, k = torch.randn(1, 4, 2048, 16), torch.randn(1, 2, 2048, 16)
    for top_k in (1, 2, 5):
        index = moba_index(q, k, MTrainingConfig(block_size=64, index="moba", moba_block_size=256, moba_top_k=top_k))
        assert float(index.density(2048).mean()) == pytest.approx(moba_density(2048, 64, 256, top_k), rel=1e-5)
        fixed = fixed_moba_index(1, 4, 2048, 64, 256, top_k, seed=top_k).validate(2048)  # the ring's MoBA pattern
        assert float(fixed.density(2048).mean()) == pytest.approx(moba_density(2048, 64, 256, top_k), rel=1e-5)
    cfg = kernel.Config(seq_lens=[4096], heads=2, density=0.2)
    index = kernel.random_block_index(cfg, 4096, torch.device("cpu"))
    assert abs(float(index.validate(4096).density(4096).mean()) - 0.2) < 0.03
    assert index.capacity == int(index.n_key_blocks.max())


def test_gpu_block_patterns_script_dry_run_and_cpu_run(tmp_path):
    """scripts/gpu_block_patterns.sh: the two calls behind the block-pattern keys (kernel at 128K on
    one GPU, the MoBA ring at 512K on every GPU), and its shell logic end to end on CPU ranks."""
    script = os.path.join(REPO, "scripts", "gpu_block_patterns.sh")
    env = dict(os.environ, DRY_RUN="1", OUT=str(tmp_path / "dry"), NGPU="4")
    proc = subprocess.run(["bash", script], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    kernel_cmd, ring_cmd = proc.stdout.strip().splitlines()
    assert "benchmarks/kernel.py --seq-lens 131072 --index block --block-pattern moba" in kernel_cmd
    assert "--nproc_per_node 4 benchmarks/ring.py --seq-lens 524288 --variants dense_zigzag,sparse_moba" in ring_cmd
    out = tmp_path / "cpu"
    env = dict(os.environ, OMP_NUM_THREADS="1", REUSE_VENV="1", NGPU="2", RING_SEQ_LEN="512", BENCH_ARGS="--smoke",
               OUT=str(out))
    proc = subprocess.run(["bash", script], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "kernel rc=0" in proc.stdout and "ring rc=0" in proc.stdout, proc.stdout
    kernel_json = json.loads(next(out.glob("kernel_block_moba_*.json")).read_text())
    ring_json = json.loads(next(out.glob("ring_moba_*_2gpu.json")).read_text())
    assert kernel_json["runs"][0]["block"]["rate_ratio_over_vs"]["fwdbwd"] > 0
    assert ring_json["runs"][0]["variants"]["sparse_moba"]["speedup"]["vs_best_dense"] > 0
    assert (out / "block_patterns_logs.tgz").exists() and not list(out.glob("*.png"))
