#!/usr/bin/env bash
# The real Megatron-LM tree (branch core_r0.19.0, megatron-core 0.19.1) on 1-2 GPUs: its
# pretrain_gpt.py through the launcher (unmodified tree, examples/pretrain_small_mtraining.sh) and
# as the patched fork (patches/, MTRAINING_ENTRY=fork of the same example), at CP=2 and CP=1. Each
# of these runs three times from the same seed and mock data: to N iterations, saving a
# distributed checkpoint (torch_dist) there; from that checkpoint (--load) on to N+M; and to N+M
# without a stop. The resumed and the uninterrupted runs both save at N+M.
#
# Two verdicts on exact resume (MTraining runs deterministic kernels by default,
# --mtraining-deterministic; cuBLAS, NCCL and TE are pinned to deterministic algorithms below):
# * printed numbers (scripts/compare_megatron_runs.py): the per-iteration losses and gradient
#   norms, as Megatron prints them (lm loss to 7 significant digits, grad norm to 3 decimals), of
#   the resumed run equal the uninterrupted run's, and so do the first N of the saving run. A run's
#   second lm loss line is Megatron's average of its first two iterations: the comparison recovers
#   each iteration's own value first;
# * saved state (scripts/compare_checkpoints.py): the resumed run's checkpoint at N+M and the
#   uninterrupted run's, tensor by tensor (model parameters, the distributed optimizer's fp32
#   parameters and Adam moments, RNG and optimizer-step objects), bit-equal.
#
# Layers: Transformer Engine when it imports (the launchers' default; a TE installed by
# scripts/gpu_te.sh into $TE_SITE, default /tmp/te_site, is put on PYTHONPATH), else local ones;
# TRANSFORMER_IMPL=transformer_engine|local chooses. Decided once, for every run; the summary says
# which, and checks that each run's Megatron arguments show it.
#
# The tarball does not travel to the device machine by itself: copy it into the working tree
# (an ignored folder) and carry that folder, with .whl (megatron-core's wheel, for the set-up):
#   mkdir -p .carry && cp ../shared/third_party/megatron-lm-core_r0.19.0.tar.gz .carry/
#   device run: carry [".carry", ".whl"], command: bash scripts/gpu_megatron_lm.sh
# (on TE layers: run scripts/gpu_te.sh's install first on the same warm machine, then
#   REUSE_VENV=1 bash scripts/gpu_megatron_lm.sh).
# Looked up at $MTRAINING_MEGATRON_LM_TARBALL (absolute, or relative to the repository), else
# .carry/, else ../shared/third_party/.
# It is unpacked twice under $BUILD_DIR (default third_party_build/, ignored): as is, and patched.
#
# Settings: N (3), M (3), SEQ (16384 tokens), CP_SIZES ("2 1"; CP=2 is skipped with a message on
# one GPU), ENTRIES ("launcher fork"), RUN_TIMEOUT (seconds per run, 240), EXTRA_ARGS (more
# Megatron flags for every run, e.g. --deterministic-mode), TRANSFORMER_IMPL (auto), TE_SITE,
# REUSE_VENV=1 (gpu_common.sh). At CP=1 on 2 GPUs the launcher's and the fork's runs go side by
# side, one GPU each.
# DRY_RUN=1 unpacks and patches the trees and prints every training command (no GPU needed; the
# tests feed them to the real Megatron-LM parser); DRY_RUN_GPUS (2) stands in for the GPU count.
# Sized to finish in about 8 minutes on 2 H200s with a warm .venv (not yet measured: the first run
# also compiles the Triton kernels).
# Results under $OUT (gpu_common.sh): summary.txt (the comparisons; also printed), logs/<entry>_cp<CP>.log
# (the three runs of each, one after another), setup.log. Exit status 0 only when every run
# finished and every comparison matched.
# shellcheck source=SCRIPTDIR/gpu_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_common.sh" || exit 1

N=${N:-3}
M=${M:-3}
SEQ=${SEQ:-16384}
CP_SIZES=${CP_SIZES:-"2 1"}
ENTRIES=${ENTRIES:-"launcher fork"}
RUN_TIMEOUT=${RUN_TIMEOUT:-240}
DRY=${DRY_RUN:-0}
BUILD=${BUILD_DIR:-third_party_build}
case $BUILD in /*) ;; *) BUILD=$REPO/$BUILD ;; esac
TARBALL_NAME=megatron-lm-core_r0.19.0.tar.gz
PATCH=$REPO/patches/megatron-lm-core_r0.19.x-mtraining.patch
EXAMPLE=$REPO/examples/pretrain_small_mtraining.sh

TARBALL=${MTRAINING_MEGATRON_LM_TARBALL:-}
if [ -z "$TARBALL" ]; then
  for candidate in "$REPO/.carry/$TARBALL_NAME" "$REPO/../shared/third_party/$TARBALL_NAME"; do
    [ -f "$candidate" ] && { TARBALL=$candidate; break; }
  done
fi
if [ ! -f "$TARBALL" ]; then
  echo "error: $TARBALL_NAME not found (MTRAINING_MEGATRON_LM_TARBALL, $REPO/.carry/, $REPO/../shared/third_party/):" \
       "copy it into .carry/ and carry that folder" >&2
  exit 1
fi

if [ "$DRY" = 1 ]; then
  if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
  elif [ -x "$REPO/.venv/bin/python" ]; then PY=$REPO/.venv/bin/python
  else PY=python3; fi
  NGPU=${DRY_RUN_GPUS:-2}
else
  setup_venv || exit 1
  NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())") || NGPU=0
  if [ "$NGPU" -lt 1 ]; then echo "error: no CUDA GPU visible to $PY" >&2; exit 1; fi
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/[gpu] /'
fi

# ---- layers: Transformer Engine when it imports, else local (decided once, for every run) ----
TE_SITE=${TE_SITE:-/tmp/te_site}
if [ -d "$TE_SITE" ]; then export PYTHONPATH=$TE_SITE${PYTHONPATH:+:$PYTHONPATH}; fi
TE_VERSION=$("$PY" -c 'import transformer_engine as te, transformer_engine.pytorch; print(getattr(te, "__version__", "unknown"))' 2>/dev/null) || TE_VERSION=
case ${TRANSFORMER_IMPL:=auto} in
  auto) if [ -n "$TE_VERSION" ]; then TRANSFORMER_IMPL=transformer_engine; else TRANSFORMER_IMPL=local; fi ;;
  transformer_engine|local) ;;
  *) echo "error: TRANSFORMER_IMPL=$TRANSFORMER_IMPL is none of auto, transformer_engine, local" >&2; exit 1 ;;
esac
if [ "$TRANSFORMER_IMPL" = transformer_engine ] && [ -z "$TE_VERSION" ] && [ "$DRY" != 1 ]; then
  echo "error: TRANSFORMER_IMPL=transformer_engine but Transformer Engine does not import in $PY" \
       "(PYTHONPATH ${PYTHONPATH:-unset}); install it with scripts/gpu_te.sh or set TRANSFORMER_IMPL=local" >&2
  exit 1
fi
export TRANSFORMER_IMPL
if [ "$TRANSFORMER_IMPL" = transformer_engine ]; then
  LAYERS="Transformer Engine ${TE_VERSION:-(not importable here: dry run)} (--transformer-impl transformer_engine)"
else
  LAYERS="local (--transformer-impl local$([ -z "$TE_VERSION" ] && echo ': Transformer Engine does not import'))"
fi
echo "[megatron-lm] tarball $TARBALL; python $PY; $NGPU GPU(s); N=$N M=$M seq $SEQ; CP sizes $CP_SIZES; entries $ENTRIES"
echo "[megatron-lm] layers: $LAYERS"

# ---- the two trees ----
PRISTINE=$(unpack_tree "$BUILD/megatron-lm") || exit 1
PATCHED=$(unpack_tree "$BUILD/megatron-lm-mtraining") || exit 1
apply_patch "$PATCHED" || { echo "error: $PATCH does not apply to $PATCHED" >&2; exit 1; }
echo "[megatron-lm] unpacked $PRISTINE; patched $PATCHED"

# ---- the runs ----
RUNS=$BUILD/runs
mkdir -p "$RUNS" "$OUT/logs"
rm -f "$RUNS"/*.log "$RUNS"/*.rc
# Fewer, smaller layers than the example's; the rest (recompute, distributed optimizer, bf16,
# --mtraining --mtraining-top-p 0.9 --mtraining-layout striped) stays as it ships.
# Every parameter's size is a multiple of 64 elements: no gaps between parameters in the
# distributed optimizer's buckets, which megatron-core fills with torch.empty in a checkpoint
# (they would differ between runs; scripts/compare_checkpoints.py compares the buckets whole).
MODEL=(--num-layers 4 --hidden-size 512 --ffn-hidden-size 1536 --num-attention-heads 8 --num-query-groups 4
       --kv-channels 64 --vocab-size 8192 --seed 1234 --mtraining-deterministic)
# shellcheck disable=SC2206  # EXTRA_ARGS is a list of flags
MODEL+=(${EXTRA_ARGS:-})
# Bit-exact settings for cuBLAS, NCCL and Transformer Engine (what Megatron's --deterministic-mode
# asks for: megatron/training/determinism.py).
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8} NCCL_ALGO=${NCCL_ALGO:-Ring}
export NVTE_ALLOW_NONDETERMINISTIC_ALGO=${NVTE_ALLOW_NONDETERMINISTIC_ALGO:-0}
# NVLink multicast off, as in scripts/gpu_te.sh (the GPU machines' notes ask for it).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PORT=29400

run_one() {  # ENTRY CP MODE DEVICES PORT
  local entry=$1 cp=$2 mode=$3 devices=$4 port=$5
  local name=${entry}_cp${cp} tree=$PRISTINE extra=()
  [ "$entry" = fork ] && tree=$PATCHED
  # The saving run's checkpoint (at N) in $ckpt; the resumed and the uninterrupted runs save at
  # N+M into folders of their own, for scripts/compare_checkpoints.py.
  local ckpt=$BUILD/ckpt/$name
  case $mode in
    save) extra=(--save "$ckpt" --save-interval "$N" --exit-interval "$N" --ckpt-format torch_dist) ;;
    resume) extra=(--load "$ckpt" --save "${ckpt}_resume" --save-interval "$((N + M))" --ckpt-format torch_dist) ;;
    full) extra=(--save "${ckpt}_full" --save-interval "$((N + M))" --ckpt-format torch_dist) ;;
  esac
  local env=(CUDA_VISIBLE_DEVICES="$devices" MEGATRON_LM="$tree" MTRAINING_ENTRY="$entry" PYTHON="$PY"
             GPUS_PER_NODE="$cp" NNODES=1 NODE_RANK=0 MASTER_ADDR=localhost MASTER_PORT="$port"
             SEQ_LENGTH="$SEQ" TRAIN_ITERS="$((N + M))" GLOBAL_BATCH_SIZE=1 LOG_INTERVAL=1 MTRAINING_LOG_INTERVAL=1
             CHECKPOINT_PATH= DATA_PATH=)
  if [ "$DRY" = 1 ]; then
    local cmd
    cmd=$(env "${env[@]}" DRY_RUN=1 bash "$EXAMPLE" "${MODEL[@]}" "${extra[@]}") || { echo "error: $EXAMPLE refused the $name $mode run" >&2; return 1; }
    echo "[dry-run] $name $mode: CUDA_VISIBLE_DEVICES=$devices $cmd"
    return 0
  fi
  case $mode in save) rm -rf "$ckpt" ;; *) rm -rf "${ckpt}_$mode" ;; esac  # nothing left from an earlier call
  local log=$RUNS/${name}_${mode}.log start=$SECONDS rc
  env "${env[@]}" timeout "$RUN_TIMEOUT" bash "$EXAMPLE" "${MODEL[@]}" "${extra[@]}" > "$log" 2>&1
  rc=$?
  echo "$rc" > "$RUNS/${name}_${mode}.rc"
  { echo "======== $name $mode (GPUs $devices, rc=$rc, $((SECONDS - start)) s) ========"; cat "$log"; echo; } >> "$OUT/logs/$name.log"
  echo "[run] $name $mode: rc=$rc in $((SECONDS - start)) s$( [ "$rc" = 124 ] && echo " (timed out after $RUN_TIMEOUT s)")"
  [ "$rc" = 0 ]
}
sequence() {  # ENTRY CP DEVICES PORT: save to N, resume to N+M, uninterrupted N+M
  run_one "$1" "$2" save "$3" "$4"
  run_one "$1" "$2" resume "$3" "$(($4 + 1))"
  run_one "$1" "$2" full "$3" "$(($4 + 2))"
}

if [ "$DRY" != 1 ]; then
  prepare_dataset_helpers "$PRISTINE" "$PATCHED" || { echo "error: could not prepare Megatron-LM's dataset helpers" >&2; exit 1; }
  rm -f "$OUT"/logs/*.log
fi
DONE=()
for cp in $CP_SIZES; do
  if [ "$cp" -gt "$NGPU" ]; then
    echo "[megatron-lm] CP=$cp skipped: needs $cp GPUs, $NGPU visible"
    continue
  fi
  devices=$(seq -s, 0 $((cp - 1)))
  if [ "$cp" = 1 ] && [ "$NGPU" -ge 2 ] && [ "$(echo "$ENTRIES" | wc -w)" -ge 2 ] && [ "$DRY" != 1 ]; then
    # Two single-GPU sequences side by side, one per GPU.
    gpu=0
    for entry in $ENTRIES; do
      sequence "$entry" 1 "$gpu" "$((PORT + 10 * gpu))" &
      gpu=$(( (gpu + 1) % NGPU )); PORT=$((PORT + 3))
    done
    wait
  else
    for entry in $ENTRIES; do
      sequence "$entry" "$cp" "$devices" "$PORT"
      PORT=$((PORT + 3))
    done
  fi
  PORT=$((PORT + 20))
  for entry in $ENTRIES; do DONE+=("${entry}_cp${cp}"); done
done
[ "$DRY" = 1 ] && exit 0

# ---- the comparisons ----
check_layers() {  # Megatron prints its arguments: each run must show the layers decided above
  local name mode ok=0
  echo "Layers: $LAYERS"
  for name in "${DONE[@]}"; do
    for mode in save resume full; do
      if grep -Eq " transformer_impl \.+ $TRANSFORMER_IMPL[[:space:]]*\$" "$RUNS/${name}_${mode}.log" 2>/dev/null; then
        echo "  ok   $name $mode run on --transformer-impl $TRANSFORMER_IMPL"
      else
        echo "  FAIL $name $mode run: its log does not show transformer_impl $TRANSFORMER_IMPL"; ok=1
      fi
    done
  done
  return "$ok"
}
status=0
check_layers > "$OUT/summary.txt" || status=1
cat "$OUT/summary.txt"
echo | tee -a "$OUT/summary.txt"
# Printed losses and grad norms (compare_megatron_runs.py undoes Megatron's averaging of a run's
# first two logged iterations before comparing).
"$PY" "$REPO/scripts/compare_megatron_runs.py" "$RUNS" "$N" "$M" "$BUILD/ckpt" "${DONE[@]}" | tee -a "$OUT/summary.txt"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
# Saved state: the resumed run's checkpoint at N+M against the uninterrupted run's, bit for bit.
# rng_state is compared but does not count: the resumed run builds its data iterators after
# restoring the RNGs, and torch's DataLoader draws each iterator's base seed from the CPU generator,
# so that generator is one draw further there (training itself draws nothing from it: no dropout).
for name in "${DONE[@]}"; do
  echo -e "\n$name: exact resume on the saved state (iteration $((N + M)))" | tee -a "$OUT/summary.txt"
  "$PY" "$REPO/scripts/compare_checkpoints.py" "$BUILD/ckpt/${name}_resume" "$BUILD/ckpt/${name}_full" \
      --iteration "$((N + M))" --ignore rng_state 2>&1 | tee -a "$OUT/summary.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
done
echo -e "\nOVERALL: $([ "$status" = 0 ] && echo PASS || echo FAIL) (layers: $LAYERS)" | tee -a "$OUT/summary.txt"
ls "$OUT" "$OUT/logs"
exit "$status"
