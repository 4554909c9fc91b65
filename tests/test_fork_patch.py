"""patches/megatron-lm-core_r0.19.x-mtraining.patch applies to the trees users fork.

Two trees, each unpacked into pytest's tmp dir, ``git apply --check`` then ``git apply``:

* ``megatron-lm``: Megatron-LM branch core_r0.19.0 from its tarball (``megatron-lm-core_r0.19.0.tar.gz``,
  found at ``$MTRAINING_MEGATRON_LM_TARBALL``, ``<repo>/../shared/third_party/`` or ``<repo>/.carry/``:
  see ``tests/megatron_lm_tree.py``); skipped when none is there.
* ``wheel``: the ``megatron/`` tree of the megatron-core 0.19.2 wheel, from ``<repo>/.whl/`` when
  carried there; downloaded from PyPI (no install: it needs Python 3.12) only as the fallback when
  the Megatron-LM tarball is absent, and skipped otherwise.

On each, the patched files are checked without importing them (this file's Python may not import
megatron-core 0.19): they compile, ``--mtraining`` is registered in ``add_megatron_arguments``, the
backend selection is in ``pretrain``, and the GPTModel spec hook exists. ``_add_mtraining_args`` is
also run on a bare argparse parser (lifted out of the patched file with ``ast``), with the plugin
importable, not importable, and broken. ``tests/test_real_megatron_lm.py`` runs the patched real
tree's own parser and ``pretrain()``.
"""

from __future__ import annotations

import argparse
import ast
import importlib.abc
import os
import py_compile
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from megatron_lm_tree import PATCH, PATCHED_FILES, REPO, apply_patch, find_tarball, require_tarball, unpack, where

WHEEL_SPEC = "megatron-core==0.19.2"


def _wheel(dest: Path) -> Path:
    """The megatron-core 0.19.2 wheel: the copy carried in ./.whl/ when there is one; else, only when
    the Megatron-LM tarball is absent, from PyPI (skipped when PyPI is out of reach)."""
    carried = sorted((REPO / ".whl").glob("megatron_core-0.19.2-*.whl"))
    if carried:
        return carried[0]
    tarball = find_tarball()
    if tarball is not None:
        pytest.skip(f"megatron-core 0.19.2 wheel not carried in {REPO / '.whl'}; not downloading it since "
                    f"the real Megatron-LM tree ({tarball}) is tested instead")
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


@pytest.fixture(scope="module", params=["megatron-lm", "wheel"])
def patched_tree(request, tmp_path_factory) -> Path:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    assert PATCH.is_file(), PATCH
    if request.param == "megatron-lm":
        tarball = require_tarball(f"the fork patch on Megatron-LM core_r0.19.0 ({PATCH.name})")
        root = unpack(tarball, tmp_path_factory.mktemp("megatron_lm"))
    else:
        wheel = _wheel(tmp_path_factory.mktemp("wheel"))
        root = tmp_path_factory.mktemp("megatron_core_wheel")
        with zipfile.ZipFile(wheel) as zf:
            members = [m for m in zf.namelist() if m.startswith("megatron/")]
            assert members, f"{wheel.name} holds no megatron/ tree"
            zf.extractall(root, members)
    apply_patch(root)
    return root


def test_tarball_location_documented():
    """The skip messages name every place the tarball is looked for (none of them is a guess)."""
    assert "MTRAINING_MEGATRON_LM_TARBALL" in where()
    assert "shared/third_party/megatron-lm-core_r0.19.0.tar.gz" in where()
    assert ".carry/megatron-lm-core_r0.19.0.tar.gz" in where()


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
    assert "'--mtraining'" in body and "sys.executable" in body and "pip install" in body


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


def _missing_plugin_error(patched_tree, capsys) -> str:
    add = _load_add_mtraining_args(patched_tree)
    parser = add(argparse.ArgumentParser(prog="pretrain_gpt.py"))
    assert parser.parse_args([]).mtraining is False  # the fork still runs without --mtraining
    assert not any(o.startswith("--mtraining-") for o in parser._option_string_actions)
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--mtraining"])
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_add_mtraining_args_without_plugin(patched_tree, monkeypatch, capsys):
    # Not installed for this interpreter: the import fails as a missing module does.
    monkeypatch.setitem(sys.modules, "megatron_mtraining.integration.args", None)
    err = _missing_plugin_error(patched_tree, capsys)
    assert "--mtraining needs the MTraining plugin" in err
    assert f"this Python, {sys.executable}, cannot import" in err  # names the interpreter that looked
    assert f"{sys.executable} -m pip install --no-build-isolation -e" in err  # how, with that one
    assert "-m torch.distributed.run" in err and "torchrun" in err


class _BrokenPlugin(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "megatron_mtraining.integration.args":
            raise RuntimeError("extension built for another torch")
        return None


def test_add_mtraining_args_with_broken_plugin(patched_tree, monkeypatch, capsys):
    """A plugin that is installed but fails to import breaks only --mtraining, and says why."""
    monkeypatch.delitem(sys.modules, "megatron_mtraining.integration.args")
    monkeypatch.setattr(sys, "meta_path", [_BrokenPlugin(), *sys.meta_path])
    err = _missing_plugin_error(patched_tree, capsys)
    assert "RuntimeError: extension built for another torch" in err and sys.executable in err


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
    # A run that ends on a telemetry log iteration logs it after the training loop, before evaluation.
    flush = "disable_telemetry(flush=True)"
    assert body.index("train(") < body.index(flush) < body.index("evaluate_and_print_results(")


def test_gpt_model_applies_spec_hook(patched_tree):
    tree = ast.parse((patched_tree / "megatron/core/models/gpt/gpt_model.py").read_text())
    assert any(isinstance(n, ast.Assign) and ast.unparse(n) == "transformer_layer_spec_hook = None"
               for n in tree.body)
    gpt = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GPTModel"][0]
    init = ast.unparse(_function(gpt, "__init__"))
    hook = "transformer_layer_spec = transformer_layer_spec_hook(transformer_layer_spec)"
    assert hook in init and init.index(hook) < init.index("self.transformer_layer_spec: ModuleSpec")
