#!/usr/bin/env bash
# One 4-GPU device call (written for what session 2's two GPUs could not measure): ring at 256K,
# strong scaling 1 -> 2 -> 4 at 512K, flat vs hierarchical under an emulated slow inter-node link,
# the approximator over 4 GPUs, and end-to-end Megatron training at 512K.
# STAGES picks a subset (default: all): ext gputests ring scaling slowlink approx e2e. RING_LENS,
# SCALING_GPUS and SLOW_LINK_GBPS narrow the ring, scaling and slowlink stages (defaults
# 262144,524288, "1 2", "1 2"); TIMEOUT (240 s; e2e 420 s) and TAIL apply per stage. All of it may
# not fit in one 10-minute call: STAGES="ext ring scaling slowlink approx", then STAGES=e2e.
# Results under $OUT (gpu_common.sh), logs and heatmaps packed in logs_x4.tgz.
# The set-up (always, first) builds the package's compiled extension (CUDA index conversion):
# without it every ring step converts its index in PyTorch (the benchmarks' meta.extension says
# which ran); "ext" stops the job when the extension does not import. The set-up wants the
# megatron-core wheel carried in .whl/ (e2e needs megatron-core).
# shellcheck source=SCRIPTDIR/gpu_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_common.sh" || exit 1
STAGES=${STAGES:-ext gputests ring scaling slowlink approx e2e}
setup_venv || exit 1
run() { local name=$1; shift; timeout "${TIMEOUT:-240}" "$@" > "$OUT/$name.log" 2>&1; echo "$name rc=$?"; tail -"${TAIL:-6}" "$OUT/$name.log"; }
TR=("$PY" -m torch.distributed.run --standalone)
for stage in $STAGES; do case $stage in
  ext) "$PY" -c "import megatron_mtraining._C" || { echo "extension not importable: stopping"; exit 1; } ;;
  gputests) run gpu_tests "$PY" -m pytest -q tests/test_gpu_approx.py tests/test_gpu_ring.py tests/test_slow_link.py ;;
  ring) run ring_4gpu "${TR[@]}" --nproc_per_node=4 benchmarks/ring.py --seq-lens "${RING_LENS:-262144,524288}" --no-fwd --scaling \
          --out "$OUT/ring_${DEVICE_SLUG}_4gpu.json" ;;
  scaling) for n in ${SCALING_GPUS:-1 2}; do
          run "ring_scaling_${n}gpu" "${TR[@]}" --nproc_per_node="$n" benchmarks/ring.py --seq-lens 524288 --no-fwd --scaling \
            --variants sparse_striped,dense_zigzag --reps 3 --out "$OUT/ring_${DEVICE_SLUG}_${n}gpu_scaling.json"; done ;;
  slowlink) for gbps in ${SLOW_LINK_GBPS:-1 2}; do
          run "ring_slowlink_$gbps" "${TR[@]}" --nproc_per_node=4 benchmarks/ring.py --seq-lens 524288 --no-fwd --inner-size 2 \
            --variants sparse_striped,sparse_striped_hier --slow-link-gbps "$gbps" \
            --out "$OUT/ring_${DEVICE_SLUG}_4gpu_slowlink${gbps}GBps.json"; done ;;
  approx) run approx_ring_4gpu "${TR[@]}" --nproc_per_node=4 benchmarks/approx.py --ring \
          --out "$OUT/approx_ring_${DEVICE_SLUG}_4gpu.json" ;;
  e2e) TIMEOUT=420 run e2e "$PY" benchmarks/e2e.py --seq-length 524288 --num-layers 4 --train-iters 6 \
          --out "$OUT/e2e_${DEVICE_SLUG}_4gpu.json" ;;
  *) echo "unknown stage: $stage" ;;
esac; done
# The device tool returns at most 8 files: JSON results stay, logs and heatmaps are packed.
cd "$OUT" || exit 1
shopt -s nullglob  # no heatmaps: no *.png argument
tar czf logs_x4.tgz -- *.log *.png && rm -f -- *.log *.png
ls
