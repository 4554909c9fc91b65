"""The real Megatron-LM tree for tests: where its tarball is, unpacking it, applying the fork patch.

The tarball ``megatron-lm-core_r0.19.0.tar.gz`` (Megatron-LM branch core_r0.19.0, megatron-core
0.19.1: ``megatron/``, ``pretrain_gpt.py``, ``gpt_builders.py``, ``model_provider.py``) is looked
up, first found wins, at

1. ``$MTRAINING_MEGATRON_LM_TARBALL`` (an error, not a skip, when set to a missing file),
2. ``<repo>/../shared/third_party/megatron-lm-core_r0.19.0.tar.gz`` (the team's shared folder),
3. ``<repo>/.carry/megatron-lm-core_r0.19.0.tar.gz`` (the copy that travels to the GPU machines,
   see ``scripts/gpu_megatron_lm.sh``).

Tests that need it skip, saying what they would have run, when none of these exists.
"""

from __future__ import annotations

import os
import subprocess
import tarfile
from pathlib import Path
from typing import List, Optional

import pytest

REPO = Path(__file__).resolve().parents[1]
PATCH = REPO / "patches" / "megatron-lm-core_r0.19.x-mtraining.patch"
TARBALL_NAME = "megatron-lm-core_r0.19.0.tar.gz"
ENV_VAR = "MTRAINING_MEGATRON_LM_TARBALL"
# The files the fork patch edits.
PATCHED_FILES = ("megatron/training/arguments.py", "megatron/training/training.py",
                 "megatron/core/models/gpt/gpt_model.py")


def tarball_candidates() -> List[Path]:
    return [REPO.parent / "shared" / "third_party" / TARBALL_NAME, REPO / ".carry" / TARBALL_NAME]


def find_tarball() -> Optional[Path]:
    explicit = os.environ.get(ENV_VAR)
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            pytest.fail(f"{ENV_VAR}={explicit} is not a file")
        return path
    return next((p for p in tarball_candidates() if p.is_file()), None)


def where() -> str:
    """The places searched, for skip messages."""
    return f"${ENV_VAR}, " + ", ".join(str(p) for p in tarball_candidates())


def require_tarball(would_run: str) -> Path:
    """The tarball, or skip saying what would have run and where the tarball was looked for."""
    tarball = find_tarball()
    if tarball is None:
        pytest.skip(f"Megatron-LM core_r0.19.0 tarball ({TARBALL_NAME}) not found at {where()}: "
                    f"not run: {would_run}")
    return tarball


def unpack(tarball: Path, dest: Path) -> Path:
    """Unpack into ``dest``; returns the folder that holds ``pretrain_gpt.py`` and ``megatron/``."""
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tarball) as tf:
        if hasattr(tarfile, "data_filter"):
            tf.extractall(dest, filter="data")
        else:  # pragma: no cover - Python < 3.11.4
            tf.extractall(dest)
    candidates = [dest] + sorted(p for p in dest.iterdir() if p.is_dir())
    root = next((c for c in candidates if (c / "pretrain_gpt.py").is_file()), None)
    assert root is not None, f"{tarball} holds no pretrain_gpt.py at its top (or one folder down)"
    for needed in ("megatron/training/arguments.py", "gpt_builders.py", "model_provider.py"):
        assert (root / needed).is_file(), f"{tarball}: no {needed} beside pretrain_gpt.py"
    return root


def git(args, cwd: Path, check: bool = False) -> subprocess.CompletedProcess:
    # GIT_CEILING_DIRECTORIES: never let git find an enclosing repository (git apply inside a
    # repository's subdirectory resolves paths from that repository's root, and skips the rest).
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(cwd.parent)}
    proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, env=env, timeout=60)
    if check:
        assert proc.returncode == 0, f"git {' '.join(args)} failed in {cwd}:\n{proc.stdout}\n{proc.stderr}"
    return proc


def apply_patch(root: Path, patch: Path = PATCH) -> None:
    """``git apply --check`` then ``git apply`` in ``root``; asserts it applied exactly once."""
    for rel in PATCHED_FILES:
        assert "mtraining" not in (root / rel).read_text(), f"{rel} already mentions mtraining"
    git(["apply", "--check", "-v", str(patch)], root, check=True)
    git(["apply", str(patch)], root, check=True)
    for rel in PATCHED_FILES:
        assert "mtraining" in (root / rel).read_text(), f"git apply left {rel} unchanged"
    # Applied exactly once: the reverse applies cleanly, a second forward apply does not.
    assert git(["apply", "--check", "-R", str(patch)], root).returncode == 0
    assert git(["apply", "--check", str(patch)], root).returncode != 0


def rerun_on_megatron_core_0_19(test_files: List[str], tmp_path: Path) -> None:
    """Run ``test_files`` again in ONE subprocess on megatron-core 0.19.1 from the unpacked tree
    (the GPU machines' version), on this Python, with the one shim its imports need on Python 3.11
    (``typing.override``). One pytest run for all of them: the tree is unpacked, and pytest,
    torch and megatron-core are imported, once. Asserts that the subprocess imported 0.19 and
    that every file had passing tests and none skipped or failed. Skips without the tarball."""
    import sys
    import xml.etree.ElementTree as ET

    names = [Path(f).name for f in test_files]
    root = unpack(require_tarball(f"{', '.join(names)} on megatron-core 0.19.1"), tmp_path / "tree")
    shim = tmp_path / "shim"
    shim.mkdir()
    # The shim also records the megatron-core version the subprocess runs with (no second process).
    version_file = tmp_path / "megatron_core_version.txt"
    (shim / "sitecustomize.py").write_text(
        "import typing\nif not hasattr(typing, 'override'):\n    typing.override = lambda function: function\n")
    (shim / "megatron_version_probe.py").write_text(
        "import megatron.core.package_info as p\n"
        f"open({str(version_file)!r}, 'w').write(p.__version__)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(shim), str(root), str(REPO)]))
    report = tmp_path / "report.xml"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "megatron_version_probe",
                          "-W", "ignore", f"--junitxml={report}", *test_files], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=900)
    assert version_file.is_file(), run.stdout[-3000:] + run.stderr[-3000:]
    assert version_file.read_text().startswith("0.19"), version_file.read_text()
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]
    passed = {name: 0 for name in names}
    for case in ET.parse(report).iter("testcase"):
        module = (case.get("classname") or "").split(".")[-1] + ".py"
        if module in passed and not list(case):  # no failure, error or skipped child
            passed[module] += 1
    assert all(passed.values()), f"files with no passing test on megatron-core 0.19: {passed}"
