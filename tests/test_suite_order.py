"""The suite's own scheduling data stays true to the files it names (tests/conftest.py)."""

import os

from conftest import LONGEST_FIRST

TESTS = os.path.dirname(os.path.abspath(__file__))


def test_longest_first_names_existing_test_files():
    missing = [name for name in LONGEST_FIRST if not os.path.isfile(os.path.join(TESTS, name))]
    assert not missing, f"tests/conftest.py LONGEST_FIRST names files that no longer exist: {missing}"
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST), "a file is named twice in LONGEST_FIRST"


def test_megatron_core_0_19_rerun_names_existing_files():
    from test_megatron_core_0_19 import FILES

    missing = [name for name in FILES if not os.path.isfile(os.path.join(TESTS, name))]
    assert not missing, f"tests/test_megatron_core_0_19.py reruns files that no longer exist: {missing}"
