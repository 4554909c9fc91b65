#!/usr/bin/env bash
# Issue 17 spike, the install-free measurements (benchmarks/spike_hopper_kernels.md section 7,
# M1-M4), in one single-GPU device call (kind nvidia-h200: the baselines are H200 figures):
#   M1 benchmarks/spike_kv_stream.py  the forward's K/V tile traffic with the math removed
#   M2 benchmarks/spike_l2.py         random tile reads from L2-sized and HBM-sized buffers
#   M3 benchmarks/kernel.py at 128-token blocks (our Triton kernels, 128K, fixed 5% index)
#   M4 benchmarks/spike_autows.py     slash-only forward: production vs TMA vs autoWS variants
# STAGES (default "m4 m1 m2 m3": the decisive one first), STAGE_TIMEOUT (seconds each, 180).
# Results: $OUT/spike_<name>_<device>.json and one log per stage (gpu_common.sh's $OUT); a
# short table per stage is printed at the end.
# shellcheck source=SCRIPTDIR/gpu_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_common.sh" || exit 1
REUSE_VENV=${REUSE_VENV:-1} setup_venv setup_spike.log || exit 1

stage() {  # NAME COMMAND...: run one stage under its timeout, log to $OUT/NAME.log
  local name=$1; shift
  timeout "${STAGE_TIMEOUT:-180}" "$@" > "$OUT/$name.log" 2>&1
  echo "[spike] $name rc=$?"
}
for s in ${STAGES:-m4 m1 m2 m3}; do
  case $s in
    m1) stage spike_kv_stream "$PY" benchmarks/spike_kv_stream.py --out "$OUT/spike_kv_stream_$DEVICE_SLUG.json" ;;
    m2) stage spike_l2 "$PY" benchmarks/spike_l2.py --out "$OUT/spike_l2_$DEVICE_SLUG.json" ;;
    m3) stage kernel_b128 "$PY" benchmarks/kernel.py --block-size 128 --seq-lens 131072 --skip flex,dense,check \
          --out "$OUT/kernel_b128_$DEVICE_SLUG.json" ;;
    m4) stage spike_autows "$PY" benchmarks/spike_autows.py --out "$OUT/spike_autows_$DEVICE_SLUG.json" ;;
    *) echo "[spike] unknown stage $s (m1 m2 m3 m4)" >&2 ;;
  esac
done
for log in "$OUT"/spike_*.log "$OUT"/kernel_b128.log; do
  [ -f "$log" ] && { echo "== $(basename "$log")"; tail -15 "$log"; }
done
