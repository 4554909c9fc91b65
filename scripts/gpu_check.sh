#!/usr/bin/env bash
# One device call for the single-device kernels: set up, run the whole test suite on the GPU,
# then the kernel benchmark. Logs and results go to $OUT (device tool) or ./gpu_out.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt"
bash scripts/setup_env.sh .venv > "$OUT/setup.log" 2>&1 || { tail -20 "$OUT/setup.log"; exit 1; }
tail -1 "$OUT/setup.log"
.venv/bin/python -m pytest -q -p no:cacheprovider tests --durations=10 > "$OUT/tests.log" 2>&1
echo "tests rc=$?"; tail -4 "$OUT/tests.log"
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  GIT_COMMIT=${GIT_COMMIT:-unknown} .venv/bin/python benchmarks/kernel.py --out "$OUT/kernel.json" > "$OUT/bench.log" 2>&1
  echo "bench rc=$?"; tail -12 "$OUT/bench.log"
fi
