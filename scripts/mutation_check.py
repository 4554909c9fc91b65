"""Mutation check: does the test suite catch small breaks of the core behaviours?

    python scripts/mutation_check.py [--ci] [--only NAME ...] [--list] [--check-targets]
                                     [--baseline] [--keep] [--timeout S]

Each entry of ``MUTATIONS`` is one small textual replacement at a named place of the package
(the causal mask inside the diagonal block, a slash offset or a column dropped, the ring's dK/dV
merge and its source order, the agreement's comparison, the approximator's softmax scale, budget,
normaliser and document weights, a document boundary, the kernels' token mask, the layout maps)
and the tests that should catch it. The script copies the repository (without .git and virtual
environments) into a temporary folder, then, one mutation at a time, applies it there, runs its
tests with pytest (``-x``: the first failure is enough), and restores the file. A mutation is
caught when a test fails; it survives when its tests pass. The script exits 1 naming every
mutation that survived or whose tests did not run (none collected, all skipped, a timeout).

It fails loudly (exit 2), before running anything, if a replacement's target text no longer
occurs exactly once in its file: a refactor must update the list, it cannot silently make a
mutation a no-op. ``--check-targets`` does only that check (seconds).

``--ci`` runs the subset marked ``ci`` (tests/test_mutations.py runs it in the normal suite);
without it every mutation runs. ``--baseline`` first runs each mutation's tests unmutated (they
must pass, or the mutation's verdict means nothing); the normal suite already does that for the
subset, so CI leaves it off. docs/testing.md describes the check.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import List, Optional, Sequence, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IGNORED = (".git", ".venv", "venv", "__pycache__", ".pytest_cache", "*.egg-info", "build", "dist", ".carry")


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    path: str                 # relative to the repository root
    old: str                  # must occur exactly once in the file
    new: str
    tests: Tuple[str, ...]    # pytest arguments, relative to the repository root
    what: str                 # the behaviour it breaks
    ci: bool = False          # in the CI subset


MUTATIONS: Sequence[Mutation] = (
    Mutation(
        "reference-diagonal-mask", "megatron_mtraining/kernels/reference.py",
        "    causal = k_positions[None, :] <= q_positions[:, None]\n    bitmap = index.slash_bitmap",
        "    causal = k_positions[None, :] <= q_positions[:, None] + 1\n    bitmap = index.slash_bitmap",
        ("tests/test_reference.py",),
        "the reference's causal mask inside the diagonal block lets a query see the next key", ci=True),
    Mutation(
        "slash-dropped", "megatron_mtraining/index.py",
        "valid = ((torch.arange(self.slash.shape[-1], device=self.device) < self.n_slash[..., None])",
        "valid = ((torch.arange(self.slash.shape[-1], device=self.device) < self.n_slash[..., None] - 1)",
        ("tests/test_reference.py",),
        "the slash bitmap (reference and kernel plans) drops each head's last selected offset", ci=True),
    Mutation(
        "column-dropped", "megatron_mtraining/index.py",
        "valid = torch.arange(self.vertical.shape[-1], device=self.device) < self.n_vertical[..., None]",
        "valid = torch.arange(self.vertical.shape[-1], device=self.device) < self.n_vertical[..., None] - 1",
        ("tests/test_reference.py",),
        "the column mask drops each head's last selected column", ci=True),
    Mutation(
        "kernel-token-mask", "megatron_mtraining/kernels/triton_common.py",
        '    """[queries, keys] pairs that are causal (and, with DOCS, in the query\'s document)."""\n'
        "    keep = k_pos[None, :] <= q_pos[:, None]",
        '    """[queries, keys] pairs that are causal (and, with DOCS, in the query\'s document)."""\n'
        "    keep = k_pos[None, :] < q_pos[:, None]",
        ("tests/test_sparse_attention.py", "-k", "test_edge_case_indices and triton"),
        "the Triton kernels' token mask hides each query's own key", ci=True),
    Mutation(
        "document-boundary", "megatron_mtraining/documents.py",
        "which = torch.searchsorted(cu, positions.to(torch.int64), right=True) - 1",
        "which = torch.searchsorted(cu, positions.to(torch.int64), right=False) - 1",
        ("tests/test_documents.py", "-k", "triton_against_oracle and mixed-random"),
        "the kernels' document tables take a document's first token for the previous document's", ci=True),
    Mutation(
        "reference-document-boundary", "megatron_mtraining/kernels/reference.py",
        "positions, right=True)",
        "positions, right=False)",
        ("tests/test_documents.py", "-k", "torch_backend_against_oracle and 4-2"),
        "the reference takes a document's first token for the previous document's"),
    Mutation(
        "layout-striped-map", "megatron_mtraining/layout.py",
        "        return torch.arange(rank, num_blocks, world_size)",
        "        return torch.arange(world_size - 1 - rank, num_blocks, world_size)",
        ("tests/test_layout.py",),
        "the striped layout deals the blocks to the ranks in reverse order (still a permutation)", ci=True),
    Mutation(
        "layout-zigzag-map", "megatron_mtraining/layout.py",
        "    last = 2 * world_size - 1 - rank",
        "    last = world_size + rank",
        ("tests/test_layout.py",),
        "the zigzag layout's second chunk is not the mirror of the first (still a permutation)"),
    Mutation(
        "ring-last-merge", "megatron_mtraining/ring/schedule.py",
        "                    grads = _add(partial, grads)",
        "                    grads = grads if last else _add(partial, grads)",
        ("tests/test_ring.py", "-k", "w2- and not triton"),
        "the ring backward drops the partial dK/dV that arrives at the last step", ci=True),
    Mutation(
        "ring-source-order", "megatron_mtraining/ring/comm.py",
        "(i - inner_step) % self.inner_size",
        "(i + inner_step) % self.inner_size",
        ("tests/test_ring.py", "-k", "w3- and not triton"),
        "the ring names the wrong source rank for the K/V it holds (same at 2 ranks: 3 are needed)", ci=True),
    Mutation(
        "agreement-comparison", "megatron_mtraining/collective/agreement.py",
        "if low[world + i] != high[world + i]]",
        "if low[world + i] > high[world + i]]",
        ("tests/test_failures.py", "-k", "test_ranks_that_disagree_fail_on_every_rank"),
        "the CP ranks' agreement never sees a disagreement", ci=True),
    Mutation(
        "approx-softmax-scale", "megatron_mtraining/approx.py",
        "    nb = seq_len // B\n    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)",
        "    nb = seq_len // B\n    scale = softmax_scale if softmax_scale is not None else 0.7 / math.sqrt(d)",
        ("tests/test_approx_oracle.py", "-k", "statistics_equal and torch"),
        "the approximator's statistics use softmax scale 0.7 / sqrt(d)", ci=True),
    Mutation(
        "approx-budget", "megatron_mtraining/approx.py",
        "    budget = (~reached).sum(-1) + 1 ",
        "    budget = (~reached).sum(-1) + 0 ",
        ("tests/test_approx_oracle.py", "-k", "index_equals_the_oracle and top_p and unpacked and not distributed"),
        "the top-p budget stops one entry short of top_p of the mass", ci=True),
    Mutation(
        "approx-normaliser-across-ranks", "megatron_mtraining/approx.py",
        "q_pos0, scale, L)\n    local_max = row_max.clone()\n    _all_reduce(row_max, dist.ReduceOp.MAX, group, world)\n"
        "    normaliser *= torch.exp(local_max - _finite(row_max)).double()",
        "q_pos0, scale, L)\n    local_max = row_max.clone()\n    _all_reduce(row_max, dist.ReduceOp.MAX, group, world)\n"
        "    normaliser *= 1.0",
        ("tests/test_approx_oracle.py", "-k", "distributed and unpacked"),
        "each rank's softmax normaliser is summed without rescaling to the global row max"),
    Mutation(
        "approx-document-weight", "megatron_mtraining/approx.py",
        "row_weight = torch.where(valid, L / n_rows.clamp(min=1).double()[:, None], 0.0)",
        "row_weight = torch.where(valid, 1.0, 0.0).double()",
        ("tests/test_approx_oracle.py", "-k", "statistics_equal and torch and packed"),
        "a scored document shorter than last_q is not weighted up to last_q of mass"),
    Mutation(
        "approx-sinks", "megatron_mtraining/approx.py",
        "    mandatory_v = cand_positions < config.sink_tokens\n",
        "    mandatory_v = cand_positions < config.sink_tokens - 1\n",
        ("tests/test_approx_oracle.py", "-k", "index_equals_the_oracle and not triton and not distributed"),
        "the last sink column is no longer mandatory"),
)


def check_targets(mutations: Sequence[Mutation], root: str = REPO) -> List[str]:
    """Problems with the list: a target that does not occur exactly once, a test file that is gone."""
    problems = []
    for m in mutations:
        path = os.path.join(root, m.path)
        if not os.path.isfile(path):
            problems.append(f"{m.name}: {m.path} does not exist")
            continue
        with open(path, encoding="utf-8") as fh:
            found = fh.read().count(m.old)
        if found != 1:
            problems.append(f"{m.name}: the target text occurs {found} times in {m.path} (must be once); "
                            "update the mutation to the code")
        if m.old == m.new:
            problems.append(f"{m.name}: the replacement changes nothing")
        for arg in m.tests:
            if arg.startswith("tests/") and not os.path.isfile(os.path.join(root, arg.split("::")[0])):
                problems.append(f"{m.name}: test file {arg} does not exist")
    names = [m.name for m in mutations]
    problems += [f"{n}: the name is used twice" for n in sorted({n for n in names if names.count(n) > 1})]
    return problems


def copy_repository(dest: str) -> None:
    shutil.copytree(REPO, dest, ignore=shutil.ignore_patterns(*IGNORED), symlinks=True)


def _env(root: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def check_copy_is_imported(root: str, python: str) -> None:
    """The copy's package, not the installed (editable) one, must be what the tests import."""
    out = subprocess.run([python, "-c", "import megatron_mtraining; print(megatron_mtraining.__file__)"],
                         cwd=root, env=_env(root), capture_output=True, text=True)
    path = out.stdout.strip()
    if out.returncode or not os.path.realpath(path).startswith(os.path.realpath(root) + os.sep):
        raise SystemExit(f"mutation check: the tests would import megatron_mtraining from {path or '?'} "
                         f"rather than the copy in {root}:\n{out.stderr}")


_COUNT = re.compile(r"(\d+) (passed|failed|error|errors|skipped)")


def run_tests(root: str, python: str, args: Sequence[str], timeout: float) -> Tuple[str, str, float]:
    """(outcome, pytest's last lines, seconds): outcome "failed" (a test failed: caught), "passed",
    or a reason the tests did not decide ("no test ran", "timeout", "pytest exit N")."""
    cmd = [python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-rs", *args]
    start = time.monotonic()
    try:
        out = subprocess.run(cmd, cwd=root, env=_env(root), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", "", time.monotonic() - start
    seconds = time.monotonic() - start
    tail = "\n".join((out.stdout + out.stderr).strip().splitlines()[-15:])
    counts = {}
    last = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    for n, kind in _COUNT.findall(last):
        counts[kind.rstrip("s") if kind == "errors" else kind] = int(n)
    if out.returncode in (1, 2) and (counts.get("failed") or counts.get("error")):
        return "failed", tail, seconds
    if out.returncode == 0 and counts.get("passed"):
        return "passed", tail, seconds
    if out.returncode in (0, 5):
        return "no test ran", tail, seconds
    return f"pytest exit {out.returncode}", tail, seconds


def run(mutations: Sequence[Mutation], python: str = sys.executable, timeout: float = 900.0,
        baseline: bool = False, keep: bool = False) -> List[Tuple[Mutation, str, float]]:
    """(mutation, verdict, seconds) for each of ``mutations``, one at a time in a temporary copy;
    the verdict is "caught", "SURVIVED" or "NOT DECIDED (why)"."""
    tmp = tempfile.mkdtemp(prefix="mtraining-mutations-")
    root = os.path.join(tmp, "repo")
    results = []
    try:
        copy_repository(root)
        check_copy_is_imported(root, python)
        for m in mutations:
            if baseline:
                outcome, tail, seconds = run_tests(root, python, m.tests, timeout)
                if outcome != "passed":
                    results.append((m, f"baseline {outcome}", seconds))
                    print(f"[{m.name}] unmutated tests: {outcome} ({seconds:.0f} s)\n{tail}", flush=True)
                    continue
            path = os.path.join(root, m.path)
            with open(path, encoding="utf-8") as fh:
                original = fh.read()
            try:
                with open(path, "w", encoding="utf-8") as fh:
                    fh.write(original.replace(m.old, m.new, 1))
                outcome, tail, seconds = run_tests(root, python, m.tests, timeout)
            finally:
                with open(path, "w", encoding="utf-8") as fh:
                    fh.write(original)
            verdict = {"failed": "caught", "passed": "SURVIVED"}.get(outcome, f"NOT DECIDED ({outcome})")
            results.append((m, verdict, seconds))
            print(f"[{m.name}] {verdict} in {seconds:.0f} s", flush=True)
            if verdict != "caught":
                print(tail, flush=True)
    finally:
        if keep:
            print(f"mutation check: the copy is kept in {root}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return results


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ci", action="store_true", help="only the mutations marked for CI")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="only these mutations")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--check-targets", action="store_true",
                        help="only check that every target text occurs once (no tests run)")
    parser.add_argument("--baseline", action="store_true", help="first run each mutation's tests unmutated")
    parser.add_argument("--keep", action="store_true", help="keep the temporary copy")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per pytest run (default 900)")
    parser.add_argument("--python", default=sys.executable, help="the interpreter that runs pytest")
    args = parser.parse_args(argv)

    problems = check_targets(MUTATIONS)
    if problems:
        print("mutation check: the list no longer matches the code:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 2
    chosen = [m for m in MUTATIONS if (m.ci or not args.ci)]
    if args.only:
        unknown = sorted(set(args.only) - {m.name for m in MUTATIONS})
        if unknown:
            parser.error(f"unknown mutation(s) {unknown}; --list shows them")
        chosen = [m for m in chosen if m.name in args.only]
    if args.list:
        for m in chosen:
            print(f"{m.name:34s} {'ci ' if m.ci else '   '}{m.path}: {m.what}\n{'':38s}tests: {' '.join(m.tests)}")
        return 0
    if args.check_targets:
        print(f"mutation check: all {len(MUTATIONS)} targets match")
        return 0

    results = run(chosen, args.python, args.timeout, baseline=args.baseline, keep=args.keep)
    bad = [(m, verdict) for m, verdict, _ in results if verdict != "caught"]
    total = sum(seconds for _, _, seconds in results)
    print(f"\nmutation check: {len(results) - len(bad)} of {len(results)} mutations caught ({total:.0f} s of tests)")
    for m, verdict in bad:
        print(f"  {verdict}: {m.name} ({m.path}: {m.what}); tests: {' '.join(m.tests)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
