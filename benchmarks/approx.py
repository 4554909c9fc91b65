"""Approximator benchmark: recall versus density, and its cost against the attention it feeds.

1. Quality (any device): on synthetic post-RoPE q/k with a vertical-slash structure
   (`synthetic.py`), the approximated index at top-p 0.8 / 0.9 / 0.95: its
   density and the share of the true (dense softmax) attention mass it covers (recall).
2. Overhead (GPU): approximator time / sparse attention forward+backward time of the same
   layer, canonical shape (16/2 heads, d 128, bf16), one GPU holding S tokens.
3. Overhead over a context-parallel ring (``--ring``, under torchrun, NCCL): every GPU holds
   ``--ring-local-len`` tokens (default 128K) of a W x longer sequence in the striped layout;
   the distributed approximator against ``sparse_ring_attention`` forward+backward with the
   index it built.

    python benchmarks/approx.py                     # GPU: parts 1 and 2
    python benchmarks/approx.py --quality-only      # CPU: part 1 (writes a plot too)
    python -m torch.distributed.run --nproc-per-node 4 benchmarks/approx.py --ring   # part 3
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import device_slug, json_ready, median, run_metadata, time_ms  # noqa: E402

from megatron_mtraining import MTrainingConfig, approximate_index, sparse_attention  # noqa: E402
from synthetic import attention_recall, synthetic_vs_qk  # noqa: E402

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def quality(device, seq_len, heads, kv_heads, head_dim, top_ps, seeds):
    rows = []
    for top_p in top_ps:
        for seed in seeds:
            q, k = synthetic_vs_qk(1, heads, kv_heads, seq_len, head_dim, seed=seed, device=device)
            # min_vertical 0: the recall-density curve of the top-p budget alone
            cfg = MTrainingConfig(top_p=top_p, max_vertical=max(64, seq_len // 16), min_vertical=0,
                                  max_slash=max(16, seq_len // 256))
            index = approximate_index(q, k, cfg)
            r = attention_recall(q, k, index)
            rows.append({"top_p": top_p, "seed": seed, "seq_len": seq_len, "recall": r["mean_recall"],
                         "density": r["mean_density"], "recall_per_head": r["recall"].flatten().tolist(),
                         "density_per_head": r["density"].flatten().tolist()})
            print(f"top_p {top_p:.2f} seed {seed}: recall {r['mean_recall']:.3f} density {r['mean_density']:.3f}",
                  flush=True)
    return rows


def overhead(device, seq_len, warmup, reps):
    cfg = MTrainingConfig(top_p=0.9)
    q, k = synthetic_vs_qk(1, 16, 2, seq_len, 128, seed=0, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    approx_ms = median(time_ms(lambda: approximate_index(q, k, cfg), [()], device, warmup, reps))
    index = approximate_index(q, k, cfg)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    grad = torch.randn_like(q)

    def attention():
        out = sparse_attention(qg, kg, vg, index)
        out.backward(grad)

    attn_ms = median(time_ms(attention, [()], device, warmup, reps))
    density = index.density(seq_len).mean().item()
    return {"seq_len": seq_len, "approximator_ms": approx_ms, "sparse_attention_fwdbwd_ms": attn_ms,
            "overhead": approx_ms / attn_ms, "index_density": density,
            "n_slash_mean": index.n_slash.float().mean().item(),
            "n_vertical_mean": index.n_vertical.float().mean().item()}


def ring_overhead(local_len, warmup, reps):
    import torch.distributed as dist

    from megatron_mtraining import shard_sequence, sparse_ring_attention

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda")
    cfg = MTrainingConfig(top_p=0.9)
    seq_len = local_len * world
    # The synthetic full sequence is built in float64 on the host, once: by rank 0 with all the
    # cores (torchrun starts every rank with one thread), then broadcast in bf16. W copies of the
    # float64 build at 512K do not fit in a 4-GPU host's memory (a rank was killed).
    shape_q, shape_k = (1, 16, seq_len, 128), (1, 2, seq_len, 128)
    if rank == 0:
        torch.set_num_threads(os.cpu_count() or 1)
        q, k = (x.contiguous() for x in synthetic_vs_qk(*shape_q[:2], shape_k[1], seq_len, 128, seed=0,
                                                        device=device, dtype=torch.bfloat16))
    else:
        q = torch.empty(shape_q, device=device, dtype=torch.bfloat16)
        k = torch.empty(shape_k, device=device, dtype=torch.bfloat16)
    dist.broadcast(q, 0)
    dist.broadcast(k, 0)
    q, k = (shard_sequence(x, 2, "striped", world, rank, cfg.block_size).contiguous() for x in (q, k))
    v = torch.randn_like(k)
    group = dist.group.WORLD

    def approx():
        return approximate_index(q, k, cfg, group=group)

    approx_ms = time_ms(approx, [()], device, warmup, reps)
    index = approx()
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    grad = torch.randn_like(q)

    def attention():
        sparse_ring_attention(qg, kg, vg, index, group=group).backward(grad)

    attn_ms = time_ms(attention, [()], device, warmup, reps)
    # Every rank's medians; the slowest rank is the one the layer waits for.
    local = torch.tensor([median(approx_ms), median(attn_ms)], device=device, dtype=torch.float64)
    table = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(table, local)
    approx_max = max(t[0].item() for t in table)
    attn_max = max(t[1].item() for t in table)
    row = {"world_size": world, "tokens_per_gpu": local_len, "seq_len": seq_len, "approximator_ms": approx_max,
           "sparse_ring_attention_fwdbwd_ms": attn_max, "overhead": approx_max / attn_max,
           "approximator_ms_per_rank": [t[0].item() for t in table],
           "attention_ms_per_rank": [t[1].item() for t in table],
           "index_density": index.density(seq_len).mean().item()}
    dist.destroy_process_group()
    return rank, row


def plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(5, 4))
    for top_p in sorted({r["top_p"] for r in rows}):
        sel = [r for r in rows if r["top_p"] == top_p]
        ax.scatter([d for r in sel for d in r["density_per_head"]], [x for r in sel for x in r["recall_per_head"]],
                   s=10, label=f"top-p {top_p}")
    ax.set_xlabel("index density (active / causal pairs)")
    ax.set_ylabel("recall (attention mass covered)")
    ax.set_title(f"approximator on synthetic VS data, S={rows[0]['seq_len']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quality-len", type=int, default=8192)
    p.add_argument("--overhead-lens", default="131072")
    p.add_argument("--quality-only", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--ring", action="store_true", help="part 3 only, under torchrun")
    p.add_argument("--ring-local-len", type=int, default=131072)
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.ring:
        if "RANK" not in os.environ or not torch.cuda.is_available():
            raise SystemExit("approx.py --ring runs under torchrun on GPUs, e.g. "
                             "python -m torch.distributed.run --nproc-per-node 4 benchmarks/approx.py --ring")
        rank, row = ring_overhead(args.ring_local_len, args.warmup, args.reps)
        if rank == 0:
            out = args.out or os.path.join(RESULTS_DIR, f"approx_ring_{device_slug(device)}_{row['world_size']}gpu.json")
            with open(out, "w") as f:
                json.dump(json_ready({"benchmark": "approx_ring", "meta": run_metadata(device), "ring": row}), f,
                          indent=1)
            print(f"wrote {out}\nW={row['world_size']} x {row['tokens_per_gpu']} tokens: approximator "
                  f"{row['approximator_ms']:.2f} ms, sparse ring attention fwd+bwd "
                  f"{row['sparse_ring_attention_fwdbwd_ms']:.2f} ms, overhead {row['overhead']:.3f} "
                  f"(density {row['index_density']:.3f})")
        return
    result = {"benchmark": "approx", "meta": run_metadata(device),
              "quality": quality(device, args.quality_len, 8, 2, 64, (0.8, 0.9, 0.95), (0, 1))}
    if device.type == "cuda" and not args.quality_only:
        result["overhead"] = [overhead(device, int(s), args.warmup, args.reps) for s in args.overhead_lens.split(",")]
    out = args.out or os.path.join(RESULTS_DIR, f"approx_{device_slug(device)}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    result["plot"] = plot(result["quality"], os.path.splitext(out)[0] + "_recall.png")
    with open(out, "w") as f:
        json.dump(json_ready(result), f, indent=1)
    print(f"wrote {out}")
    print("top_p  recall  density")
    for top_p in (0.8, 0.9, 0.95):
        sel = [r for r in result["quality"] if r["top_p"] == top_p]
        print(f"{top_p:5.2f}  {sum(r['recall'] for r in sel) / len(sel):.3f}   "
              f"{sum(r['density'] for r in sel) / len(sel):.3f}")
    for o in result.get("overhead", []):
        print(f"S={o['seq_len']}: approximator {o['approximator_ms']:.2f} ms, sparse attention fwd+bwd "
              f"{o['sparse_attention_fwdbwd_ms']:.2f} ms, overhead {o['overhead']:.3f} (density {o['index_density']:.3f})")


if __name__ == "__main__":
    main()
