"""scripts/gpu_common.sh names the commit a GPU job ran: a device copy can carry the .git of an
older checkout, so a tracked tree that differs from that HEAD must be marked "+dirty" (and the
benchmarks' metadata then says dirty), never reported as the clean commit."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def job_commit(tree, env_commit=None):
    env = {k: v for k, v in os.environ.items() if k != "GIT_COMMIT"}
    if env_commit:
        env["GIT_COMMIT"] = env_commit
    script = f'OUT={tree}/out; source {tree}/scripts/gpu_common.sh >/dev/null && echo "$GIT_COMMIT"'
    return subprocess.run(["bash", "-c", script], cwd=tree, capture_output=True, text=True, env=env,
                          timeout=60).stdout.strip()


@pytest.fixture
def tree(tmp_path):
    """A copy of scripts/ in a fresh git repository with one commit."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "gpu_common.sh").write_text(open(os.path.join(REPO, "scripts", "gpu_common.sh")).read())
    (tmp_path / "file.txt").write_text("a\n")
    git = lambda *a: subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)  # noqa: E731
    git("init", "-q")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True,
                          text=True).stdout.strip()
    return tmp_path, head


def test_clean_tree_names_its_head(tree):
    path, head = tree
    assert job_commit(path) == head


def test_a_tree_that_differs_from_the_carried_head_is_marked_dirty(tree):
    path, head = tree
    (path / "file.txt").write_text("b\n")
    assert job_commit(path) == head + "+dirty"


def test_an_explicit_commit_wins(tree):
    path, _ = tree
    (path / "file.txt").write_text("b\n")
    assert job_commit(path, "abc1234") == "abc1234"


def test_benchmark_metadata_reads_the_dirty_mark(monkeypatch):
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import common
    monkeypatch.setenv("GIT_COMMIT", "f83643e+dirty")
    assert common.git_commit() == {"commit": "f83643e", "dirty": True}
    monkeypatch.setenv("GIT_COMMIT", "5856e0f")
    assert json.loads(json.dumps(common.git_commit())) == {"commit": "5856e0f", "dirty": None}
