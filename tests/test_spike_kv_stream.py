"""benchmarks/spike_kv_stream.py (issue 17 spike M1) on the CPU: every variant's stream kernel runs
in Triton's interpreter and its per-program checksums must equal the host's, recomputed in PyTorch
from the plan's lists (so a kernel that skips or misaddresses a tile fails)."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "benchmarks", "spike_kv_stream.py")


def test_cpu_check_every_variant_streams_exactly_the_plans_tiles(tmp_path):
    out = tmp_path / "spike_kv_stream.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, SCRIPT, "--cpu-check", "--variants", "a,b,c,d", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["benchmark"] == "spike_kv_stream" and result["cpu_check"] and result["finished"]
    assert set(result["variants"]) == {"a", "b", "c", "d"}
    for name, entry in result["variants"].items():
        assert entry["status"] == "done", (name, entry)
        check = entry["check"]
        assert check["pass"] and check["programs"] > 0 and not any(check["wrong"].values()), (name, check)
        assert entry["bytes"]["kv_bytes"] > 0
    # Two heads per program load each slash tile once for both: fewer slash bytes, same columns.
    a, d = result["variants"]["a"]["bytes"], result["variants"]["d"]["bytes"]
    assert d["slash_bytes"] < a["slash_bytes"] and d["column_bytes"] == a["column_bytes"]
    assert result["all_checks_pass"] is True
