#!/usr/bin/env bash
# The quality benchmark, one device call on 2 GPUs (or RUNS=dense, RUNS=mtraining: two calls on one
# GPU; PATTERNS=1 adds MoBA and XAttention's index, below). The dense and the MTraining
# trainings run side by side, one per GPU, from the same seed and data; then the merge writes
# quality.json and the plots to $OUT (gpu_common.sh). QUALITY_FLAGS overrides the schedule / model
# flags; QUALITY_TIMEOUT bounds each training.
# PACKED=1: the packed-documents runs (quality.py --packed: 3-8 documents per sequence,
# attention masked at their boundaries through cu_seqlens in both runs), the same side-by-side
# structure, merged into quality_packed.json (plots quality_packed_*.png). One device call on
# 2 H200s: `PACKED=1 bash scripts/gpu_quality.sh`, carry [".whl"]. DOCUMENT_MIX=prolong: the issue's
# long-document mix instead (quality_packed_prolong.json). EXTEND=1: context extension from one
# dense base (below), one call on 1 or 2 GPUs.
# shellcheck source=SCRIPTDIR/gpu_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_common.sh" || exit 1
# An existing .venv is kept (REUSE_VENV=0 redoes the set-up): on a warm machine, RUNS=dense then
# RUNS=mtraining set up once.
REUSE_VENV=${REUSE_VENV:-1} setup_venv setup_quality.log || exit 1
# Defaults (the quality.py docstring says why): fact needles (one token per key-value pair, so
# one attention head retrieves it, no induction plateau), vocabulary 2048 (21 keys x 21 values),
# RoPE base 1e6, a 128 -> 1K -> 4K -> 32K curriculum, answer tokens weighted 20x in the training
# loss. Estimate on one H200 (bf16): ~1 min up to 4K, ~0.15 s per 32K iteration.
FLAGS=${QUALITY_FLAGS:---phases 128:800,1024:400,4096:400,32768:800 --tokens-per-iteration 16384 --needles-per-1k 48 --queries 6 --needle-format fact --vocab-size 2048 --rotary-base 1000000 --answer-loss-weight 20 --lr 3e-3 --warmup 50 --eval-probes 16 --max-train-seconds 360}
# RUNS="dense" then RUNS="mtraining" runs them one per call on a single GPU (each alone on it);
# the merge happens where both JSONs are (here, or later with quality.py --merge).
# MT_VARIANT="--min-vertical 0" adds a second MTraining run with these extra flags, after the
# first on the same GPU, merged against the same dense run into quality_${VARIANT_NAME}.json.
PREFIX=quality
if [ "${PACKED:-0}" = 1 ]; then
  # The unpacked recipe's model and flags; the schedule starts at 512 tokens (3-8 documents of ~64-170
  # tokens, like the unpacked first phase's 128) and keeps its tokens per iteration and iterations.
  # Estimate from the notes above (~1 min up to 4K, ~0.15 s per 32K iteration, ~150 s per training
  # with data and evaluation; attention within documents does less work than causal attention over
  # the whole sequence, the evaluation adds one probe grid without the document mask): ~3-4 min per
  # training, both side by side; the guards (280 s of training, 420 s per run) keep one call under
  # 10 minutes with the set-up.
  PREFIX=quality_packed
  FLAGS=${QUALITY_FLAGS:---packed --documents 3:8 --phases 512:800,2048:400,8192:400,32768:800 --tokens-per-iteration 16384 --needles-per-1k 48 --queries 6 --needle-format fact --vocab-size 2048 --rotary-base 1000000 --answer-loss-weight 20 --lr 3e-3 --warmup 50 --eval-probes 16 --max-train-seconds 280}
  # DOCUMENT_MIX=prolong (or L1,L2,...): every sequence is that mix of documents instead of 3-8 random
  # ones (quality.py --document-mix; prolong is the 128K packed benchmark mix, long documents holding
  # most of the pairs), merged into quality_packed_prolong.json. Scaled to 32K the mix's documents
  # are as short as the random ones (an offset costs the same share of the pairs:
  # benchmarks/document_costs.py), so without QUALITY_FLAGS the schedule ends with 100 iterations at
  # 128K, where it costs what an unpacked 32K sequence does. Estimate: ~0.6 s per 128K iteration,
  # ~5 min per training; run one training per call (RUNS=dense, then RUNS=mtraining, REUSE_VENV=1).
  if [ -n "${DOCUMENT_MIX:-}" ]; then
    if [ -z "${QUALITY_FLAGS:-}" ]; then  # a later flag wins
      FLAGS="$FLAGS --phases 512:800,2048:400,8192:400,32768:400,131072:100 --max-train-seconds 400"
      QUALITY_TIMEOUT=${QUALITY_TIMEOUT:-520}
    fi
    FLAGS="$FLAGS --document-mix $DOCUMENT_MIX"; PREFIX="${PREFIX}_${DOCUMENT_MIX//,/-}"
  fi
  QUALITY_TIMEOUT=${QUALITY_TIMEOUT:-420}
fi
# PATTERNS=1: the block-sparse patterns too (quality.py --run moba, --run xattn), at the same token budget
# and flags, merged with the dense and MTraining runs into ${PREFIX}_patterns.json. Their defaults
# scaled to the 32K schedule (MoBA's 4096-token blocks x 12 would attend densely up to 48K): MoBA blocks
# of 1024 tokens, top-3 (3 of 32 blocks at 32K); XAttention blocks of 128, stride 16, threshold 0.9.
# XAttention's index takes no packed documents: with PACKED=1 the patterns are MoBA's only. On fewer
# GPUs than runs, the runs of one GPU go one after the other: 4 trainings on 2 GPUs take two of them.
BLOCK_PATTERN_FLAGS=${BLOCK_PATTERN_FLAGS:---moba-block-size 1024 --moba-top-k 3 --xattn-block-size 128 --xattn-stride 16 --xattn-threshold 0.9}
if [ "${PATTERNS:-0}" = 1 ]; then
  FLAGS="$FLAGS $BLOCK_PATTERN_FLAGS"
  if [ "${PACKED:-0}" = 1 ]; then RUNS=${RUNS:-dense mtraining moba}; else RUNS=${RUNS:-dense mtraining moba xattn}; fi
fi
# EXTEND=1: the paper's context-extension protocol (quality.py --save-model / --init-from). A dense
# base trains at 2K (128 -> 2K, the recipe's model and flags), then extends 16x to 32K from that
# same base with dense attention and with MTraining, on the same tokens, side by side on 2 GPUs (one
# after the other on 1); merged into quality_extension.json. Estimate on one H200: the base ~2 min,
# each extension ~2 min (400 iterations at 32K, ~0.15 s each, and the evaluation): one call.
if [ "${EXTEND:-0}" = 1 ]; then
  BASE_PHASES=${BASE_PHASES:-128:800,2048:800}
  EXTEND_PHASES=${EXTEND_PHASES:-32768:400}
  EXTEND_FLAGS="--eval-lengths 2048,8192,32768 --max-train-seconds 150"
  QUALITY_TIMEOUT=${QUALITY_TIMEOUT:-240}
  NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")
  # shellcheck disable=SC2086  # FLAGS is a list of flags; later flags win
  timeout "$QUALITY_TIMEOUT" "$PY" benchmarks/quality.py --run dense --out "$OUT/quality_extension_base.json" $FLAGS \
      --phases "$BASE_PHASES" --eval-lengths 2048 --save-model "$OUT/base.pt" > "$OUT/quality_extension_base.log" 2>&1 \
    || { tail -20 "$OUT/quality_extension_base.log"; exit 1; }
  extend() {  # extend RUN GPU
    # shellcheck disable=SC2086
    CUDA_VISIBLE_DEVICES=$2 timeout "$QUALITY_TIMEOUT" "$PY" benchmarks/quality.py --run "$1" $FLAGS --phases "$EXTEND_PHASES" \
        $EXTEND_FLAGS --init-from "$OUT/base.pt" --out "$OUT/quality_extension_$1.json" > "$OUT/quality_extension_$1.log" 2>&1
  }
  if [ "${NGPU:-1}" -ge 2 ] 2>/dev/null; then extend dense 0 & extend mtraining 1 & wait
  else extend dense 0; extend mtraining 0; fi
  for log in "$OUT"/quality_extension_*.log; do echo "$(basename "$log"):"; tail -2 "$log"; done
  cd "$OUT" || exit 1
  "$PY" "$REPO/benchmarks/quality.py" --merge quality_extension_dense.json quality_extension_mtraining.json \
      --out quality_extension.json && rm -f quality_extension_dense.json quality_extension_mtraining.json base.pt
  shopt -s nullglob
  tar czf quality_logs.tgz -- quality_*.log setup_quality*.log *.png && rm -f -- quality_*.log *.png
  ls
  exit 0
fi
RUNS=${RUNS:-dense mtraining}
VARIANT_NAME=${VARIANT_NAME:-variant}
if [ -n "${MT_VARIANT:-}" ]; then
  # Two MTraining trainings one after the other must fit one 10-minute device call (each takes
  # ~150 s with data and evaluation on an H200): tighter guards (a later flag wins).
  FLAGS="$FLAGS --max-train-seconds 200"; QUALITY_TIMEOUT=${QUALITY_TIMEOUT:-260}
fi
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")
train() {  # train RUN OUTPUT_NAME EXTRA_FLAGS...: one training on this job's GPU
  local run=$1 name=$2; shift 2
  # shellcheck disable=SC2086  # FLAGS is a list of flags
  timeout "${QUALITY_TIMEOUT:-520}" "$PY" benchmarks/quality.py --run "$run" --out "$OUT/${PREFIX}_$name.json" $FLAGS "$@" \
      > "$OUT/${PREFIX}_$name.log" 2>&1
}
# Run i on GPU i mod NGPU; a GPU's runs one after the other, so each has the GPU its time guard assumes.
[ "$NGPU" -ge 1 ] 2>/dev/null || NGPU=1
declare -A on_gpu=()
i=0
for run in $RUNS; do on_gpu[$((i % NGPU))]+="$run "; i=$((i + 1)); done
for gpu in "${!on_gpu[@]}"; do
  (
    export CUDA_VISIBLE_DEVICES=$gpu
    for run in ${on_gpu[$gpu]}; do
      train "$run" "$run"
      # shellcheck disable=SC2086  # MT_VARIANT is a list of flags
      if [ "$run" = mtraining ] && [ -n "${MT_VARIANT:-}" ]; then train mtraining "mtraining_$VARIANT_NAME" $MT_VARIANT; fi
    done
  ) &
done
wait
for log in "$OUT"/quality_*.log; do echo "$(basename "$log"):"; grep -E "answer|phase" "$log" | tail -3; tail -2 "$log"; done
cd "$OUT" || exit 1
merge() { [ -f "${PREFIX}_dense.json" ] && [ -f "${PREFIX}_$1.json" ] \
  && "$PY" "$REPO/benchmarks/quality.py" --merge "${PREFIX}_dense.json" "${PREFIX}_$1.json" --out "$2"; }
if [ "${PATTERNS:-0}" = 1 ]; then  # before the two-run merge below removes its inputs
  results=()
  for run in dense mtraining moba xattn; do [ -f "${PREFIX}_$run.json" ] && results+=("${PREFIX}_$run.json"); done
  "$PY" "$REPO/benchmarks/quality.py" --merge "${results[@]}" --out "${PREFIX}_patterns.json" \
    && rm -f "${PREFIX}_moba.json" "${PREFIX}_xattn.json"
fi
merge mtraining "$PREFIX.json" && rm -f "${PREFIX}_mtraining.json"
merge "mtraining_$VARIANT_NAME" "${PREFIX}_$VARIANT_NAME.json" && rm -f "${PREFIX}_mtraining_$VARIANT_NAME.json"
[ -f "$PREFIX.json" ] && rm -f "${PREFIX}_dense.json"
# The device tool returns at most 8 files: logs and plots travel packed.
shopt -s nullglob  # the set-up log and the plots may be missing
tar czf quality_logs.tgz -- quality_*.log setup_quality*.log *.png && rm -f -- quality_*.log *.png
ls
