#!/usr/bin/env bash
# One multi-GPU device call for the ring: GPU ring checks on 2 and 4 GPUs (torchrun, NCCL,
# bf16 vs fp32 reference, no host sync), then benchmarks/ring.py on all GPUs.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt"
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
for n in 2 4; do
  [ "$n" -le "$NGPU" ] || continue
  timeout 240 python3 -m torch.distributed.run --standalone --nproc_per_node=$n tests/ring_gpu_worker.py \
    > "$OUT/ring_check_${n}gpu.log" 2>&1
  echo "ring check ${n} GPUs rc=$?"; grep -h "rank 0\]" "$OUT/ring_check_${n}gpu.log"
done
timeout ${BENCH_TIMEOUT:-300} python3 -m torch.distributed.run --standalone --nproc_per_node=$NGPU benchmarks/ring.py \
  --out "$OUT/ring_nvidia-h200_${NGPU}gpu.json" ${BENCH_ARGS:-} > "$OUT/ring_bench.log" 2>&1
echo "ring bench rc=$?"; tail -12 "$OUT/ring_bench.log"
# SLOW_LINK_GBPS="1 2": flat vs hierarchical ring (nodes of 2 GPUs) under an emulated slow inter-node link.
for gbps in ${SLOW_LINK_GBPS:-}; do
  timeout 200 python3 -m torch.distributed.run --standalone --nproc_per_node=$NGPU benchmarks/ring.py \
    --seq-lens 524288 --variants sparse_striped,sparse_striped_hier --no-fwd --inner-size 2 --slow-link-gbps $gbps \
    --out "$OUT/ring_nvidia-h200_${NGPU}gpu_slowlink${gbps}GBps.json" > "$OUT/ring_slowlink_${gbps}.log" 2>&1
  echo "slow link ${gbps} GB/s rc=$?"; tail -4 "$OUT/ring_slowlink_${gbps}.log"
done
# The device tool returns at most 8 files: pack the heatmaps.
ls "$OUT"/*.png >/dev/null 2>&1 && tar czf "$OUT/heatmaps.tgz" -C "$OUT" $(cd "$OUT" && ls *.png) && rm -f "$OUT"/*.png
ls "$OUT"
