"""How the launchers start Megatron's ranks: never with a bare ``torchrun``.

A ``torchrun`` on PATH may belong to another Python than the one that has the plugin (the GPU
machines' venv reuses the host's torch: ``.venv/bin/torchrun`` does not exist there, and ``torchrun``
runs the host interpreter, without megatron_mtraining). So every launcher and README command runs
``"$PYTHON" -m torch.distributed.run``. Checked here: no bare ``torchrun`` command in the READMEs,
``examples/*.sh``, ``scripts/*.sh`` and the Makefile; the example launchers' commands (``DRY_RUN=1``)
with the default, an explicit and a plugin-less ``PYTHON``, for both entries (launcher, patched
fork); ``scripts/gpu_megatron_lm.sh``'s syntax and its message without the Megatron-LM tarball.
(``tests/test_real_megatron_lm.py`` feeds the printed commands to the real Megatron-LM parser.)
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((REPO / "examples").glob("pretrain_*.sh"))  # the launchers (common.sh: what they source)
SCANNED = sorted({REPO / "README.md", REPO / "examples" / "README.md", REPO / "patches" / "README.md",
                  REPO / "Makefile", *(REPO / "examples").glob("*.sh"), *(REPO / "scripts").glob("*.sh")})
BASH = shutil.which("bash")

pytestmark = pytest.mark.skipif(BASH is None, reason="bash not available")

# `torchrun` in command position: followed by an option, a quoted or $-argument, "...", or a script.
# Prose ("under torchrun", "(torchrun, NCCL)", "`torchrun`") is not a command.
BARE_TORCHRUN = re.compile(r"(?<![\w.-])torchrun(?=[ \t]+(?:-|\"|'|\$|\.\.\.|[\w./-]+\.(?:py|sh)\b))")


@pytest.mark.parametrize("text", [
    "torchrun --nproc_per_node 8 -m megatron_mtraining.launch pretrain_gpt.py",
    "CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun --nproc-per-node 4 examples/pretrain_gpt_mtraining.py \\",
    'torchrun "${DISTRIBUTED_ARGS[@]}" -m megatron_mtraining.launch "$MEGATRON_LM/pretrain_gpt.py" \\',
    "- **Launcher:** `torchrun ... -m megatron_mtraining.launch pretrain_gpt.py <Megatron args>",
    "timeout 100 torchrun $ARGS", ".venv/bin/torchrun --standalone x.py", "torchrun benchmarks/ring.py",
])
def test_bare_torchrun_pattern_flags_commands(text):
    assert BARE_TORCHRUN.search(text)


@pytest.mark.parametrize("text", [
    '"$PYTHON" -m torch.distributed.run --nproc_per_node 8 -m megatron_mtraining.launch pretrain_gpt.py',
    "a ring-only check under torchrun (`python -m torch.distributed.run --nproc_per_node 2 ...`)",
    "# One device call (torchrun, NCCL, bf16)", "Run under `torchrun`; each rank", "torchrun's env",
    'TORCHRUN=("$PY" -m torch.distributed.run --standalone --nproc_per_node)', "a torchrun on PATH may",
])
def test_bare_torchrun_pattern_spares_prose(text):
    assert not BARE_TORCHRUN.search(text)


def test_no_bare_torchrun_in_launchers_and_readmes():
    assert len(EXAMPLES) >= 3 and (REPO / "scripts" / "gpu_megatron_lm.sh") in SCANNED
    found = [f"{path.relative_to(REPO)}:{number}: {line.strip()}"
             for path in SCANNED for number, line in enumerate(path.read_text().splitlines(), 1)
             if BARE_TORCHRUN.search(line)]
    assert not found, "bare torchrun (use \"$PYTHON\" -m torch.distributed.run):\n" + "\n".join(found)


# ------------------------------------------------------------------ example launchers, DRY_RUN=1


def _tree(tmp_path: Path, patched: bool = False) -> Path:
    """A stand-in Megatron-LM folder: what the launchers look at before they print the command."""
    tree = tmp_path / ("fork" if patched else "megatron_lm")
    (tree / "megatron" / "training").mkdir(parents=True)
    (tree / "pretrain_gpt.py").write_text("")
    (tree / "megatron" / "training" / "arguments.py").write_text(
        "def _add_mtraining_args(parser):\n    return parser\n" if patched else "")
    return tree


def _example(script: Path, *args, **env) -> subprocess.CompletedProcess:
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "DRY_RUN": "1", "GPUS_PER_NODE": "2"}
    base.update(env)
    return subprocess.run(["env", "-i", *(f"{k}={v}" for k, v in base.items()), BASH, str(script), *args],
                          capture_output=True, text=True, timeout=60)


ids = [p.name for p in EXAMPLES]


@pytest.mark.parametrize("script", EXAMPLES, ids=ids)
def test_example_starts_ranks_with_python_m_torch_distributed_run(script, tmp_path):
    tree = _tree(tmp_path)
    proc = _example(script, MEGATRON_LM=tree, PYTHON=sys.executable)
    assert proc.returncode == 0, proc.stderr
    cmd = shlex.split(proc.stdout)
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert cmd[cmd.index("--nproc_per_node") + 1] == "2"
    entry = cmd.index("-m", 3)
    assert cmd[entry:entry + 3] == ["-m", "megatron_mtraining.launch", f"{tree}/pretrain_gpt.py"]
    assert "--mtraining" in cmd and "torchrun" not in proc.stdout

    proc = _example(script, "--train-iters", "7", MEGATRON_LM=tree, PYTHON=sys.executable)
    assert shlex.split(proc.stdout) == cmd + ["--train-iters", "7"]  # extra arguments come last


@pytest.mark.parametrize("script", EXAMPLES, ids=ids)
def test_example_fork_entry(script, tmp_path):
    fork = _tree(tmp_path, patched=True)
    proc = _example(script, MEGATRON_LM=fork, PYTHON=sys.executable, MTRAINING_ENTRY="fork")
    assert proc.returncode == 0, proc.stderr
    cmd = shlex.split(proc.stdout)
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    script_at = cmd.index(f"{fork}/pretrain_gpt.py")
    assert "megatron_mtraining.launch" not in cmd and "-m" not in cmd[3:script_at]
    assert "--mtraining" in cmd[script_at:]

    unpatched = _tree(tmp_path)
    proc = _example(script, MEGATRON_LM=unpatched, PYTHON=sys.executable, MTRAINING_ENTRY="fork")
    assert proc.returncode != 0 and "is not patched" in proc.stderr and "git apply" in proc.stderr
    proc = _example(script, MEGATRON_LM=unpatched, PYTHON=sys.executable, MTRAINING_ENTRY="nope")
    assert proc.returncode != 0 and "neither launcher nor fork" in proc.stderr


@pytest.mark.parametrize("script", EXAMPLES, ids=ids)
def test_example_default_python_is_the_repo_venv(script, tmp_path):
    venv_python = REPO / ".venv" / "bin" / "python"
    if not os.access(venv_python, os.X_OK):
        pytest.skip(f"{venv_python} does not exist: the default is then python3 (make setup creates the venv)")
    proc = _example(script, MEGATRON_LM=_tree(tmp_path))  # no PYTHON
    assert proc.returncode == 0, proc.stderr
    assert shlex.split(proc.stdout)[:3] == [str(venv_python), "-m", "torch.distributed.run"]


@pytest.mark.parametrize("script", EXAMPLES, ids=ids)
def test_example_refuses_a_python_without_the_plugin(script, tmp_path):
    foreign = tmp_path / "python-without-plugin"
    foreign.write_text("#!/bin/sh\nexit 1\n")  # find_spec("megatron_mtraining") is None there
    foreign.chmod(0o755)
    proc = _example(script, MEGATRON_LM=_tree(tmp_path), PYTHON=foreign)
    assert proc.returncode != 0 and not proc.stdout
    assert f"PYTHON={foreign} cannot import megatron_mtraining" in proc.stderr
    assert f"{foreign} -m pip install --no-build-isolation -e {REPO}" in proc.stderr

    proc = _example(script, MEGATRON_LM=_tree(tmp_path / "b"), PYTHON=tmp_path / "no-such-python")
    assert proc.returncode != 0 and "is not an executable" in proc.stderr


# ------------------------------------------------------------------ scripts/gpu_megatron_lm.sh

GPU_SCRIPT = REPO / "scripts" / "gpu_megatron_lm.sh"


def test_gpu_megatron_lm_script_syntax():
    proc = subprocess.run([BASH, "-n", str(GPU_SCRIPT)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    text = GPU_SCRIPT.read_text()
    assert 'source "$(dirname "${BASH_SOURCE[0]}")/gpu_common.sh"' in text
    assert "examples/pretrain_small_mtraining.sh" in text and "MTRAINING_ENTRY" in text
    for flag in ("--save", "--load", "--exit-interval", "--ckpt-format torch_dist", "--mtraining-deterministic"):
        assert flag in text, flag
    # Exact resume on the saved state: the resumed and the uninterrupted runs both save at N+M, and
    # scripts/compare_checkpoints.py compares the two checkpoints (tests/test_compare_checkpoints.py).
    assert text.count('--save-interval "$((N + M))"') == 2
    assert 'scripts/compare_checkpoints.py" "$BUILD/ckpt/${name}_resume" "$BUILD/ckpt/${name}_full"' in text
    assert "NVTE_ALLOW_NONDETERMINISTIC_ALGO" in text and "TRANSFORMER_IMPL" in text


def test_gpu_megatron_lm_script_without_tarball(tmp_path):
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "OUT": str(tmp_path / "out"), "DRY_RUN": "1",
           "BUILD_DIR": str(tmp_path / "build"), "MTRAINING_MEGATRON_LM_TARBALL": str(tmp_path / "none.tar.gz")}
    proc = subprocess.run([BASH, str(GPU_SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "megatron-lm-core_r0.19.0.tar.gz not found" in proc.stderr and ".carry/" in proc.stderr
    assert not (tmp_path / "build").exists()


@pytest.mark.parametrize("script", EXAMPLES, ids=ids)
def test_example_tensor_parallel_splits_the_gpus(script, tmp_path):
    """TP=N: tensor parallelism over N GPUs, context parallelism over the rest; a TP that does not
    divide the GPUs stops before anything starts."""
    tree = _tree(tmp_path)

    def sizes(proc):
        assert proc.returncode == 0, proc.stderr
        cmd = shlex.split(proc.stdout)
        return (cmd[cmd.index("--tensor-model-parallel-size") + 1], cmd[cmd.index("--context-parallel-size") + 1])

    assert sizes(_example(script, MEGATRON_LM=tree, PYTHON=sys.executable, GPUS_PER_NODE="8")) == ("1", "8")
    assert sizes(_example(script, MEGATRON_LM=tree, PYTHON=sys.executable, GPUS_PER_NODE="8", TP="2")) == ("2", "4")
    for bad in ("3", "0", "two"):
        proc = _example(script, MEGATRON_LM=tree, PYTHON=sys.executable, GPUS_PER_NODE="8", TP=bad)
        assert proc.returncode != 0 and f"TP={bad} must be a positive divisor of the 8 GPUs" in proc.stderr
