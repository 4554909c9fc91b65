#!/usr/bin/env bash
# The flagship launchers (examples/pretrain_qwen2.5_3b_512k_mtraining.sh, .._llama3.1_8b_..) on every
# GPU of this machine through benchmarks/flagship.py: full depth, measured (tokens/s, TFLOP/s, peak
# memory per GPU) beside the planner's prediction, MTraining and Megatron's own CP as the baseline.
#
#   device run: carry [".carry", ".whl"], command: bash scripts/gpu_flagship.sh [flagship.py's flags]
#   (.carry: the Megatron-LM tarball, .whl: megatron-core's wheel; see scripts/gpu_megatron_lm.sh)
#
# Arguments go to benchmarks/flagship.py (default: Qwen2.5-3B at 256K, MTraining and TE's CP). Settings:
# TE_SITE (a Transformer Engine installed by scripts/gpu_te.sh; without TE the layers are local and
# only MTraining runs: Megatron's local attention has no context parallelism at these lengths),
# REUSE_VENV=1 (gpu_common.sh). Results under $OUT: the JSON(s) and logs/ of each run.
# shellcheck source=SCRIPTDIR/gpu_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_common.sh" || exit 1

TARBALL_NAME=megatron-lm-core_r0.19.0.tar.gz
TARBALL=${MTRAINING_MEGATRON_LM_TARBALL:-}
if [ -z "$TARBALL" ]; then
  for candidate in "$REPO/.carry/$TARBALL_NAME" "$REPO/../shared/third_party/$TARBALL_NAME"; do
    [ -f "$candidate" ] && { TARBALL=$candidate; break; }
  done
fi
[ -f "$TARBALL" ] || { echo "error: $TARBALL_NAME not found: copy it into .carry/ and carry that folder" >&2; exit 1; }
BUILD=${BUILD_DIR:-$REPO/third_party_build}

setup_venv || exit 1
TE_SITE=${TE_SITE:-/tmp/te_site}
if [ -d "$TE_SITE" ]; then export PYTHONPATH=$TE_SITE${PYTHONPATH:+:$PYTHONPATH}; fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/[gpu] /'
TREE=$(unpack_tree "$BUILD/megatron-lm") || exit 1
prepare_dataset_helpers "$TREE" || { echo "error: could not prepare Megatron-LM's dataset helpers" >&2; exit 1; }
export PYTHON=$PY MEGATRON_LM=$TREE

"$PY" benchmarks/flagship.py "$@" --out "$OUT/flagship.json" 2>&1 | tee "$OUT/flagship.txt"
exit "${PIPESTATUS[0]}"
