#!/usr/bin/env bash
# Quick single-node smoke test of the whole stack: Megatron-LM pretrain_gpt.py + the
# megatron_mtraining launcher + MTraining sparse context-parallel attention, on a small GPT
# (12 layers, hidden 768, FFN 3072, 12 query heads / 4 KV groups, head dim 64) at 64K tokens per
# sequence, context parallel over all GPUs of the node, mock data by default, 20 iterations,
# no checkpoint saving unless CHECKPOINT_PATH is set.
#
# Requirements:
#   - a Megatron-LM checkout of branch core_r0.19.x (the folder with pretrain_gpt.py), in $MEGATRON_LM
#   - this plugin installed in the Python that runs the ranks, $PYTHON (default: this repo's
#     .venv/bin/python when it exists, else python3); the ranks start with
#     "$PYTHON" -m torch.distributed.run, so a torchrun of another Python cannot be picked up:
#       "$PYTHON" -m pip install --no-build-isolation -e <path to this repo>
#   - real data: a Megatron indexed dataset (prefix in $DATA_PATH, built with
#     $MEGATRON_LM/tools/preprocess_data.py) and a Hugging Face tokenizer ($TOKENIZER_MODEL,
#     e.g. gpt2 or a local folder); without $DATA_PATH (the default) it trains on --mock-data.
#
# Run (one node; set GPUS_PER_NODE to the GPUs you have, e.g. 2, 4 or 8):
#   MEGATRON_LM=/path/to/Megatron-LM GPUS_PER_NODE=4 bash examples/pretrain_small_mtraining.sh
# NNODES etc. work as in the 512K launchers, but this one is meant for one node.
# Extra arguments are appended to the Megatron command line (later flags win), e.g. --train-iters 100.
# MTRAINING_ENTRY=fork runs $MEGATRON_LM/pretrain_gpt.py itself, for a fork patched with
# patches/megatron-lm-core_r0.19.x-mtraining.patch (default: launcher, for unmodified Megatron-LM).
# TP=N splits the heads over N GPUs (tensor parallelism) and rings over the other WORLD_SIZE / N
# (context parallelism); add --sequence-parallel where Transformer Engine or apex is installed
# (megatron-core's torch norms refuse it).
# DRY_RUN=1 prints the command instead of running it.
set -euo pipefail

# ---- distributed setup (defaults: one node) ----
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
WORLD_SIZE=$((GPUS_PER_NODE * NNODES))
# Tensor parallelism (TP ranks split the heads) inside context parallelism: CP = WORLD_SIZE / TP.
TP=${TP:-1}
if ! [[ "$TP" =~ ^[1-9][0-9]*$ ]] || (( WORLD_SIZE % TP )); then
    echo "error: TP=$TP must be a positive divisor of the $WORLD_SIZE GPUs (GPUS_PER_NODE * NNODES)" >&2
    exit 1
fi
CP=$((WORLD_SIZE / TP))

# ---- Megatron-LM checkout ----
if [[ -z "${MEGATRON_LM:-}" ]]; then
    echo "error: MEGATRON_LM is not set; point it at a Megatron-LM core_r0.19.x checkout (the folder containing pretrain_gpt.py)" >&2
    exit 1
fi
if [[ ! -f "$MEGATRON_LM/pretrain_gpt.py" ]]; then
    echo "error: MEGATRON_LM=$MEGATRON_LM does not contain pretrain_gpt.py; point it at a Megatron-LM core_r0.19.x checkout" >&2
    exit 1
fi
export PYTHONPATH="$MEGATRON_LM${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}

# ---- interpreter and entry point ----
# The ranks are started with "$PYTHON" -m torch.distributed.run, never a bare `torchrun`: the
# torchrun on PATH may belong to another Python than the one holding the plugin (e.g. a host torch
# that a project venv reuses), and its ranks would then not find megatron_mtraining.
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$REPO_ROOT/.venv/bin/python" ]]; then PYTHON=$REPO_ROOT/.venv/bin/python; else PYTHON=python3; fi
fi
if ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "error: PYTHON=$PYTHON is not an executable; set PYTHON to the Python that has megatron-mtraining installed" >&2
    exit 1
fi
if ! "$PYTHON" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("megatron_mtraining") is None)' 2>/dev/null; then
    echo "error: PYTHON=$PYTHON cannot import megatron_mtraining; set PYTHON to the Python that has it, or install it into that one: $PYTHON -m pip install --no-build-isolation -e $REPO_ROOT" >&2
    exit 1
fi
case "${MTRAINING_ENTRY:-launcher}" in
    launcher)   # unmodified Megatron-LM: the plugin's launcher adds the flags and the hooks
        ENTRY=(-m megatron_mtraining.launch "$MEGATRON_LM/pretrain_gpt.py") ;;
    fork)       # Megatron-LM with patches/megatron-lm-core_r0.19.x-mtraining.patch applied
        if ! grep -q "_add_mtraining_args" "$MEGATRON_LM/megatron/training/arguments.py" 2>/dev/null; then
            echo "error: MTRAINING_ENTRY=fork but MEGATRON_LM=$MEGATRON_LM is not patched (git apply $REPO_ROOT/patches/megatron-lm-core_r0.19.x-mtraining.patch there, or use MTRAINING_ENTRY=launcher)" >&2
            exit 1
        fi
        ENTRY=("$MEGATRON_LM/pretrain_gpt.py") ;;
    *)
        echo "error: MTRAINING_ENTRY=${MTRAINING_ENTRY} is neither launcher nor fork" >&2
        exit 1 ;;
esac

# ---- run configuration ----
SEQ_LENGTH=${SEQ_LENGTH:-65536}
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-1}
TRAIN_ITERS=${TRAIN_ITERS:-20}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-}
LOG_INTERVAL=${LOG_INTERVAL:-1}
MTRAINING_LOG_INTERVAL=${MTRAINING_LOG_INTERVAL:-5}
DISTRIBUTED_ARGS=(
    --nproc_per_node "$GPUS_PER_NODE"
    --nnodes "$NNODES"
    --node_rank "$NODE_RANK"
    --master_addr "$MASTER_ADDR"
    --master_port "$MASTER_PORT"
)

MODEL_ARGS=(
    --num-layers 12
    --hidden-size 768
    --ffn-hidden-size 3072
    --num-attention-heads 12
    --group-query-attention
    --num-query-groups 4
    --kv-channels 64
    --swiglu
    --normalization RMSNorm
    --norm-epsilon 1e-6
    --disable-bias-linear
    --untie-embeddings-and-output-weights
    --seq-length "$SEQ_LENGTH"
    --max-position-embeddings "$SEQ_LENGTH"
    --position-embedding-type rope
    --rotary-base 1000000
    --attention-dropout 0
    --hidden-dropout 0
    --init-method-std 0.02
    --transformer-impl local          # Transformer Engine is optional: MTraining replaces core attention
    --no-rope-fusion                  # fused RoPE needs Transformer Engine
    --no-persist-layer-norm           # the persistent LayerNorm kernel needs apex
    --no-create-attention-mask-in-dataloader   # causal: no [seq, seq] mask per sample (1 TiB at 512K)
)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size "$GLOBAL_BATCH_SIZE"
    --train-iters "$TRAIN_ITERS"
    --lr 3e-4
    --min-lr 3e-5
    --lr-decay-style cosine
    --lr-warmup-iters 2
    --weight-decay 0.1
    --adam-beta2 0.95
    --clip-grad 1.0
    --bf16
    --recompute-granularity full
    --recompute-method uniform
    --recompute-num-layers 1
    --no-gradient-accumulation-fusion   # needs apex; harmless to drop when apex is installed
    --use-distributed-optimizer
)

PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP"
    --pipeline-model-parallel-size 1
    --context-parallel-size "$CP"
    --cp-comm-type p2p
)

MTRAINING_ARGS=(
    --mtraining
    --mtraining-top-p 0.9
    --mtraining-layout striped
    --mtraining-block-size 64
    --mtraining-log-interval "$MTRAINING_LOG_INTERVAL"
)
# Hierarchical ring across nodes: inner ring = the GPUs of one node.
if (( NNODES > 1 )); then
    MTRAINING_ARGS+=(--mtraining-inner-ring-size "${MTRAINING_INNER_RING_SIZE:-$GPUS_PER_NODE}")
fi

if [[ -n "${DATA_PATH:-}" ]]; then
    if [[ -z "${TOKENIZER_MODEL:-}" ]]; then
        echo "error: DATA_PATH is set but TOKENIZER_MODEL is not (a Hugging Face tokenizer name or folder, e.g. gpt2)" >&2
        exit 1
    fi
    DATA_ARGS=(
        --data-path "$DATA_PATH"
        --split 99,1,0
        --tokenizer-type HuggingFaceTokenizer
        --tokenizer-model "$TOKENIZER_MODEL"
    )
else
    DATA_ARGS=(
        --mock-data
        --tokenizer-type NullTokenizer
        --vocab-size 32000
    )
fi

LOGGING_ARGS=(
    --log-interval "$LOG_INTERVAL"
    --log-throughput
    --eval-interval 1000
    --eval-iters 0
)
# Checkpoints only when asked for (a smoke test should leave nothing behind).
if [[ -n "$CHECKPOINT_PATH" ]]; then
    LOGGING_ARGS+=(--save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --save-interval "$TRAIN_ITERS")
fi

CMD=("$PYTHON" -m torch.distributed.run "${DISTRIBUTED_ARGS[@]}" "${ENTRY[@]}"
    "${MODEL_ARGS[@]}"
    "${TRAINING_ARGS[@]}"
    "${PARALLEL_ARGS[@]}"
    "${MTRAINING_ARGS[@]}"
    "${DATA_ARGS[@]}"
    "${LOGGING_ARGS[@]}"
    "$@"
)
# DRY_RUN=1 prints the command (shell-quoted) instead of running it.
if [[ "${DRY_RUN:-0}" == 1 ]]; then
    printf '%q ' "${CMD[@]}"
    echo
    exit 0
fi
exec "${CMD[@]}"
