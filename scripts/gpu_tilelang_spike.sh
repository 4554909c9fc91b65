#!/usr/bin/env bash
# Issue 17 spike on one sm_90 GPU: TileLang kernels (benchmarks/tilelang_slash.py) on our slash
# lists at B = 128 and 64, against our kernels in the same call (benchmarks/spike_tilelang.py).
# tilelang (~50 MB) and z3-solver (~29 MB) together exceed one call's 64 MiB, so two calls to one
# warm machine (gpu_common.sh):
#   call 1: PHASE=stash  (carry .tla: the tilelang wheel)
#   call 2: PHASE=run    (carry .tlb: z3-solver, apache-tvm-ffi 0.1.12 and the small wheels)
#           -> $OUT/spike_tilelang_<device>.json (SWEEP=1: the per-kernel sweep instead)
# How to fill .tla / .tlb: benchmarks/NOTES.md, session 18. TileLang compiles its kernels with the
# machine's nvcc (CUDA 13), found on PATH or under CUDA_HOME.
# shellcheck source=SCRIPTDIR/gpu_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_common.sh" || exit 1
case ${PHASE:-run} in
  stash)
    stash_wheel_parts .tla || exit 1 ;;
  run)
    REUSE_VENV=${REUSE_VENV:-1} setup_venv || exit 1
    install_split_wheels .tlb /tmp/tilelang_site || exit 1
    if ! command -v nvcc > /dev/null && [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
      export CUDA_HOME=/usr/local/cuda PATH=/usr/local/cuda/bin:$PATH
    fi
    "$PY" -c "import tilelang; print('tilelang', tilelang.__version__, 'from', tilelang.__file__)" || exit 1
    # SWEEP=1: each kernel alone over the script's variants (spike_tilelang_sweep_<device>.json);
    # SPIKE_ARGS: more arguments for spike_tilelang.py (e.g. "--parts none": the reference checks only)
    name=spike_tilelang${SWEEP:+_sweep}
    timeout "${SPIKE_TIMEOUT:-520}" "$PY" benchmarks/spike_tilelang.py ${SWEEP:+--sweep} ${SPIKE_ARGS:-} \
        --out "$OUT/${name}_$DEVICE_SLUG.json" > "$OUT/$name.log" 2>&1
    echo "spike rc=$?"; grep -E "^(checks|b[0-9]+)" "$OUT/$name.log" | tail -24
    tail -3 "$OUT/$name.log" ;;
  *) echo "PHASE must be stash or run" >&2; exit 1 ;;
esac
