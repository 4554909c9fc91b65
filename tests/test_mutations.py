"""The mutation check (scripts/mutation_check.py, docs/testing.md): its list still matches the
code, it reports a break that no test catches, and the tests catch every break of its CI subset."""

import importlib.util
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "mutation_check.py")


def _load():
    spec = importlib.util.spec_from_file_location("mutation_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


mutation_check = _load()


def test_every_target_occurs_once_in_the_code():
    assert mutation_check.check_targets(mutation_check.MUTATIONS) == []
    assert any(m.ci for m in mutation_check.MUTATIONS) and not all(m.ci for m in mutation_check.MUTATIONS)


def test_a_stale_target_is_reported():
    stale = mutation_check.Mutation("stale", "megatron_mtraining/layout.py", "no such text", "x",
                                    ("tests/test_layout.py",), "nothing")
    gone = mutation_check.Mutation("gone", "megatron_mtraining/layout.py", "def shard_sequence(", "def f(",
                                   ("tests/no_such_file.py",), "nothing")
    problems = mutation_check.check_targets([stale, gone, gone])
    assert any(p.startswith("stale: the target text occurs 0 times") for p in problems), problems
    assert any("tests/no_such_file.py does not exist" in p for p in problems), problems
    assert any(p.startswith("gone: the name is used twice") for p in problems), problems


def test_a_break_no_test_catches_survives():
    """A replacement that changes no behaviour (a docstring's words) passes its tests: SURVIVED."""
    harmless = mutation_check.Mutation(
        "harmless", "megatron_mtraining/layout.py",
        '"""The tokens of ``rank`` from a full sequence along ``dim``, in the layout\'s local order."""',
        '"""The tokens of ``rank`` along ``dim``, in the layout\'s local order."""',
        ("tests/test_layout.py", "-k", "single_rank_holds_everything_in_order"), "nothing")
    assert mutation_check.check_targets([harmless]) == []
    [(_, verdict, _)] = mutation_check.run([harmless], timeout=300)
    assert verdict == "SURVIVED"


@pytest.mark.slow
def test_the_tests_catch_every_break_of_the_ci_subset():
    """40-65 s on 2 CPU cores (docs/testing.md); the full list runs on demand."""
    proc = subprocess.run([sys.executable, SCRIPT, "--ci"], cwd=REPO, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    assert f"{sum(m.ci for m in mutation_check.MUTATIONS)} of " in proc.stdout
