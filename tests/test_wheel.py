"""A regular install works outside the source tree: the package is built into a wheel (from a
copy of the tree, so the build leaves nothing in it), the wheel is installed into a folder of its
own, and from a folder outside the repository, with only that install and the environment's
torch on the path (``python -S``: no site hooks, so not the editable install either), the planner
answers from the device profiles the wheel carries and the README's one-device sample runs.
The compiled extension is left out (``MTRAINING_NO_EXT=1``): it is optional, and compiling it
costs minutes; the package's data files are the point here."""

import os
import re
import shutil
import site
import subprocess
import sys
import zipfile

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
PROFILES = os.path.join(REPO, "megatron_mtraining", "plan", "profiles")


def _run(cmd, cwd, env, timeout=180):
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(the folder the wheel was installed into, the wheel's file names)."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    os.makedirs(source)
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(os.path.join(REPO, name), source / name)
    shutil.copytree(os.path.join(REPO, "megatron_mtraining"), source / "megatron_mtraining",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    env = dict(os.environ, MTRAINING_NO_EXT="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INDEX="1")
    _run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
          "-w", str(root / "dist")], cwd=root, env=env)
    wheels = list((root / "dist").glob("megatron_mtraining-*.whl"))
    assert len(wheels) == 1, wheels
    target = root / "site"
    _run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(target), str(wheels[0])],
         cwd=root, env=env)
    with zipfile.ZipFile(wheels[0]) as whl:
        names = whl.namelist()
    return target, names


def _outside_env(target):
    """Only the installed copy and the site-packages folders holding torch and the other
    dependencies; under ``python -S`` their ``.pth`` hooks (the editable install's) do not run."""
    deps = [os.path.dirname(os.path.dirname(torch.__file__))]
    deps += [p for p in site.getsitepackages() + [site.getusersitepackages()] if os.path.isdir(p) and p not in deps]
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(target)] + deps), CUDA_VISIBLE_DEVICES="",
                OMP_NUM_THREADS="1")


def test_the_wheel_carries_the_device_profiles(installed):
    _, names = installed
    profiles = sorted(f for f in os.listdir(PROFILES) if f.endswith(".json"))
    assert profiles, "no device profiles in the source tree"
    missing = [f for f in profiles if f"megatron_mtraining/plan/profiles/{f}" not in names]
    assert not missing, f"the wheel leaves out the planner's profiles {missing}"


def test_the_installed_planner_runs_outside_the_tree(installed, tmp_path):
    target, _ = installed
    env = _outside_env(target)
    where = _run([sys.executable, "-S", "-c", "import megatron_mtraining; print(megatron_mtraining.__file__)"],
                 cwd=tmp_path, env=env)
    assert where.strip().startswith(str(target)), f"imported {where.strip()}, not the installed copy"
    out = _run([sys.executable, "-S", "-m", "megatron_mtraining.plan", "--gpus", "4", "--seq-length", "262144"],
               cwd=tmp_path, env=env)
    assert "nvidia-h100 x 4" in out and "mtraining_flat" in out, out


def test_the_readme_one_device_sample_runs_from_the_installed_copy(installed, tmp_path):
    target, _ = installed
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as fh:
        first = PYTHON_BLOCK.search(fh.read()).group(1)
    assert "sparse_attention(q, k, v, index)" in first, "the README's first sample is no longer the one-device one"
    script = tmp_path / "readme_sample.py"
    script.write_text("import megatron_mtraining\nassert megatron_mtraining.__file__.startswith("
                      f"{str(target)!r}), megatron_mtraining.__file__\n" + first)
    out = _run([sys.executable, "-S", str(script)], cwd=tmp_path, env=_outside_env(target), timeout=300)
    assert "max difference to the reference:" in out, out
