#!/usr/bin/env bash
# One 4-GPU device call for the measurements still missing after session 2 (see summary.json):
# ring at 256K, strong scaling 1 -> 2 -> 4 at 512K, flat vs hierarchical under an emulated slow
# inter-node link, the approximator over 4 GPUs, and end-to-end Megatron training at 512K.
# STAGES picks a subset (default: all): ext gputests ring scaling slowlink approx e2e; RING_LENS and
# SCALING_GPUS narrow the ring and scaling stages (default 256K,512K and 1 2). All of it may not fit
# in one 10-minute call: STAGES="ext ring scaling slowlink approx", then STAGES=e2e. Results go to $OUT.
# "ext" builds the package's compiled extension (CUDA index conversion) first: without it every
# ring step converts its index in PyTorch (the benchmarks' meta.extension says which ran).
# "ext" and "e2e" need the megatron-core wheel carried in .whl/.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD GIT_COMMIT=${GIT_COMMIT:-unknown}
cd "$(dirname "$0")/.."
STAGES=${STAGES:-ext gputests ring scaling slowlink approx e2e}
run() { local name=$1; shift; timeout ${TIMEOUT:-240} "$@" > "$OUT/$name.log" 2>&1; echo "$name rc=$?"; tail -${TAIL:-6} "$OUT/$name.log"; }
TR="python3 -m torch.distributed.run --standalone"
for stage in $STAGES; do case $stage in
  ext) bash scripts/setup_env.sh .venv > "$OUT/setup.log" 2>&1; tail -1 "$OUT/setup.log"
       python3 -c "import megatron_mtraining._C" || { echo "extension not importable: stopping"; exit 1; } ;;
  gputests) run gpu_tests python3 -m pytest -q tests/test_gpu_approx.py tests/test_gpu_ring.py tests/test_slow_link.py ;;
  ring) run ring_4gpu $TR --nproc_per_node=4 benchmarks/ring.py --seq-lens ${RING_LENS:-262144,524288} --no-fwd --scaling \
          --out "$OUT/ring_nvidia-h200_4gpu.json" ;;
  scaling) for n in ${SCALING_GPUS:-1 2}; do
          run ring_scaling_${n}gpu $TR --nproc_per_node=$n benchmarks/ring.py --seq-lens 524288 --no-fwd --scaling \
            --variants sparse_striped,dense_zigzag --reps 3 --out "$OUT/ring_nvidia-h200_${n}gpu_scaling.json"; done ;;
  slowlink) for gbps in ${SLOW_LINK_GBPS:-1 2}; do
          run ring_slowlink_$gbps $TR --nproc_per_node=4 benchmarks/ring.py --seq-lens 524288 --no-fwd --inner-size 2 \
            --variants sparse_striped,sparse_striped_hier --slow-link-gbps $gbps \
            --out "$OUT/ring_nvidia-h200_4gpu_slowlink${gbps}GBps.json"; done ;;
  approx) run approx_ring_4gpu $TR --nproc_per_node=4 benchmarks/approx.py --ring \
          --out "$OUT/approx_ring_nvidia-h200_4gpu.json" ;;
  e2e) [ -x .venv/bin/python ] || bash scripts/setup_env.sh .venv > "$OUT/setup.log" 2>&1 || { tail -5 "$OUT/setup.log"; continue; }
       TIMEOUT=420 run e2e .venv/bin/python benchmarks/e2e.py --seq-length 524288 --num-layers 4 --train-iters 6 \
          --out "$OUT/e2e_nvidia-h200_4gpu.json" ;;
esac; done
# The device tool returns at most 8 files: JSON results stay, logs and heatmaps are packed.
cd "$OUT" && tar czf logs_x4.tgz *.log $(ls *.png 2>/dev/null) && rm -f *.log *.png; ls
