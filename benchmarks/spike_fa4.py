"""Issue 17 spike: FlashAttention-4's Hopper kernels (CuTe DSL, ``flash_attn.cute``, PyPI
``flash-attn-4``) on our problem's slash part, against our kernels on the same pairs, one call.

The slash part of the canonical index at B = 128 (fixed 5% index, columns dropped) is exactly a
block-sparse mask on the 128 x 128 block grid: per query block, the key blocks ``q - o`` for the
head's offsets ``o``. FA4 takes it as block lists: the diagonal block as a "mask" block (with a
causal ``mask_mod``) and every other listed block as a "full" one; its backward takes the same
mask transposed (per key block, its query blocks). Measured, each on the same inputs:

  ours     ``sparse_attention`` on the slash-only index (the default kernels at B = 128)
  fa4      FA4's forward and backward on the same block lists (deterministic=False and True)
  fa4_dense / cudnn_dense   dense causal, to place FA4's per-pair rate on this GPU

Rates are on active pairs (4d FLOPs per pair forward, x3.5 forward+backward, as kernel.py).
The column part (gathered key columns) has no FA4 form on sm_90 and is left out of every run.

    python benchmarks/spike_fa4.py [--seq-len 131072] [--out results/spike_fa4_<device>.json]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from common import describe_index, relative_l2, write_json  # noqa: E402
from kernel import Config, dense_attention, expand_kv, forward_and_backward, index_and_inputs, pick_dense  # noqa: E402
from megatron_mtraining import sparse_attention  # noqa: E402
from megatron_mtraining.index import VSIndex  # noqa: E402
from spike_common import attempt, measurer, slash_only, spike_arguments, spike_start  # noqa: E402


def block_lists(index: VSIndex, seq_len: int):
    """FA4's block-sparse tensors of the slash mask: (forward, backward), each a
    BlockSparseTensorsTorch of (mask = the diagonal block, full = every other listed block),
    lists in ascending block order (as FlexAttention's BlockMask gives them); the backward's with
    the dQ write order its deterministic mode needs (the rank of each key block among a query
    block's contributors, descending like its causal schedule: spt)."""
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch, compute_dq_write_order

    B = index.block_size
    nb = seq_len // B
    q_blk = torch.arange(nb, device=index.slash.device)
    offset = q_blk[:, None] - q_blk[None, :]  # [q block, k block]
    selected = index.slash_bitmap(nb).bool()  # [b, h, offset]
    active = selected[:, :, offset.clamp(min=0)] & (offset >= 0)  # [b, h, q block, k block]
    diagonal = torch.eye(nb, dtype=torch.bool, device=active.device).expand_as(active)
    full = active & ~diagonal
    masked = active & diagonal

    def lists(mask):
        count = mask.sum(-1, dtype=torch.int32)
        order = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return count.contiguous(), order.contiguous()

    (mc, mi), (fc, fi) = lists(masked), lists(full)
    (tmc, tmi), (tfc, tfi) = lists(masked.transpose(-1, -2)), lists(full.transpose(-1, -2))
    order, order_full = compute_dq_write_order(mc, mi, fc, fi, tmc, tmi, tfc, tfi, spt=True)
    forward = BlockSparseTensorsTorch(mask_block_cnt=mc, mask_block_idx=mi, full_block_cnt=fc, full_block_idx=fi,
                                      block_size=(B, B))
    backward = BlockSparseTensorsTorch(mask_block_cnt=tmc, mask_block_idx=tmi, full_block_cnt=tfc, full_block_idx=tfi,
                                       block_size=(B, B), dq_write_order=order, dq_write_order_full=order_full,
                                       spt=True)
    return forward, backward


def causal_mask_mod():
    """FA4's mask_mod for the diagonal block: key position <= query position (same length)."""
    import cutlass.cute as cute

    @cute.jit
    def keys_not_after_query(batch, head, m_idx, n_idx, seqlen_info, aux_tensors):
        return n_idx <= m_idx

    return keys_not_after_query


def main(argv=None) -> int:
    p = spike_arguments(__doc__.splitlines()[0])
    p.add_argument("--check-len", type=int, default=16384, help="sequence length of the correctness check")
    p.add_argument("--skip-dense", action="store_true")
    args = p.parse_args(argv)
    device, cfg, scale, result = spike_start(args, checks={})

    from flash_attn.cute.interface import flash_attn_func

    mask_mod = causal_mask_mod()

    def ours_fn(index):
        return lambda q, k, v: sparse_attention(q, k, v, index, scale)

    # FA4 takes [b, n, h, d]: its runs get inputs of that layout (made once, outside the timing).
    def fa4_fn(tensors, deterministic):
        fwd, bwd = tensors

        def attn(q, k, v):
            out = flash_attn_func(q, k, v, softmax_scale=scale, mask_mod=mask_mod, block_sparse_tensors=fwd,
                                  block_sparse_tensors_bwd=bwd, deterministic=deterministic, pack_gqa=False)
            return out[0] if isinstance(out, tuple) else out
        return attn

    def fa4_dense(q, k, v):
        out = flash_attn_func(q, k, v, softmax_scale=scale, causal=True)
        return out[0] if isinstance(out, tuple) else out

    def fa4_layout(sets):
        return [tuple(x.detach().transpose(1, 2).contiguous().requires_grad_(x.requires_grad) for x in s)
                for s in sets]

    measure = measurer(result, device, args.reps, args.out)

    for B in args.block_sizes:
        # Correctness on a short sequence first: FA4 against ours on the same slash-only index.
        c_index, c_sets = index_and_inputs(Config(seq_lens=[args.check_len], block_size=B), args.check_len, device)
        c_index = slash_only(c_index)
        q, k, v, dout = c_sets[0]
        ref_out = ours_fn(c_index)(q, k, v)
        ref = forward_and_backward(ours_fn(c_index))(q, k, v, dout)
        fq, fk, fv, fdout = fa4_layout(c_sets[:1])[0]
        c_lists = attempt(result["checks"], f"b{B}_lists", lambda: block_lists(c_index, args.check_len))
        result["checks"].pop(f"b{B}_lists", None)
        for det in ((False, True) if c_lists is not None else ()):
            tag = f"b{B}_{'det' if det else 'nondet'}"
            attn = fa4_fn(c_lists, det)
            attempt(result["checks"], f"{tag}_out",
                    lambda: relative_l2(attn(fq, fk, fv).transpose(1, 2), ref_out))
            got = attempt(result["checks"], f"{tag}_grads", lambda: forward_and_backward(attn)(fq, fk, fv, fdout))
            if got is not None:
                result["checks"].pop(f"{tag}_grads")
                for name, g, r in zip(("dq", "dk", "dv"), got, ref):
                    result["checks"][f"{tag}_{name}"] = relative_l2(g.transpose(1, 2), r)
        print("checks (rel L2, FA4 against ours):", result["checks"], flush=True)

        full_index, arg_sets = index_and_inputs(Config(seq_lens=[args.seq_len], block_size=B), args.seq_len, device)
        index = slash_only(full_index)
        pairs = describe_index(index, args.seq_len)["active_pairs"]
        result[f"b{B}_active_pairs"] = pairs
        flops = 4 * cfg.head_dim * pairs
        measure(f"b{B}_ours", ours_fn(index), arg_sets, flops)
        # The whole index (columns too) for the projection "FA4's slash part + our column part".
        full_pairs = describe_index(full_index, args.seq_len)["active_pairs"]
        result[f"b{B}_full_active_pairs"] = full_pairs
        measure(f"b{B}_ours_full_index", ours_fn(full_index), arg_sets, 4 * cfg.head_dim * full_pairs)
        tensors = attempt(result, f"b{B}_lists", lambda: block_lists(index, args.seq_len))
        if tensors is not None:
            result.pop(f"b{B}_lists")
            fa4_sets = fa4_layout(arg_sets)
            for det in (False, True):
                measure(f"b{B}_fa4{'_deterministic' if det else ''}", fa4_fn(tensors, det), fa4_sets, flops)
            del fa4_sets
        ms = result["ms"]
        for det in ("", "_deterministic"):
            for kind in ("fwd", "fwdbwd"):
                ours, fa4 = ms.get(f"b{B}_ours_{kind}"), ms.get(f"b{B}_fa4{det}_{kind}")
                full = ms.get(f"b{B}_ours_full_index_{kind}")
                if ours and fa4:
                    result.setdefault("ours_over_fa4", {})[f"b{B}{det}_{kind}"] = ours / fa4
                if ours and fa4 and full:  # our column part's cost, added to FA4's slash part
                    result.setdefault("projection_fa4_slash_plus_our_columns_ms", {})[f"b{B}{det}_{kind}"] = (
                        fa4 + full - ours)

    if not args.skip_dense:
        _, arg_sets = index_and_inputs(cfg, args.seq_len, device)
        dense_flops = 2 * args.seq_len ** 2 * cfg.head_dim * cfg.heads * cfg.batch
        measure("fa4_dense", fa4_dense, fa4_layout(arg_sets), dense_flops)
        name, backend, gqa, _ = pick_dense(cfg, device)
        if name is not None:
            sets = arg_sets if gqa else expand_kv(arg_sets, cfg.heads // cfg.kv_heads)
            measure("cudnn_dense", dense_attention(backend, gqa), sets, dense_flops)
    print({k: v for k, v in result.items() if k != "meta"})
    if args.out:
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
