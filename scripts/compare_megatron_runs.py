"""Compare save / resume / uninterrupted Megatron-LM runs (scripts/gpu_megatron_lm.sh's verdict).

    python scripts/compare_megatron_runs.py RUNS_DIR N M CKPT_ROOT NAME [NAME ...]

RUNS_DIR holds ``<name>_<mode>.log`` and ``<name>_<mode>.rc`` for the modes save (to iteration N,
writing a checkpoint), resume (N+1 .. N+M from it) and full (1 .. N+M without a stop). Prints one
ok/FAIL line per check, the per-iteration table and ``RESULT: PASS|FAIL``; exits 0 only on PASS.

Megatron's printed lm loss is an average over the iterations since the last reset, and
``training_log`` does not reset after a run's FIRST logged iteration (core_r0.19.0,
``should_reset = not is_first_iteration``): with --log-interval 1 a run's second line prints the
mean of its first two iterations. So a resumed run's second iteration reads
(loss[N+1] + loss[N+2]) / 2, while the uninterrupted run prints loss[N+2] there. Each run's own
per-iteration losses are recovered first (second line: 2 x printed - first printed), and a value
so derived is compared within the rounding of the printed digits (7 significant digits, each
printed value within half a unit of its last digit): the recovery carries up to one unit of the
second line's last digit plus half of the first's, the value it is compared with half of its own,
so two units apart is still the same loss (seen on a correct CP=2 run: 7.873597 recovered against
7.873599 printed). Lines printed as is must be equal as printed. Grad norms are per iteration and
compared as printed.
"""

from __future__ import annotations

import math
import os
import re
import sys
from typing import Dict, Tuple

LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: (\S+) \|.*?grad norm: (\S+) \|")

# iteration -> (lm loss as printed, grad norm as printed)
Printed = Dict[int, Tuple[str, str]]
# iteration -> (lm loss, grad norm as printed, derived: recovered from an average, rounding bound:
# how far the loss may be from the exact value through the printed digits it was read from)
PerIteration = Dict[int, Tuple[float, str, bool, float]]


def parse(text: str) -> Printed:
    return {int(i): (loss, gnorm) for i, loss, gnorm in LINE.findall(text)}


def per_iteration(printed: Printed) -> PerIteration:
    """Undo Megatron's averaging of a run's first two logged iterations (module docstring)."""
    out = {i: (float(loss), gnorm, False, last_digit(float(loss)) / 2) for i, (loss, gnorm) in printed.items()}
    first = sorted(printed)[:2]
    if len(first) == 2 and first[1] == first[0] + 1:
        a, b = (float(printed[i][0]) for i in first)
        out[first[1]] = (2 * b - a, printed[first[1]][1], True, last_digit(b) + last_digit(a) / 2)
    return out


def last_digit(value: float) -> float:
    """One unit of the last digit Megatron prints (``%E``: 7 significant digits)."""
    return 10.0 ** (math.floor(math.log10(abs(value))) - 6) if value else 1e-6


def same_iteration(a: Tuple[float, str, bool, float], b: Tuple[float, str, bool, float]) -> bool:
    if a[1] != b[1]:
        return False
    if a[2] or b[2]:  # within both values' rounding bounds (plus float noise of the subtraction)
        return abs(a[0] - b[0]) <= (a[3] + b[3]) * (1 + 1e-9)
    return a[0] == b[0]


def main(argv) -> int:
    runs, n, m, ckpt_root, names = argv[0], int(argv[1]), int(argv[2]), argv[3], argv[4:]
    ok = True

    def check(label, good, detail=""):
        nonlocal ok
        ok &= bool(good)
        print(f"  {'ok  ' if good else 'FAIL'} {label}{': ' + detail if detail else ''}")

    def read(name, mode):
        path = os.path.join(runs, f"{name}_{mode}.log")
        text = open(path, errors="replace").read() if os.path.exists(path) else ""
        rc_path = os.path.join(runs, f"{name}_{mode}.rc")
        rc = open(rc_path).read().strip() if os.path.exists(rc_path) else "not run"
        return text, rc, parse(text)

    print(f"Real Megatron-LM core_r0.19.0: save at {n}, resume to {n + m}, against an uninterrupted {n + m}")
    print("(lm loss per iteration: a run's second logged line averages its first two iterations in Megatron's "
          "log; '*' marks the value recovered from that average, compared within the printed precision)")
    full_losses = {}
    for name in names:
        print(f"\n{name}")
        logs = {mode: read(name, mode) for mode in ("save", "resume", "full")}
        for mode, (text, rc, it) in logs.items():
            check(f"{mode} run finished", rc == "0",
                  f"rc={rc}, iterations {min(it) if it else '-'}..{max(it) if it else '-'}")
            check(f"{mode} run enabled MTraining attention", "MTraining sparse attention enabled" in text)
            check(f"{mode} run logged MTraining telemetry", "[MTraining] iteration" in text)
        save, resume, full = (logs[k][2] for k in ("save", "resume", "full"))
        full_losses[name] = full
        tracker = os.path.join(ckpt_root, name, "latest_checkpointed_iteration.txt")
        saved = open(tracker).read().strip() if os.path.exists(tracker) else "none"
        check(f"checkpoint saved at iteration {n}",
              re.search(rf"successfully saved checkpoint from iteration\s+{n} to", logs["save"][0]) and saved == str(n),
              f"latest_checkpointed_iteration.txt: {saved}")
        check(f"resumed run loaded the checkpoint of iteration {n}",
              re.search(rf"successfully loaded checkpoint from .* at iteration {n}\b", logs["resume"][0]))
        check(f"save run logged iterations 1..{n}", sorted(save) == list(range(1, n + 1)), str(sorted(save)))
        check(f"resumed run logged iterations {n + 1}..{n + m}", sorted(resume) == list(range(n + 1, n + m + 1)),
              str(sorted(resume)))
        check(f"uninterrupted run logged iterations 1..{n + m}", sorted(full) == list(range(1, n + m + 1)),
              str(sorted(full)))
        base_it, save_it, resume_it = per_iteration(full), per_iteration(save), per_iteration(resume)
        print(f"    {'iter':>4}  {'uninterrupted: lm loss':>24} {'grad norm':>10}  {'save/resume: lm loss':>22} "
              f"{'grad norm':>10}  same")
        for i in range(1, n + m + 1):
            other = (save_it if i <= n else resume_it).get(i)
            base = base_it.get(i)
            same = other is not None and base is not None and same_iteration(other, base)
            show = lambda v: f"{v[0]:.6E}{'*' if v[2] else ' '}" if v else "-"  # noqa: E731
            print(f"    {i:>4}  {show(base):>24} {base[1] if base else '-':>10}  {show(other):>22} "
                  f"{other[1] if other else '-':>10}  {'yes' if same else 'NO'}")
        check(f"save run = uninterrupted run, iterations 1..{n}",
              all(i in save_it and i in base_it and same_iteration(save_it[i], base_it[i]) for i in range(1, n + 1)))
        diffs = [abs(resume_it[i][0] - base_it[i][0]) for i in range(n + 1, n + m + 1) if i in resume_it and i in base_it]
        check(f"resumed run = uninterrupted run, iterations {n + 1}..{n + m} (at the printed precision)",
              all(i in resume_it and i in base_it and same_iteration(resume_it[i], base_it[i])
                  for i in range(n + 1, n + m + 1)),
              f"largest lm loss difference {max(diffs):.3e}" if diffs else "")

    print("\nFor information (not pass/fail):")
    for cp in sorted({name.rsplit("_cp", 1)[1] for name in names}):
        a, b = full_losses.get(f"launcher_cp{cp}"), full_losses.get(f"fork_cp{cp}")
        if a and b:
            print(f"  CP={cp}: launcher and fork uninterrupted runs {'identical' if a == b else 'DIFFER'}")
    for entry in ("launcher", "fork"):
        a, b = full_losses.get(f"{entry}_cp2"), full_losses.get(f"{entry}_cp1")
        if a and b:
            common = sorted(set(a) & set(b))
            diff = max((abs(float(a[i][0]) - float(b[i][0])) / abs(float(b[i][0])) for i in common),
                       default=float("nan"))
            print(f"  {entry}: CP=2 vs CP=1 lm loss, largest relative difference {diff:.2e} over iterations {common}")
    print("\nRESULT:", "PASS" if ok and names else "FAIL")
    return 0 if ok and names else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
