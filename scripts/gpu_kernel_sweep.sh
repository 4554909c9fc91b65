#!/usr/bin/env bash
# One single-GPU device call: compare launch settings of our kernels (benchmarks/kernel.py
# --sweep), then run the full kernel benchmark with the fastest forward and backward settings.
# SWEEP (num_warps x num_stages candidates), SWEEP_LENS, SWEEP_TIMEOUT, KERNEL_TIMEOUT; logs and
# results (kernelsweep_<device>.json, kernel_<device>.json) under $OUT (gpu_common.sh).
# shellcheck source=SCRIPTDIR/gpu_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_common.sh" || exit 1
setup_venv || exit 1
timeout "${SWEEP_TIMEOUT:-240}" "$PY" benchmarks/kernel.py --seq-lens "${SWEEP_LENS:-131072}" --sweep "${SWEEP:-4x2,4x3,8x2,8x3}" \
    --reps 5 --out "$OUT/kernelsweep_$DEVICE_SLUG.json" > "$OUT/sweep.log" 2>&1
echo "sweep rc=$?"; grep -E "^(fwd|bwd) " "$OUT/sweep.log"
LAUNCH=$("$PY" - "$OUT/kernelsweep_$DEVICE_SLUG.json" <<'PYEOF'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
best = {}
for family, key in (("fwd", "fwd_ms"), ("bwd", "fwdbwd_ms")):
    timed = [r for r in rows if r["family"] == family and isinstance(r.get(key), (int, float))]
    if timed:
        best[family] = min(timed, key=lambda r: r[key])["launch"]
print(",".join(f"{f}:{s}" for f, s in best.items()))
PYEOF
)
echo "fastest launch settings: ${LAUNCH:-none}"
timeout "${KERNEL_TIMEOUT:-300}" "$PY" benchmarks/kernel.py --launch "$LAUNCH" --out "$OUT/kernel_$DEVICE_SLUG.json" \
    > "$OUT/kernel.log" 2>&1
echo "kernel rc=$?"; tail -8 "$OUT/kernel.log"
