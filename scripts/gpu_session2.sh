#!/usr/bin/env bash
# One device call (2 GPUs): set up; GPU tests and the Megatron tests on megatron-core 0.19.2;
# approximator overhead on 1 GPU and over the 2-GPU ring; make demo's job (telemetry on GPUs); the
# end-to-end Megatron benchmark (MTraining vs dense ring, E2E_SEQ tokens, default 256K). The only
# script for approx_ring_<device>_2gpu.json and e2e_<device>_2gpu.json. Results under $OUT
# (gpu_common.sh), logs packed in logs.tgz (logs_e2e.tgz with E2E_ONLY).
# E2E=0 skips the end-to-end benchmark; E2E_ONLY=1 runs only it (after set-up).
# shellcheck source=SCRIPTDIR/gpu_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_common.sh" || exit 1
setup_venv || exit 1
if [ "${E2E_ONLY:-0}" != 1 ]; then
  {
    timeout 200 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tail -15
    timeout 200 "$PY" -m pytest -q -p no:cacheprovider tests/test_megatron_attention.py tests/test_indexer_recompute.py \
        tests/test_telemetry.py tests/test_enable.py tests/test_patches.py 2>&1 | tail -15
  } > "$OUT/tests.log" 2>&1
  grep -E "passed|failed|error" "$OUT/tests.log" | tail -4
  timeout 150 "$PY" benchmarks/approx.py --out "$OUT/approx_$DEVICE_SLUG.json" > "$OUT/approx.log" 2>&1
  tail -4 "$OUT/approx.log"
  timeout 150 "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/approx.py --ring \
      --out "$OUT/approx_ring_${DEVICE_SLUG}_2gpu.json" > "$OUT/approx_ring.log" 2>&1
  tail -2 "$OUT/approx_ring.log"
  OMP_NUM_THREADS=1 timeout 120 "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 \
      -m megatron_mtraining.tools.demo > "$OUT/demo.log" 2>&1
  echo "demo rc=$?"; grep -E "MTraining\]|\[demo\] loss" "$OUT/demo.log" | tail -3
fi
if [ "${E2E:-1}" != 0 ]; then
  timeout 420 "$PY" benchmarks/e2e.py --seq-length "${E2E_SEQ:-262144}" --num-layers 4 --train-iters 7 \
      --out "$OUT/e2e_${DEVICE_SLUG}_2gpu.json" > "$OUT/e2e.log" 2>&1
  tail -4 "$OUT/e2e.log"
fi
# The device tool returns at most 8 files: JSON results stay, logs are packed.
cd "$OUT" || exit 1
suffix=""; [ "${E2E_ONLY:-0}" = 1 ] && suffix=_e2e
tar czf "logs$suffix.tgz" -- *.log && rm -f -- *.log
ls
