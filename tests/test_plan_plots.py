"""docs/scaling.md's charts: the SVG writer (benchmarks/svg_chart.py) and the committed charts, which
must be current (benchmarks/plan_validation.py --plots) and carry the planner's numbers."""

import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import plan_validation  # noqa: E402
from svg_chart import Series, line_chart, nice_step  # noqa: E402

SVG = "{http://www.w3.org/2000/svg}"
SERIES = ["MTraining flat", "MTraining hierarchical", "TE p2p (dense)", "TE a2a+p2p (dense)"]


def _series(root):
    return {g.get("data-name"): g for g in root.iter(f"{SVG}g") if g.get("class") == "series"}


def test_committed_charts_are_current():
    stale = plan_validation.write_charts(check=True)
    assert stale == [], f"rerun python benchmarks/plan_validation.py --plots ({stale})"


@pytest.mark.parametrize("seq_len,tag", sorted(plan_validation.SCALING_LENGTHS.items()))
def test_chart_is_well_formed_and_carries_the_planned_tokens_per_s(seq_len, tag):
    root = ET.parse(os.path.join(REPO, "docs", f"scaling_{tag}.svg")).getroot()
    assert root.tag == f"{SVG}svg"
    series = _series(root)
    assert list(series) == SERIES
    plans = plan_validation.scaling_plans(seq_len)
    for name, group in series.items():
        circles = group.findall(f"{SVG}circle")
        assert len(circles) == len(plan_validation.SCALING_GPUS)
        points = group.find(f"{SVG}polyline").get("points").split()
        coords = [tuple(float(v) for v in pair.split(",")) for pair in points]
        assert [c[1] for c in coords] == [float(c.get("cy")) for c in circles]
        for circle, r in zip(circles, plans):
            note = circle.find(f"{SVG}title").text
            gpus = r["cluster"]["gpus"]
            assert f"GPUs {gpus}:" in note and "limited by" in note and "exposed comm" in note
            if name == "MTraining flat":
                expected = next(p for p in r["predictions"] if p["name"] == "mtraining_flat")["tokens_per_s"] / 1e3
                assert f"GPUs {gpus}: {expected:.1f}K;" in note, note
    # Every point inside the plot area (the frame is the second rect, after the white background).
    frame = root.findall(f"{SVG}rect")[1]
    x0, y0 = float(frame.get("x")), float(frame.get("y"))
    x1, y1 = x0 + float(frame.get("width")), y0 + float(frame.get("height"))
    for group in series.values():
        for c in group.findall(f"{SVG}circle"):
            assert x0 <= float(c.get("cx")) <= x1 and y0 <= float(c.get("cy")) <= y1
    # Higher tokens/s is drawn higher: the y coordinate falls as the value rises.
    flat = [float(c.get("cy")) for c in series["MTraining flat"].findall(f"{SVG}circle")]
    values = [next(p for p in r["predictions"] if p["name"] == "mtraining_flat")["tokens_per_s"] for r in plans]
    assert sorted(range(len(flat)), key=lambda i: flat[i]) == sorted(range(len(values)), key=lambda i: -values[i])


def test_check_plots_flag_reports_stale_charts(tmp_path, monkeypatch):
    monkeypatch.setattr(plan_validation, "DOCS", str(tmp_path))
    assert plan_validation.main(["--check-plots"]) == 1
    assert not list(tmp_path.iterdir())  # --check-plots writes nothing
    assert len(plan_validation.write_charts(check=False)) == 2
    assert plan_validation.main(["--check-plots"]) == 0


def test_check_plots_command_line_on_the_committed_charts():
    run = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "plan_validation.py"), "--check-plots"],
                         capture_output=True, text=True, timeout=300, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "charts are current" in run.stdout


def test_line_chart_is_deterministic_and_escapes_text():
    series = [Series("a < b", [1.0, 2.5, 4.0], ["x & y", "", "z"]), Series("c", [0.0, 1.0, 3.0])]
    first = line_chart("t & t", "GPUs", "y", [8, 16, 32], series)
    assert first == line_chart("t & t", "GPUs", "y", [8, 16, 32], series)
    root = ET.fromstring(first)
    assert list(_series(root)) == ["a < b", "c"]
    assert root.find(f"{SVG}text").text == "t & t"


@pytest.mark.parametrize("xs,series,message", [
    ([1, 2], [Series("a", [1.0])], "1 values for 2 x values"),
    ([1, 2], [Series("a", [1.0, -1.0])], "finite and >= 0"),
    ([1, 2], [Series("a", [1.0, float("nan")])], "finite and >= 0"),
    ([1, 2], [Series("a", [1.0, 2.0], ["only one note"])], "1 point notes for 2 x values"),
    ([], [Series("a", [])], "needs x values"),
])
def test_line_chart_rejects_bad_input(xs, series, message):
    with pytest.raises(ValueError, match=message):
        line_chart("t", "x", "y", xs, series)


@pytest.mark.parametrize("top,step", [(268.0, 50.0), (9.0, 2.0), (1.0, 0.2), (600.0, 100.0)])
def test_nice_step(top, step):
    assert nice_step(top) == pytest.approx(step)
