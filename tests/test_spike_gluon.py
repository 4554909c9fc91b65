"""benchmarks/spike_gluon.py (issue 17 spike M10): Gluon has no CPU interpreter, so on the CPU the
kernel is cross-compiled for sm_90a (in a subprocess without TRITON_INTERPRET): it must compile
keep two programs per SM (<= 113 KB of shared memory), and hold its wgmma and TMA instructions.
Its numbers are checked on the GPU by the script itself (against the fp32 reference and
production's forward)."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gluon_variants_compile_for_sm90a_with_two_programs_per_sm(tmp_path):
    pytest.importorskip("triton.experimental.gluon")
    out = tmp_path / "compile.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "spike_gluon.py"), "--compile-sm90",
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    compiled = json.loads(out.read_text())["variants"]
    assert set(compiled) == {"g_s2", "g_s3", "g_ws_s2", "g_ws_s3", "g_pp_s3", "g_s3_qreg", "g128_s2", "g128_pp_s2",
                             "g128_pp_s3", "g_heads_pp_s3"}
    for name, entry in compiled.items():
        assert "errors" not in entry, (name, entry.get("errors"))
        assert entry["ptxas_ok"] and not entry["spills"] and not entry["wgmma_serialized"], (name, entry)
        if name.startswith(("g_ws", "g_pp", "g128", "g_heads")):  # two consumer warpgroups + a producer warp, one program per SM
            assert entry["num_warps"] == 12 and entry["shared_bytes"] <= 227 * 1024, entry
            # B = 64: per consumer 8 + 4 wgmma per tile, in 2 places; B = 128: 8 + 8
            assert entry["wgmma"] == (64 if name.startswith("g128") else 48), entry
            continue
        assert entry["num_warps"] == 4 and entry["shared_bytes"] <= 113 * 1024, (name, entry)
        # Per S tile 8 wgmma (d 128 / k 16) and per PV tile 4 (64 keys / 16), each in 2 places.
        assert entry["wgmma"] == 24 and entry["tma_loads"] >= 6, (name, entry)
