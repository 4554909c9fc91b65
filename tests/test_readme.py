"""Every ```python sample of README.md runs as written, on the CPU, in a fresh process; a sample
that starts a process group runs under torch.distributed.run with 2 gloo processes (as the
README says to run it). Also the front door: the two commands near the top, the venv, the length."""

import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def readme():
    with open(README, encoding="utf-8") as fh:
        return fh.read()


def samples():
    text = readme()
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in PYTHON_BLOCK.finditer(text)]


def test_readme_has_python_samples():
    assert len(samples()) >= 3, "the README's Python API samples are missing or no longer ```python blocks"


@pytest.mark.parametrize("line, code", samples(), ids=lambda x: f"line{x}" if isinstance(x, int) else "")
def test_readme_sample_runs_on_cpu(tmp_path, line, code):
    script = tmp_path / f"readme_line{line}.py"
    script.write_text(code)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    if "init_process_group" in code:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    else:
        cmd = [sys.executable, str(script)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"README.md line {line}: the sample failed\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def test_front_door():
    lines = readme().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; keep it a user's page (details go to docs/)"
    first = "\n".join(lines[:30])
    assert "make demo" in first and "make test" in first, "the two commands belong near the top"
    assert "source .venv/bin/activate" in readme(), "say how to get the Python with the plugin"
