#!/usr/bin/env bash
# Block-sparse patterns on GPUs (issue 43's throughput targets) in one device call on a machine with
# 4 GPUs (bf16, block 64, the canonical heads; the MoBA pattern at about the 5% of the VS index):
#   kernel: benchmarks/kernel.py --index block --block-pattern moba at 128K on one GPU: the block-sparse
#           index through our kernels beside the vertical-slash index (TFLOP/s on active pairs), and
#           FlexAttention with the same BlockMask (block_kernel_rate_ratio_128k, block_speedup_vs_flex_128k);
#   ring:   benchmarks/ring.py --variants dense_zigzag,sparse_moba at 512K over the GPUs: the MoBA
#           pattern on the striped ring against the dense ring, with its worker and step imbalance
#           (ring_moba_speedup_vs_dense_512k_4gpu, ring_moba_worker_imbalance).
# Writes under $OUT (gpu_common.sh): kernel_block_moba_<device>.json, ring_moba_<device>_<W>gpu.json,
# block_patterns_logs.tgz (the logs with setup.log, the ring's heatmaps). Copy the two JSON files to
# benchmarks/results/ and run python benchmarks/make_tables.py.
#
# Cost on 4 H200s (estimated; budget 8 minutes): setup_venv ~90 s; the kernel run ~2-4 minutes (Triton
# and FlexAttention compiles at 128K, 10 reps of fwd and fwd+bwd per index); the ring ~1-2 minutes
# (torchrun ~20 s, the dense ring ~1.9 s per fwd+bwd x 8, the MoBA index ~5 s on the CPU).
# Each call has its own timeout (KERNEL_TIMEOUT, RING_TIMEOUT).
#
#   bash scripts/gpu_block_patterns.sh             # on the GPU machine
#   DRY_RUN=1 bash scripts/gpu_block_patterns.sh   # print the commands only (no venv, no GPU)
# The shell logic on a CPU machine with a venv at .venv (tiny shapes; tests/test_kernel_benchmark.py):
#   REUSE_VENV=1 NGPU=2 RING_SEQ_LEN=512 BENCH_ARGS=--smoke bash scripts/gpu_block_patterns.sh
# shellcheck source=SCRIPTDIR/gpu_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_common.sh" || exit 1

DRY_RUN=${DRY_RUN:-0}
KERNEL_SEQ_LEN=${KERNEL_SEQ_LEN:-131072}
RING_SEQ_LEN=${RING_SEQ_LEN:-524288}
KERNEL_TIMEOUT=${KERNEL_TIMEOUT:-300}
RING_TIMEOUT=${RING_TIMEOUT:-240}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

setup_multi_gpu || exit 1

# shellcheck disable=SC2206  # BENCH_ARGS is a list of flags
kernel=(timeout "$KERNEL_TIMEOUT" "$PY" benchmarks/kernel.py --seq-lens "$KERNEL_SEQ_LEN" --index block
        --block-pattern moba --skip dense,flex,breakdown --out "$OUT/kernel_block_moba_$DEVICE_SLUG.json"
        ${BENCH_ARGS:-})
# shellcheck disable=SC2206
ring=(timeout "$RING_TIMEOUT" "$PY" -m torch.distributed.run --standalone --nproc_per_node "$NGPU" benchmarks/ring.py
      --seq-lens "$RING_SEQ_LEN" --variants dense_zigzag,sparse_moba --out "$OUT/ring_moba_${DEVICE_SLUG}_${NGPU}gpu.json"
      ${BENCH_ARGS:-})
if [ "$DRY_RUN" = 1 ]; then
  echo "${kernel[*]} > $OUT/kernel_block.log 2>&1"
  echo "${ring[*]} > $OUT/ring_moba.log 2>&1"
  exit 0
fi

# A failed call prints its error lines here too: the logs go into the archive below.
errors() { grep -E "Error|error|terminate|what\(\)|Signal" "$1" | head -20; }
start=$SECONDS
"${kernel[@]}" > "$OUT/kernel_block.log" 2>&1
rc=$?; echo "kernel rc=$rc, $((SECONDS - start)) s"; grep -E "^(block|check|error)" "$OUT/kernel_block.log"
[ "$rc" = 0 ] || errors "$OUT/kernel_block.log"
start=$SECONDS
"${ring[@]}" > "$OUT/ring_moba.log" 2>&1
rc=$?; echo "ring rc=$rc, $((SECONDS - start)) s"; tail -4 "$OUT/ring_moba.log"
[ "$rc" = 0 ] || errors "$OUT/ring_moba.log"

# The device tool returns a few files: the logs, setup.log and the heatmaps go in one archive.
cd "$OUT" || exit 1
shopt -s nullglob
extra=(kernel_block.log ring_moba.log setup.log ./*.png)
shopt -u nullglob
present=()
for f in "${extra[@]}"; do [ -e "$f" ] && present+=("$f"); done
[ "${#present[@]}" -gt 0 ] && tar czf block_patterns_logs.tgz -- "${present[@]}" && rm -f -- "${present[@]}"
ls "$OUT"
