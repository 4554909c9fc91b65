"""Which commit's code produced a benchmark result: its ``meta.source_tree`` (the git tree hash of
the files the run read, ``common.source_tree``) looked up among this repository's commits.

Device copies carry the session's first commit as their .git, so a result's ``meta.commit`` may
name older code than ran; the tree hash does not.

    python benchmarks/which_commit.py benchmarks/results/kernel_nvidia-h200.json [...]
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import commit_of_tree  # noqa: E402


def main(argv=None) -> int:
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    unresolved = 0
    for path in paths:
        with open(path) as f:
            meta = json.load(f).get("meta", {})
        tree = meta.get("source_tree")
        commit = commit_of_tree(tree) if tree else None
        unresolved += commit is None
        why = "no source_tree in its meta" if not tree else f"tree {tree}: no commit has it (uncommitted code?)"
        print(f"{path}: {commit or why} (meta.commit {meta.get('commit')})")
    return 1 if unresolved else 0


if __name__ == "__main__":
    sys.exit(main())
