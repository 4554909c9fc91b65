#!/usr/bin/env bash
# One multi-GPU device call for the ring: set up, GPU ring checks on 2 and 4 GPUs (torchrun, NCCL,
# bf16 vs fp32 reference, no host sync), then benchmarks/ring.py on all GPUs (BENCH_ARGS adds flags,
# BENCH_TIMEOUT). Logs and ring_<device>_<W>gpu*.json under $OUT (gpu_common.sh). The set-up builds
# the compiled index conversion; MTRAINING_NO_EXT=1 leaves it out (PyTorch conversion).
# shellcheck source=SCRIPTDIR/gpu_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_common.sh" || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt"
setup_venv || exit 1
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")
TORCHRUN=("$PY" -m torch.distributed.run --standalone --nproc_per_node)  # + the process count
for n in 2 4; do
  [ "$n" -le "$NGPU" ] || continue
  timeout 240 "${TORCHRUN[@]}" "$n" tests/ring_gpu_worker.py > "$OUT/ring_check_${n}gpu.log" 2>&1
  echo "ring check ${n} GPUs rc=$?"; grep -h "rank 0\]" "$OUT/ring_check_${n}gpu.log"
done
# shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
timeout "${BENCH_TIMEOUT:-300}" "${TORCHRUN[@]}" "$NGPU" benchmarks/ring.py \
  --out "$OUT/ring_${DEVICE_SLUG}_${NGPU}gpu.json" ${BENCH_ARGS:-} > "$OUT/ring_bench.log" 2>&1
echo "ring bench rc=$?"; tail -12 "$OUT/ring_bench.log"
# SLOW_LINK_GBPS="1 2": flat vs hierarchical ring (nodes of 2 GPUs) under an emulated slow inter-node link.
for gbps in ${SLOW_LINK_GBPS:-}; do
  timeout 200 "${TORCHRUN[@]}" "$NGPU" benchmarks/ring.py \
    --seq-lens 524288 --variants sparse_striped,sparse_striped_hier --no-fwd --inner-size 2 --slow-link-gbps "$gbps" \
    --out "$OUT/ring_${DEVICE_SLUG}_${NGPU}gpu_slowlink${gbps}GBps.json" > "$OUT/ring_slowlink_${gbps}.log" 2>&1
  echo "slow link ${gbps} GB/s rc=$?"; tail -4 "$OUT/ring_slowlink_${gbps}.log"
done
# The device tool returns at most 8 files: pack the heatmaps.
cd "$OUT" || exit 1
ls -- *.png >/dev/null 2>&1 && tar czf heatmaps.tgz -- *.png && rm -f -- *.png
ls
