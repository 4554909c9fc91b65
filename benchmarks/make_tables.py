"""Regenerate the results tables from the JSON files in benchmarks/results/.

    python benchmarks/make_tables.py           # rewrite both generated sections (below)
    python benchmarks/make_tables.py --check   # exit 1 if either section or summary.json is stale

Writes ``results/summary.json`` (the headline figures and the targets, with their sources), the
README's short results table (from summary.json only) and the full tables of docs/benchmarks.md,
each between the BENCH markers of its file.

Results files are named ``<kind>_<device>.json``; each kind has one renderer in ``RENDERERS``
(``kernel``, ``ring``; the approximator benchmark adds its own with ``@renderer(...)``).
``analysis_*.json`` (CPU models of ring balance and index coverage) have none: docs/performance.md
quotes them. A file without its markers gets nothing written and its section goes to stdout.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from typing import Callable, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
BEGIN, END = "<!-- BENCH:BEGIN -->", "<!-- BENCH:END -->"

Result = Tuple[str, Dict]                      # (path relative to the repo, parsed JSON)
RENDERERS: Dict[str, Callable[[List[Result]], str]] = {}


def renderer(kind: str):
    """Register the markdown renderer of one results kind (files ``<kind>_*.json``)."""
    def register(fn):
        RENDERERS[kind] = fn
        return fn
    return register


# ----------------------------------------------------------------------------------------------
# Cell formatting
# ----------------------------------------------------------------------------------------------


def num(x, digits: int = 2) -> str:
    return f"{x:.{digits}f}" if isinstance(x, (int, float)) else "—"


def pair(a, b, digits: int = 2, suffix: str = "") -> str:
    """'a / b' with a dash for anything missing (an item that failed or was skipped)."""
    def cell(x):
        return num(x, digits) + (suffix if isinstance(x, (int, float)) else "")
    return f"{cell(a)} / {cell(b)}"


def tokens(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def tokens_key(n: int) -> str:
    """A sequence length as summary keys spell it: 256k, 512k, 1m."""
    return f"{n >> 20}m" if n % (1 << 20) == 0 else tokens(n).lower()


def gib(mb) -> str:
    return num(mb / 1024, 2) if isinstance(mb, (int, float)) else "—"


def table(header: List[str], rows: List[List[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def source_line(results: List[Result]) -> str:
    parts = []
    for path, data in results:
        meta = data.get("meta", {})
        parts.append(f"`{path}` ({meta.get('device', '?')}, torch {meta.get('torch', '?')}, "
                     f"triton {meta.get('triton', '?')}, commit {str(meta.get('commit', 'unknown'))[:10]})")
    return "Source: " + "; ".join(parts) + "."


# ----------------------------------------------------------------------------------------------
# Renderers
# ----------------------------------------------------------------------------------------------


def backward_tflops(ours: Dict) -> Optional[float]:
    """The backward's rate on active pairs (2.5x the forward's FLOPs over fwd+bwd time minus fwd
    time), from a kernel result's forward and fwd+bwd figures."""
    f_tf, f_ms, fb_ms = (ours.get(k) for k in ("fwd_tflops", "fwd_ms", "fwdbwd_ms"))
    if not all(isinstance(x, (int, float)) for x in (f_tf, f_ms, fb_ms)) or fb_ms <= f_ms:
        return None
    return 2.5 * f_tf * f_ms / (fb_ms - f_ms)


@renderer("kernel")
def render_kernel(results: List[Result]) -> str:
    header = ["device", "S", "density", "ours fwd / fwd+bwd ms", "cuDNN fwd / fwd+bwd ms",
              "Flex fwd / fwd+bwd ms", "vs cuDNN fwd / fwd+bwd", "vs Flex fwd / fwd+bwd",
              "ours TFLOP/s fwd / bwd / fwd+bwd", "extra memory GiB ours / cuDNN"]
    rows, notes, kernels = [], [], set()
    for _, data in results:
        device = data.get("meta", {}).get("device", "?")
        for run in data.get("runs", []):
            ours, dense, flex = run.get("ours", {}), run.get("dense", {}), run.get("flex", {})
            speed = run.get("speedup", {})
            dense_ms = pair(dense.get("fwd_ms"), dense.get("fwdbwd_ms"))
            if dense.get("backend") not in (None, "cudnn"):   # cuDNN was missing: say what ran instead
                dense_ms += f" ({dense['backend']})"
            rows.append([
                device, tokens(run["seq_len"]), f"{100 * run['index']['density_mean']:.1f}%",
                pair(ours.get("fwd_ms"), ours.get("fwdbwd_ms")), dense_ms,
                pair(flex.get("fwd_ms"), flex.get("fwdbwd_ms")),
                pair(speed.get("dense_over_ours_fwd"), speed.get("dense_over_ours_fwdbwd"), 1, "x"),
                pair(speed.get("flex_over_ours_fwd"), speed.get("flex_over_ours_fwdbwd"), 1, "x"),
                f"{num(ours.get('fwd_tflops'), 0)} / {num(backward_tflops(ours), 0)} / "
                f"{num(ours.get('fwdbwd_tflops'), 0)}",
                f"{gib(ours.get('fwdbwd_peak_extra_mb'))} / {gib(dense.get('fwdbwd_peak_extra_mb'))}",
            ])
            if isinstance(flex.get("block_density"), float):
                notes.append(f"{tokens(run['seq_len'])}: {100 * flex['block_density']:.0f}%")
            kernels.add((ours.get("forward_kernel"), ours.get("backward_kernel")))
    cfg = results[0][1].get("config", {})
    text = [
        f"**Sparse attention kernel, one GPU.** {cfg.get('heads')} query / {cfg.get('kv_heads')} KV heads, "
        f"head dim {cfg.get('head_dim')}, {cfg.get('dtype')}, causal, batch {cfg.get('batch')}, "
        f"block {cfg.get('block_size')}, synthetic `{cfg.get('index_kind', 'fixed')}` index. Median of "
        f"{cfg.get('reps')} runs over {cfg.get('input_sets')} rotated input sets. TFLOP/s count the active "
        "pairs (4·d per pair forward, x2.5 backward, x3.5 forward+backward; the backward's time is "
        "fwd+bwd minus fwd); \"vs\" is their time over ours; extra "
        "memory is the peak one forward+backward allocates beyond its inputs.",
        "",
        table(header, rows),
        "",
    ]
    ran = sorted((f or "triton", b or "triton") for f, b in kernels)
    if ran and ran != [("triton", "triton")]:
        text.append("Our kernels: " + "; ".join(f"forward {f}, backward {b}"
                                                for f, b in ran) + " (`kernels/dispatch.py` chooses"
                    + ("; the Hopper backward runs dQ and key-block dK/dV only at B = 128, Triton's at B = 64"
                       if any(b == "hopper" for _, b in ran) else "") + ").")
        text.append("")
    if notes:
        text.append("FlexAttention gets a 128-block BlockMask of exactly the same pairs; the blocks it "
                    "computes, as a share of the causal blocks: " + ", ".join(notes) + ".")
        text.append("")
    block_rows = block_kernel_rows(results)
    if block_rows:
        text += ["Block-sparse indices (`kernel.py --index block`) through the same kernels, beside the vertical-slash "
                 "index of the same run; FlexAttention gets the same BlockMask (128-blocks, exactly the same pairs).",
                 "", table(["device", "S", "pattern", "density (VS)", "ours fwd / fwd+bwd ms", "Flex fwd / fwd+bwd ms",
                            "TFLOP/s fwd+bwd", "rate over VS", "vs Flex fwd+bwd"], block_rows), ""]
    text.append(source_line(results))
    return "\n".join(text)


def block_kernel_rows(results: List[Result]) -> List[List[str]]:
    rows = []
    for _, data in results:
        for run in data.get("runs", []):
            block = run.get("block")
            if not block:
                continue
            ours, flex, made = block.get("ours", {}), block.get("flex", {}), block.get("index", {})
            rows.append([data.get("meta", {}).get("device", "?"), tokens(run["seq_len"]), block.get("pattern", "?"),
                         f"{num(made.get('density_mean'), 3)} ({num(run.get('index', {}).get('density_mean'), 3)})",
                         pair(ours.get("fwd_ms"), ours.get("fwdbwd_ms")), pair(flex.get("fwd_ms"), flex.get("fwdbwd_ms")),
                         num(ours.get("fwdbwd_tflops"), 0), num(block.get("rate_ratio_over_vs", {}).get("fwdbwd")),
                         num(block.get("speedup", {}).get("flex_over_ours_fwdbwd"), 1)])
    return rows


@renderer("packed")
def render_packed(results: List[Result]) -> str:
    header = ["device", "commit", "S", "documents", "density of document pairs", "ours fwd / fwd+bwd ms",
              "Flex (documents) fwd / fwd+bwd ms", "vs Flex fwd / fwd+bwd", "ours TFLOP/s fwd / fwd+bwd",
              "unpacked TFLOP/s fwd+bwd: same density / same work"]
    rows = []
    for _, data in results:
        device = data.get("meta", {}).get("device", "?")
        for run in data.get("runs", []):
            ours, flex, ratios = run.get("packed", {}), run.get("flex", {}), run.get("ratios", {})
            unpacked, equal = run.get("unpacked", {}), run.get("unpacked_equal_work", {})
            rows.append([
                device, short_commit(data), tokens(run["seq_len"]), str(len(run["documents"])),
                f"{100 * run['index']['density_of_document_pairs']:.1f}%",
                pair(ours.get("fwd_ms"), ours.get("fwdbwd_ms")), pair(flex.get("fwd_ms"), flex.get("fwdbwd_ms")),
                pair(ratios.get("flex_over_ours_fwd"), ratios.get("flex_over_ours_fwdbwd"), 1, "x"),
                pair(ours.get("fwd_tflops"), ours.get("fwdbwd_tflops"), 0),
                pair(unpacked.get("fwdbwd_tflops"), equal.get("fwdbwd_tflops"), 0),
            ])
    return "\n".join([
        "**Packed documents, one GPU.** The ProLong-like mix (`benchmarks/common.py`: ten documents, 48K "
        "down to 1K at 128K), canonical heads and dtype, the `fixed` index at ~5% of the document-causal "
        "pairs (exact pair counts). FlexAttention runs the dense document-causal mask (compiled "
        "`create_block_mask`). TFLOP/s count active pairs; the unpacked columns are our kernels without "
        "documents at the same density of causal pairs (kernel table) and at the packed run's active pairs "
        "(about 4x less work per query block, the fair per-pair comparison).",
        "",
        table(header, rows),
        "",
        source_line(results),
    ])


RING_LABELS = {
    "dense_zigzag": "dense ring, zigzag (ours)",
    "torch_native_cp": "PyTorch context parallel (SDPA)",
    "sparse_zigzag": "sparse ring, zigzag",
    "sparse_striped": "sparse ring, striped",
    "sparse_striped_hier": "sparse ring, striped, hierarchical",
    "sparse_moba": "sparse ring, striped, MoBA pattern",
}


def ring_note(name: str, section: Dict) -> str:
    """What ran (kernel / SDPA backend), or why nothing did."""
    if "errors" in section:
        return "failed: " + str(next(iter(section["errors"].values())))[:80].replace("|", "/").replace("\n", " ")
    if "skipped" in section:
        return "skipped"
    if name == "dense_zigzag":
        return str(section.get("impl", ""))
    if name == "torch_native_cp":
        return f"{section.get('sdpa', '?')}, {section.get('rotate_method', '?')}"
    if section.get("inner_size"):
        return f"inner {section['inner_size']}"
    return ""


def short_commit(data: Dict) -> str:
    return str(data.get("meta", {}).get("commit", "unknown"))[:7]


def same_setup_times(results: List[Result]) -> Dict[Tuple, Tuple[float, str]]:
    """fwd+bwd ms of every (device, commit, S, variant, W) measured on plain links (a run under
    the emulated slow link is another setup), with the file it came from."""
    times: Dict[Tuple, Tuple[float, str]] = {}
    for path, data in results:
        meta = data.get("meta", {})
        config = data.get("config", {})
        if config.get("slow_link_gbps") or meta.get("dirty") or short_commit(data) == "unknown":
            continue  # another link, or code that no commit names
        device = meta.get("device", "?")
        for run in data.get("runs", []):
            for name, section in run.get("variants", {}).items():
                if isinstance(section.get("fwdbwd_ms"), (int, float)):
                    key = (device, short_commit(data), run["seq_len"], name, run["world_size"])
                    times[key] = (section["fwdbwd_ms"], path)
    return times


def ring_scaling(results: List[Result]) -> str:
    """Strong-scaling efficiency T_1 / (T_W * W), pairing only runs of one device and one commit
    (a T_1 from other kernels would measure the kernels, not the ring)."""
    times = same_setup_times(results)
    rows = []
    for (device, commit, seq_len, name, world), (ms, _) in sorted(times.items()):
        single = times.get((device, commit, seq_len, name, 1))
        if world > 1 and single:
            rows.append([device, commit, tokens(seq_len), RING_LABELS.get(name, name), str(world),
                         num(single[0]), num(ms), num(single[0] / (ms * world), 2)])
    if not rows:
        return ""
    return ("Strong scaling (same S, W GPUs against one, both measured at the same commit): "
            "efficiency = T_1 / (T_W · W).\n\n"
            + table(["device", "commit", "S", "variant", "W", "T_1 ms", "T_W ms", "efficiency"], rows))


def causal_work_ratio(tokens_per_gpu: int, world: int) -> float:
    """How much more causal work each GPU does at W GPUs with T tokens each (S = W*T, balanced
    striping) than one GPU with T tokens: (S(S+1)/2 / W) / (T(T+1)/2) = (W*T + 1) / (T + 1), about W."""
    return (world * tokens_per_gpu + 1) / (tokens_per_gpu + 1)


def weak_scaling_points(results: List[Result]) -> List[Dict]:
    """Weak-scaling efficiency at fixed tokens per GPU T, pairing only runs of one device and one
    commit (plain links):

        efficiency = T_1(S = T) * (W*T + 1) / (T + 1) / T_W(S = W*T)

    1.0 when the W-GPU run does its W-fold causal work per GPU at the 1-GPU rate; the ring's per-step
    costs, waits and imbalance take it below. ``active_work_ratio`` is the same ratio counted in the
    index's active pairs (``index.active_pairs`` of both runs, where recorded): the synthetic index
    is fitted to 5% at each length, so it differs from the causal ratio by the fit's error."""
    times = same_setup_times(results)
    active = {}
    for path, data in results:
        device = data.get("meta", {}).get("device", "?")
        for run in data.get("runs", []):
            if isinstance(run.get("index", {}).get("active_pairs"), (int, float)):
                active[(device, short_commit(data), run["seq_len"])] = run["index"]["active_pairs"]
    points = []
    for (device, commit, seq_len, name, world), (ms, path) in sorted(times.items()):
        if world == 1 or seq_len % world:
            continue
        per_gpu = seq_len // world
        single = times.get((device, commit, per_gpu, name, 1))
        if not single:
            continue
        ratio = causal_work_ratio(per_gpu, world)
        a_w, a_1 = active.get((device, commit, seq_len)), active.get((device, commit, per_gpu))
        points.append({"device": device, "commit": commit, "variant": name, "world_size": world,
                       "tokens_per_gpu": per_gpu, "t1_ms": single[0], "tw_ms": ms, "causal_work_ratio": ratio,
                       "active_work_ratio": a_w / (world * a_1) if a_w and a_1 else None,
                       "efficiency": single[0] * ratio / ms, "path": path, "single_path": single[1]})
    return points


def weak_scaling_table(results: List[Result]) -> str:
    rows = [[p["device"], p["commit"], tokens(p["tokens_per_gpu"]), RING_LABELS.get(p["variant"], p["variant"]),
             str(p["world_size"]), num(p["t1_ms"]), num(p["tw_ms"]), num(p["causal_work_ratio"], 3),
             num(p["active_work_ratio"], 3), num(p["efficiency"], 2)] for p in weak_scaling_points(results)]
    if not rows:
        return ""
    return ("Weak scaling (same tokens per GPU T, W GPUs against one, both measured at the same commit): "
            "efficiency = T_1 · (W·T + 1) / (T + 1) / T_W, the 1-GPU time scaled by the causal work per GPU, "
            "which grows (W·T + 1) / (T + 1) ≈ W-fold (the same ratio in the index's active pairs beside it).\n\n"
            + table(["device", "commit", "T per GPU", "variant", "W", "T_1 ms", "T_W ms", "causal work ratio",
                     "active work ratio", "efficiency"], rows))


@renderer("ring")
def render_ring(results: List[Result], heading: str = "**Ring attention, one layer over W GPUs.**",
                density_key: str = "density_mean") -> str:
    header = ["device", "GPUs", "S", "density", "variant", "fwd+bwd ms", "fwd ms", "speedup fwd+bwd / fwd",
              "imbalance worker / step", "compute ratio", "commit", "note"]
    rows = []
    for _, data in results:
        device = data.get("meta", {}).get("device", "?")
        gbps = data.get("config", {}).get("slow_link_gbps")
        link = f"emulated {gbps:g} GB/s between nodes" if gbps else ""
        # The index conversion ran in PyTorch where the compiled extension was not built.
        conversion = "" if data.get("meta", {}).get("extension", "built with CUDA") == "built with CUDA" \
            else "conversion in PyTorch"
        for run in data.get("runs", []):
            density = run.get("index", {}).get(density_key)
            for name, section in run.get("variants", {}).items():
                if "skipped" in section:   # e.g. the hierarchical ring on 2 GPUs; the JSON says why
                    continue
                speed = section.get("speedup", {})
                imbalance = section.get("steps", {}).get("fwd_bwd", {}).get("imbalance", {})
                label = RING_LABELS.get(name, name)
                if name == run.get("best_dense"):
                    label += " (baseline)"
                rows.append([
                    device, str(run.get("world_size")), tokens(run["seq_len"]),
                    f"{100 * density:.1f}%" if isinstance(density, float) else "—", label,
                    num(section.get("fwdbwd_ms"), 1), num(section.get("fwd_ms"), 1),
                    pair(speed.get("vs_best_dense"), speed.get("vs_best_dense_fwd"), 2, "x") if speed else "—",
                    pair(imbalance.get("worker_imbalance"), imbalance.get("step_imbalance")) if imbalance else "—",
                    num(imbalance.get("computation_ratio")), short_commit(data),
                    "; ".join(x for x in (ring_note(name, section), link,
                                          conversion if name.startswith("sparse") else "") if x),
                ])
    cfg = results[0][1].get("config", {})
    reps = " or ".join(str(r) for r in sorted({d.get("config", {}).get("reps") for _, d in results} - {None})) or "?"
    text = [
        f"{heading} {cfg.get('heads')} query / {cfg.get('kv_heads')} KV "
        f"heads, head dim {cfg.get('head_dim')}, {cfg.get('dtype')}, causal, batch {cfg.get('batch')}, block "
        f"{cfg.get('block_size')}, synthetic `{cfg.get('index_kind', 'fixed')}` index (same on every rank); "
        f"S/W tokens per GPU. Time: max over ranks of each rank's median of {reps} runs "
        "(CUDA events, barrier before each). Speedup: the faster dense baseline (dense zigzag ring, "
        "PyTorch context parallel) over the variant. Imbalance (paper's appendix, forward+backward "
        "per step, one instrumented run): worker = max/mean over ranks, step = max/mean over steps, "
        "compute ratio = compute / (compute + wait).",
        "",
        table(header, rows),
        "",
    ]
    scaling = ring_scaling(results)
    if scaling:
        text += [scaling, ""]
    weak = weak_scaling_table(results) if heading.startswith("**Ring attention") else ""
    if weak:
        text += [weak, ""]
    notes = sorted({note for _, data in results for note in data.get("notes", []) if note.startswith("TODO")})
    text += [f"Open item: {note[len('TODO: '):]}" for note in notes]
    if notes:
        text.append("")
    text.append(source_line(results))
    return "\n".join(text)


@renderer("ringpacked")
def render_ring_packed(results: List[Result]) -> str:
    return render_ring(results, density_key="density_of_document_pairs", heading=(
        "**Packed documents over the ring** (`ring.py --documents`): the document mix of the packed table "
        "scaled to S in every sequence, the fixed index at the density of the document-causal pairs given. "
        "The dense baseline is `dense_ring_attention(cu_seqlens=...)`: no cuDNN ring step takes a document "
        "mask, so it runs our kernels on the all-blocks index with the documents (whole blocks of earlier "
        "documents skipped). The rest as the ring table:"))


# ----------------------------------------------------------------------------------------------
# Files and README
# ----------------------------------------------------------------------------------------------


@renderer("approx")
def render_approx(results: List[Result]) -> str:
    quality_rows, overhead_rows = [], []
    for _, data in results:
        device = data.get("meta", {}).get("device", "?")
        quality = data.get("quality", [])
        for top_p in sorted({r["top_p"] for r in quality}):
            sel = [r for r in quality if r["top_p"] == top_p]
            quality_rows.append([device, tokens(sel[0]["seq_len"]), num(top_p),
                                 num(sum(r["recall"] for r in sel) / len(sel), 3),
                                 num(sum(r["density"] for r in sel) / len(sel), 3), str(len(sel))])
        for o in data.get("overhead", []):
            overhead_rows.append([device, "1", tokens(o["seq_len"]), num(o["approximator_ms"]),
                                  num(o["sparse_attention_fwdbwd_ms"]), num(o["overhead"], 3),
                                  num(o["index_density"], 3), short_commit(data)])
        ring = data.get("ring")  # approx.py --ring: the distributed approximator over W GPUs
        if ring:
            overhead_rows.append([device, str(ring["world_size"]), f"{tokens(ring['tokens_per_gpu'])}/GPU",
                                  num(ring["approximator_ms"]), num(ring["sparse_ring_attention_fwdbwd_ms"]),
                                  num(ring["overhead"], 3), num(ring["index_density"], 3), short_commit(data)])
    parts = ["**Index approximator.** Synthetic post-RoPE q/k with a vertical-slash structure "
             "(`benchmarks/synthetic.py`, 8/2 heads, d 64): recall = share of the true dense "
             "attention mass the approximated index covers, averaged over heads and seeds.",
             table(["device", "S", "top-p", "recall", "density", "seeds"], quality_rows)]
    if overhead_rows:
        parts += ["Cost, canonical shape (16/2 heads, d 128, bf16), top-p 0.9: approximator time against "
                  "sparse attention forward+backward of the same layer with its index (on W GPUs: the "
                  "distributed approximator against `sparse_ring_attention`, slowest rank).",
                  table(["device", "GPUs", "S", "approximator ms", "sparse attention fwd+bwd ms", "overhead",
                         "density", "commit"], overhead_rows)]
    plots = [data["plot"] for _, data in results if data.get("plot")]
    if plots:
        # The JSON records where the device wrote the plot; it is committed beside the JSON.
        parts.append("Recall against density per head: "
                     + ", ".join(f"`benchmarks/results/{os.path.basename(p)}`" for p in plots) + ".")
    parts.append(source_line(results))
    return "\n\n".join(parts)


OLD_E2E_BASELINE = "dense index through the sparse kernels"


def e2e_label(run: Dict, world_size: int) -> str:
    """What attention an e2e run used, from its flags and GPU count (``MTrainingAttention.
    uses_dense_kernels``): the dense baseline ran MTraining's sparse kernels over the all-blocks
    index in the earliest results, the dense kernels since (SDPA, which picks cuDNN for bf16 on an H200,
    or the cuDNN zigzag ring)."""
    flags = run.get("flags", [])
    if run["name"] == "te_cp_a2a_p2p":
        return "Transformer Engine's hierarchical CP (a2a+p2p, cuDNN)"
    if run["name"] == "te_cp":
        return "Transformer Engine's CP ring (p2p, cuDNN)" if world_size > 1 else "Transformer Engine (cuDNN)"
    if run["name"] == "mtraining":
        return "MTraining (vs, top-p 0.9)"
    if run["name"] == "mtraining_b128":
        return "MTraining (vs, top-p 0.9), 128-token index blocks"
    if "--mtraining-index" in flags and "dense" in flags:
        if "--no-mtraining-deterministic" not in flags:
            return OLD_E2E_BASELINE
        if world_size == 1:
            return "dense, SDPA (cuDNN)"
        if "zigzag" in flags:
            return "dense, cuDNN zigzag ring"
        return OLD_E2E_BASELINE  # the striped ring keeps the sparse kernels
    return run["name"]


def e2e_baseline(data: Dict) -> str:
    name = data.get("baseline", "dense")
    dense = next((run for run in data.get("runs", []) if run["name"] == name), None)
    return e2e_label(dense, data["world_size"]) if dense else "?"


def e2e_layers(data: Dict) -> str:
    """The layers an e2e result trained: Transformer Engine's (bf16 or FP8 GEMMs) or the local ones."""
    if data.get("transformer_impl") == "transformer_engine":
        return f"TE {data.get('transformer_engine') or '?'}" + (", FP8 GEMMs" if data.get("fp8") else "")
    return "local"


@renderer("e2e")
def render_e2e(results: List[Result]) -> str:
    rows = []
    for _, data in results:
        device = data.get("meta", {}).get("device", "?")
        for run in data.get("runs", []):
            rows.append([device, str(data["world_size"]), tokens(data["seq_length"]), e2e_layers(data),
                         e2e_label(run, data["world_size"]), num(run.get("mean_iteration_ms"), 0),
                         num(run.get("tokens_per_s"), 0), "" if run["returncode"] == 0 else f"rc {run['returncode']}"])
    m = results[0][1]["model"]
    speedups = "; ".join(f"{num(d.get('e2e_speedup'))}x ({d['world_size']} x {d.get('meta', {}).get('device', '?')}, "
                         f"{tokens(d['seq_length'])}, {e2e_layers(d)} layers; baseline: {e2e_baseline(d)})"
                         for _, d in results if d.get("e2e_speedup"))
    caveat = ""
    if any(e2e_baseline(d) == OLD_E2E_BASELINE for _, d in results if d.get("e2e_speedup")):
        caveat = (" The dense index through the sparse kernels is slower than cuDNN (its attention took ~1.3 s per "
                  "layer against 0.92 s for the cuDNN zigzag ring at 256K over 2 GPUs, `docs/performance.md`), so "
                  "ratios against it overstate the gain over a cuDNN-based dense run.")
    return "\n\n".join([
        f"**End-to-end Megatron training** (`benchmarks/e2e.py`: `examples/pretrain_gpt_mtraining.py` on "
        f"`megatron.training.pretrain`, megatron-core 0.19.2, mock data, bf16 (FP8 GEMMs where the layers say so), "
        f"CP over all GPUs; Transformer Engine layers where TE was installed, the local ones before). Model: "
        f"{m['shape_of']}: {m['num_layers']} layers, hidden {m['hidden']}, FFN {m['ffn']}, {m['heads']}/"
        f"{m['kv_groups']} heads, head dim {m['head_dim']}, vocabulary {m['vocab']}. Mean over the iterations "
        f"after the warm-up (leaving out telemetry and profiled iterations where the result lists them). "
        f"MTraining's tokens/s over the baseline's: {speedups}.{caveat}",
        table(["device", "GPUs", "S", "layers", "attention", "iteration ms", "tokens/s", "note"], rows),
        *e2e_breakdown(results),
        source_line(results)])


@renderer("flagship")
def render_flagship(results: List[Result]) -> str:
    rows = []
    for _, data in results:
        device = data.get("meta", {}).get("device", "?")
        for run in data.get("runs", []):
            planner = run.get("planner", {})
            rows.append([device, str(data["world_size"]), data["model"], tokens(data["seq_length"]), run["name"],
                         num(run.get("tokens_per_s"), 0), num(run.get("tokens_per_s_per_gpu"), 0),
                         num(run.get("executed_tflops_per_gpu"), 0), num(run.get("executed_share_of_bf16_peak")),
                         pair(run.get("peak_allocated_gib"), run.get("peak_reserved_gib"), 1),
                         num(run.get("density"), 3), pair(planner.get("tokens_per_s"), planner.get("peak_gib"), 0),
                         pair(run.get("planner_tokens_per_s_error"), run.get("planner_memory_error")),
                         "" if run["returncode"] == 0 else f"rc {run['returncode']}"])
    resume = "; ".join(f"{d['model']} {tokens(d['seq_length'])} x {d['world_size']}: exact resume "
                       + ("PASS" if d["resume"]["ok"] else "FAIL") for _, d in results if d.get("resume"))
    return "\n\n".join([
        "**The flagship launchers** (`benchmarks/flagship.py`: `examples/pretrain_*_512k_mtraining.sh` as shipped "
        "but for the length, iterations and global batch named in each result's command; mock data; `te_cp` is the "
        "same launcher with `MTRAINING=0`). Executed TFLOP/s count the GEMMs, attention on its active pairs and the "
        "recomputed forwards; memory is Megatron's peak per GPU; the planner predicts each run from its own flags "
        "and measured density." + (f" {resume}." if resume else ""),
        table(["device", "GPUs", "model", "S", "run", "tokens/s", "per GPU", "TFLOP/s per GPU", "of bf16 peak",
               "peak GiB (alloc / reserved)", "density", "planner tokens/s / GiB", "planner error (speed / memory)",
               "note"], rows),
        source_line(results)])


def e2e_breakdown(results: List[Result]) -> List[str]:
    """Where one profiled iteration's GPU time went (``--profile-iteration``), per run that has it."""
    categories = ("mtraining", "dense_attention", "gemm", "nccl", "other")
    rows = []
    for _, data in results:
        for run in data.get("runs", []):
            b = run.get("gpu_time_breakdown")
            if b:
                by = b["by_category_ms"]
                rows.append([data.get("meta", {}).get("device", "?"), str(data["world_size"]),
                             tokens(data["seq_length"]), e2e_layers(data), e2e_label(run, data["world_size"]),
                             *(num(by.get(c, 0.0), 0) for c in categories), num(b["gpu_busy_ms"], 0)])
    if not rows:
        return []
    return ["GPU time of one profiled iteration (rank 0, ms; kernels may overlap, so busy can exceed the "
            "iteration): MTraining's kernels (attention, approximator, plan), dense attention (cuDNN), GEMMs, "
            "NCCL, everything else.",
            table(["device", "GPUs", "S", "layers", "attention", "MTraining", "dense attention", "GEMM", "NCCL",
                   "other", "busy"], rows)]


def index_settings(settings: Dict) -> str:
    return f"top-p {settings['top_p']}, last_q {settings['last_q']}, min_vertical {settings.get('min_vertical', 0)}"


def needle_coverage_rows(coverage: Optional[Dict]) -> List[List[str]]:
    """One row at the longest probed length: per layer, the share of probes whose needle the
    index lets the answering row see (dense column: the dense model under MTraining's index)."""
    if not coverage:
        return []
    length = max(coverage.get("mtraining") or coverage.get("dense"), key=int)
    per_layer = lambda run: " / ".join(num(c, 2) for c in coverage.get(run, {}).get(length, [])) or "—"
    return [[f"needle coverage by the index at {tokens(int(length))}, per layer", per_layer("dense"),
             per_layer("mtraining"), "", ""]]


PATTERN_NAMES = {"mtraining": "MTraining (vertical-slash)", "moba": "MoBA", "xattn": "XAttention's index"}


def pattern_settings(run: str, settings: Dict) -> str:
    if run == "moba":
        return f"blocks {settings['moba_block_size']}, top-{settings['moba_top_k']}"
    if run == "xattn":
        return (f"blocks {settings['xattn_block_size']}, stride {settings['xattn_stride']}, "
                f"threshold {settings['xattn_threshold']}")
    return index_settings(settings)


def pattern_rows(summary: Dict, data: Dict) -> List[str]:
    """A result that also trained the block-sparse patterns (quality.py --merge with moba / xattn runs):
    one row per run against dense, at the longest length every run trained at."""
    others = [r for r in summary.get("runs", []) if r in ("moba", "xattn")]
    if not others:
        return []
    rows = []
    for run in ["mtraining"] + others:
        get = (lambda key, run=run: summary.get(f"{run}_{key}", summary.get(key) if run == "mtraining" else None))
        rows.append([PATTERN_NAMES[run], num(get("held_out_loss"), 3), num(100 * get("final_loss_gap"), 2) + "%",
                     num(get("retrieval_accuracy"), 3), num(get("retrieval_accuracy_sparse_inference"), 3),
                     num(get("mean_density"), 3), pattern_settings(run, data[run]["settings"])])
    dense = ["dense", num(summary["dense_held_out_loss"], 3), "", num(summary["dense_retrieval_accuracy"], 3), "",
             "1", ""]
    return [table(["run", "held-out LM loss", "loss vs dense", "retrieval (dense inference)",
                   "retrieval (own index)", "density", "index"], [dense] + rows)]


@renderer("quality")
def render_quality(results: List[Result]) -> str:
    parts = []
    for path, data in results:
        s = data["summary"]
        stopped = s.get("stopped_at_iteration", {})
        parts.append(table(
            ["metric", "dense", "MTraining", "gap", "target"],
            [["held-out LM loss", num(s["dense_held_out_loss"], 3), num(s["mtraining_held_out_loss"], 3),
              num(s["final_loss_gap"], 3), "within 0.02"],
             ["retrieval accuracy (dense inference)", num(s["dense_retrieval_accuracy"], 3),
              num(s["mtraining_retrieval_accuracy"], 3), f"{num(s['retrieval_accuracy_gap'], 1)} points",
              "<= 2 points, dense above chance"],
             ["retrieval accuracy (MTraining's index at inference)",
              num(s.get("dense_retrieval_accuracy_sparse_inference"), 3),
              num(s.get("mtraining_retrieval_accuracy_sparse_inference"), 3), "", ""],
             ["index density at the longest trained context", "1", num(s["mean_density"], 3), "", "<= 0.10"]]
            + needle_coverage_rows(s.get("needle_coverage_per_layer"))))
        if any(stopped.get(run) is not None for run in ("dense", "mtraining")):
            schedule = (f"training stopped at iterations {stopped.get('dense')} (dense) / "
                        f"{stopped.get('mtraining')} (MTraining) by the time budget")
        else:
            schedule = ("every run" if len(s.get("runs", [])) > 2 else "both runs") + " trained the whole schedule"
        mt, stem = data["mtraining"]["settings"], os.path.splitext(path)[0]
        dense_note = ("" if index_settings(data["dense"]["settings"]) == index_settings(mt) else
                      f" (the dense model under MTraining's index: {index_settings(data['dense']['settings'])})")
        parts.extend(pattern_rows(s, data))
        parts.append(f"`{path}`: MTraining index {index_settings(mt)}{dense_note}. "
                     f"Longest trained context {tokens(s['longest_context'])}, held-out loss at "
                     f"{tokens(s.get('held_out_length', s['longest_context']))}; {schedule}; retrieval chance "
                     f"{num(s['retrieval_chance'], 3)}. Plots: `{stem}_loss.png`, `{stem}_retrieval.png`, "
                     f"`{stem}_density.png`." + (f" Note: {s['note']}" if s.get("note") else ""))
    return "\n\n".join(["**Training quality, MTraining vs dense** (`benchmarks/quality.py`, synthetic "
                          "retrieval corpus, same seed and data)."] + parts)


# ----------------------------------------------------------------------------------------------
# summary.json: the performance targets of the project in one file
# ----------------------------------------------------------------------------------------------

TARGETS = {  # key: (comparison, target)
    # Megatron training on Transformer Engine layers against TE's own CP ring (--cp-comm-type p2p): the
    # configuration users run. bf16, and FP8 GEMMs on both sides (attention bf16 on both).
    "e2e_speedup_vs_te_cp_256k_2gpu": (">=", 4.5), "e2e_speedup_vs_te_cp_512k_4gpu": (">=", 8),
    "e2e_speedup_vs_te_cp_fp8_256k_2gpu": (">=", 5.5), "e2e_speedup_vs_te_cp_fp8_512k_4gpu": (">=", 10),
    # The kernels: the floor that must hold with the deterministic backward (16x / 430 would need
    # ~545 TFLOP/s executed by the split backward, above cuDNN's dense rate: docs/performance.md).
    "kernel_fwdbwd_speedup_vs_cudnn_128k": (">=", 12.5), "kernel_fwdbwd_speedup_vs_flex_64k": (">=", 2.5),
    "kernel_fwdbwd_effective_tflops_128k": (">=", 330), "ring_speedup_vs_dense_512k_4gpu": (">=", 8),
    "ring_speedup_vs_sparse_zigzag_512k_4gpu": (">=", 1.3), "worker_imbalance": ("<=", 1.05),
    "step_imbalance": ("<=", 1.15), "computation_ratio": (">=", 0.85), "ring_strong_scaling_4gpu": (">=", 0.93),
    # The ring at small work per GPU: 32K tokens per GPU, 1 against 4 GPUs, the causal work divided out.
    "ring_weak_scaling_32k_per_gpu_4gpu": (">=", 0.85),
    "hierarchical_speedup_slow_link": (">=", 1.3), "approximator_overhead": ("<=", 0.05),
    "e2e_speedup_512k_4gpu": (">=", 4),
    # The same against the cuDNN zigzag ring (the baseline a user compares with).
    "e2e_speedup_512k_4gpu_vs_cudnn": (">=", 7),
    # Megatron training at 256K over 2 GPUs against the cuDNN zigzag ring.
    "e2e_speedup_256k_2gpu_vs_cudnn": (">=", 5.0),
    # Packed documents (packed.json): ours vs Flex's document-causal attention; our per-pair rate packed over
    # the unpacked kernel's (kernel_fwdbwd_effective_tflops_128k).
    "packed_speedup_vs_flex_doc_128k": (">=", 8), "packed_effective_tflops_ratio_128k": (">=", 0.9),
    # Block-sparse indices (kernel.py --index block, MoBA pattern at about the VS density): the same kernels'
    # TFLOP/s on active pairs over the vertical-slash index's, fwd+bwd; FlexAttention with the same BlockMask.
    "block_kernel_rate_ratio_128k": (">=", 0.9), "block_speedup_vs_flex_128k": (">=", 2),
    # The MoBA pattern on the striped ring (ring.py --variants ...,sparse_moba), 512K over 4 GPUs.
    "ring_moba_speedup_vs_dense_512k_4gpu": (">=", 7), "ring_moba_worker_imbalance": ("<=", 1.1),
    # Training quality (quality.json: the default settings; its variants are ablations).
    "final_loss_gap": ("abs <=", 0.02), "retrieval_accuracy_gap": ("<=", 2.0), "mean_density": ("<=", 0.10),
    # The same with packed documents (quality_packed.json; density of document-causal pairs).
    "packed_final_loss_gap": ("abs <=", 0.02), "packed_retrieval_accuracy_gap": ("<=", 2.0),
    "packed_mean_density": ("<=", 0.10),
    # The flagship launchers as shipped, full depth, on H200s (flagship.json): MTraining over Megatron's own
    # CP (TE's p2p ring), each side at its fastest setting that fits; the planner's errors on every run.
    "flagship_qwen2.5_3b_256k_4gpu_vs_te_cp": (">=", 5.5), "flagship_qwen2.5_3b_256k_4gpu_vs_te_cp_fp8": (">=", 6.5),
    "flagship_qwen2.5_3b_512k_8gpu_vs_te_cp": (">=", 7.5), "flagship_qwen2.5_3b_512k_8gpu_vs_te_cp_fp8": (">=", 8.5),
    "flagship_llama3.1_8b_512k_8gpu_vs_te_cp": (">=", 6.5),
    "flagship_memory_max_abs_error": ("<=", 0.10), "flagship_planner_max_abs_error": ("<=", 0.15),
}


def target_met(value: float, op: str, target: float) -> bool:
    return {">=": value >= target, "<=": value <= target, "abs <=": abs(value) <= target}[op]


SLOW_LINK_KEY_GBPS = 2  # hierarchical_speedup_slow_link's emulated inter-node link


def _fp8(run: Dict) -> bool:
    return "--fp8-format" in run.get("megatron_argv", [])


def flagship_values(flagship: List[Result]) -> Dict[str, Tuple]:
    """The flagship keys: per model, length and GPU count, the fastest MTraining run over the fastest TE
    CP run of the same precision (each at its fastest setting that fits, i.e. the fastest that ran); the
    planner's largest memory and tokens/s errors over every run."""
    values: Dict[str, Tuple] = {}
    memory_errors, speed_errors = [], []
    # A later H200 result of the same key wins, as for the other figures.
    for path, data in sorted(flagship, key=lambda r: (r[1].get("meta", {}).get("device") == "NVIDIA H200",
                                                      r[1].get("meta", {}).get("time_utc") or "")):
        runs = [r for r in data.get("runs", []) if r.get("tokens_per_s")]
        memory_errors += [(abs(r["planner_memory_error"]), path) for r in runs if "planner_memory_error" in r]
        speed_errors += [(abs(r["planner_tokens_per_s_error"]), path) for r in runs
                         if "planner_tokens_per_s_error" in r]
        for fp8 in (False, True):
            ours = [r for r in runs if "--mtraining" in r.get("megatron_argv", []) and _fp8(r) == fp8]
            theirs = [r for r in runs if "--mtraining" not in r.get("megatron_argv", []) and _fp8(r) == fp8]
            if ours and theirs:
                best, base = max(ours, key=lambda r: r["tokens_per_s"]), max(theirs, key=lambda r: r["tokens_per_s"])
                key = (f"flagship_{data['model']}_{tokens_key(data['seq_length'])}_{data['world_size']}gpu_vs_te_cp"
                       + ("_fp8" if fp8 else ""))
                values[key] = (best["tokens_per_s"] / base["tokens_per_s"], path,
                               f"{best['name']} over {base['name']}; {data.get('meta', {}).get('device', '?')}")
    for key, errors in (("flagship_memory_max_abs_error", memory_errors),
                        ("flagship_planner_max_abs_error", speed_errors)):
        if errors:
            error, path = max(errors)
            values[key] = (error, path, f"the largest of {len(errors)} runs")
    return values


def block_kernel_values(path: str, data: Dict) -> Dict[str, Tuple]:
    """The block-sparse kernel keys of a ``kernel.py --index block`` result at 128K (MoBA pattern only)."""
    values: Dict[str, Tuple] = {}
    for run in data.get("runs", []):
        block = run.get("block", {})
        if run["seq_len"] != 131072 or block.get("pattern") != "moba":
            continue
        made = block.get("index", {})
        where = (f"MoBA, {made.get('moba_block_size')}-token blocks, top-{made.get('moba_top_k')}, density "
                 f"{num(made.get('density_mean'), 3)} (VS {num(run.get('index', {}).get('density_mean'), 3)})")
        values["block_kernel_rate_ratio_128k"] = (block.get("rate_ratio_over_vs", {}).get("fwdbwd"), path,
                                                  f"fwd+bwd TFLOP/s on active pairs; {where}")
        values["block_speedup_vs_flex_128k"] = (block.get("speedup", {}).get("flex_over_ours_fwdbwd"), path,
                                                f"fwd+bwd; {where}")
    return values


def summarise(results: Dict[str, List[Result]]) -> Dict:
    """The target figures found in the results (None where not measured yet), with sources."""
    values: Dict[str, Tuple] = {}  # key -> (value, source, note)
    for path, data in results.get("kernel", []):
        cfg = data.get("config", {})
        if cfg.get("density") != 0.05 or cfg.get("block_size", 64) != 64:
            continue  # the targets' shape only (the other figures, e.g. kernel_report_*, are tabled)
        if cfg.get("index", "vs") == "block":
            values.update(block_kernel_values(path, data))
            continue  # the vertical-slash keys come from the plain runs
        for run in data.get("runs", []):
            sp = run.get("speedup", {})
            if run["seq_len"] == 131072:
                values["kernel_fwdbwd_speedup_vs_cudnn_128k"] = (sp.get("dense_over_ours_fwdbwd"), path, "")
                values["kernel_fwdbwd_effective_tflops_128k"] = (run.get("ours", {}).get("fwdbwd_tflops"), path, "")
            if run["seq_len"] == 65536:
                values["kernel_fwdbwd_speedup_vs_flex_64k"] = (sp.get("flex_over_ours_fwdbwd"), path, "")
    for path, data in results.get("packed", []):
        for run in data.get("runs", []):
            if run["seq_len"] != 131072:
                continue
            ratios, rate = run.get("ratios", {}), run.get("packed", {}).get("fwdbwd_tflops")
            values["packed_speedup_vs_flex_doc_128k"] = (ratios.get("flex_over_ours_fwdbwd"), path, "")
            values["packed_effective_tflops_128k"] = (rate, path, "fwd+bwd, on active pairs")
            values["packed_effective_tflops_ratio_128k"] = (
                ratios.get("packed_over_unpacked_tflops_fwdbwd"), path,
                "over the unpacked kernel at 5% of causal pairs (4x the work per query block); over the unpacked "
                f"kernel at the same work: {num(ratios.get('packed_over_unpacked_equal_work_tflops_fwdbwd'))}")
    imbalances = []  # (path, data, the 512K 4-GPU striped run's imbalance figures)
    moba_runs = []  # (path, data, the 512K 4-GPU run's sparse_moba section, its index)
    for path, data in results.get("ring", []):
        if data.get("config", {}).get("slow_link_gbps"):  # emulated slow link: its own key below
            continue
        for run in data.get("runs", []):
            if run["seq_len"] != 524288 or run["world_size"] != 4:
                continue
            striped, zigzag = run["variants"].get("sparse_striped", {}), run["variants"].get("sparse_zigzag", {})
            if run["variants"].get("sparse_moba", {}).get("speedup", {}).get("vs_best_dense"):
                moba_runs.append((path, data, run["variants"]["sparse_moba"], run.get("moba_index", {})))
            if striped.get("speedup", {}).get("vs_best_dense"):  # a scaling run has no dense baseline
                values["ring_speedup_vs_dense_512k_4gpu"] = (striped["speedup"]["vs_best_dense"], path, "")
            if striped.get("fwdbwd_ms") and zigzag.get("fwdbwd_ms"):
                values["ring_speedup_vs_sparse_zigzag_512k_4gpu"] = (
                    zigzag["fwdbwd_ms"] / striped["fwdbwd_ms"], path,
                    "the layouts' work balance bounds it at 1.03 on NVLink (analysis_ring_balance.json); 1.3 "
                    "needs a step-synchronous ring of 32 ranks (analysis_ring_balance_w32.json)")
            if striped.get("steps", {}).get("fwd_bwd", {}).get("imbalance"):
                imbalances.append((path, data, striped["steps"]["fwd_bwd"]["imbalance"]))
    # Where several results give one key (a re-run kept beside the run it repeats, or another GPU's
    # run of the same shape), an H200's wins (the targets are defined on H200s), then the newest (the
    # 1-GPU floor the weak points divide by moves with the host machine; a commit hash says nothing of
    # when it ran).
    def precedence(result):
        meta = result[1].get("meta", {})
        return meta.get("device") == "NVIDIA H200", meta.get("time_utc") or ""

    measured_at = {path: precedence((path, data)) for path, data in results.get("ring", [])}
    if moba_runs:  # the MoBA pattern's figures, from the run with precedence
        path, data, moba, made = max(moba_runs, key=lambda entry: precedence(entry[:2]))
        imbalance = moba.get("steps", {}).get("fwd_bwd", {}).get("imbalance", {})
        where = (f"{moba.get('pattern', 'MoBA')}, density {num(made.get('density_mean'), 3)}, striped ring; step "
                 f"imbalance {num(imbalance.get('step_imbalance'))}, computation ratio "
                 f"{num(imbalance.get('computation_ratio'))}; commit {short_commit(data)}")
        values["ring_moba_speedup_vs_dense_512k_4gpu"] = (moba["speedup"]["vs_best_dense"], path,
                                                          f"fwd+bwd over the faster dense ring; {where}")
        values["ring_moba_worker_imbalance"] = (imbalance.get("worker_imbalance"), path, where)
    if imbalances:  # the paper's imbalance figures, from the run with precedence
        path, data, imbalance = max(imbalances, key=lambda entry: precedence(entry[:2]))
        for key, value in imbalance.items():
            values[key] = (value, path, f"sparse striped ring, 512K, 4 GPUs, commit {short_commit(data)}")
    # Strong scaling of the sparse striped ring at 512K: T(1 GPU) / (4 x T(4 GPUs)), one commit.
    times = same_setup_times(results.get("ring", []))
    pairs = [(commit, t4, p4, times[(device, commit, seq_len, name, 1)])
             for (device, commit, seq_len, name, world), (t4, p4) in times.items()
             if (seq_len, name, world) == (524288, "sparse_striped", 4) and (device, commit, seq_len, name, 1) in times]
    if pairs:
        commit, t4, p4, (t1, p1) = max(pairs, key=lambda pair: measured_at.get(pair[2], (False, "")))
        values["ring_strong_scaling_4gpu"] = (t1 / (4 * t4), p4, f"T1 {t1:.0f} ms ({os.path.basename(p1)}), "
                                              f"T4 {t4:.0f} ms, commit {commit}")
    # Weak scaling of the sparse striped ring at every (tokens per GPU, W) measured.
    for point in sorted(weak_scaling_points(results.get("ring", [])),
                        key=lambda p: measured_at.get(p["path"], (False, ""))):
        if point["variant"] != "sparse_striped":
            continue
        key = f"ring_weak_scaling_{tokens(point['tokens_per_gpu']).lower()}_per_gpu_{point['world_size']}gpu"
        active = point["active_work_ratio"]
        values[key] = (point["efficiency"], point["path"],
                       f"T1 {point['t1_ms']:.1f} ms ({os.path.basename(point['single_path'])}) x causal work ratio "
                       f"{point['causal_work_ratio']:.3f}"
                       + (f" (active pairs: {active:.3f})" if active else "")
                       + f", T{point['world_size']} {point['tw_ms']:.1f} ms, commit {point['commit']}")
    for path, data in results.get("ring", []):
        # The key is defined at 2 GB/s between nodes; the other emulated links feed the planner's validation.
        if data.get("config", {}).get("slow_link_gbps") != SLOW_LINK_KEY_GBPS:
            continue
        for run in sorted(data.get("runs", []), key=lambda r: r["seq_len"]):
            flat = run["variants"].get("sparse_striped", {}).get("fwdbwd_ms")
            hier = run["variants"].get("sparse_striped_hier", {}).get("fwdbwd_ms")
            if flat and hier:
                values["hierarchical_speedup_slow_link"] = (
                    flat / hier, path, f"{tokens(run['seq_len'])}, {run['world_size']} GPUs, emulated "
                    f"{data['config']['slow_link_gbps']:g} GB/s between nodes of {data['config']['inner_size']}")
    overheads = sorted(((d["ring"]["world_size"], d["ring"]["overhead"], p) for p, d in results.get("approx", [])
                        if d.get("ring") and d["ring"]["tokens_per_gpu"] == 131072), reverse=True)
    if overheads:
        world, value, path = overheads[0]
        values["approximator_overhead"] = (value, path, f"128K tokens per GPU on {world} GPUs")
    for path, data in sorted(results.get("e2e", []), key=precedence):
        against = f"against: {e2e_baseline(data)}"
        if data.get("e2e_speedup") and data.get("baseline") == "te_cp":
            fp8 = "_fp8" if data.get("fp8") else ""
            key = f"e2e_speedup_vs_te_cp{fp8}_{tokens_key(data['seq_length'])}_{data['world_size']}gpu"
            recompute = "activation recompute on both sides; " if data.get("recompute") else ""
            conditions = data.get("meta", {}).get("concurrency_note")  # e.g. two pairs side by side
            values[key] = (data["e2e_speedup"], path, f"{e2e_layers(data)} layers; {recompute}{against}; "
                                                     f"{data.get('meta', {}).get('device', '?')}"
                                                     + (f"; {conditions}" if conditions else ""))
        elif data.get("e2e_speedup") and data["seq_length"] == 524288 and data["world_size"] == 4:
            cudnn = e2e_baseline(data) != OLD_E2E_BASELINE
            values["e2e_speedup_512k_4gpu_vs_cudnn" if cudnn else "e2e_speedup_512k_4gpu"] = (
                data["e2e_speedup"], path, against)
        elif data.get("e2e_speedup"):
            # Against cuDNN (SDPA, or the zigzag ring over CP) the key says so, as issue 17's target does.
            cudnn = "_vs_cudnn" if e2e_baseline(data) != OLD_E2E_BASELINE else ""
            device = data.get("meta", {}).get("device", "?")
            key = f"e2e_speedup_{tokens(data['seq_length']).lower()}_{data['world_size']}gpu{cudnn}"
            shape = "" if key in TARGETS else "not the target's shape (512K over 4 GPUs); "
            values[key] = (data["e2e_speedup"], path, f"{shape}{against}; {device}")
    for path, data in results.get("quality", []):
        if os.path.basename(path) == "quality.json":
            summary_q = data.get("summary", {})
            for key, note in (("final_loss_gap", "held-out LM loss, MTraining - dense"),
                              ("retrieval_accuracy_gap", "points, dense - MTraining (dense inference)"),
                              ("mean_density", "MTraining's index at the longest trained context")):
                if isinstance(summary_q.get(key), (int, float)):
                    values[key] = (summary_q[key], path, note)
    values.update(packed_quality_values(results.get("quality", [])))
    for path, data in results.get("ringpacked", []):
        for run in data.get("runs", []):
            striped = run.get("variants", {}).get("sparse_striped", {})
            if not striped.get("fwdbwd_ms"):
                continue
            where = f"{tokens(run['seq_len'])} packed, {run['world_size']} GPUs"
            values[f"packed_ring_speedup_vs_dense_{tokens(run['seq_len']).lower()}_{run['world_size']}gpu"] = (
                striped.get("speedup", {}).get("vs_best_dense"), path,
                f"sparse striped ring over dense_ring_attention with the same documents, {where}")
            for key, value in striped.get("steps", {}).get("fwd_bwd", {}).get("imbalance", {}).items():
                values[f"packed_ring_{key}"] = (value, path, f"sparse striped ring, {where}")
    values.update(flagship_values(results.get("flagship", [])))
    sources = {path for value, path, _ in values.values() if path}
    metas = [d.get("meta", {}) for kind in results for path, d in results[kind] if path in sources]
    latest = max(metas, key=lambda m: m.get("time_utc", ""), default={})
    # The device most figures come from (a figure from another one names it in its note).
    devices = [m.get("device") for m in metas if m.get("device")]
    device = max(sorted(set(devices)), key=devices.count, default=latest.get("device"))
    summary = {"device": device, "torch": latest.get("torch"), "triton": latest.get("triton"),
               "git_commit": latest.get("commit"),
               "git_commits": {path: d.get("meta", {}).get("commit") for kind in results
                               for path, d in results[kind] if path in sources}}
    details = {}
    for key in list(TARGETS) + sorted(k for k in values if k not in TARGETS):
        value, source, note = values.get(key, (None, None, "not measured yet"))
        summary[key] = value
        entry = {"source": source, "note": note}
        if key in TARGETS:
            op, target = TARGETS[key]
            entry["target"] = f"{op} {target}"
            entry["met"] = None if value is None else target_met(value, op, target)
        details[key] = entry
    summary["details"] = details
    return summary


def render_summary(summary: Dict) -> str:
    rows = []
    for key, entry in summary["details"].items():
        value = summary[key]
        met = {True: "yes", False: "no", None: "—"}[entry.get("met")]
        rows.append([f"`{key}`", num(value, 3) if value is not None else "—", entry.get("target", ""), met,
                     entry.get("note", "")])
    return ("**Targets** (`benchmarks/results/summary.json`, written by this script from the results below; "
            f"{summary['device']}):\n\n" + table(["key", "value", "target", "met", "note"], rows))


DOCUMENT_COSTS = os.path.join(REPO, "benchmarks", "results", "analysis_document_costs.json")


def document_costs(path: str = DOCUMENT_COSTS) -> Optional[Dict]:
    """``document_costs.py``'s analysis with its rows keyed by (documents, seq_len), or None where
    it has not been run."""
    if not os.path.exists(path):
        return None
    with open(path) as fh:
        data = json.load(fh)
    return dict(data, rows={(r["documents"], r["seq_len"]): r for r in data["rows"]})


def document_cost_note(path: str = DOCUMENT_COSTS) -> str:
    """The packed density's projection onto the benchmark's ProLong mix at 128K
    (``document_costs.py``), or nothing where that analysis has not been run."""
    data = document_costs(path)
    if data is None:
        return ""
    rows = data["rows"]
    packed = next((p for p in data.get("projections", []) if p["quality_run"] == "quality_packed.json"), None)
    if packed is None or ("random_3_8", 32768) not in rows or ("unpacked", 32768) not in rows:
        return ""
    return (f"; with these 3-8 documents per 32K an offset costs {rows[('random_3_8', 32768)]['share_per_offset']:.2%} "
            f"of the pairs against {rows[('unpacked', 32768)]['share_per_offset']:.2%} unpacked, so its "
            f"~{packed['implied_offsets_per_head']:.0f} offsets per head would give "
            f"{packed['projected_density_prolong_mix_128k']:.3f} on the benchmark's ProLong mix at 128K "
            f"(a projection, analysis_document_costs.json)")


def packed_quality_values(quality: List[Result]) -> Dict:
    """The packed quality targets (``packed_*`` keys: value, source, note) from the issue's
    benchmark mix at 128K where it has run (quality_packed_prolong.json), else from 3-8 random
    documents per 32K sequence (quality_packed.json)."""
    runs = {os.path.basename(path): (path, data) for path, data in quality}
    name = next((n for n in ("quality_packed_prolong.json", "quality_packed.json") if n in runs), None)
    if name is None:
        return {}
    path, data = runs[name]
    prolong = name == "quality_packed_prolong.json"
    mix = "the ProLong mix at 128K" if prolong else "3-8 random documents per 32K"
    density_note = f"of document-causal pairs, at the longest trained context ({mix})"
    random_docs = runs.get("quality_packed.json", (None, {}))[1].get("summary", {}).get("mean_density")
    if not prolong:
        density_note += document_cost_note()
    elif isinstance(random_docs, float):
        density_note += (f"; 3-8 random documents per 32K: {random_docs:.3f} (quality_packed.json), where an "
                         f"offset costs more of the pairs{offset_cost_ratio_note()}")
    summary_q = data.get("summary", {})
    notes = {"final_loss_gap": f"held-out LM loss, MTraining - dense, packed documents ({mix})",
             "retrieval_accuracy_gap": "points, dense - MTraining, packed probes with distractors",
             "mean_density": density_note}
    return {"packed_" + key: (summary_q[key], path, note) for key, note in notes.items()
            if isinstance(summary_q.get(key), (int, float))}


def offset_cost_ratio_note(path: str = DOCUMENT_COSTS) -> str:
    """How much more of the pairs a slash offset costs with 3-8 random documents per 32K than on
    the ProLong mix at 128K (``document_costs.py``), or nothing where that analysis is missing."""
    data = document_costs(path)
    rows = data["rows"] if data else {}
    if ("random_3_8", 32768) not in rows or ("prolong_mix", 131072) not in rows:
        return ""
    ratio = rows[("random_3_8", 32768)]["share_per_offset"] / rows[("prolong_mix", 131072)]["share_per_offset"]
    return f" ({ratio:.1f}x, analysis_document_costs.json)"


def load_results(results_dir: str) -> Dict[str, List[Result]]:
    """Parsed results per kind, in file-name order; smoke runs and unknown kinds are left out."""
    found: Dict[str, List[Result]] = {}
    for path in sorted(glob.glob(os.path.join(results_dir, "*.json"))):
        kind = os.path.splitext(os.path.basename(path))[0].split("_", 1)[0]
        if kind not in RENDERERS:
            continue
        with open(path) as fh:
            data = json.load(fh)
        if data.get("smoke"):
            continue
        found.setdefault(kind, []).append((os.path.relpath(path, REPO), data))
    return found


def render_section(results: Dict[str, List[Result]]) -> str:
    parts = [RENDERERS[kind](results[kind]) for kind in RENDERERS if kind in results]
    return "\n\n".join(parts) if parts else "_No benchmark results yet._"


# ----------------------------------------------------------------------------------------------
# README: the headline figures, from summary.json alone
# ----------------------------------------------------------------------------------------------

# (summary key, what it measures, format): the README's table, in this order. A key that
# summary.json does not hold (not measured yet) is left out.
README_FIGURES = [
    ("e2e_speedup_vs_te_cp_256k_2gpu", "Megatron training on TE layers, 2 GPUs, 256K: tokens/s over TE's own CP ring", "x"),
    ("e2e_speedup_vs_te_cp_fp8_256k_2gpu", "the same with FP8 GEMMs on both sides", "x"),
    ("e2e_speedup_vs_te_cp_512k_4gpu", "Megatron training on TE layers, 4 GPUs, 512K: tokens/s over TE's own CP ring", "x"),
    ("e2e_speedup_vs_te_cp_fp8_512k_4gpu", "the same with FP8 GEMMs on both sides", "x"),
    ("e2e_speedup_vs_te_cp_1m_4gpu", "the same at 1M in bf16, activation recompute on both sides", "x"),
    ("kernel_fwdbwd_speedup_vs_cudnn_128k", "sparse attention kernel, fwd+bwd, 128K, 5% density: over cuDNN dense causal", "x"),
    ("kernel_fwdbwd_speedup_vs_flex_64k", "the same at 64K: over FlexAttention given the same pairs", "x"),
    ("kernel_fwdbwd_effective_tflops_128k", "the same at 128K: rate on active pairs", "tflops"),
    ("packed_speedup_vs_flex_doc_128k", "packed documents, 128K mix, fwd+bwd: over FlexAttention's document-causal mask", "x"),
    ("ring_speedup_vs_dense_512k_4gpu", "one layer over 4 GPUs, 512K, fwd+bwd: over the cuDNN dense ring", "x"),
    ("worker_imbalance", "the same: worker-level imbalance (max / mean over ranks)", "ratio"),
    ("computation_ratio", "the same: computation ratio (compute / (compute + wait))", "ratio"),
    ("ring_strong_scaling_4gpu", "the same: strong-scaling efficiency, 1 to 4 GPUs", "ratio"),
    ("ring_weak_scaling_32k_per_gpu_4gpu", "the ring at 32K tokens per GPU: weak-scaling efficiency, 1 to 4 GPUs",
     "ratio"),
    ("hierarchical_speedup_slow_link", "hierarchical over flat ring, 4 GPUs, emulated 2 GB/s between nodes", "x"),
    ("packed_ring_speedup_vs_dense_512k_2gpu", "packed documents over 2 GPUs, 512K: over the dense ring with the same documents", "x"),
    ("approximator_overhead", "index approximator: its time over the attention it feeds (4 GPUs, 128K each)", "pct"),
    ("final_loss_gap", "training from scratch, 32K: held-out LM loss, MTraining minus dense", "loss"),
    ("retrieval_accuracy_gap", "the same: retrieval accuracy, MTraining minus dense", "points"),
    ("mean_density", "the same: MTraining's index density", "pct"),
    ("packed_final_loss_gap", "packed documents, 128K mix: held-out LM loss, MTraining minus dense", "loss"),
    ("packed_retrieval_accuracy_gap", "the same: retrieval accuracy, MTraining minus dense", "points"),
    ("packed_mean_density", "the same: index density of the document-causal pairs", "pct"),
]


def readme_value(value: float, fmt: str) -> str:
    if fmt == "x":
        return f"{value:.1f}x"
    if fmt == "tflops":
        return f"{value:.0f} TFLOP/s"
    if fmt == "pct":
        return f"{100 * value:.1f}%"
    if fmt == "loss":  # a gap that rounds to zero reads 0.000, not -0.000
        return f"{abs(value):.3f}" if abs(value) < 5e-4 else f"{value:+.3f}"
    if fmt == "points":  # summary.json holds dense - MTraining; the table says MTraining - dense
        return f"{-value:+.1f} points"
    return f"{value:.2f}"


def readme_target(entry: Dict, fmt: str) -> str:
    """The README's target cell: the threshold and whether the figure meets it, "—" without one.
    Thresholds in another unit or sign than the value shown (percentages held as fractions, gaps
    held as dense - MTraining) give the verdict alone."""
    target = entry.get("target")
    if not target:
        return "—"
    verdict = "met" if entry.get("met") else "missed"
    return f"{target}: {verdict}" if fmt in ("x", "tflops", "ratio") else verdict


def render_readme_summary(summary: Dict) -> str:
    """The README's results table: the headline figures of ``summary.json``, each with the commit
    of the result file it comes from; a figure from another device than the summary's names it."""
    rows = []
    for key, label, fmt in README_FIGURES:
        value = summary.get(key)
        if not isinstance(value, (int, float)):
            continue
        entry = summary["details"][key]
        note = entry.get("note", "")
        other = next((part.strip() for part in note.split(";") if part.strip().startswith("NVIDIA")
                      and part.strip() != summary["device"]), "")
        commit = str(summary.get("git_commits", {}).get(entry.get("source")) or "—")[:7]
        rows.append([label + (f" ({other})" if other else ""), readme_value(value, fmt), readme_target(entry, fmt),
                     commit])
    return (f"Measured on {summary['device']} GPUs (torch {summary['torch']}, triton {summary['triton']}); "
            "generated from `benchmarks/results/summary.json` by `benchmarks/make_tables.py`. Shapes, "
            "baselines, every run and the targets: [docs/benchmarks.md](docs/benchmarks.md).\n\n"
            + table(["figure", "value", "target", "commit"], rows))


# ----------------------------------------------------------------------------------------------
# Writing the sections
# ----------------------------------------------------------------------------------------------

GENERATED = "<!-- Generated by benchmarks/make_tables.py from benchmarks/results/; do not edit by hand. -->"


def splice(readme: str, section: str) -> str:
    """Text with the part between the markers replaced by ``section``."""
    head, rest = readme.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{section}\n{END}{tail}"


def update_section(path: str, section: str, check: bool) -> bool:
    """Writes ``section`` between ``path``'s markers (or checks it); True when it was stale. A file
    without its markers is reported and its section printed, and counts as up to date."""
    text = open(path).read() if os.path.exists(path) else None
    if text is None or BEGIN not in text or END not in text.split(BEGIN, 1)[1]:
        print(f"{path}: no such file or no {BEGIN} / {END} markers; its section follows.\n", file=sys.stderr)
        print(section)
        return False
    updated = splice(text, section)
    if updated == text:
        print(f"{path}: generated section up to date")
        return False
    if check:
        print(f"{path}: the generated section is stale; run python benchmarks/make_tables.py", file=sys.stderr)
    else:
        with open(path, "w") as fh:
            fh.write(updated)
        print(f"{path}: generated section rewritten")
    return True


def ring_scaling_report(results: List[Result]) -> str:
    """The scaling figures of one device call's ring files (``scripts/gpu_ring_scaling.sh``): taken
    as one commit whatever their metadata says, strong and weak efficiency by the formulas above, the
    per-step timeline of every run (ms summed over steps, mean over ranks, fwd+bwd)."""
    one_call = []
    commit = short_commit(results[0][1]) if results else "unknown"
    for path, data in results:
        meta = dict(data.get("meta", {}), commit=commit, dirty=None)
        one_call.append((path, dict(data, meta=meta)))
    rows = []
    for path, data in one_call:
        for run in data.get("runs", []):
            section = run.get("variants", {}).get("sparse_striped", {})
            line = section.get("steps", {}).get("timeline", {}).get("fwd_bwd", {})
            imbalance = section.get("steps", {}).get("fwd_bwd", {}).get("imbalance", {})
            rows.append([str(run["world_size"]), tokens(run["seq_len"]), tokens(run["tokens_per_rank"]),
                         num(section.get("fwdbwd_ms")),
                         " / ".join(num(line.get(f"{kind}_ms", {}).get("mean"), 1)
                                    for kind in ("compute", "wait", "plan", "merge")),
                         num(imbalance.get("computation_ratio")),
                         "; ".join(str(e)[:60] for e in section.get("errors", {}).values())])
    timeline = table(["W", "S", "per GPU", "fwd+bwd ms", "steps: compute / wait / plan / merge ms",
                      "compute ratio", "error"], rows)
    return "\n\n".join(x for x in (ring_scaling(one_call), weak_scaling_table(one_call), timeline) if x)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", default=os.path.join(HERE, "results"), help="folder of results JSON")
    p.add_argument("--readme", default=os.path.join(REPO, "README.md"), help="gets the headline table")
    p.add_argument("--tables", default=os.path.join(REPO, "docs", "benchmarks.md"), help="gets the full tables")
    p.add_argument("--check", action="store_true", help="exit 1 if a section or summary.json is stale")
    p.add_argument("--ring-scaling", nargs="+", metavar="JSON",
                   help="print the scaling figures of these ring files of one device call, write nothing")
    args = p.parse_args(argv)
    if args.ring_scaling:
        files = []
        for path in args.ring_scaling:
            with open(path) as fh:
                files.append((path, json.load(fh)))
        print(ring_scaling_report(files))
        return 0

    results = load_results(args.results)
    summary = summarise(results)
    summary_path = os.path.join(args.results, "summary.json")
    summary_text = json.dumps(summary, indent=1) + "\n"
    stale_summary = not os.path.exists(summary_path) or open(summary_path).read() != summary_text
    if stale_summary:
        if args.check:
            print(f"{summary_path} is stale; run python benchmarks/make_tables.py", file=sys.stderr)
        else:
            with open(summary_path, "w") as fh:
                fh.write(summary_text)
    readme_section = f"{GENERATED}\n\n{render_readme_summary(summary)}"
    tables_section = f"{GENERATED}\n\n{render_summary(summary)}\n\n{render_section(results)}"
    stale = [update_section(args.readme, readme_section, args.check),
             update_section(args.tables, tables_section, args.check)]
    return 1 if args.check and (stale_summary or any(stale)) else 0


if __name__ == "__main__":
    sys.exit(main())
