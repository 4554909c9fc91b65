"""Issue 17 spike: TileLang kernels (``tilelang_slash.py``) on our problem, against our kernels on
the same pairs, one call.

The problem of ``spike_fa4.py`` (the canonical fixed 5% index at 128K), in two parts:

  slash   the index's slash part alone (columns dropped), fwd and fwd+bwd through autograd:
          ours (``sparse_attention``) against the four TileLang kernels (forward; delta, dK/dV and
          dQ; deterministic, no atomics). FlashAttention-4's figures are on the same problem.
  full    the whole index, columns too: TileLang's forward and dQ kernels take the column tiles
          (pre-gathered column rows after the sequence in K and V, one copy per call, timed), so
          each kernel is timed alone against our kernels' own breakdown of the same fwd+bwd (the
          spike has no TileLang column dK/dV: the projection takes ours).

Correctness first: TileLang and ours each against the PyTorch reference at ``--check-len`` (4K),
then TileLang against ours on the timed problem itself (relative L2 of out and the gradients; the
backward run twice must agree bit for bit), then the timings. Rates are on
active pairs (4d FLOPs per pair forward, x3.5 forward+backward, as kernel.py). ``--sweep`` times
each kernel alone over (pipeline stages, programs per SM) instead.

    python benchmarks/spike_tilelang.py [--seq-len 131072] [--block-sizes 128,64] [--out F.json]
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from common import describe_index, kernel_times_ms, median, relative_l2, time_ms, write_json  # noqa: E402
from kernel import Config, forward_and_backward, index_and_inputs  # noqa: E402
from megatron_mtraining import sparse_attention  # noqa: E402
from spike_common import attempt, measurer, slash_only, spike_arguments, spike_start  # noqa: E402
import tilelang_slash as tls  # noqa: E402

# (num_stages, programs per SM) of the attention kernels. B = 128 programs have 2 consumer
# warpgroups and ~190 KB of shared memory at 2 stages: one per SM. B = 64 ones have one consumer
# warpgroup: a second program per SM is the only other warpgroup there to overlap with.
SWEEP = {128: [(1, 1), (2, 1)], 64: [(2, 1), (1, 2), (2, 2)]}
BEST = {128: (2, 1), 64: (2, 2)}  # the sweep's fastest on an H100 (session 18)


def ours_fn(index, scale):
    return lambda q, k, v: sparse_attention(q, k, v, index, scale)


def kernel_alone_ms(kernel, args, device, reps) -> float:
    return median(time_ms(lambda: kernel(*args), [()], device, 3, reps))


def reference_checks(args, B, cfg, scale, device, result) -> None:
    """At ``--check-len``: TileLang and ours each against the PyTorch reference (DESIGN.md
    section 1, fp32), the slash part (out and all gradients) and the whole index (out and dQ,
    the spike's kernels with columns)."""
    from megatron_mtraining.kernels.reference import reference_attention

    n = args.check_len
    index, sets = index_and_inputs(Config(seq_lens=[n], block_size=B), n, device)
    q, k, v, dout = sets[0]
    section = result.setdefault("reference_rel_l2", {})
    for part, idx in (("slash", slash_only(index)), ("full", index)):
        ref_out, _ = reference_attention(q, k, v, idx, softmax_scale=scale)
        ref = (ref_out, *torch.autograd.grad(ref_out, (q, k, v), dout.float()))
        out = sparse_attention(q, k, v, idx, scale)
        ours = (out, *torch.autograd.grad(out, (q, k, v), dout))
        plan = tls.make_plan(idx, n, cfg.kv_heads, columns=part == "full")
        variant = BEST[B]
        if part == "slash":
            out = tls.slash_attention(q, k, v, plan, scale, variant)
            theirs = (out, *torch.autograd.grad(out, (q, k, v), dout))
        else:
            theirs = tls.forward_and_dq(q.detach(), k.detach(), v.detach(), dout, plan, scale, variant)
        for name, r, o, t in zip(("out", "dq", "dk", "dv"), ref, ours, theirs):
            section[f"b{B}_{part}_{name}_ours"] = relative_l2(o, r)
            section[f"b{B}_{part}_{name}_tilelang"] = relative_l2(t, r)
    print("against the reference (rel L2):", {k_: f"{v_:.1e}" for k_, v_ in section.items()
                                              if k_.startswith(f"b{B}_")}, flush=True)


def slash_part(args, B, cfg, scale, device, result, measure) -> None:
    """The slash-only index through autograd: checks, then fwd and fwd+bwd against ours."""
    index, arg_sets = index_and_inputs(Config(seq_lens=[args.seq_len], block_size=B), args.seq_len, device)
    index = slash_only(index)
    plan = tls.make_plan(index, args.seq_len, cfg.kv_heads, columns=False)
    q, k, v, dout = arg_sets[0]
    variant = BEST[B]

    def build():
        start = time.time()
        tls.compile_kernels(plan, q.shape, k.shape[1], scale, (variant,))
        return time.time() - start

    if attempt(result["compile_s"], f"b{B}_slash", build) is None:
        return
    attn = (lambda q_, k_, v_: tls.slash_attention(q_, k_, v_, plan, scale, variant))
    ref_out = ours_fn(index, scale)(q, k, v)
    ref = forward_and_backward(ours_fn(index, scale))(q, k, v, dout)
    got_out = attempt(result["checks"], f"b{B}_out", lambda: relative_l2(attn(q, k, v), ref_out))
    got = attempt(result["checks"], f"b{B}_grads", lambda: forward_and_backward(attn)(q, k, v, dout))
    if got is not None:
        result["checks"].pop(f"b{B}_grads")
        for name, g, r in zip(("dq", "dk", "dv"), got, ref):
            result["checks"][f"b{B}_{name}"] = relative_l2(g, r)
        again = forward_and_backward(attn)(q, k, v, dout)
        result["checks"][f"b{B}_bitwise_repeatable"] = all(torch.equal(a, b) for a, b in zip(got, again))
    ref_out = ref = None  # the memory, before the timings
    print("checks (rel L2, TileLang against ours):", result["checks"], flush=True)
    if got_out is None or got is None:
        return
    pairs = describe_index(index, args.seq_len)["active_pairs"]
    result[f"b{B}_active_pairs"] = pairs
    flops = 4 * cfg.head_dim * pairs
    measure(f"b{B}_ours", ours_fn(index, scale), arg_sets, flops)
    measure(f"b{B}_tilelang", attn, arg_sets, flops)
    for kind in ("fwd", "fwdbwd"):
        ours, theirs = result["ms"].get(f"b{B}_ours_{kind}"), result["ms"].get(f"b{B}_tilelang_{kind}")
        if ours and theirs:
            result.setdefault("ours_over_tilelang", {})[f"b{B}_{kind}"] = ours / theirs


def full_index(args, B, cfg, scale, device, result, measure) -> None:
    """The whole index: TileLang's forward and dQ with the column tiles, each kernel alone,
    against our kernels' breakdown; checks against ours first."""
    index, arg_sets = index_and_inputs(Config(seq_lens=[args.seq_len], block_size=B), args.seq_len, device)
    plan = tls.make_plan(index, args.seq_len, cfg.kv_heads, columns=True)
    q, k, v, dout = (x.detach() for x in arg_sets[0])
    b, hq, n, d = q.shape
    variant = BEST[B]
    section = result.setdefault("full", {})
    kernels = attempt(section, f"b{B}_build", lambda: tls.compile_kernels(plan, q.shape, k.shape[1], scale, (variant,)))
    if kernels is None:
        return
    section.pop(f"b{B}_build")
    fwd_k, dq_k = kernels["forward", variant], kernels["dq", variant]
    dkdv_k, delta_k = kernels["dkdv", variant], kernels["delta", ()]

    def extend():
        return tls.with_columns(k, plan.col_pos, plan.max_cols), tls.with_columns(v, plan.col_pos, plan.max_cols)

    k_rows, v_rows = extend()
    out, lse = torch.empty_like(q), torch.empty(b, hq, n, dtype=torch.float32, device=device)
    fwd_args = (q, k_rows, v_rows, plan.fwd_idx, plan.fwd_cnt, plan.col_pos, plan.col_tiles, plan.col_limit,
                plan.slash, out, lse)
    attempt(section, f"b{B}_forward_run", lambda: fwd_k(*fwd_args))
    if f"b{B}_forward_run_error" in section:
        return
    section.pop(f"b{B}_forward_run", None)
    delta = torch.empty_like(lse)
    delta_k(out, dout, delta)
    dq = torch.empty_like(q)
    dq_args = (q, k_rows, v_rows, dout, lse, delta, plan.fwd_idx, plan.fwd_cnt, plan.col_pos, plan.col_tiles,
               plan.col_limit, plan.slash, dq)
    dq_k(*dq_args)
    # Checks: against ours on the same inputs.
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    ref_out = sparse_attention(qg, kg, vg, index, scale)
    ref_dq, = torch.autograd.grad(ref_out, (qg,), dout)
    section[f"b{B}_check_out"] = relative_l2(out, ref_out)
    section[f"b{B}_check_dq"] = relative_l2(dq, ref_dq)
    print(f"b{B} full-index checks: out {section[f'b{B}_check_out']:.2e}  dq {section[f'b{B}_check_dq']:.2e}",
          flush=True)
    ref_out = ref_dq = qg = kg = vg = None
    # Each kernel alone; the slash-only dK/dV (the plan's transposed lists) as in the slash part.
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    alone = {
        "with_columns": (extend, ()),
        "forward": (fwd_k, fwd_args),
        "delta": (delta_k, (out, dout, delta)),
        "dq": (dq_k, dq_args),
        "dkdv_slash": (dkdv_k, (q, k, v, dout, lse, delta, plan.bwd_idx, plan.bwd_cnt, dk, dv)),
    }
    ms = {name: kernel_alone_ms(fn, fn_args, device, args.reps) for name, (fn, fn_args) in alone.items()}
    section[f"b{B}_tilelang_kernels_ms"] = ms
    ours = kernel_times_ms(forward_and_backward(ours_fn(index, scale)), arg_sets[0])
    section[f"b{B}_ours_kernels_ms"] = {name: t for name, t in ours.items() if t > 0.02}
    pairs = describe_index(index, args.seq_len)["active_pairs"]
    section[f"b{B}_active_pairs"] = pairs
    measure(f"b{B}_ours_full_index", ours_fn(index, scale), arg_sets, 4 * cfg.head_dim * pairs)
    print(f"b{B} full index, TileLang kernels alone (ms):", {name: round(t, 3) for name, t in ms.items()})
    print(f"b{B} full index, ours (ms):", {name[:48]: round(t, 3) for name, t in ours.items() if t > 0.02},
          flush=True)


def sweep(args, cfg, scale, device, result) -> None:
    """Each TileLang kernel alone (slash part), per (num_stages, programs per SM), against our
    kernels' own breakdown of the same fwd+bwd; variants must reproduce the first one's outputs."""
    out = result.setdefault("sweep", {})
    for B in args.block_sizes:
        index, arg_sets = index_and_inputs(Config(seq_lens=[args.seq_len], block_size=B), args.seq_len, device)
        index = slash_only(index)
        plan = tls.make_plan(index, args.seq_len, cfg.kv_heads, columns=False)
        q, k, v, dout = (x.detach() for x in arg_sets[0])
        b, hq, n, d = q.shape
        kernels = tls.compile_kernels(plan, q.shape, k.shape[1], scale, SWEEP[B])
        o, lse = tls.forward_pass(q, k, v, plan, scale, SWEEP[B][0])
        delta = torch.empty_like(lse)
        kernels["delta", ()](o, dout, delta)
        cols = (plan.col_pos, plan.col_tiles, plan.col_limit, plan.slash)
        calls = {"forward": (lambda: (q, k, v, plan.fwd_idx, plan.fwd_cnt, *cols), lambda: (torch.empty_like(q),
                                                                                             torch.empty_like(lse))),
                 "dkdv": (lambda: (q, k, v, dout, lse, delta, plan.bwd_idx, plan.bwd_cnt),
                          lambda: (torch.empty_like(k), torch.empty_like(v))),
                 "dq": (lambda: (q, k, v, dout, lse, delta, plan.fwd_idx, plan.fwd_cnt, *cols),
                        lambda: (torch.empty_like(q),))}
        first = {}
        for (name, variant), kernel in kernels.items():
            if name == "delta":
                continue
            key = f"b{B}_{name}_stages{variant[0]}_programs{variant[1]}"
            inputs, outputs = calls[name]
            dst = outputs()
            ms = attempt(out, key + "_ms", lambda: kernel_alone_ms(kernel, (*inputs(), *dst), device, args.reps))
            if ms is None:
                continue
            if name in first:  # every variant computes the same numbers
                out[key + "_equal"] = all(torch.equal(x, y) for x, y in zip(dst, first[name]))
            else:
                first[name] = dst
            print(f"{key:40s} {ms:.3f} ms", flush=True)
        ours = kernel_times_ms(forward_and_backward(ours_fn(index, scale)), arg_sets[0])
        out[f"b{B}_ours_kernels_ms"] = {name: t for name, t in ours.items() if t > 0.05}
        print(f"b{B} ours:", {name[:60]: round(t, 3) for name, t in ours.items() if t > 0.05}, flush=True)
        if args.out:
            write_json(args.out, result)


def main(argv=None) -> int:
    p = spike_arguments(__doc__.splitlines()[0])
    p.add_argument("--check-len", type=int, default=4096, help="sequence length of the checks against the reference")
    p.add_argument("--parts", default="slash,full", help="slash, full, both, or none (the reference checks only)")
    p.add_argument("--sweep", action="store_true", help="each kernel alone over SWEEP's variants instead")
    args = p.parse_args(argv)
    device, cfg, scale, result = spike_start(args, checks={}, compile_s={},
                                             variants={str(B): BEST[B] for B in args.block_sizes})
    if args.sweep:
        sweep(args, cfg, scale, device, result)
        return 0

    measure = measurer(result, device, args.reps, args.out)
    parts = args.parts.split(",")
    for B in args.block_sizes:
        attempt(result, f"b{B}_reference", lambda: reference_checks(args, B, cfg, scale, device, result))
        if "slash" in parts:
            slash_part(args, B, cfg, scale, device, result, measure)
        if "full" in parts:
            attempt(result, f"b{B}_full", lambda: full_index(args, B, cfg, scale, device, result, measure))
        if args.out:  # after each block size: a call cut short keeps what it measured
            write_json(args.out, result)
    print({k: v for k, v in result.items() if k != "meta"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
