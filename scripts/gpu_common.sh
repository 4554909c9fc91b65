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
