#!/usr/bin/env bash
# Fault injection on 2-4 GPUs with NCCL (issue 31): ranks that disagree, die or stall, one torchrun
# per case (tests/faults_gpu_worker.py), each under a wall-clock limit; then the agreement's cost
# against one ring forward+backward at 512K tokens on all GPUs (at most 4). Prints a table
# case | world | rank | outcome | seconds and writes $OUT/faults_<device>.json (gpu_common.sh).
#   FAULT_PG_TIMEOUT_S  the process group's timeout (NCCL watchdog bound), default 30
#   TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC  PyTorch's wait for debug dumps (x4 after a timeout), default here 2000
#   FAULT_CASES         the cases to run (default: all, see the worker's docstring)
#   COST_SEQ_LEN        the cost cases' sequence length, default 524288 (cost: the ring benchmark's 16/2
#                       heads and ~5% index; cost_sparse: 16/4 heads and the worker's sparse test index)
# shellcheck source=SCRIPTDIR/gpu_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_common.sh" || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt"
setup_venv || exit 1
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")
[ "$NGPU" -ge 2 ] || { echo "gpu_faults.sh needs at least 2 GPUs, found $NGPU" >&2; exit 1; }
export FAULT_PG_TIMEOUT_S=${FAULT_PG_TIMEOUT_S:-30}
# The NCCL watchdog waits 4x this after a timeout (for debug dumps) before it ends the process:
# 60 s by default, which made a dead-peer case last timeout + 60 s. 2 s keeps the run short; the
# bound it shows is then timeout + 8 s (docs/troubleshooting.md).
export TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC=${TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC:-2000}
CASES=${FAULT_CASES:-"disagree_index disagree_length_eager local_failure_eager die_before_forward die_between_forward_and_backward stall_between_forward_and_backward stall_blocking_wait cost cost_sparse"}
LIMIT=$(( ${FAULT_PG_TIMEOUT_S%.*} * 2 + 90 ))  # a case that outlives this is reported as a HANG
WORLDS=$([ "$NGPU" -ge 4 ] && echo "2 4" || echo "2")
mkdir -p "$OUT/faults"
for case in $CASES; do
  for world in $WORLDS; do
    case $case in cost*) [ "$world" != "${WORLDS##* }" ] && continue ;; esac  # cost: the largest world only
    dir=$OUT/faults/${case}_${world}gpu
    rm -rf "$dir" && mkdir -p "$dir"
    env=()
    case $case in
      *_eager) env+=(MTRAINING_RING_AGREEMENT=eager) ;;
      stall_blocking_wait) env+=(TORCH_NCCL_BLOCKING_WAIT=1 MTRAINING_RING_TIMEOUT_S=10) ;;
      cost_sparse) env+=(COST_INDEX=sparse) ;;  # the worker's short test-index ring (cost: the benchmark's)
    esac
    worker_case=${case/stall_blocking_wait/stall_between_forward_and_backward}
    worker_case=${worker_case/cost_sparse/cost}
    start=$(date +%s.%N)
    env "${env[@]}" timeout -k 10 "$LIMIT" "$PY" -m torch.distributed.run --standalone --nproc_per_node "$world" \
      tests/faults_gpu_worker.py "$worker_case" "$dir" > "$dir/log.txt" 2>&1
    rc=$?
    end=$(date +%s.%N)
    echo "$case world=$world rc=$rc wall=$(awk "BEGIN { printf \"%.1f\", $end - $start }")s" > "$dir/rc.txt"
  done
done
"$PY" - "$OUT" "$DEVICE_SLUG" "$LIMIT" <<'EOF'
import glob, json, os, sys
out, slug, limit = sys.argv[1], sys.argv[2], float(sys.argv[3])
rows, cases = [], []
for d in sorted(glob.glob(os.path.join(out, "faults", "*gpu"))):
    name = os.path.basename(d)
    case, world = name.rsplit("_", 1)[0], int(name.rsplit("_", 1)[1][:-3])
    rc_text = open(os.path.join(d, "rc.txt")).read().split()
    rc, wall = int(rc_text[2][3:]), float(rc_text[3][5:-1])
    entry = {"case": case, "world": world, "rc": rc, "wall_s": wall, "ranks": []}
    for rank in range(world):
        try:
            rec = json.load(open(os.path.join(d, f"rank{rank}.json")))
        except (OSError, ValueError):
            rec = {"status": "no record"}
        if rec["status"] == "started":  # torn down without an end record: the watchdog, or the fault itself
            rec = {"status": "HANG (killed at the limit)" if rc in (124, 137) else "killed (NCCL watchdog / fault)",
                   "seconds": round(wall, 1)}
        outcome = rec.get("type") or rec["status"]
        if rec.get("returned_after_peer_fault"):  # no host error; NCCL's watchdog acts on its own
            outcome = ("returned, then torn down by NCCL's watchdog" if rc != 0 else
                       "returned without an error (a peer faulted)")
        if "nan_output" in rec:
            outcome += f" (nan output: {rec['nan_output']})"
        entry["ranks"].append({"rank": rank, **rec})
        rows.append((case, world, rank, outcome, rec.get("seconds", "")))
        if case.startswith("cost") and rec["status"] == "ok" and rank == 0:
            rows.append(("  cost", world, 0, f"ring fwd+bwd {rec['ring_fwd_bwd_ms']:.1f} ms at {rec['seq_len']} "
                         f"({rec['index']} index, density {rec['index_density']:.3f}, heads {rec['heads']}) "
                         f"({rec['ring_without_agreement_ms']:.1f} without the agreement: "
                         f"{100 * rec['agreement_share_of_ring']:+.2f}%); one agreement alone {rec['agreement_us']:.0f} us "
                         f"of host time ({rec['mode']})", ""))
    cases.append(entry)
print(f"{'case':40s} | W | rank | outcome | seconds")
for case, world, rank, outcome, seconds in rows:
    print(f"{case:40s} | {world} | {rank} | {outcome} | {seconds}")
path = os.path.join(out, f"faults_{slug}.json")
with open(path, "w") as f:
    json.dump({"meta": {"git_commit": os.environ.get("GIT_COMMIT"), "pg_timeout_s":
                        float(os.environ["FAULT_PG_TIMEOUT_S"]), "limit_s": limit,
                        "nccl_dump_wait_ms": int(os.environ["TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"])}, "cases": cases}, f, indent=1)
print("wrote", path)
EOF
# The logs travel as one archive (the device tool returns a limited number of files).
cd "$OUT" && tar czf faults_logs.tgz faults && rm -rf faults && ls
