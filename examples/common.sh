# shellcheck shell=bash
# Sourced (not run) by the example launchers, examples/pretrain_*.sh: what they share. A launcher
# holds only what is its own (model shape, run size, learning rate, checkpoints):
#
#   set -euo pipefail
#   source "$(dirname "${BASH_SOURCE[0]}")/common.sh"   # checks the environment, sets the below
#   SEQ_LENGTH=... GLOBAL_BATCH_SIZE=... TRAIN_ITERS=... MTRAINING_LOG_INTERVAL=...
#   MODEL_ARGS=(...)      # shape, norm epsilon, position embedding
#   SCHEDULE_ARGS=(...)   # --lr, --min-lr, --lr-warmup-iters
#   CHECKPOINT_ARGS=(...) # --save / --load / ... (may be empty)
#   TOKENIZER_EXAMPLE=... # named in the error when DATA_PATH is set without TOKENIZER_MODEL
#   MOCK_VOCAB_SIZE=...   # --vocab-size of the mock data
#   PRETRAINED=CKPT       # (environment) continued pretraining from a converted checkpoint
#   mtraining_launch "$@" # builds the command, prints it (DRY_RUN=1) or runs it
#
# Sourcing sets WORLD_SIZE, TP, CP, REPO_ROOT, PYTHON, ENTRY (the entry point after
# torch.distributed.run), IMPL_ARGS (the layer implementation, below) and LOG_INTERVAL, exports
# PYTHONPATH (the checkout first) and CUDA_DEVICE_MAX_CONNECTIONS, and exits with an error on a bad
# setting, before anything starts.
#
# Layer implementation (TRANSFORMER_IMPL, default auto): Transformer Engine when
# `"$PYTHON" -c "import transformer_engine.pytorch"` succeeds, with Megatron's defaults for it
# (fused RoPE, TE's fused LayerNorm + linear layers); otherwise megatron-core's local layers, with
# the flags they need (--no-rope-fusion: the fused RoPE is TE's; --no-persist-layer-norm: the
# persistent LayerNorm kernel is apex's). One line on stderr says which. TRANSFORMER_IMPL=
# transformer_engine or local chooses explicitly; transformer_engine where TE does not import stops
# with an error, except under DRY_RUN=1, which prints the command for a machine that has TE.
# MTRAINING=0 runs the same command without the --mtraining flags (Megatron's own CP attention: the
# baseline). PLAN_PROFILE (auto | a profile such as nvidia-h200 | none) selects the device profile of
# the planner's start-up line.
# Independently of the layers, --no-gradient-accumulation-fusion is added when apex's
# fused_weight_gradient_mlp_cuda does not import: megatron-core's output layer needs it for that
# fusion on TE layers too.

(return 0 2>/dev/null) || { echo "examples/common.sh is sourced by examples/pretrain_*.sh, not run" >&2; exit 1; }

LAUNCHER_NAME=$(basename "$0")

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

# ---- layer implementation: Transformer Engine when it imports, else local ----
# Asked of $PYTHON with PYTHONPATH as the ranks will have it (the checkout first).
TE_VERSION=$("$PYTHON" -c 'import transformer_engine as te, transformer_engine.pytorch; print(getattr(te, "__version__", "unknown"))' 2>/dev/null) || TE_VERSION=
LOCAL_IMPL_ARGS=(--transformer-impl local --no-rope-fusion --no-persist-layer-norm)
case "${TRANSFORMER_IMPL:-auto}" in
    auto)
        if [[ -n "$TE_VERSION" ]]; then
            IMPL_ARGS=(--transformer-impl transformer_engine)
            echo "[$LAUNCHER_NAME] layers: Transformer Engine $TE_VERSION (--transformer-impl transformer_engine, Megatron's defaults: fused RoPE, TE LayerNorm + linear); TRANSFORMER_IMPL=local for megatron-core's local layers" >&2
        else
            IMPL_ARGS=("${LOCAL_IMPL_ARGS[@]}")
            echo "[$LAUNCHER_NAME] layers: local (${LOCAL_IMPL_ARGS[*]}): Transformer Engine does not import in $PYTHON (python -c \"import transformer_engine.pytorch\" failed); install transformer-engine[pytorch] 2.20 for TE layers" >&2
        fi ;;
    transformer_engine)
        if [[ -z "$TE_VERSION" ]]; then
            if [[ "${DRY_RUN:-0}" != 1 ]]; then
                echo "error: TRANSFORMER_IMPL=transformer_engine but Transformer Engine does not import in $PYTHON (python -c \"import transformer_engine.pytorch\" failed); install transformer-engine[pytorch] 2.20 or set TRANSFORMER_IMPL=local" >&2
                exit 1
            fi
            TE_VERSION="(not importable here: DRY_RUN prints the command for a machine that has it)"
        fi
        IMPL_ARGS=(--transformer-impl transformer_engine)
        echo "[$LAUNCHER_NAME] layers: Transformer Engine $TE_VERSION (TRANSFORMER_IMPL=transformer_engine)" >&2 ;;
    local)
        IMPL_ARGS=("${LOCAL_IMPL_ARGS[@]}")
        echo "[$LAUNCHER_NAME] layers: local (${LOCAL_IMPL_ARGS[*]}; TRANSFORMER_IMPL=local)" >&2 ;;
    *)
        echo "error: TRANSFORMER_IMPL=${TRANSFORMER_IMPL} is none of auto, transformer_engine, local" >&2
        exit 1 ;;
esac
# Megatron's gradient-accumulation fusion is apex's kernel (megatron-core's output layer asks for
# it on TE layers as well): off without apex.
if ! "$PYTHON" -c 'import fused_weight_gradient_mlp_cuda' >/dev/null 2>&1; then
    IMPL_ARGS+=(--no-gradient-accumulation-fusion)
fi

LOG_INTERVAL=${LOG_INTERVAL:-1}

# mtraining_launch EXTRA_ARGS...: the command from the launcher's settings (see the top of this
# file) and the shared ones; extra arguments come last, so they win (argparse keeps the last value).
mtraining_launch() {
    local distributed_args=(
        --nproc_per_node "$GPUS_PER_NODE"
        --nnodes "$NNODES"
        --node_rank "$NODE_RANK"
        --master_addr "$MASTER_ADDR"
        --master_port "$MASTER_PORT"
    )
    # Shared by every model here: a Llama-style GPT (SwiGLU, RMSNorm, GQA, no linear biases);
    # tied or untied embeddings are the model's own (MODEL_ARGS).
    local common_model_args=(
        --group-query-attention
        --swiglu
        --normalization RMSNorm
        --disable-bias-linear
        --seq-length "$SEQ_LENGTH"
        --max-position-embeddings "$SEQ_LENGTH"
        --attention-dropout 0
        --hidden-dropout 0
        --init-method-std 0.02
        --no-create-attention-mask-in-dataloader   # causal: no [seq, seq] mask per sample (1 TiB at 512K)
    )
    local training_args=(
        --micro-batch-size 1
        --global-batch-size "$GLOBAL_BATCH_SIZE"
        --train-iters "$TRAIN_ITERS"
        "${SCHEDULE_ARGS[@]}"
        --lr-decay-style cosine
        --weight-decay 0.1
        --adam-beta2 0.95
        --clip-grad 1.0
        --bf16
        --recompute-granularity full
        --recompute-method uniform
        --recompute-num-layers 1
        --use-distributed-optimizer
    )
    local parallel_args=(
        --tensor-model-parallel-size "$TP"
        --pipeline-model-parallel-size 1
        --context-parallel-size "$CP"
        --cp-comm-type p2p
    )
    local mtraining_args=(
        --mtraining
        --mtraining-top-p 0.9
        --mtraining-layout striped
        --mtraining-block-size 64
        --mtraining-log-interval "$MTRAINING_LOG_INTERVAL"
    )
    # Hierarchical ring across nodes: inner ring = the GPUs of one node.
    if (( NNODES > 1 )); then
        mtraining_args+=(--mtraining-inner-ring-size "${MTRAINING_INNER_RING_SIZE:-$GPUS_PER_NODE}")
    fi
    # PRETRAINED=CKPT: continued pretraining from a converted model (python -m megatron_mtraining.convert
    # hf-to-megatron). Megatron loads it when --load holds no checkpoint yet (then as --finetune:
    # iteration 0, a fresh optimizer) and resumes from --load afterwards. The vocabulary padding and
    # the tokenizer are the conversion's; MTraining's start-up checks the model flags against it.
    local pretrained_args=() pretrained_vocab="" pretrained_tokenizer=""
    if [[ -n "${PRETRAINED:-}" ]]; then
        local pretrained_info
        pretrained_info=$("$PYTHON" - "$PRETRAINED" <<'PY'
import json, os, sys
path = os.path.join(sys.argv[1], "mtraining_conversion.json")
if not os.path.isfile(os.path.join(sys.argv[1], "latest_checkpointed_iteration.txt")) or not os.path.isfile(path):
    sys.exit(f"error: PRETRAINED={sys.argv[1]} is not a converted checkpoint (no mtraining_conversion.json beside "
             "latest_checkpointed_iteration.txt): convert the Hugging Face model with "
             "python -m megatron_mtraining.convert hf-to-megatron --hf DIR --out CKPT")
record = json.load(open(path))
print(record["padded_vocab_size"], record["make_vocab_size_divisible_by"], record.get("tokenizer") or "")
PY
        ) || exit 1
        read -r pretrained_vocab pretrained_divisor pretrained_tokenizer <<<"$pretrained_info"
        pretrained_args=(--pretrained-checkpoint "$PRETRAINED" --make-vocab-size-divisible-by "$pretrained_divisor")
        if [[ ${#CHECKPOINT_ARGS[@]} -eq 0 ]]; then
            echo "error: PRETRAINED is set but the run saves no checkpoints: set CHECKPOINT_PATH (the continued run's --save / --load folder)" >&2
            exit 1
        fi
        echo "[$LAUNCHER_NAME] continued pretraining from $PRETRAINED (vocabulary $pretrained_vocab rows${pretrained_tokenizer:+, tokenizer $pretrained_tokenizer})" >&2
    fi
    local data_args
    if [[ -n "${DATA_PATH:-}" ]]; then
        TOKENIZER_MODEL=${TOKENIZER_MODEL:-$pretrained_tokenizer}
        if [[ -z "${TOKENIZER_MODEL:-}" ]]; then
            echo "error: DATA_PATH is set but TOKENIZER_MODEL is not (a Hugging Face tokenizer name or folder, e.g. $TOKENIZER_EXAMPLE)" >&2
            exit 1
        fi
        data_args=(
            --data-path "$DATA_PATH"
            --split 99,1,0
            --tokenizer-type HuggingFaceTokenizer
            --tokenizer-model "$TOKENIZER_MODEL"
        )
    else
        data_args=(
            --mock-data
            --tokenizer-type NullTokenizer
            --vocab-size "${pretrained_vocab:-$MOCK_VOCAB_SIZE}"
        )
    fi
    local logging_args=(
        --log-interval "$LOG_INTERVAL"
        --log-throughput
        --eval-interval 1000
        --eval-iters 0
    )
    # MTRAINING=0: the same run on Megatron's own context-parallel attention (Transformer Engine's
    # p2p ring), the baseline to compare with.
    if [[ "${MTRAINING:-1}" == 0 ]]; then
        mtraining_args=()
    elif [[ "${MTRAINING:-1}" != 1 ]]; then
        echo "error: MTRAINING=${MTRAINING} is neither 1 (MTraining attention) nor 0 (Megatron's own CP attention)" >&2
        exit 1
    fi
    local megatron_args=(
        "${MODEL_ARGS[@]}"
        "${common_model_args[@]}"
        "${IMPL_ARGS[@]}"
        "${training_args[@]}"
        "${parallel_args[@]}"
        "${mtraining_args[@]}"
        "${data_args[@]}"
        "${logging_args[@]}"
        "${CHECKPOINT_ARGS[@]}"
        "${pretrained_args[@]}"
        "$@"
    )
    local cmd=("$PYTHON" -m torch.distributed.run "${distributed_args[@]}" "${ENTRY[@]}" "${megatron_args[@]}")
    # One line on stderr before the run: the planner's tokens/s and peak memory per GPU for these
    # settings, and the fastest configuration that fits (PLAN_PROFILE: a device profile; auto, the
    # default, asks nvidia-smi and says nothing on a machine without it; none: no line).
    local plan_profile=${PLAN_PROFILE:-auto}
    if [[ "$plan_profile" != none && "$NODE_RANK" == 0 ]] && { [[ "$plan_profile" != auto ]] || command -v nvidia-smi >/dev/null 2>&1; }; then
        # --vocab: the model's vocabulary, which the command names only with mock data (--vocab-size).
        local plan_vocab=()
        [[ -n "${MOCK_VOCAB_SIZE:-}" ]] && plan_vocab=(--vocab "$MOCK_VOCAB_SIZE")
        "$PYTHON" -m megatron_mtraining.plan --startup --gpu-type "$plan_profile" --gpus-per-node "$GPUS_PER_NODE" \
            "${plan_vocab[@]}" "${megatron_args[@]}" >&2 \
            || echo "[$LAUNCHER_NAME] the planner could not predict this run (its error is above); training goes on" >&2
    fi
    # DRY_RUN=1 prints the command (shell-quoted) instead of running it.
    if [[ "${DRY_RUN:-0}" == 1 ]]; then
        printf '%q ' "${cmd[@]}"
        echo
        exit 0
    fi
    exec "${cmd[@]}"
}
