"""scripts/compare_megatron_runs.py, the verdict of scripts/gpu_megatron_lm.sh, on the numbers of the
real Megatron-LM tree's run on one H200 (benchmarks/results/logs/megatron_lm_resume_nvidia-h200_1gpu.log):
Megatron prints a run's second lm loss as the mean of its first two iterations, so the resumed
run's iteration 4 reads (loss[3] + loss[4]) / 2 = 8.211313 where the uninterrupted run prints
loss[4] = 7.872828. The comparison recovers each iteration's own loss first: that run passes, and
a resume that really diverges (lm loss or grad norm) fails."""

import importlib.util
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("compare_megatron_runs",
                                              os.path.join(REPO, "scripts", "compare_megatron_runs.py"))
compare = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare)

# (iteration, lm loss, grad norm) as Megatron printed them on the H200 (launcher, CP=1, N=2, M=2).
SAVE = [(1, "9.117990E+00", "2.256"), (2, "9.116199E+00", "2.212")]
RESUME = [(3, "8.549797E+00", "4.951"), (4, "8.211313E+00", "16.160")]
FULL = [(1, "9.117990E+00", "2.256"), (2, "9.116199E+00", "2.212"), (3, "8.549797E+00", "4.951"),
        (4, "7.872828E+00", "16.160")]


def megatron_log(lines, loaded=None, saved=None):
    text = ["MTraining sparse attention enabled", "[MTraining] iteration 1 | density 0.1"]
    if loaded is not None:
        text.append(f" successfully loaded checkpoint from /ckpt [ t 1/1, p 1/1 ] at iteration {loaded}")
    for i, loss, gnorm in lines:
        text.append(f" [2026-11-24 23:48:42.142181] iteration {i:8d}/       4 | consumed samples: {i:12d} | "
                    f"learning rate: 1.500000E-04 | global batch size:     1 | lm loss: {loss} | loss scale: 1.0 | "
                    f"grad norm: {gnorm} | number of skipped iterations:   0 |")
    if saved is not None:
        text.append(f"  successfully saved checkpoint from iteration {saved:7d} to /ckpt [ t 1/1, p 1/1 ]")
    return "\n".join(text) + "\n"


def run(tmp_path, capsys, resume=RESUME):
    runs, ckpt = tmp_path / "runs", tmp_path / "ckpt"
    runs.mkdir()
    (ckpt / "launcher_cp1").mkdir(parents=True)
    (ckpt / "launcher_cp1" / "latest_checkpointed_iteration.txt").write_text("2")
    for mode, lines, extra in (("save", SAVE, dict(saved=2)), ("resume", resume, dict(loaded=2)),
                               ("full", FULL, {})):
        (runs / f"launcher_cp1_{mode}.log").write_text(megatron_log(lines, **extra))
        (runs / f"launcher_cp1_{mode}.rc").write_text("0\n")
    rc = compare.main([str(runs), "2", "2", str(ckpt), "launcher_cp1"])
    return rc, capsys.readouterr().out


def test_the_h200_resume_passes_once_the_average_is_undone(tmp_path, capsys):
    rc, out = run(tmp_path, capsys)
    assert rc == 0 and "RESULT: PASS" in out and "FAIL" not in out, out
    # Iteration 4 of the resumed run, recovered: 2 x 8.211313 - 8.549797.
    assert "7.872829E+00*" in out


@pytest.mark.parametrize("resume", [
    [(3, "8.549797E+00", "4.951"), (4, "8.211400E+00", "16.160")],   # loss[4] off by 1.7e-4
    [(3, "8.549797E+00", "4.951"), (4, "8.211313E+00", "16.161")],   # grad norm differs
    [(3, "8.549798E+00", "4.951"), (4, "8.211313E+00", "16.160")],   # first resumed line, as printed
])
def test_a_diverging_resume_fails(tmp_path, capsys, resume):
    rc, out = run(tmp_path, capsys, resume)
    assert rc == 1 and "RESULT: FAIL" in out and "FAIL resumed run = uninterrupted run" in out, out


def test_per_iteration_undoes_only_the_second_line():
    printed = {3: ("8.549797E+00", "4.951"), 4: ("8.211313E+00", "16.160"), 5: ("7.000000E+00", "1.0")}
    got = compare.per_iteration(printed)
    assert got[3][:3] == (8.549797, "4.951", False) and got[5][:3] == (7.0, "1.0", False)
    assert got[4][2] and got[4][0] == pytest.approx(7.872829, abs=1e-9)
    assert got[4][3] == pytest.approx(1.5e-6)  # one unit of the second line's last digit + half the first's


def test_recovered_loss_two_last_digits_apart_is_the_same_iteration():
    """A correct CP=2 run (real Megatron-LM, 2 GPUs): iteration 4 recovered from the two-iteration
    mean reads 7.873597 against the uninterrupted run's printed 7.873599, inside the rounding."""
    resumed = compare.per_iteration({3: ("8.000001E+00", "4.0"), 4: ("7.936799E+00", "3.0")})
    full = compare.per_iteration({1: ("9.0E+00", "1.0"), 2: ("8.5E+00", "2.0"), 4: ("7.873599E+00", "3.0")})
    assert resumed[4][0] == pytest.approx(7.873597, abs=1e-9)
    assert compare.same_iteration(resumed[4], full[4])
    off = compare.per_iteration({3: ("8.000001E+00", "4.0"), 4: ("7.936798E+00", "3.0")})  # 7.873595: 4 units off
    assert not compare.same_iteration(off[4], full[4])
