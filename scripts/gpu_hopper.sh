#!/usr/bin/env bash
# Single-GPU device calls for the Hopper kernels (issue 17; an sm_90 GPU: H100 or H200). All the
# stages take more than one call's 10 minutes: STAGES=tests in one call, the default in another.
# STAGES (default "kernel ab packed"):
#   tests   the Hopper kernels' tests and test_gpu.py, on the GPU (TESTS overrides)
#   kernel  benchmarks/kernel.py, the default forward (the Hopper kernel on sm_90): kernel_<device>.json
#   ab      kernel.py at 128K with the Triton kernels only (MTRAINING_FORWARD_KERNEL and
#           MTRAINING_BACKWARD_KERNEL = triton), the same call's A/B: kernelrerun_triton_<device>.json
#   bwd_ab  kernel.py at 128K, no dense baselines, the backward on the Hopper kernels and then on
#           Triton's (the forward Hopper's in both), index blocks of BLOCK_SIZE (default 64):
#           kernelrerun_{hopper,triton}bwd_b<BLOCK_SIZE>_<device>.json
#   packed  benchmarks/packed.py at 128K: packed_<device>.json
#   report  issue 17's other figures, B = 64 and the default kernels, cuDNN beside (no Flex): 512K at 5%,
#           128K at 2.5% and at 10%: kernel_report_{512k,d025,d10}_<device>.json (tabled, never the
#           targets' figures)
# Logs and results under $OUT (gpu_common.sh).
# shellcheck source=SCRIPTDIR/gpu_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_common.sh" || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt"
setup_venv || exit 1
stage() { case " ${STAGES:-kernel ab packed} " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
# One A/B leg: kernel.py at 128K, no dense baselines, index blocks of BLOCK_SIZE (default 64), at
# most $2 seconds: kernelrerun_$1_<device>.json; the further arguments go to kernel.py.
ab_leg() {
  local name=$1 limit=$2
  shift 2
  timeout "$limit" "$PY" benchmarks/kernel.py --seq-lens 131072 --block-size "${BLOCK_SIZE:-64}" \
      --skip dense,flex,check "$@" --out "$OUT/kernelrerun_${name}_$DEVICE_SLUG.json" > "$OUT/kernel_$name.log" 2>&1
  echo "kernel $name rc=$?"; tail -4 "$OUT/kernel_$name.log"
}
if stage tests; then
  # The default fits one call with a cold set-up (~4 min on an H200). test_sparse_attention.py and
  # test_documents.py compile many small variants on the GPU: more than 7 minutes together, so a
  # call of their own (TESTS=...).
  # shellcheck disable=SC2086  # TESTS is a list of paths
  timeout "${TEST_TIMEOUT:-480}" "$PY" -m pytest -q -p no:cacheprovider ${TESTS:-tests/test_hopper_kernels.py \
      tests/test_gpu.py} > "$OUT/tests.log" 2>&1
  echo "tests rc=$?"; tail -3 "$OUT/tests.log"
fi
if stage kernel; then
  timeout 400 "$PY" benchmarks/kernel.py --out "$OUT/kernel_$DEVICE_SLUG.json" > "$OUT/kernel.log" 2>&1
  echo "kernel rc=$?"; tail -6 "$OUT/kernel.log"
fi
if stage ab; then
  timeout 200 "$PY" benchmarks/kernel.py --seq-lens 131072 --skip flex,check --forward-kernel triton \
      --backward-kernel triton --out "$OUT/kernelrerun_triton_$DEVICE_SLUG.json" > "$OUT/kernel_ab.log" 2>&1
  echo "kernel ab rc=$?"; tail -4 "$OUT/kernel_ab.log"
fi
if stage bwd_ab; then
  for kernel in hopper triton; do
    ab_leg "${kernel}bwd_b${BLOCK_SIZE:-64}" 150 --backward-kernel $kernel
  done
fi
if stage report; then
  for spec in "524288 0.05 512k" "131072 0.025 d025" "131072 0.10 d10"; do
    read -r seq density name <<< "$spec"
    timeout 180 "$PY" benchmarks/kernel.py --seq-lens "$seq" --density "$density" --skip flex --reps 5 \
        --out "$OUT/kernel_report_${name}_$DEVICE_SLUG.json" > "$OUT/kernel_report_$name.log" 2>&1
    echo "kernel report $name rc=$?"; tail -3 "$OUT/kernel_report_$name.log"
  done
fi
if stage packed; then
  timeout 300 "$PY" benchmarks/packed.py --seq-lens 131072 --out "$OUT/packed_$DEVICE_SLUG.json" \
      > "$OUT/packed.log" 2>&1
  echo "packed rc=$?"; tail -6 "$OUT/packed.log"
fi
