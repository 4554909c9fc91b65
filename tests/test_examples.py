"""Static checks of the shell launchers under examples/ (fast; no Megatron, no GPU)."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from megatron_mtraining.integration.args import add_mtraining_args

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SCRIPTS = sorted(EXAMPLES.glob("*.sh"))
EXPECTED = {"pretrain_qwen2.5_3b_512k_mtraining.sh", "pretrain_llama3.1_8b_512k_mtraining.sh",
            "pretrain_small_mtraining.sh"}
BASH = shutil.which("bash")

pytestmark = pytest.mark.skipif(BASH is None, reason="bash not available")
ids = [p.name for p in SCRIPTS]


def _code(path: Path) -> str:
    """Script text without comment-only lines."""
    return "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("#"))


def test_expected_scripts_present():
    assert EXPECTED <= {p.name for p in SCRIPTS}
    assert (EXAMPLES / "README.md").is_file()


@pytest.mark.parametrize("script", SCRIPTS, ids=ids)
def test_bash_syntax(script):
    r = subprocess.run([BASH, "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=ids)
def test_uses_launcher_and_mtraining(script):
    code = _code(script)
    assert "set -euo pipefail" in code
    assert re.search(r"-m megatron_mtraining\.launch \"\$MEGATRON_LM/pretrain_gpt\.py\"", code)
    assert re.search(r"(?<![\w-])--mtraining(?![\w-])", code)
    for flag in ("--mtraining-top-p", "--mtraining-layout", "--mtraining-block-size",
                 "--mtraining-log-interval", "--mtraining-inner-ring-size", "--attention-dropout 0",
                 "--context-parallel-size", "--bf16", "--micro-batch-size 1", "--mock-data"):
        assert flag in code, flag
    for var in ("GPUS_PER_NODE", "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "DATA_PATH",
                "TOKENIZER_MODEL", "CHECKPOINT_PATH"):
        assert "${" + var in code, var
    assert "--use-flash-attn" not in code


def _run_env(script, **env):
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    base.update(env)
    return subprocess.run(["env", "-i", *(f"{k}={v}" for k, v in base.items()), BASH, str(script)],
                          capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("script", SCRIPTS, ids=ids)
def test_missing_megatron_lm_fails_clearly(script, tmp_path):
    r = _run_env(script)
    assert r.returncode != 0
    assert "MEGATRON_LM is not set" in r.stderr
    r = _run_env(script, MEGATRON_LM=str(tmp_path))     # exists, but no pretrain_gpt.py
    assert r.returncode != 0
    assert "does not contain pretrain_gpt.py" in r.stderr


def test_mtraining_flags_exist():
    parser = add_mtraining_args(argparse.ArgumentParser())
    known = set(parser._option_string_actions)
    seen = set()
    for script in SCRIPTS:
        used = set(re.findall(r"(?<![\w-])--mtraining[\w-]*", _code(script)))
        assert used, script.name
        unknown = used - known
        assert not unknown, f"{script.name}: {sorted(unknown)} not defined by add_mtraining_args"
        seen |= used
    assert {"--mtraining", "--mtraining-top-p", "--mtraining-layout", "--mtraining-block-size"} <= seen


@pytest.mark.parametrize("script", SCRIPTS, ids=ids)
def test_mtraining_values_parse(script):
    """The literal --mtraining* values in the script are accepted by the parser (choices, types)."""
    parser = add_mtraining_args(argparse.ArgumentParser())
    code = _code(script)
    argv = ["--mtraining"]
    for flag in ("--mtraining-top-p", "--mtraining-layout", "--mtraining-block-size"):
        m = re.search(re.escape(flag) + r"\s+(\S+)", code)
        assert m, flag
        argv += [flag, m.group(1)]
    args = parser.parse_args(argv)
    assert args.mtraining and args.mtraining_top_p == 0.9
    assert args.mtraining_layout == "striped" and args.mtraining_block_size == 64
