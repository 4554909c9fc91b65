#!/usr/bin/env bash
# One single-GPU device call: set up, run the whole test suite on the GPU, then benchmarks
# (BENCHES, default "kernel": benchmarks/<name>.py each, to <name>_<device>.json) and optionally
# make demo (DEMO=1). Logs and results under $OUT (gpu_common.sh).
# shellcheck source=SCRIPTDIR/gpu_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_common.sh" || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt"
setup_venv || exit 1
"$PY" -m pytest -q -p no:cacheprovider tests --durations=10 > "$OUT/tests.log" 2>&1
echo "tests rc=$?"; tail -4 "$OUT/tests.log"
for bench in ${BENCHES:-kernel}; do
  timeout 400 "$PY" "benchmarks/$bench.py" --out "$OUT/${bench}_$DEVICE_SLUG.json" > "$OUT/${bench}_bench.log" 2>&1
  echo "$bench bench rc=$?"; tail -8 "$OUT/${bench}_bench.log"
done
if [ "${DEMO:-0}" = 1 ]; then
  make demo > "$OUT/demo.log" 2>&1; echo "demo rc=$?"; tail -4 "$OUT/demo.log"
fi
