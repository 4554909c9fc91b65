#!/usr/bin/env bash
# The ring at small work per GPU: strong and weak scaling of the sparse striped ring in one device
# call on a machine with 1-4 GPUs (fwd+bwd, bf16, block 64, 5% fixed index, the current kernels):
#   strong: S = 512K on 1, 2 and 4 GPUs;
#   weak:   16K, 32K and 128K tokens per GPU on 1, 2 and 4 GPUs (S = tokens x W);
#   check:  first, tests/ring_gpu_worker.py on the largest W (bf16 ring against an fp32 reference, no
#           host synchronisation): the ring is right on GPUs (CHECK=0 skips it).
# One benchmarks/ring.py call per world size covers both modes (--seq-lens 524288 --tokens-per-gpu ...).
# Writes under $OUT (gpu_common.sh): ring_<device>_<W>gpu_scaling.json, heatmaps.tgz, ring_scaling_logs.tgz
# (the logs and setup.log), and prints the scaling table last (make_tables.py --ring-scaling: its
# formulas on this call's files).
#
# Cost on 4 H200s (estimated; budget 6 minutes): setup_venv ~90 s; every torchrun ~15-20 s to start
# (imports, NCCL), the first one ~30-60 s more for the Triton/Gluon compiles (later ones hit the
# cache); index generation ~1-3 s per length; timed work per call is small: 4 lengths x (3 warmup
# + 7 reps + 1 instrumented) fwd+bwd, at most ~0.6 s each (512K on one GPU: ~7 s), so ~10 s per W.
# The check ~30 s (4 layouts at 16K). About 4 x 35 s + 60 s of compiles + 90 s: ~4.8 minutes.
# Each call has its own timeout (RUN_TIMEOUT, default 150 s): one hang cannot take the whole budget.
#
#   bash scripts/gpu_ring_scaling.sh             # on the GPU machine
#   DRY_RUN=1 bash scripts/gpu_ring_scaling.sh   # print the commands only (no venv, no GPU)
#   WORLDS="1 4" bash scripts/gpu_ring_scaling.sh   # fewer runs
#   BENCH_ARGS=--kernel-profile WORLDS="1 4" bash scripts/gpu_ring_scaling.sh   # + rank 0's kernel times
#     per length (one profiled fwd+bwd each): which kernels grow from 1 GPU to W at the same S
# The shell logic on a CPU machine with a venv at .venv (gloo, tiny shapes; tests/test_ring_scaling.py):
#   REUSE_VENV=1 NGPU=2 WORLDS="1 2" STRONG_SEQ_LEN=512 TOKENS_PER_GPU=64,128 BENCH_ARGS=--smoke \
#     bash scripts/gpu_ring_scaling.sh
# shellcheck source=SCRIPTDIR/gpu_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_common.sh" || exit 1

DRY_RUN=${DRY_RUN:-0}
STRONG_SEQ_LEN=${STRONG_SEQ_LEN:-524288}
TOKENS_PER_GPU=${TOKENS_PER_GPU:-16384,32768,131072}
REPS=${REPS:-7}
WARMUP=${WARMUP:-3}
RUN_TIMEOUT=${RUN_TIMEOUT:-150}
CHECK=${CHECK:-1}  # 1: tests/ring_gpu_worker.py on the largest world size first

setup_multi_gpu || exit 1
WORLDS=${WORLDS:-1 2 4}
TORCHRUN=("$PY" -m torch.distributed.run --standalone --nproc_per_node)  # + the process count

# run W: one benchmarks/ring.py call on W GPUs, JSON $OUT/ring_<device>_<W>gpu_scaling.json.
run() {
  local world=$1 json log rc
  json=$OUT/ring_${DEVICE_SLUG}_${world}gpu_scaling.json
  log=$OUT/ring_${world}gpu_scaling.log
  local cmd=(timeout "$RUN_TIMEOUT" "${TORCHRUN[@]}" "$world" benchmarks/ring.py
             --variants sparse_striped --no-fwd --scaling --seq-lens "$STRONG_SEQ_LEN"
             --tokens-per-gpu "$TOKENS_PER_GPU" --reps "$REPS" --warmup "$WARMUP" --out "$json")
  # shellcheck disable=SC2206  # BENCH_ARGS is a list of flags
  cmd+=(${BENCH_ARGS:-})
  if [ "$DRY_RUN" = 1 ]; then
    echo "${cmd[*]} > $log 2>&1"
    return 0
  fi
  local start=$SECONDS
  "${cmd[@]}" > "$log" 2>&1
  rc=$?
  echo "ring ${world} GPU(s): rc=$rc, $((SECONDS - start)) s"
  [ "$rc" = 0 ] || tail -5 "$log"
}

worlds=() largest=0
for world in $WORLDS; do
  if [ "$world" -gt "$NGPU" ]; then
    echo "skipping ${world} GPUs: this machine has $NGPU"
    continue
  fi
  worlds+=("$world")
  largest=$world
done

# check W: the GPU ring check (bf16 ring against an fp32 reference, and no host synchronisation
# in a forward+backward) on W GPUs; first, so its compiles warm the cache.
check() {
  local world=$1 log
  log=$OUT/ring_check_${world}gpu.log
  local cmd=(timeout "$RUN_TIMEOUT" "${TORCHRUN[@]}" "$world" tests/ring_gpu_worker.py)
  if [ "$DRY_RUN" = 1 ]; then
    echo "${cmd[*]} > $log 2>&1"
    return 0
  fi
  local start=$SECONDS
  "${cmd[@]}" > "$log" 2>&1
  echo "ring check ${world} GPUs: rc=$?, $((SECONDS - start)) s"
  grep -h "rank 0\]" "$log"
}
if [ "$CHECK" = 1 ] && [ "$largest" -gt 1 ]; then
  check "$largest"
fi
for world in ${worlds[@]+"${worlds[@]}"}; do  # (an empty array is "unbound" to older bash under -u)
  run "$world"
done
[ "$DRY_RUN" = 1 ] && exit 0

# The device tool returns at most 8 files: pack the heatmaps, and the logs with setup.log.
cd "$OUT" || exit 1
ls -- *.png >/dev/null 2>&1 && tar czf heatmaps.tgz -- *.png && rm -f -- *.png
logs=(ring_*.log)
[ -e setup.log ] && logs+=(setup.log)
[ -e "${logs[0]}" ] && tar czf ring_scaling_logs.tgz -- "${logs[@]}" && rm -f -- "${logs[@]}"
cd "$REPO" || exit 1
shopt -s nullglob
results=("$OUT"/ring_*gpu_scaling.json)
shopt -u nullglob
ls "$OUT"
if [ "${#results[@]}" -gt 0 ]; then
  echo
  "$PY" benchmarks/make_tables.py --ring-scaling "${results[@]}"
else
  echo "no ring results were written (see the logs)"
fi
