#!/usr/bin/env bash
# One single-GPU device call for packed documents: the GPU tests of the kernels (documents first,
# then the unpacked kernel tests as a regression guard), then benchmarks/packed.py at 128K
# (ours with documents vs FlexAttention's document-causal attention vs our unpacked kernels).
# PACKED_LENS, TEST_TIMEOUT, BENCH_TIMEOUT; logs and packed_<device>.json under $OUT (gpu_common.sh).
# shellcheck source=SCRIPTDIR/gpu_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_common.sh" || exit 1
setup_venv || exit 1
timeout "${TEST_TIMEOUT:-300}" "$PY" -m pytest -q tests/test_documents.py tests/test_gpu.py tests/test_convert.py \
    tests/test_sparse_attention.py > "$OUT/tests.log" 2>&1
echo "tests rc=$?"; tail -3 "$OUT/tests.log"
timeout "${BENCH_TIMEOUT:-300}" "$PY" benchmarks/packed.py --seq-lens "${PACKED_LENS:-131072}" \
    --out "$OUT/packed_$DEVICE_SLUG.json" > "$OUT/packed.log" 2>&1
echo "packed rc=$?"; tail -12 "$OUT/packed.log"
