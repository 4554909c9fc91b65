#!/usr/bin/env bash
# One device call for the single-device kernels: set up, run the whole test suite on the GPU,
# then benchmarks (BENCHES) and optionally make demo (DEMO=1). Logs and results go to $OUT (device tool) or ./gpu_out.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt"
bash scripts/setup_env.sh .venv > "$OUT/setup.log" 2>&1 || { tail -20 "$OUT/setup.log"; exit 1; }
tail -1 "$OUT/setup.log"
.venv/bin/python -m pytest -q -p no:cacheprovider tests --durations=10 > "$OUT/tests.log" 2>&1
echo "tests rc=$?"; tail -4 "$OUT/tests.log"
# BENCHES: which benchmark scripts to run after the tests (default: the kernel benchmark).
for bench in ${BENCHES:-kernel}; do
  GIT_COMMIT=${GIT_COMMIT:-unknown} timeout 400 .venv/bin/python benchmarks/$bench.py \
    --out "$OUT/${bench}_nvidia-h200.json" > "$OUT/${bench}_bench.log" 2>&1
  echo "$bench bench rc=$?"; tail -8 "$OUT/${bench}_bench.log"
done
if [ "${DEMO:-0}" = 1 ]; then
  make demo > "$OUT/demo.log" 2>&1; echo "demo rc=$?"; tail -4 "$OUT/demo.log"
fi
