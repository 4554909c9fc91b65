#!/usr/bin/env bash
# Issue 17 spike on one sm_90 GPU: FlashAttention-4's Hopper kernels (flash-attn-4, CuTe DSL) on
# our slash lists at B = 128 and 64, against our kernels in the same call (benchmarks/spike_fa4.py).
# Its wheels exceed one call's 64 MiB, so two calls to one warm machine (gpu_common.sh):
#   call 1: PHASE=stash  (carry .fa4a: the first part of nvidia-cutlass-dsl-libs-cu13), then STAGES
#           of gpu_hopper.sh if given, so the call does useful work while it carries
#   call 2: PHASE=run    (carry .fa4b: the rest and the other wheels) -> $OUT/spike_fa4_<device>.json
# How to fill .fa4a / .fa4b: benchmarks/NOTES.md, session 17.
# shellcheck source=SCRIPTDIR/gpu_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_common.sh" || exit 1
case ${PHASE:-run} in
  stash)
    stash_wheel_parts .fa4a || exit 1
    if [ -n "${STAGES:-}" ]; then bash scripts/gpu_hopper.sh; fi ;;
  run)
    REUSE_VENV=${REUSE_VENV:-1} setup_venv || exit 1
    install_split_wheels .fa4b /tmp/fa4_site || exit 1
    "$PY" -c "import flash_attn.cute, cutlass; print('flash_attn.cute from', flash_attn.cute.__file__)" || exit 1
    timeout "${SPIKE_TIMEOUT:-520}" "$PY" benchmarks/spike_fa4.py --out "$OUT/spike_fa4_$DEVICE_SLUG.json" \
        > "$OUT/spike_fa4.log" 2>&1
    echo "spike rc=$?"; grep -E "^(checks|ours|fa4|cudnn)" "$OUT/spike_fa4.log" | tail -20 ;;
  *) echo "PHASE must be stash or run" >&2; exit 1 ;;
esac
