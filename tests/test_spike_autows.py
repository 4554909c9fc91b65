"""benchmarks/spike_autows.py (issue 17 spike M4) on the CPU.

The smoke run puts every variant through Triton's interpreter at tiny fp32 shapes: the production
forward and the TMA spike kernels must match the fp32 reference and each other (the interpreter
ignores warp_specialize, so the c variants run as b there). The sm_90 cross-compile checks what
the GPU run depends on: the warp-specialised variants really get ttg.warp_specialize."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "benchmarks", "spike_autows.py")
VARIANTS = ("a", "b", "b_every", "b_every_s3", "b_host", "c", "c_s3", "c_every", "c_host")


def run_script(*args, interpret=True):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=env)


def test_smoke_run_checks_pass_and_writes_the_json(tmp_path):
    out = tmp_path / "spike_autows.json"
    proc = run_script("--smoke", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert {"benchmark", "smoke", "finished", "meta", "config", "work", "check_work", "variants",
            "all_checks_pass"} <= set(result)
    assert result["benchmark"] == "spike_autows" and result["smoke"] and result["finished"]
    assert result["config"]["interpreter"] is True
    assert tuple(result["variants"]) == VARIANTS
    for name, entry in result["variants"].items():
        assert "errors" not in entry, (name, entry.get("errors"))
        assert entry["status"] == "done"
        check = entry["check"]
        assert check["pass"], (name, check)
        assert check["out_rel_l2_vs_ref"] < 1e-4 and check["lse_max_abs_vs_ref"] < 1e-4
        if name != "a":
            assert check["out_rel_l2_vs_a"] < 1e-4 and check["lse_max_abs_vs_a"] < 1e-4
        assert {"ms", "samples_ms", "tflops_computed", "tflops_active", "speedup_vs_a", "compiled"} <= set(entry)
        assert entry["compiled"]["warp_specialized"] is None  # no compiled kernel in the interpreter
        if entry["ws"]:
            assert "ignored by the interpreter" in entry["note"]
    assert result["all_checks_pass"] is True

    work = result["work"]
    assert work["n_slash"] >= 3 and work["slash_offsets"][0] == 0  # off-diagonal blocks are exercised
    # The JSON keeps 6 significant digits.
    assert work["computed_pairs"] == pytest.approx(work["tiles"] * 64 * 64, rel=1e-5)
    assert work["active_pairs"] == pytest.approx(work["active_pairs_index_density"], rel=1e-5)
    assert work["flops_computed"] == pytest.approx(4 * result["config"]["head_dim"] * work["computed_pairs"], rel=1e-5)
    assert "all checks pass: yes" in proc.stdout


def test_unknown_variant_is_rejected(tmp_path):
    proc = run_script("--smoke", "--variants", "a,z", "--out", str(tmp_path / "x.json"))
    assert proc.returncode != 0 and "unknown variants ['z']" in proc.stderr


def test_sm90_cross_compile_finds_warp_specialisation(tmp_path):
    out = tmp_path / "sm90.json"
    proc = run_script("--compile-sm90", "--out", str(out), interpret=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    compiled = json.loads(out.read_text())["variants"]
    assert set(compiled) == set(VARIANTS) - {"a"}
    for name, entry in compiled.items():
        assert "errors" not in entry, (name, entry)
        ws = name.startswith("c")
        assert entry["warp_specialized"] is ws, (name, entry)
        assert entry["num_warps"] == (12 if ws else 4), (name, entry)  # producer + two 4-warp partitions
