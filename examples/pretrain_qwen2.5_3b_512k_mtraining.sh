#!/usr/bin/env bash
# Continue pretraining Qwen2.5-3B (or pretrain its architecture) at 512K tokens per sequence with
# MTraining dynamic sparse context-parallel attention.
#
# Model: Qwen2.5-3B as released: 36 layers, hidden 2048, FFN 11008 (SwiGLU), 16 query heads / 2 KV
# groups (head dim 128), RMSNorm, QKV bias, tied embeddings, vocab 151936 (3.09B parameters). Sequence length 524288 (512K), context
# parallelism over ALL GPUs (CP = GPUS_PER_NODE * NNODES / TP, TP default 1), micro batch 1, bf16,
# full recompute, striped layout, top-p 0.9, block size 64; two-level (hierarchical) ring when
# NNODES > 1.
#
# Run (one node, 8 GPUs):
#   MEGATRON_LM=/path/to/Megatron-LM bash examples/pretrain_qwen2.5_3b_512k_mtraining.sh
# Multi-node: set NNODES, NODE_RANK, MASTER_ADDR (and GPUS_PER_NODE) on every node.
# Real data: DATA_PATH (a Megatron indexed dataset prefix) and TOKENIZER_MODEL (e.g.
# Qwen/Qwen2.5-3B); without DATA_PATH it trains on --mock-data. PRETRAINED=CKPT continues from the
# real model, converted with python -m megatron_mtraining.convert hf-to-megatron --hf DIR --out CKPT.
# Transformer Engine layers when TE imports, else local ones (one line on stderr says which;
# TRANSFORMER_IMPL=transformer_engine|local chooses). MTRAINING_ENTRY=fork runs a patched fork's own
# pretrain_gpt.py; TP=N adds tensor parallelism; DRY_RUN=1 prints the command; extra arguments are
# appended (later flags win). Requirements and every setting: examples/README.md; the shared part
# of the launchers: examples/common.sh.
set -euo pipefail
# shellcheck source=SCRIPTDIR/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

SEQ_LENGTH=${SEQ_LENGTH:-524288}
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-8}
TRAIN_ITERS=${TRAIN_ITERS:-1000}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/qwen2.5_3b_512k_mtraining}
MTRAINING_LOG_INTERVAL=${MTRAINING_LOG_INTERVAL:-10}
# Qwen2.5 was pretrained with rope base 1e6 at 32K; YaRN stretches it 16x to 512K.
YARN_ORIGINAL_MAX_POSITIONS=${YARN_ORIGINAL_MAX_POSITIONS:-32768}
YARN_SCALING_FACTOR=${YARN_SCALING_FACTOR:-$((SEQ_LENGTH / YARN_ORIGINAL_MAX_POSITIONS))}

MODEL_ARGS=(
    --num-layers 36
    --hidden-size 2048
    --ffn-hidden-size 11008
    --num-attention-heads 16
    --num-query-groups 2
    --kv-channels 128
    --norm-epsilon 1e-6
    --add-qkv-bias
    # RoPE + YaRN as exposed by Megatron-LM core_r0.19.x: --position-embedding-type yarn with
    # --rotary-scaling-factor (becomes TransformerConfig.yarn_rotary_scaling_factor) and
    # --yarn-original-max-position-embeddings. For plain RoPE use --position-embedding-type rope.
    --position-embedding-type yarn
    --rotary-base 1000000
    --rotary-scaling-factor "$YARN_SCALING_FACTOR"
    --yarn-original-max-position-embeddings "$YARN_ORIGINAL_MAX_POSITIONS"
)
SCHEDULE_ARGS=(--lr 1e-5 --min-lr 1e-6 --lr-warmup-iters 50)
TOKENIZER_EXAMPLE=Qwen/Qwen2.5-3B
MOCK_VOCAB_SIZE=151936
CHECKPOINT_ARGS=(
    --save-interval 500
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --tensorboard-dir "$CHECKPOINT_PATH/tensorboard"
)

mtraining_launch "$@"
