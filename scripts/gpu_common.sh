# shellcheck shell=bash
# Sourced (not run) by every scripts/gpu_*.sh, before anything else: the set-up those GPU jobs share.
#   source "$(dirname "${BASH_SOURCE[0]}")/gpu_common.sh" || exit 1
# It cd's to the repository root and sets:
#   OUT         absolute, created; default <repo>/gpu_out, a relative OUT is taken from the
#               directory the job was started in (the device tool sets an absolute one)
#   GIT_COMMIT  exported for the benchmarks' metadata; default the checkout's short HEAD, else
#               "unknown" (device copies may carry no .git)
#   PYTHONUNBUFFERED=1, so the logs under $OUT fill as the job runs
# and defines setup_venv [LOG]: scripts/setup_env.sh .venv (log $OUT/LOG, default setup.log), then
#   PY          the venv's python (absolute)
#   DEVICE_SLUG the GPU's name as the benchmarks spell it in file names ("nvidia-h200"), else "gpu"
# REUSE_VENV=1 skips setup_env.sh when .venv exists (a warm device machine keeps it between calls;
# only a csrc/ change then needs a fresh set-up).

# -u and pipefail, but no -e: a failed stage must not stop the stages after it (each prints its
# rc). Errors here return, never exit: the caller decides (`|| exit 1`).
set -uo pipefail

(return 0 2>/dev/null) || { echo "gpu_common.sh is sourced by scripts/gpu_*.sh, not run" >&2; exit 1; }

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd) || return 1
case ${OUT:=$REPO/gpu_out} in /*) ;; *) OUT=$PWD/$OUT ;; esac  # before the cd: relative to the caller
if ! mkdir -p "$OUT" || ! OUT=$(cd "$OUT" && pwd); then echo "cannot create OUT=$OUT" >&2; return 1; fi
cd "$REPO" || return 1

if [ -z "${GIT_COMMIT:-}" ]; then
  # Only this checkout's own .git: a copy inside another repository must not take its HEAD. A
  # device copy may carry the .git of an older checkout (seen: the session's first commit on every
  # call): a tracked tree that differs from that HEAD is named "<HEAD>+dirty", never a clean commit
  # it did not run. Device commands that know the commit pass GIT_COMMIT=<hash> themselves; every
  # result also records meta.source_tree, the tree hash of the code that ran, which
  # benchmarks/which_commit.py turns into the commit back on the development machine.
  if [ -e .git ] && head=$(git rev-parse --short HEAD 2>/dev/null); then
    if [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then GIT_COMMIT=$head+dirty; else GIT_COMMIT=$head; fi
  else
    GIT_COMMIT=unknown
  fi
fi
export OUT GIT_COMMIT PYTHONUNBUFFERED=1

setup_venv() {
  local log=$OUT/${1:-setup.log}
  if [ "${REUSE_VENV:-0}" = 1 ] && [ -x .venv/bin/python ]; then
    echo "[setup] reusing .venv (REUSE_VENV=1)"
  elif bash scripts/setup_env.sh .venv > "$log" 2>&1; then
    tail -1 "$log"
  else
    echo "set-up failed (scripts/setup_env.sh, full log in $log):" >&2
    tail -20 "$log" >&2
    return 1
  fi
  PY=$REPO/.venv/bin/python
  DEVICE_SLUG=$("$PY" -c "import sys, torch; sys.path.insert(0, 'benchmarks'); from common import device_slug; print(device_slug(torch.device('cuda')))" 2>/dev/null)
  [ -n "$DEVICE_SLUG" ] || DEVICE_SLUG=gpu  # no CUDA device, or torch missing: still a valid file name
}

# setup_multi_gpu: the preamble of the scripts that launch torchrun over the GPUs. DRY_RUN=1 sets
# PY=python, DEVICE_SLUG=gpu and NGPU (default 4) with no set-up, so the script can print its
# commands; otherwise the GPU list goes to $OUT/gpu.txt, setup_venv runs, and NGPU defaults to the
# GPUs torch sees.
setup_multi_gpu() {
  if [ "${DRY_RUN:-0}" = 1 ]; then
    PY=python DEVICE_SLUG=gpu NGPU=${NGPU:-4}
    return 0
  fi
  nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
  setup_venv || return 1
  NGPU=${NGPU:-$("$PY" -c "import torch; print(torch.cuda.device_count())")}
}

# Wheels over the 64 MiB a device call may carry travel split over two calls to one warm machine:
#   here:    split -b 55000000 -d --additional-suffix= BIG.whl BIG.whl.part  (names end .partNN)
#            first folder: the first part(s); second folder: the rest and the other wheels
#   call 1:  stash_wheel_parts .wheels_a      (copies the parts out of the repository copy)
#   call 2:  install_split_wheels .wheels_b SITE  (the same machine, within its 30 s warm window)
# Parts wait in $WHEEL_PARTS (default /tmp/mtraining_wheel_parts), outside the repository copy,
# because a path a call does not carry is removed there.
WHEEL_PARTS=${WHEEL_PARTS:-/tmp/mtraining_wheel_parts}
stash_wheel_parts() {
  mkdir -p "$WHEEL_PARTS" && cp "$1"/* "$WHEEL_PARTS"/ && ls -la "$WHEEL_PARTS"
}
# install_split_wheels DIR SITE: DIR's files join the stashed parts, every BIG.whl.partNN set is
# joined in order into BIG.whl, and every wheel is installed (no index, no dependencies) into SITE,
# which goes first on PYTHONPATH; a sitecustomize.py there runs SITE's .pth files (PYTHONPATH alone
# skips them, and some wheels find their modules through one). Returns non-zero,
# saying which, when a wheel is missing or broken.
install_split_wheels() {
  local dir=$1 site=$2 part whole
  stash_wheel_parts "$dir" > /dev/null || return 1
  for part in "$WHEEL_PARTS"/*.whl.part00; do
    [ -e "$part" ] || continue
    whole=${part%.part00}
    cat "$whole".part* > "$whole" || return 1
    python3 -m zipfile -t "$whole" > /dev/null || { echo "joined wheel $whole is broken (a part missing?)" >&2; return 1; }
  done
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
      "$WHEEL_PARTS"/*.whl || return 1
  printf 'import site\nsite.addsitedir(%s)\n' "'$site'" > "$site/sitecustomize.py"
  export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
}

# ---- the real Megatron-LM tree (scripts/gpu_megatron_lm.sh, scripts/gpu_flagship.sh) ----
# unpack_tree DEST (prints the folder holding pretrain_gpt.py), apply_patch TREE (the fork patch) and
# prepare_dataset_helpers TREE... read TARBALL, PATCH, BUILD and PY when called.
unpack_tree() {  # DEST: prints the folder that holds pretrain_gpt.py
  local dest=$1 root
  rm -rf "$dest" && mkdir -p "$dest" && tar -xzf "$TARBALL" -C "$dest" || return 1
  root=$(dirname "$(find "$dest" -maxdepth 2 -name pretrain_gpt.py | head -1)")
  [ -f "$root/pretrain_gpt.py" ] || { echo "error: no pretrain_gpt.py in $TARBALL" >&2; return 1; }
  echo "$root"
}
apply_patch() {  # TREE
  local tree=$1
  if command -v git >/dev/null 2>&1; then
    # GIT_CEILING_DIRECTORIES: $BUILD lies inside this repository, and git apply run in a
    # repository's subfolder would skip the paths outside it instead of patching the tree.
    (cd "$tree" && GIT_CEILING_DIRECTORIES=$(dirname "$tree") git apply --check "$PATCH" \
                && GIT_CEILING_DIRECTORIES=$(dirname "$tree") git apply "$PATCH") || return 1
  else
    (cd "$tree" && patch -p1 --forward --batch --dry-run < "$PATCH" >/dev/null && patch -p1 --forward --batch < "$PATCH") || return 1
  fi
  grep -q "_add_mtraining_args" "$tree/megatron/training/arguments.py"
}
# Megatron-LM's dataset helpers:
# Megatron-LM (unlike the megatron-core wheel, which ships it built) compiles
# megatron/core/datasets/helpers_cpp at start-up: rank 0 runs `make` there, and the Makefile asks
# `python3 -m pybind11 --includes` and `python3-config --extension-suffix` of PATH, not the
# interpreter that runs the job (on the GPU machines: no pybind11 module, maybe no
# python3-config). So the library is put in place here for $PY (the installed megatron-core's,
# built from the same helpers.cpp, else compiled with pybind11's or torch's headers), and a
# python3-config that answers for $PY goes first on PATH, so that make finds it up to date.
prepare_dataset_helpers() {  # TREE...
  local suffix inc built tree dir
  suffix=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))') || return 1
  built=$("$PY" -c 'import os, megatron.core.datasets as d; print(os.path.dirname(d.__file__))' 2>/dev/null)
  for tree in "$@"; do
    dir=$tree/megatron/core/datasets
    if [ -n "$built" ] && [ -f "$built/helpers_cpp$suffix" ] && cmp -s "$built/helpers.cpp" "$dir/helpers.cpp"; then
      cp "$built/helpers_cpp$suffix" "$dir/" || return 1
      echo "[megatron-lm] dataset helpers: copied helpers_cpp$suffix from $built"
    else
      inc=$("$PY" -c '
import sysconfig
paths = [sysconfig.get_paths()["include"]]
try:
    import pybind11
    paths.append(pybind11.get_include())
except ImportError:
    from torch.utils.cpp_extension import include_paths
    paths += include_paths()
print(" ".join("-I" + p for p in paths))') || return 1
      # shellcheck disable=SC2086  # $inc is a list of -I flags
      "${CXX:-g++}" -O3 -Wall -shared -std=c++17 -fPIC $inc "$dir/helpers.cpp" -o "$dir/helpers_cpp$suffix" || return 1
      echo "[megatron-lm] dataset helpers: compiled helpers_cpp$suffix"
      built=$dir
    fi
    touch "$dir/helpers_cpp$suffix"
  done
  mkdir -p "$BUILD/bin"
  cat > "$BUILD/bin/python3-config" <<EOF
#!/usr/bin/env bash
# Written by scripts/gpu_megatron_lm.sh: Megatron-LM's dataset Makefile asks python3-config; this
# answers for the job's interpreter, $PY.
case "\$1" in
  --extension-suffix) echo "$suffix" ;;
  --includes) "$PY" -c 'import sysconfig; print("-I" + sysconfig.get_paths()["include"])' ;;
  *) echo "python3-config shim: \$1 not supported" >&2; exit 1 ;;
esac
EOF
  chmod +x "$BUILD/bin/python3-config"
  export PATH="$BUILD/bin:$PATH"
  for tree in "$@"; do  # make -q: up to date, so rank 0's make at start-up will compile nothing
    make -q -C "$tree/megatron/core/datasets" >/dev/null 2>&1 || { echo "error: make would rebuild $tree/megatron/core/datasets" >&2; return 1; }
  done
}

