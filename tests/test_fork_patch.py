"""patches/megatron-lm-core_r0.19.x-mtraining.patch applies to the megatron-core 0.19.2 wheel.

Downloads the wheel (no install: it needs Python 3.12) into pytest's tmp dir, extracts its
``megatron/`` tree, runs ``git apply --check`` and ``git apply`` there, and checks the patched
files: they compile, ``--mtraining`` is registered in ``add_megatron_arguments``, the backend
selection is in ``pretrain``, and the GPTModel spec hook exists. ``_add_mtraining_args`` is
also run on a bare argparse parser (lifted out of the patched file with ``ast``, so neither
torch nor megatron-core is imported), with and without megatron_mtraining importable.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import py_compile
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PATCH = REPO / "patches" / "megatron-lm-core_r0.19.x-mtraining.patch"
WHEEL_SPEC = "megatron-core==0.19.2"
PATCHED_FILES = ("megatron/training/arguments.py", "megatron/training/training.py",
                 "megatron/core/models/gpt/gpt_model.py")


def _download_wheel(dest: Path) -> Path:
    """The megatron-core 0.19.2 wheel: the copy carried in ./.whl/ for the GPU machines when there
    is one (no network needed), else from PyPI (skipped when PyPI is out of reach)."""
    carried = sorted((REPO / ".whl").glob("megatron_core-0.19.2-*.whl"))
    if carried:
        return carried[0]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-cache-dir", "--no-deps",
           "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
           "--platform", "manylinux_2_28_x86_64", "-d", str(dest), WHEEL_SPEC]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    except subprocess.TimeoutExpired:
        pytest.skip(f"pip download {WHEEL_SPEC} timed out (no network to PyPI?)")
    wheels = sorted(dest.glob("megatron_core-0.19.2-*.whl"))
    if proc.returncode != 0 or not wheels:
        pytest.skip(f"pip download {WHEEL_SPEC} failed (no network to PyPI?): "
                    f"{(proc.stderr or proc.stdout).strip()[-500:]}")
    return wheels[0]


def _git(args, cwd: Path) -> subprocess.CompletedProcess:
    # GIT_CEILING_DIRECTORIES: never let git find an enclosing repository (git apply inside a
    # repo's subdirectory resolves paths from the repo root).
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(cwd.parent)}
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, env=env, timeout=60)


@pytest.fixture(scope="module")
def patched_tree(tmp_path_factory) -> Path:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    assert PATCH.is_file(), PATCH
    wheel = _download_wheel(tmp_path_factory.mktemp("wheel"))
    root = tmp_path_factory.mktemp("megatron_lm")
    with zipfile.ZipFile(wheel) as zf:
        members = [m for m in zf.namelist() if m.startswith("megatron/")]
        assert members, f"{wheel.name} holds no megatron/ tree"
        zf.extractall(root, members)
    for rel in PATCHED_FILES:
        assert "mtraining" not in (root / rel).read_text(), f"{rel} already mentions mtraining"

    check = _git(["apply", "--check", "-v", str(PATCH)], root)
    assert check.returncode == 0, f"git apply --check failed:\n{check.stdout}\n{check.stderr}"
    applied = _git(["apply", str(PATCH)], root)
    assert applied.returncode == 0, f"git apply failed:\n{applied.stdout}\n{applied.stderr}"
    # Applied exactly once: the reverse applies cleanly, a second forward apply does not.
    assert _git(["apply", "--check", "-R", str(PATCH)], root).returncode == 0
    assert _git(["apply", "--check", str(PATCH)], root).returncode != 0
    return root


def _function(tree: ast.Module, name: str) -> ast.FunctionDef:
    found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    assert len(found) == 1, f"expected one top-level def {name}"
    return found[0]


def _calls(node: ast.AST) -> list:
    return [ast.unparse(n.func) for n in ast.walk(node) if isinstance(n, ast.Call)]


def test_patched_files_compile(patched_tree, tmp_path):
    for rel in PATCHED_FILES:
        py_compile.compile(str(patched_tree / rel), cfile=str(tmp_path / (Path(rel).name + "c")),
                           doraise=True)


def test_arguments_register_mtraining(patched_tree):
    source = (patched_tree / "megatron/training/arguments.py").read_text()
    tree = ast.parse(source)
    assert "_add_mtraining_args" in _calls(_function(tree, "add_megatron_arguments"))
    body = ast.unparse(_function(tree, "_add_mtraining_args"))
    assert "megatron_mtraining.integration.args" in body and "add_mtraining_args(parser)" in body
    assert "'--mtraining'" in body and "pip install megatron-mtraining" in body


def _load_add_mtraining_args(patched_tree):
    tree = ast.parse((patched_tree / "megatron/training/arguments.py").read_text())
    module = ast.Module(body=[_function(tree, "_add_mtraining_args")], type_ignores=[])
    namespace = {"argparse": argparse}
    exec(compile(module, "arguments.py:_add_mtraining_args", "exec"), namespace)
    return namespace["_add_mtraining_args"]


def test_add_mtraining_args_delegates_to_plugin(patched_tree):
    add = _load_add_mtraining_args(patched_tree)
    parser = add(argparse.ArgumentParser())
    args = parser.parse_args(["--mtraining", "--mtraining-top-p", "0.5", "--mtraining-dense-layers", "2"])
    assert args.mtraining is True and args.mtraining_top_p == 0.5 and args.mtraining_dense_layers == 2
    assert parser.parse_args([]).mtraining is False

    from megatron_mtraining.config import MTrainingConfig

    assert MTrainingConfig.from_args(args).top_p == 0.5


def test_add_mtraining_args_without_plugin(patched_tree, monkeypatch, capsys):
    add = _load_add_mtraining_args(patched_tree)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "megatron_mtraining" else real_find_spec(name, *a))
    parser = add(argparse.ArgumentParser())
    assert parser.parse_args([]).mtraining is False
    with pytest.raises(SystemExit):
        parser.parse_args(["--mtraining"])
    assert "pip install megatron-mtraining" in capsys.readouterr().err


def test_training_selects_backend(patched_tree):
    tree = ast.parse((patched_tree / "megatron/training/training.py").read_text())
    body = ast.unparse(_function(tree, "pretrain"))
    assert "getattr(args, 'mtraining', False)" in body
    selection = "mtraining_gpt_model.transformer_layer_spec_hook = enable_mtraining(args)"
    assert "from megatron_mtraining.integration.enable import enable_mtraining" in body
    assert selection in body
    # Selection happens after initialize_megatron has parsed the args, before the model is built.
    assert body.index("initialize_megatron(") < body.index(selection)
    assert body.index(selection) < body.index("setup_model_and_optimizer(")


def test_gpt_model_applies_spec_hook(patched_tree):
    tree = ast.parse((patched_tree / "megatron/core/models/gpt/gpt_model.py").read_text())
    assert any(isinstance(n, ast.Assign) and ast.unparse(n) == "transformer_layer_spec_hook = None"
               for n in tree.body)
    gpt = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GPTModel"][0]
    init = ast.unparse(_function(gpt, "__init__"))
    hook = "transformer_layer_spec = transformer_layer_spec_hook(transformer_layer_spec)"
    assert hook in init and init.index(hook) < init.index("self.transformer_layer_spec: ModuleSpec")
