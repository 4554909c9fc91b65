#!/usr/bin/env bash
# One device call (2 GPUs): the quality benchmark (issue 7). The dense and the MTraining
# trainings run side by side, one per GPU, from the same seed and data; then the merge writes
# quality.json and the plots to $OUT. QUALITY_FLAGS overrides the schedule / model flags.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh .venv > "$OUT/setup_quality.log" 2>&1 || { tail -20 "$OUT/setup_quality.log"; exit 1; }
PY=.venv/bin/python
export GIT_COMMIT=${GIT_COMMIT:-unknown}
# Defaults after the first run (fp32, 4 needles/1K of 4+4 tokens: no retrieval learned in 800
# iterations): bf16, shorter keys and values, more iterations at 4K before the 32K phase.
FLAGS=${QUALITY_FLAGS:---phases 4096:2500,32768:150 --needles-per-1k 4 --key-len 2 --value-len 2 --max-train-seconds 360}
for run in dense mtraining; do
  gpu=$([ $run = dense ] && echo 0 || echo 1)
  CUDA_VISIBLE_DEVICES=$gpu timeout ${QUALITY_TIMEOUT:-470} \
      $PY benchmarks/quality.py --run $run --out "$OUT/quality_$run.json" $FLAGS > "$OUT/quality_$run.log" 2>&1 &
done
wait
for run in dense mtraining; do tail -3 "$OUT/quality_$run.log"; done
$PY benchmarks/quality.py --merge "$OUT/quality_dense.json" "$OUT/quality_mtraining.json" --out "$OUT/quality.json"
cd "$OUT" && tar czf quality_logs.tgz quality_*.log setup_quality.log && rm -f quality_*.log quality_dense.json quality_mtraining.json
ls
