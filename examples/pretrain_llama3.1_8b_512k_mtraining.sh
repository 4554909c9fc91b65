#!/usr/bin/env bash
# Pretrain (or continue pretraining) a Llama-3.1-8B-architecture GPT at 512K tokens per sequence
# with MTraining dynamic sparse context-parallel attention.
#
# Model: 32 layers, hidden 4096, FFN 14336 (SwiGLU), 32 query heads / 8 KV groups (head dim 128),
# RMSNorm, no biases, untied embeddings, vocab 128256, RoPE base 500000 with Llama-3.1 rope
# scaling. Sequence length 524288 (512K), context parallelism over ALL GPUs (CP = GPUS_PER_NODE *
# NNODES / TP, TP default 1), micro batch 1, bf16, full recompute, striped layout, top-p 0.9, block
# size 64; two-level (hierarchical) ring when NNODES > 1.
#
# Run (one node, 8 GPUs):
#   MEGATRON_LM=/path/to/Megatron-LM bash examples/pretrain_llama3.1_8b_512k_mtraining.sh
# Multi-node: set NNODES, NODE_RANK, MASTER_ADDR (and GPUS_PER_NODE) on every node.
# Real data: DATA_PATH (a Megatron indexed dataset prefix) and TOKENIZER_MODEL (e.g.
# meta-llama/Llama-3.1-8B); without DATA_PATH it trains on --mock-data. PRETRAINED=CKPT continues
# from the real model, converted with python -m megatron_mtraining.convert hf-to-megatron.
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
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/llama3.1_8b_512k_mtraining}
MTRAINING_LOG_INTERVAL=${MTRAINING_LOG_INTERVAL:-10}
# Llama-3.1 rope scaling (factor 8 over an 8K original context, i.e. the released 128K model).
# Going to 512K relies on continued training at that length; raise the factor if you prefer.
ROPE_SCALING_FACTOR=${ROPE_SCALING_FACTOR:-8}

MODEL_ARGS=(
    --num-layers 32
    --hidden-size 4096
    --ffn-hidden-size 14336
    --num-attention-heads 32
    --num-query-groups 8
    --kv-channels 128
    --norm-epsilon 1e-5
    --untie-embeddings-and-output-weights
    # Llama-3.x rope scaling as exposed by Megatron-LM core_r0.19.x: --use-rope-scaling with
    # --rope-scaling-factor (low/high frequency factors 1/4 and original context 8192 are fixed there).
    --position-embedding-type rope
    --rotary-base 500000
    --use-rope-scaling
    --rope-scaling-factor "$ROPE_SCALING_FACTOR"
)
SCHEDULE_ARGS=(--lr 1e-5 --min-lr 1e-6 --lr-warmup-iters 50)
TOKENIZER_EXAMPLE=meta-llama/Llama-3.1-8B
MOCK_VOCAB_SIZE=128256
CHECKPOINT_ARGS=(
    --save-interval 500
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --tensorboard-dir "$CHECKPOINT_PATH/tensorboard"
)

mtraining_launch "$@"
