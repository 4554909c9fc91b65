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


# ------------------------------------------------------------------------------------------------
# Wheels carried split over two device calls (stash_wheel_parts, then install_split_wheels)
# ------------------------------------------------------------------------------------------------


def make_wheel(folder):
    """A small pure-Python wheel whose module is reachable only through its .pth file (as
    nvidia-cutlass-dsl's `cutlass`), padded so that it splits into several parts."""
    import base64
    import hashlib
    import zipfile

    files = {
        "split_demo/__init__.py": "VALUE = 7\n",
        "split_demo/extra/hidden_mod.py": "MARK = 'via pth'\n# " + "x" * 4000 + "\n",
        "split_demo.pth": "import os, split_demo; import sys; "
                          "sys.path.insert(0, os.path.join(split_demo.__path__[0], 'extra'))\n",
        "split_demo-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: split-demo\nVersion: 1.0\n",
        "split_demo-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                          "Tag: py3-none-any\n",
    }
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(text.encode())}")
    record.append("split_demo-1.0.dist-info/RECORD,,")
    files["split_demo-1.0.dist-info/RECORD"] = "\n".join(record) + "\n"
    path = folder / "split_demo-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, text in files.items():
            z.writestr(name, text)
    return path


def split_into(path, first, second, size=1500):
    """Parts NAME.partNN of ``size`` bytes: the first in ``first``, the others in ``second``."""
    data = path.read_bytes()
    chunks = [data[i:i + size] for i in range(0, len(data), size)]
    assert len(chunks) >= 3
    for i, chunk in enumerate(chunks):
        ((first if i == 0 else second) / f"{path.name}.part{i:02d}").write_bytes(chunk)


def run_phases(tmp_path, second_call):
    parts = tmp_path / "parts"
    script = (f"export WHEEL_PARTS={parts} OUT={tmp_path}/out; source {REPO}/scripts/gpu_common.sh >/dev/null && "
              f"stash_wheel_parts {tmp_path}/a >/dev/null && {second_call}")
    return subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300)


def test_split_wheel_is_joined_installed_and_its_pth_runs(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    split_into(make_wheel(tmp_path), tmp_path / "a", tmp_path / "b")
    site = tmp_path / "site"
    done = run_phases(tmp_path, f"install_split_wheels {tmp_path}/b {site} && "
                                f"{sys.executable} -c 'import split_demo, hidden_mod; print(split_demo.VALUE, hidden_mod.MARK)'")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("7 via pth")


def test_a_missing_part_is_refused_before_pip(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    split_into(make_wheel(tmp_path), tmp_path / "a", tmp_path / "b")
    sorted((tmp_path / "b").iterdir())[0].unlink()  # the second call forgot a part
    done = run_phases(tmp_path, f"install_split_wheels {tmp_path}/b {tmp_path}/site")
    assert done.returncode != 0
    assert "broken" in done.stderr
    assert not (tmp_path / "site").exists()


def test_source_tree_names_the_code_that_ran(tmp_path):
    """A result's meta.source_tree is the tree of the files the run read, committed or not, and
    which_commit.py finds the commit that has it (device copies carry a stale .git HEAD)."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import shutil

    clone = tmp_path / "clone"
    subprocess.run(["git", "init", "-q", str(clone)], check=True)
    bench = clone / "benchmarks"
    bench.mkdir()
    for name in ("common.py", "corpus.py", "which_commit.py"):
        shutil.copy(os.path.join(REPO, "benchmarks", name), bench / name)
    (clone / ".gitignore").write_text("out/\n__pycache__/\n")
    git = ["git", "-C", str(clone), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "first"], check=True)
    first = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    (clone / "kernel.txt").write_text("new code\n")  # not committed yet: the "device copy" state
    (clone / "out").mkdir()
    (clone / "out" / "ignored.json").write_text("{}")  # ignored files are not part of the tree
    probe = ("import json, sys; sys.path.insert(0, 'benchmarks'); import common; "
             "print(json.dumps({'meta': {'commit': 'x', 'source_tree': common.source_tree()}}))")
    run = subprocess.run([sys.executable, "-c", probe], cwd=clone, capture_output=True, text=True, check=True)
    result = clone / "out" / "result.json"
    result.write_text(run.stdout)
    tree = json.loads(run.stdout)["meta"]["source_tree"]
    assert tree and tree != subprocess.run([*git, "rev-parse", "HEAD^{tree}"], capture_output=True,
                                           text=True).stdout.strip()
    assert subprocess.run([*git, "status", "--porcelain"], capture_output=True, text=True).stdout.count("??") == 1
    which = [sys.executable, "benchmarks/which_commit.py", str(result)]
    old_result = clone / "out" / "old.json"  # results from before source_tree: said, not guessed
    old_result.write_text(json.dumps({"meta": {"commit": "abc1234"}}))
    old = subprocess.run([sys.executable, "benchmarks/which_commit.py", str(old_result)], cwd=clone,
                         capture_output=True, text=True)
    assert old.returncode == 1 and "no source_tree in its meta" in old.stdout
    missing = subprocess.run(which, cwd=clone, capture_output=True, text=True)
    assert missing.returncode == 1 and "no commit has it" in missing.stdout
    subprocess.run([*git, "add", "kernel.txt"], check=True)
    subprocess.run([*git, "commit", "-qm", "second"], check=True)
    second = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    found = subprocess.run(which, cwd=clone, capture_output=True, text=True)
    assert found.returncode == 0 and second in found.stdout and first not in found.stdout
