"""The suite says what it does not run: every skip's reason is in the summary, and a broken Triton
interpreter (whose tests would all skip) fails the run unless skipping is asked for
(tests/conftest.py)."""

import os
import subprocess
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)

# pytest in a fresh process whose numpy reports a version Triton 3.6's interpreter fails with.
_BROKEN = ("import sys, numpy, pytest; numpy.__version__ = '2.4.0'; "
           "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'tests/test_config.py', '-k', 'defaults'{}]))")


def _run(allow: bool, gpu_only: bool = False):
    env = {k: v for k, v in os.environ.items() if k != "MTRAINING_ALLOW_BROKEN_INTERPRETER"}
    env.update(OMP_NUM_THREADS="1", **({"MTRAINING_ALLOW_BROKEN_INTERPRETER": "1"} if allow else {}))
    code = _BROKEN.format(", '-m', 'gpu'" if gpu_only else "")
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=env)


def test_a_broken_interpreter_fails_the_run():
    proc = _run(allow=False)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "does not work with numpy 2.4.0" in proc.stdout + proc.stderr
    assert "passed" not in proc.stdout  # stopped before running anything
    allowed = _run(allow=True)
    assert allowed.returncode == 0 and "passed" in allowed.stdout, allowed.stdout[-2000:] + allowed.stderr[-2000:]
    gpu_only = _run(allow=False, gpu_only=True)  # -m gpu needs no interpreter: not stopped (nothing selected)
    assert gpu_only.returncode == 5 and "does not work" not in gpu_only.stdout + gpu_only.stderr, gpu_only.stdout


def test_skip_reasons_are_in_the_summary():
    with open(os.path.join(REPO, "pyproject.toml"), encoding="utf-8") as fh:
        text = fh.read()
    options = text.split("[tool.pytest.ini_options]", 1)[1].split("\n[", 1)[0]
    assert any(line.split("=", 1)[0].strip() == "addopts" and "-rs" in line for line in options.splitlines())
