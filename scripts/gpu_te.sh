#!/usr/bin/env bash
# Transformer Engine on a GPU machine (docs/transformer-engine.md), then the TE checks and benchmarks.
#
# TE does not fit one device call (64 MiB): scripts/fetch_te.py (run here first) leaves the core
# wheel in parts under .te/part0 .. .te/partN and everything else under .te/rest. Then, back to back
# on one warm machine (it is released after 30 s idle):
#   PHASE=stash    carry .te/partK      once per part: copies the part out of the repository copy
#   PHASE=install  carry .te/rest       joins the parts, builds transformer_engine_torch for sm_90
#                                       (skipped when rest/ holds a built wheel), installs TE into
#                                       $TE_SITE, then runs $STAGES
#   PHASE=run      (nothing to carry)   runs $STAGES on a machine where install already ran
# E2E_ARGS: more benchmarks/e2e.py flags for the e2e stages, after the stage's own (so they win:
#   e.g. E2E_ARGS="--runs te_cp,mtraining" or "--profile-iteration 7").
# STAGES (space separated, in order): check tests (every GPU test, TE's included; TESTS= a subset of
#   files: all of them take ~12 minutes on 2 H200s, over one call's limit, so split them, e.g.
#   TESTS="tests/test_convert.py tests/test_dense.py tests/test_documents.py" then the rest) rope packed equivalence fp8_tracking e2e e2e_fp8 e2e_4gpu
#   e2e_fp8_4gpu e2e_1m_4gpu (activation recompute on both sides); e2e and e2e_fp8 use every visible GPU, so
#   on a 4-GPU machine CUDA_VISIBLE_DEVICES=0,1 and =2,3 run the 2-GPU pair beside each other
#   resume (exact resume on TE layers: scripts/gpu_megatron_lm.sh at CP=2, the launcher entry;
#   carry .carry with the Megatron-LM tarball, see that script)
# Results land under $OUT (the device tool's folder), one log per stage; the built
# transformer_engine_torch wheel under $OUT/te/ (put it in .te/rest to skip the build next time).
# shellcheck source=SCRIPTDIR/gpu_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_common.sh" || exit 1
TE_SITE=${TE_SITE:-/tmp/te_site}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

install_te() {
  local build=/tmp/te_build_site wheels=$WHEEL_PARTS part whole
  stash_wheel_parts .te/rest > /dev/null || return 1
  for part in "$wheels"/*.whl.part00; do
    whole=${part%.part00}
    cat "$whole".part* > "$whole" && rm -f "$whole".part* || return 1
    python3 -m zipfile -t "$whole" > /dev/null || { echo "joined wheel $whole is broken (a part missing?)" >&2; return 1; }
  done
  mapfile -t te_wheels < <(ls "$wheels"/*.whl | grep -v megatron_core)
  if ! ls "$wheels"/transformer_engine_torch-*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$build" "${te_wheels[@]}" || return 1
    echo "[te] building transformer_engine_torch for sm_90 ($(nproc) cores)"
    local start=$SECONDS
    (cd "$wheels" && PYTHONPATH=$build NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_CUDA_ARCHS=90 MAX_JOBS=$(nproc) \
        NVTE_FRAMEWORK=pytorch python3 -m pip wheel -q --no-build-isolation --no-deps --no-index \
        transformer_engine_torch-*.tar.gz -w "$wheels") > "$OUT/te_build.log" 2>&1 \
        || { tail -30 "$OUT/te_build.log" >&2; return 1; }
    echo "[te] built in $((SECONDS - start)) s"
    mkdir -p "$OUT/te" && cp "$wheels"/transformer_engine_torch-*.whl "$OUT/te/"
    mapfile -t te_wheels < <(ls "$wheels"/*.whl | grep -v megatron_core)
  fi
  # One install for the meta, core and torch packages: they share transformer_engine/, which a
  # second --target install would replace whole.
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$TE_SITE" "${te_wheels[@]}" || return 1
  mkdir -p .whl && cp "$wheels"/megatron_core-*.whl .whl/ 2>/dev/null
  return 0
}

# The GPUs this process sees (CUDA_VISIBLE_DEVICES splits one machine between two 2-GPU runs).
visible_gpus() { "$PY" -c "import torch; print(torch.cuda.device_count())"; }

run_stage() {
  local stage=$1 rc
  echo "== $stage"
  case $stage in
    check) "$PY" -c "import transformer_engine as te, transformer_engine.pytorch, megatron.core as mc; \
from megatron_mtraining.integration.transformer_engine import check_transformer_engine as c; \
print('TE', te.__version__, 'megatron-core', mc.__version__, '->', c(required=True))" ;;
    tests) timeout 560 "$PY" -m pytest -q -p no:cacheprovider -m gpu ${TESTS:-tests} --durations=15 2>&1 | tee "$OUT/tests.log" \
        | grep -E "passed|failed|skipped|Error|^[0-9.]+s " ;;
    rope) "$PY" -m pytest -q -x tests/test_gpu_te.py 2>&1 | tee "$OUT/rope.log" | tail -5 ;;
    packed) "$PY" -m pytest -q -x -s tests/test_gpu_te_packed.py 2>&1 | tee "$OUT/packed.log" | grep -E "TE layers|passed|failed|Error" ;;
    equivalence) timeout 580 "$PY" scripts/check_te_equivalence.py --out "$OUT/te_equivalence_${DEVICE_SLUG}.json" \
        2>&1 | tee "$OUT/equivalence.log" | grep -E "^(run|pair|RESULT|wrote)" ;;
    fp8_tracking) timeout 580 "$PY" scripts/check_te_equivalence.py --study fp8 --train-iters 40 \
        --out "$OUT/te_fp8_tracking_${DEVICE_SLUG}.json" 2>&1 | tee "$OUT/fp8_tracking.log" \
        | grep -E "^(run|pair|RESULT|wrote)" ;;
    e2e|e2e_fp8) timeout 580 "$PY" benchmarks/e2e.py --seq-length 262144 --runs te_cp,mtraining \
        $([ "$stage" = e2e_fp8 ] && echo --fp8) --train-iters 12 --profile-iteration 11 ${E2E_ARGS:-} \
        --out "$OUT/e2e_te${stage#e2e}_${DEVICE_SLUG}_$(visible_gpus)gpu.json" 2>&1 | tee "$OUT/$stage.log" \
        | grep -E "rc=|speedup|tokens/s|wrote" ;;
    e2e_1m_4gpu) timeout 580 "$PY" benchmarks/e2e.py --seq-length 1048576 --runs te_cp,mtraining --recompute \
        --train-iters 6 ${E2E_ARGS:-} --out "$OUT/e2e_te_1m_${DEVICE_SLUG}.json" 2>&1 | tee "$OUT/$stage.log" \
        | grep -E "rc=|speedup|tokens/s|wrote" ;;
    e2e_4gpu|e2e_fp8_4gpu) timeout 580 "$PY" benchmarks/e2e.py --seq-length 524288 --runs te_cp,te_cp_a2a_p2p,mtraining \
        $([ "$stage" = e2e_fp8_4gpu ] && echo --fp8) --train-iters 12 --profile-iteration 11 ${E2E_ARGS:-} \
        --out "$OUT/e2e_te${stage#e2e}_${DEVICE_SLUG}.json" 2>&1 | tee "$OUT/$stage.log" | grep -E "rc=|speedup|tokens/s|wrote" ;;
    resume) ENTRIES=${ENTRIES:-launcher} CP_SIZES=${CP_SIZES:-2} REUSE_VENV=1 TE_SITE=$TE_SITE \
        bash scripts/gpu_megatron_lm.sh 2>&1 | tee "$OUT/resume.log" | tail -25 ;;
    *) echo "unknown stage $stage" >&2; return 2 ;;
  esac
  rc=${PIPESTATUS[0]}; echo "[$stage] rc=$rc"
}

case ${PHASE:-run} in
  stash)
    for d in .te/part*; do stash_wheel_parts "$d" > /dev/null || exit 1; done
    ls -la "$WHEEL_PARTS" ;;
  install|run)
    if [ "${PHASE:-run}" = install ]; then
      start=$SECONDS
      install_te || { echo "[te] install failed" >&2; exit 1; }
      echo "[te] installed into $TE_SITE in $((SECONDS - start)) s"
    fi
    export PYTHONPATH=$TE_SITE${PYTHONPATH:+:$PYTHONPATH}
    # install: set the venv up again, incrementally (a .venv left by another script on this machine
    # lacks the megatron-core wheel that install_te has just put under .whl); run: reuse it.
    default_reuse=$([ "${PHASE:-run}" = install ] && echo 0 || echo 1)
    REUSE_VENV=${REUSE_VENV:-$default_reuse} setup_venv || exit 1
    for stage in ${STAGES:-check}; do run_stage "$stage"; done ;;
  *) echo "PHASE must be stash, install or run" >&2; exit 1 ;;
esac
