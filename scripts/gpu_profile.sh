#!/usr/bin/env bash
# One single-GPU device call: GPU tests (TESTS, default the kernel and conversion tests), then
# Nsight Compute on one forward+backward of the canonical problem (benchmarks/profile_kernels.py,
# PROFILE_LEN tokens, default 64K): speed of light, occupancy, warp stalls, memory, per kernel.
# Logs and reports under $OUT (KEEP_REPORT=1 keeps the .ncu-rep); PROFILE_LAUNCH as kernel.py
# --launch; PROFILE_BLOCK the index block size (default 64; 128 runs the B = 128 kernels);
# TESTS="" skips the tests;
# TESTS_TIMEOUT, PROFILE_TIMEOUT.
# shellcheck source=SCRIPTDIR/gpu_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_common.sh" || exit 1
setup_venv || exit 1
TESTS=${TESTS-tests/test_gpu.py tests/test_convert.py tests/test_sparse_attention.py}
if [ -n "$TESTS" ]; then
  # shellcheck disable=SC2086  # TESTS is a list of paths
  timeout "${TESTS_TIMEOUT:-300}" "$PY" -m pytest -q -p no:cacheprovider -x $TESTS > "$OUT/tests.log" 2>&1
  echo "tests rc=$?"; tail -3 "$OUT/tests.log"
fi
SECTIONS=(--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats
          --section SchedulerStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis)
timeout "${PROFILE_TIMEOUT:-240}" ncu --clock-control none --profile-from-start off "${SECTIONS[@]}" \
    -k 'regex:_(vs_attn_fwd|vs_attn_fwd_sm90|vs_attn_fwd_pingpong|dq|dq_sm90|dkdv|dkdv_sm90|dkdv_col|dkdv_col_sm90|delta|column_words)_kernel' \
    --export "$OUT/profile" --force-overwrite \
    "$PY" benchmarks/profile_kernels.py --seq-len "${PROFILE_LEN:-65536}" --launch "${PROFILE_LAUNCH:-}" \
    --block-size "${PROFILE_BLOCK:-64}" \
    > "$OUT/profile.log" 2> "$OUT/ncu.err"
echo "ncu rc=$?"; grep -E "^compiled" "$OUT/profile.log"
ncu --import "$OUT/profile.ncu-rep" --page details > "$OUT/ncu.txt" 2>> "$OUT/ncu.err"
ncu --import "$OUT/profile.ncu-rep" --page raw --csv > "$OUT/raw.csv" 2>> "$OUT/ncu.err"
[ "${KEEP_REPORT:-0}" = 1 ] || rm -f "$OUT/profile.ncu-rep"  # the text pages hold what we read
# Short table: per kernel, duration, SM / tensor / memory throughput, occupancy, top stalls.
grep -E "^  _|Duration|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Executed Ipc A|Theoretical Occupancy" "$OUT/ncu.txt" | head -80
"$PY" - "$OUT/raw.csv" <<'PYEOF'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
if len(rows) < 3:
    sys.exit("no raw metrics")
head, data = rows[0], rows[2:]
def value(row, key):
    try:
        return float(row[head.index(key)].replace(",", ""))
    except (ValueError, IndexError):
        return None
want = ["gpu__time_duration.sum", "sm__throughput.avg.pct_of_peak_sustained_elapsed",
        "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",
        "lts__throughput.avg.pct_of_peak_sustained_elapsed", "dram__throughput.avg.pct_of_peak_sustained_elapsed",
        "sm__warps_active.avg.pct_of_peak_sustained_active", "launch__registers_per_thread",
        "smsp__issue_active.avg.pct_of_peak_sustained_active"]
pipes = [h for h in head if h.startswith("sm__pipe_tensor") and h.endswith("pct_of_peak_sustained_active")]
for row in data:
    name = row[head.index("Kernel Name")][:40]
    print(name)
    for key in want + pipes:
        if key in head:
            print(f"   {key:70s} {row[head.index(key)]}")
    stalls = sorted(((value(row, h) or 0.0, h) for h in head if "issue_stalled" in h and h.endswith(".ratio")), reverse=True)
    for v, h in stalls[:7]:
        print(f"   stall {h:64s} {v:.2f}")
PYEOF
