#!/usr/bin/env bash
# Quick single-node smoke test of the whole stack: Megatron-LM pretrain_gpt.py + the
# megatron_mtraining launcher + MTraining sparse context-parallel attention, on a small GPT
# (12 layers, hidden 768, FFN 3072, 12 query heads / 4 KV groups, head dim 64) at 64K tokens per
# sequence, context parallel over all GPUs of the node, mock data by default, 20 iterations,
# no checkpoint saving unless CHECKPOINT_PATH is set.
#
# Run (one node; set GPUS_PER_NODE to the GPUs you have, e.g. 2, 4 or 8):
#   MEGATRON_LM=/path/to/Megatron-LM GPUS_PER_NODE=4 bash examples/pretrain_small_mtraining.sh
# NNODES etc. work as in the 512K launchers, but this one is meant for one node.
# Transformer Engine layers when TE imports, else local ones (one line on stderr says which;
# TRANSFORMER_IMPL=transformer_engine|local chooses). MTRAINING_ENTRY=fork runs a patched fork's own
# pretrain_gpt.py; TP=N adds tensor parallelism; DRY_RUN=1 prints the command; extra arguments are
# appended (later flags win). Requirements and every setting: examples/README.md; the shared part
# of the launchers: examples/common.sh.
set -euo pipefail
# shellcheck source=SCRIPTDIR/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

SEQ_LENGTH=${SEQ_LENGTH:-65536}
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-1}
TRAIN_ITERS=${TRAIN_ITERS:-20}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-}
MTRAINING_LOG_INTERVAL=${MTRAINING_LOG_INTERVAL:-5}

MODEL_ARGS=(
    --num-layers 12
    --hidden-size 768
    --ffn-hidden-size 3072
    --num-attention-heads 12
    --num-query-groups 4
    --kv-channels 64
    --norm-epsilon 1e-6
    --untie-embeddings-and-output-weights
    --position-embedding-type rope
    --rotary-base 1000000
)
SCHEDULE_ARGS=(--lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 2)
TOKENIZER_EXAMPLE=gpt2
MOCK_VOCAB_SIZE=32000
# Checkpoints only when asked for (a smoke test should leave nothing behind).
CHECKPOINT_ARGS=()
if [[ -n "$CHECKPOINT_PATH" ]]; then
    CHECKPOINT_ARGS=(--save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --save-interval "$TRAIN_ITERS")
fi

mtraining_launch "$@"
