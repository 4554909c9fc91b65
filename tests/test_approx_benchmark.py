"""benchmarks/approx.py on the CPU (the quality part; the overhead parts need GPUs)."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quality_only_writes_recall_rows(tmp_path):
    out = tmp_path / "approx.json"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "approx.py"), "--quality-only",
                           "--quality-len", "1024", "--out", str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["benchmark"] == "approx" and "overhead" not in data
    rows = data["quality"]
    assert sorted({r["top_p"] for r in rows}) == [0.8, 0.9, 0.95]
    for r in rows:
        assert 0 < r["density"] <= 1 and 0 < r["recall"] <= 1
    # A larger top-p keeps at least as much of the attention mass (same seed, same data).
    by = {(r["top_p"], r["seed"]): r for r in rows}
    for seed in {r["seed"] for r in rows}:
        assert by[(0.8, seed)]["recall"] <= by[(0.9, seed)]["recall"] <= by[(0.95, seed)]["recall"]


def test_ring_mode_needs_torchrun():
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "approx.py"), "--ring"], cwd=REPO,
                          capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "RANK"})
    assert proc.returncode != 0 and "runs under torchrun on GPUs" in proc.stderr
