#!/usr/bin/env bash
# One single-GPU device call: compare launch settings of our kernels (benchmarks/kernel.py
# --sweep), then run the full kernel benchmark with the fastest forward and backward settings.
# SWEEP (num_warps x num_stages candidates), SWEEP_LENS; results under $OUT.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 GIT_COMMIT=${GIT_COMMIT:-unknown}
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh .venv > "$OUT/setup.log" 2>&1; tail -1 "$OUT/setup.log"
PY=.venv/bin/python
SLUG=$($PY -c "import sys, torch; sys.path.insert(0, 'benchmarks'); from common import device_slug; print(device_slug(torch.device('cuda')))")
timeout ${SWEEP_TIMEOUT:-240} $PY benchmarks/kernel.py --seq-lens ${SWEEP_LENS:-131072} --sweep ${SWEEP:-4x2,4x3,8x2,8x3} \
    --reps 5 --out "$OUT/kernelsweep_$SLUG.json" > "$OUT/sweep.log" 2>&1
echo "sweep rc=$?"; grep -E "^(fwd|bwd) " "$OUT/sweep.log"
LAUNCH=$($PY - "$OUT/kernelsweep_$SLUG.json" <<'PYEOF'
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
timeout ${KERNEL_TIMEOUT:-300} $PY benchmarks/kernel.py --launch "$LAUNCH" --out "$OUT/kernel_$SLUG.json" \
    > "$OUT/kernel.log" 2>&1
echo "kernel rc=$?"; tail -8 "$OUT/kernel.log"
