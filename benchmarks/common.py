"""Shared pieces of the benchmark scripts: the synthetic `fixed` index, timers, run metadata.

Everything here is measurement plumbing; the attention itself comes from `megatron_mtraining`.
"""

from __future__ import annotations

import collections
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

from megatron_mtraining import BlockIndex, VSIndex
from corpus import PROLONG_MIX

# ----------------------------------------------------------------------------------------------
# The `fixed` index: deterministic vertical-slash structure at a target density
# ----------------------------------------------------------------------------------------------


def slash_offsets(count: int, num_blocks: int, local_window: int = 4) -> List[int]:
    """`count` distinct block offsets: the local window 0..local_window-1, then geometric to the end.

    Geometric spacing puts most offsets near the diagonal (RoPE locality) and a few far away,
    the shape real vertical-slash indices have.
    """
    count = max(1, min(count, num_blocks))
    local = min(count, local_window)
    offsets = list(range(local))
    n_far = count - local
    if n_far == 0:
        return offsets
    lo, hi = local, num_blocks - 1
    far = [round(lo * (hi / lo) ** (i / max(1, n_far - 1))) for i in range(n_far)]
    # Rounding collides near the diagonal: push duplicates up, then pull the tail below the end.
    for i in range(1, n_far):
        far[i] = max(far[i], far[i - 1] + 1)
    for i in range(n_far - 1, -1, -1):
        far[i] = min(far[i], hi - (n_far - 1 - i))
    return offsets + far


def _make_index(batch, heads, offsets, sinks, column_order, n_cols, block_size, device) -> VSIndex:
    """Index with the same slash offsets in every head and per-head columns: sinks + a prefix."""
    slash = torch.tensor(offsets, dtype=torch.int32, device=device).expand(batch, heads, -1).contiguous()
    n_slash = torch.full((batch, heads), len(offsets), dtype=torch.int32, device=device)
    sink = torch.arange(sinks, dtype=torch.int32, device=device).expand(batch, heads, -1)
    vertical = torch.cat([sink, column_order[..., :n_cols].sort(-1).values], -1).contiguous()
    n_vertical = torch.full((batch, heads), vertical.shape[-1], dtype=torch.int32, device=device)
    return VSIndex(slash, n_slash, vertical, n_vertical, block_size)


def _largest_below(f: Callable[[int], float], target: float, lo: int, hi: int) -> int:
    """Bisection for the largest n in [lo, hi] with f(n) <= target (lo if none); f non-decreasing."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if f(mid) <= target:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _closest(f: Callable[[int], float], target: float, n: int, hi: int) -> int:
    """n or n + 1, whichever lands closer to the target."""
    if n < hi and abs(f(n + 1) - target) < abs(f(n) - target):
        return n + 1
    return n


def fixed_vs_index(batch: int, heads: int, seq_len: int, block_size: int = 64, density: float = 0.05,
                   device=None, seed: int = 0, column_share: float = 0.25, local_window: int = 4,
                   sinks: int = 4) -> VSIndex:
    """Deterministic synthetic VS index whose mean ``index.density(seq_len)`` is close to ``density``.

    Slash: the local window 0..local_window-1 plus geometrically spread offsets, the same in
    every head. Vertical: sink columns 0..sinks-1 plus random columns, different per head
    (seeded). The counts come from two small searches: the slash count for
    ``(1 - column_share) * density``, then the column count for the total. Budgets are equal
    across heads (fixed budgets, docs/design.md §2's `fixed` builder), so shapes carry no padding.
    Tiny problems cannot go below the diagonal's density; the result then has one offset.
    """
    if seq_len % block_size:
        raise ValueError(f"sequence length {seq_len} is not a multiple of block_size {block_size}")
    nb = seq_len // block_size
    sinks = min(sinks, seq_len)
    gen = torch.Generator().manual_seed(seed)
    # One random order of the non-sink columns per head; the first n of it are the columns.
    column_order = torch.stack([torch.randperm(seq_len - sinks, generator=gen) + sinks
                                for _ in range(batch * heads)]).view(batch, heads, -1)
    column_order = column_order.to(device=device, dtype=torch.int32)

    def mean_density(offsets, n_cols) -> float:
        index = _make_index(batch, heads, offsets, sinks, column_order, n_cols, block_size, device)
        return float(index.density(seq_len).mean())

    def slash_only(n):
        return mean_density(slash_offsets(n, nb, local_window), 0)

    slash_target = (1.0 - column_share) * density
    n_slash = _closest(slash_only, slash_target, _largest_below(slash_only, slash_target, 1, nb), nb)
    offsets = slash_offsets(n_slash, nb, local_window)

    def with_columns(n):
        return mean_density(offsets, n)

    max_cols = seq_len - sinks
    n_cols = _closest(with_columns, density, _largest_below(with_columns, density, 0, max_cols), max_cols)
    index = _make_index(batch, heads, offsets, sinks, column_order, n_cols, block_size, device)
    return index.validate(seq_len)


def describe_index(index: VSIndex, seq_len: int) -> Dict:
    """Density and budget figures of an index (per head density summarised over heads)."""
    dens = index.density(seq_len).float()
    causal_pairs = seq_len * (seq_len + 1) / 2
    return {
        "density_mean": float(dens.mean()),
        "density_min": float(dens.min()),
        "density_max": float(dens.max()),
        "n_slash": int(index.n_slash.max()),
        "n_vertical": int(index.n_vertical.max()),
        # Summed over batch and heads: the work the FLOP counts below are based on.
        "active_pairs": float(dens.sum()) * causal_pairs,
        "causal_pairs_per_head": causal_pairs,
    }


# ----------------------------------------------------------------------------------------------
# Timing and memory
# ----------------------------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable, arg_sets: Sequence[Sequence], device: torch.device, warmup: int = 3,
            reps: int = 10) -> List[float]:
    """Per-repetition milliseconds of ``fn(*args)``, rotating through ``arg_sets``.

    Rotating input sets keeps one set's tensors from sitting in L2 between repetitions. CUDA
    events time the device; on CPU (smoke runs) wall-clock time is all there is.
    """
    def args(i):
        return arg_sets[i % len(arg_sets)]

    for i in range(warmup):
        fn(*args(i))
    synchronize(device)
    if device.type != "cuda":
        times = []
        for i in range(reps):
            t0 = time.perf_counter()
            fn(*args(warmup + i))
            times.append((time.perf_counter() - t0) * 1e3)
        return times
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        starts[i].record()
        fn(*args(warmup + i))
        ends[i].record()
    torch.cuda.synchronize(device)
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def peak_extra_mb(fn: Callable, args: Sequence, device: torch.device) -> Optional[float]:
    """MiB that one call allocates on top of what is already held (its inputs among it).

    ``torch.cuda.max_memory_allocated`` after a reset, minus the memory allocated before the
    call: the figure does not depend on how many input sets the benchmark keeps around.
    """
    if device.type != "cuda":
        return None
    synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn(*args)
    synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


def kernel_times_ms(fn: Callable, args: Sequence, iters: int = 3) -> Dict[str, float]:
    """Device milliseconds per call of every GPU kernel ``fn(*args)`` launches (torch.profiler)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn(*args)  # compile / autotune outside the profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn(*args)
        torch.cuda.synchronize()
    totals: Dict[str, float] = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:
            totals[event.name] += event.device_time_total / 1e3 / iters
    return dict(totals)


def relative_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in fp64."""
    x, ref = x.detach().double(), ref.detach().double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


# ----------------------------------------------------------------------------------------------
# Run metadata
# ----------------------------------------------------------------------------------------------


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


def device_slug(device: torch.device) -> str:
    """'NVIDIA H200' -> 'nvidia-h200'; CPU runs are 'cpu'."""
    if device.type != "cuda":
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", device_name(device).lower()).strip("-")


def git_commit() -> Dict:
    """GIT_COMMIT when set (device copies may carry a stale .git), else HEAD and whether the
    tree has uncommitted changes."""
    if os.environ.get("GIT_COMMIT"):
        commit = os.environ["GIT_COMMIT"]
        if commit.endswith("+dirty"):  # scripts/gpu_common.sh: the tree differs from that HEAD
            return {"commit": commit[:-len("+dirty")], "dirty": True}
        return {"commit": commit, "dirty": None}
    try:
        head = _git("rev-parse", "HEAD")
        if head.returncode == 0:
            dirty = bool(_git("status", "--porcelain").stdout.strip())
            return {"commit": head.stdout.strip(), "dirty": dirty}
    except (OSError, subprocess.SubprocessError):
        pass
    return {"commit": "unknown", "dirty": None}


def _git(*cmd, env=None):
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run(["git", *cmd], cwd=repo, capture_output=True, text=True, timeout=60, env=env)


def source_tree() -> Optional[str]:
    """The git tree hash of the files this run read: every file of the working tree that git
    does not ignore, committed or not (a scratch index, so the checkout's own is untouched).

    A device copy carries the session's first commit as its .git whatever code it runs, so a
    commit there says little; the tree hash names the code exactly, and ``commit_of_tree`` finds
    the commit that has it back here (``python benchmarks/which_commit.py RESULT.json``)."""
    try:
        with tempfile.TemporaryDirectory() as scratch:
            env = dict(os.environ, GIT_INDEX_FILE=os.path.join(scratch, "index"))
            if _git("add", "-A", ".", env=env).returncode != 0:
                return None
            tree = _git("write-tree", env=env)
            return tree.stdout.strip() if tree.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def commit_of_tree(tree: str) -> Optional[str]:
    """The newest commit (any branch) whose tree is ``tree``, else None."""
    log = _git("log", "--all", "--format=%H %T")
    for line in log.stdout.splitlines():
        commit, _, commit_tree = line.partition(" ")
        if commit_tree == tree:
            return commit
    return None


def run_metadata(device: torch.device) -> Dict:
    import triton

    from megatron_mtraining import _ext

    meta = {
        "device": device_name(device),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
        "python": sys.version.split()[0],
        "extension": _ext.status(),
        "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    meta.update(git_commit())
    meta["source_tree"] = source_tree()
    return meta


def ptxas_report(ptx: str) -> Dict:
    """ptxas -v on sm_90a PTX (no GPU needed): registers, spills, whether it serialised the wgmma
    groups (C7513 / C7514: an instruction touches the registers of a group in flight, so every
    wgmma waits: a kernel that compiles and runs, only slower), and ``loop_spill_loads``, the most
    spill reloads (LDL) in one loop of the machine code: a spill outside the loops costs once per
    program, one inside once per tile (the column kernel ran 60% slower with 16 against 9)."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90).path
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        proc = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o", cubin], capture_output=True, text=True,
                              timeout=120)
        nvdisasm = os.path.join(os.path.dirname(ptxas), "nvdisasm")
        disasm = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True, timeout=120) \
            if proc.returncode == 0 and os.path.exists(nvdisasm) else None
        sass = disasm.stdout if disasm is not None and disasm.returncode == 0 else None
    text = proc.stdout + proc.stderr
    regs = [int(x) for x in re.findall(r"Used (\d+) registers", text)]
    spilled = [int(x) for x in re.findall(r"(\d+) bytes spill stores", text)]
    return {"ptxas_ok": proc.returncode == 0, "registers": max(regs) if regs else None,
            "spills": "0 bytes spill stores, 0 bytes spill loads" not in text,
            "spill_bytes": max(spilled) if spilled else None,
            "wgmma_serialized": "C7513" in text or "C7514" in text,
            "loop_spill_loads": loop_spill_loads(sass) if sass else None}


def loop_spill_loads(sass: str) -> Optional[int]:
    """The most local-memory loads (LDL: spill reloads) between a backward branch and its target in
    ``nvdisasm -c`` output: the spills a loop pays per iteration (0 without loops; None where the
    text holds no instructions, so a failed disassembly never reads as a clean one)."""
    code, labels, pending = [], {}, []
    for line in sass.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            pending.append(label.group(1))
            continue
        instr = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if instr:
            for name in pending:
                labels[name] = len(code)
            pending = []
            code.append(instr.group(2))
    if not code:
        return None
    most = 0
    for i, text in enumerate(code):
        target = re.search(r"BRA.*?(\.L_x_\d+)", text)
        if target and labels.get(target.group(1), i + 1) <= i:
            most = max(most, sum("LDL" in t for t in code[labels[target.group(1)]:i + 1]))
    return most


def tflops(flops: float, ms: Optional[float]) -> Optional[float]:
    if not ms:
        return None
    return flops / (ms * 1e-3) / 1e12


def json_ready(obj):
    """Round floats to 6 significant digits and write NaN / inf as null (JSON has neither)."""
    if isinstance(obj, dict):
        return {str(k): json_ready(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_ready(v) for v in obj]
    if isinstance(obj, float):
        return float(f"{obj:.6g}") if math.isfinite(obj) else None
    return obj


def write_json(path: str, result) -> None:
    """``result`` (through ``json_ready``) to ``path``, creating its folder."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(json_ready(result), f, indent=1)


# ----------------------------------------------------------------------------------------------
# Packed documents: exact active-pair counts and the fixed index at a density of document pairs
# ----------------------------------------------------------------------------------------------

# The benchmark mix at 128K (ProLong-like: long documents carry most of the work); x4 for 512K.
DOCUMENT_MIX_128K = PROLONG_MIX


def document_mix(seq_len: int, block_size: int = 64) -> List[int]:
    """The mix scaled to ``seq_len`` (a multiple of 128K), or, for smaller sequences (smoke runs),
    shrunk and rounded to blocks; the last document takes what rounding leaves."""
    scale = seq_len / sum(DOCUMENT_MIX_128K)
    lengths = [max(1, int(round(x * scale))) for x in DOCUMENT_MIX_128K]
    lengths[0] += seq_len - sum(lengths)
    return lengths


def cu_seqlens_of(lengths: Sequence[int], device=None) -> torch.Tensor:
    ends = [0]
    for length in lengths:
        ends.append(ends[-1] + int(length))
    return torch.tensor(ends, dtype=torch.int32, device=device)


def document_causal_pairs(lengths: Sequence[int]) -> float:
    """Pairs of dense document-causal attention per head: sum of L (L + 1) / 2."""
    return float(sum(L * (L + 1) / 2 for L in lengths))


def packed_active_pairs(index: VSIndex, cu_seqlens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """float64 ``[b, h]``: exact (query, key) pairs the function of docs/design.md §1 keeps with
    documents, counted per block from tokens-per-(block, document) without any S x S tensor:
    a slash offset ``delta`` keeps sum over blocks and documents of cnt[qb, d] * cnt[qb - delta, d]
    (the diagonal: cnt (cnt + 1) / 2), and a column in block ``cb`` of document ``d`` adds the
    tokens of ``d`` in later query blocks whose offset to ``cb`` is not selected."""
    B, nb = index.block_size, seq_len // index.block_size
    device = index.device
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    pos = torch.arange(seq_len, device=device)
    doc = torch.searchsorted(cu, pos, right=True) - 1
    docs = cu.numel() - 1
    cnt = torch.zeros(nb, docs, dtype=torch.float64, device=device)
    cnt.index_put_((pos // B, doc), torch.ones(seq_len, dtype=torch.float64, device=device), accumulate=True)
    gram = cnt @ cnt.T                                   # [qb, kb]: same-document pairs of two blocks
    blocks = torch.arange(nb, device=device)
    offsets = blocks[:, None] - blocks[None, :]          # qb - kb
    below = offsets > 0
    per_offset = torch.zeros(nb, dtype=torch.float64, device=device).index_add_(0, offsets[below], gram[below])
    per_offset[0] = (cnt * (cnt + 1) / 2).sum()
    bitmap = index.slash_bitmap(nb).to(torch.float64)   # [b, h, nb]
    slash_pairs = bitmap @ per_offset
    # Columns: uncovered[cb, qb] = 1 where qb > cb and qb - cb is not a selected offset.
    delta = -offsets  # [cb, qb] -> qb - cb
    result = slash_pairs.clone()
    for bi in range(index.batch):
        for h in range(index.heads):
            uncovered = (delta > 0) & (bitmap[bi, h][delta.clamp(0, nb - 1)] == 0)
            reach = uncovered.to(torch.float64) @ cnt      # [cb, d]: tokens of d a column of cb reaches
            n = int(index.n_vertical[bi, h])
            cols = index.vertical[bi, h, :n].long()
            result[bi, h] += reach[cols // B, doc[cols]].sum()
    return result


def moba_density(seq_len: int, block_size: int, moba_block_size: int, top_k: int) -> float:
    """Mean density of a MoBA index, whatever its gate picks: a query block of MoBA block j keeps
    min(top_k, j + 1) MoBA blocks, its own up to itself (causal inside the diagonal block)."""
    B, per = block_size, moba_block_size // block_size
    i = torch.arange(seq_len // B, dtype=torch.float64)
    j = torch.div(i, per, rounding_mode="floor")
    pairs = B * B * ((torch.clamp(j + 1, max=top_k) - 1) * per + (i - j * per)) + B * (B + 1) / 2
    return float(pairs.sum()) / (seq_len * (seq_len + 1) / 2)


def moba_top_k_for_density(seq_len: int, block_size: int, moba_block_size: int, density: float) -> int:
    """The MoBA top-k whose index density is closest to ``density``."""
    n_moba = -(-seq_len // moba_block_size)
    return min(range(1, n_moba + 1),
               key=lambda k: abs(moba_density(seq_len, block_size, moba_block_size, k) - density))


def fixed_moba_index(batch: int, heads: int, seq_len: int, block_size: int = 64, moba_block_size: int = 4096,
                     top_k: int = 12, device=None, seed: int = 0) -> BlockIndex:
    """Deterministic synthetic MoBA index (the same on every rank for one seed): per (batch, head,
    query block) its own MoBA block and ``top_k - 1`` earlier ones drawn at random, each MoBA block's
    index blocks up to the query block (``block_approx.moba_blocks``'s layout, without a gate)."""
    if seq_len % block_size or moba_block_size % block_size:
        raise ValueError(f"sequence length {seq_len} and MoBA block {moba_block_size} must be multiples of "
                         f"block_size {block_size}")
    B, per = block_size, moba_block_size // block_size
    nb, n_moba = seq_len // B, -(-seq_len // moba_block_size)
    own = (torch.arange(nb) // per)[:, None]
    moba = torch.arange(n_moba)
    gen = torch.Generator().manual_seed(seed)
    gate = torch.rand(batch, heads, nb, n_moba, generator=gen)
    gate = gate.masked_fill(moba > own, float("-inf")).masked_fill(moba == own, float("inf"))
    values, chosen = gate.topk(min(top_k, n_moba), dim=-1)
    chosen = torch.where(values > float("-inf"), chosen, n_moba).sort(-1).values   # n_moba: not chosen
    blocks = (chosen[..., None] * per + torch.arange(per)).flatten(-2)              # ascending
    valid = (chosen < n_moba).repeat_interleave(per, -1) & (blocks <= torch.arange(nb)[:, None])
    capacity = min(blocks.shape[-1], nb)
    slot = torch.cumsum(valid, -1) - 1
    out = torch.zeros(batch, heads, nb, capacity + 1, dtype=torch.int32)
    out.scatter_(-1, torch.where(valid & (slot < capacity), slot, capacity), (blocks * valid).to(torch.int32))
    counts = valid.sum(-1, dtype=torch.int32).clamp_(max=capacity)
    return BlockIndex(out[..., :capacity].contiguous().to(device), counts.to(device), B)


def fixed_packed_index(batch: int, heads: int, seq_len: int, cu_seqlens: torch.Tensor, block_size: int = 64,
                       density: float = 0.05, device=None, seed: int = 0):
    """``fixed_vs_index`` whose mean active pairs are ``density`` of the DOCUMENT-causal pairs,
    by bisection on its density argument. Returns (index, pairs [b, h], document-causal pairs)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    doc_pairs = document_causal_pairs(lengths)

    def build(full_density):
        index = fixed_vs_index(batch, heads, seq_len, block_size, full_density, device, seed)
        pairs = packed_active_pairs(index, cu_seqlens, seq_len)
        return index, pairs, float(pairs.mean()) / doc_pairs

    lo, hi = 1e-4, max(density, 1e-3)
    while build(hi)[2] < density and hi < 1.0:
        lo, hi = hi, min(1.0, hi * 2)
    best = build(hi)
    for _ in range(7):
        mid = (lo + hi) / 2
        candidate = build(mid)
        if abs(candidate[2] - density) < abs(best[2] - density):
            best = candidate
        if candidate[2] < density:
            lo = mid
        else:
            hi = mid
    return best[0], best[1], doc_pairs
