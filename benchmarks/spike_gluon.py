"""Spike M10 (issue 17): the slash-only forward as an explicit Hopper kernel in Gluon.

benchmarks/spike_hopper_kernels.md section 7 (M10) and NOTES.md (session 10, M1): our forward is not
bound by moving K/V (the tiles stream in 0.51-0.68 of its time), so what is left is the overlap of
QK^T, softmax and PV that Triton's compiler does not give one 4-warp program. Gluon (Triton 3.6's
layout-explicit dialect) lets the kernel say it:

  * K/V tiles arrive by TMA into a ring of STAGES shared-memory slots, one mbarrier per slot;
  * per key tile t, the kernel issues S_t = Q K_t^T and then O += P_{t-1} V_{t-1} as asynchronous
    wgmma groups, waits for the scores only (``warpgroup_mma_wait(1)``), and runs tile t's softmax
    on the warpgroup while the tensor cores run tile t-1's PV product (FA3's intra-warpgroup
    pipelining); the output is rescaled once that product retires. No instruction reads an
    in-flight accumulator, so ptxas keeps the wgmma groups asynchronous (an earlier schedule,
    S_{t+1} in flight over softmax(t) in the same registers, was serialised: ptxas C7514);
  * P goes from the score accumulator's registers to the PV product's A operand in registers;
  * a slot is refilled once the PV product that read it has retired (tile t-1's, at iteration t):
    STAGES >= 2, and each extra slot gives the copy one more iteration.

The function is the spike's problem (spike_autows.py): the `fixed` index with its columns
emptied, one program per (query block, batch x query head), every tile through the causal
``where`` (only the diagonal tile, listed last, is actually masked), out and natural-log lse like
production. Gluon has no CPU interpreter: the CPU checks are a cross-compile for sm_90a
(``--compile-sm90``: does it compile, how much shared memory, wgmma in the PTX); the GPU run checks
every variant against the fp32 reference and production's kernel (spike_autows's harness) and
times them at 128K beside production:

    python benchmarks/spike_gluon.py --out $OUT/spike_gluon_nvidia-h200.json   # GPU (H200)
    python benchmarks/spike_gluon.py --compile-sm90 [--out compile.json]        # CPU
"""

from __future__ import annotations

import os
import sys
from typing import Dict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import spike_autows as harness  # noqa: E402  (sets TRITON_INTERPRET on a GPU-less run; --compile-sm90 keeps it off)
import triton  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,  # noqa: E402
                                                              warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402

from megatron_mtraining.kernels.triton_fwd import LOG2E  # noqa: E402


@gluon.jit
def _fold_scores(s, q_pos, k_first, m_i, l_i, qk_scale, BLOCK: gl.constexpr, col_layout: gl.constexpr):
    """Online softmax of one score tile (raw q.k, fp32), base 2: (p, alpha, m, l). Every tile of a
    slash list holds a key for every row (the diagonal one the query itself), so m is finite from
    the first tile on."""
    k_pos = k_first + gl.arange(0, BLOCK, layout=col_layout)
    s = gl.where(k_pos[None, :] <= q_pos[:, None], s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    p = gl.exp2(s * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def _load_tile(k_desc, v_desc, k_smem, v_smem, ready, slot, row, pred):
    """K and V of one key block into ``slot``, completing on ``ready[slot]``."""
    bar = ready.index(slot)
    mbarrier.expect(bar, 2 * k_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(k_desc, [row, 0], bar, k_smem.index(slot), pred=pred)
    tma.async_copy_global_to_shared(v_desc, [row, 0], bar, v_smem.index(slot), pred=pred)


@gluon.jit
def _slash_fwd_gluon_kernel(q_desc, k_desc, v_desc, o_desc, Lse, KVCnt, KVIdx, HQ, GROUP, N, NQB, MAX_S, qk_scale,
                            HEAD_DIM: gl.constexpr, BLOCK: gl.constexpr, STAGES: gl.constexpr):
    gl.static_assert(STAGES >= 2, "a slot is refilled once its PV product retires: 2 slots or more")
    pid_m = gl.program_id(0)
    pid_bh = gl.program_id(1)
    b = pid_bh // HQ
    h = pid_bh % HQ
    kv_row0 = (b * (HQ // GROUP) + h // GROUP) * N  # Q/O are [b*hq*N, d], K/V [b*hkv*N, d]
    q_row = pid_bh * N + pid_m * BLOCK

    # One warpgroup: the m64 wgmma atom over 4 warps, scores [BLOCK, BLOCK], output [BLOCK, HEAD_DIM].
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    cols_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK, HEAD_DIM], v_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    mbarrier.init(q_bar, count=1)

    plan_row = pid_bh * NQB + pid_m
    n_tiles = gl.load(KVCnt + plan_row)
    blocks = KVIdx + plan_row * MAX_S
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, 0], q_bar, q_smem)
    for i in gl.static_range(STAGES):  # every slot starts filling at once
        j = gl.load(blocks + i, mask=i < n_tiles, other=0)
        _load_tile(k_desc, v_desc, k_smem, v_smem, ready, i, kv_row0 + j * BLOCK, i < n_tiles)

    q_pos = pid_m * BLOCK + gl.arange(0, BLOCK, layout=rows_s)
    m_i = gl.full([BLOCK], float("-inf"), gl.float32, layout=rows_s)
    l_i = gl.zeros([BLOCK], gl.float32, layout=rows_s)

    # Tile 0's scores and softmax (alpha is 0 there: the empty accumulator stays 0).
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(ready.index(0), 0)
    s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), gl.zeros([BLOCK, BLOCK], gl.float32, layout=s_layout),
                      use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    p, alpha, m_i, l_i = _fold_scores(s, q_pos, gl.load(blocks) * BLOCK, m_i, l_i, qk_scale, BLOCK, cols_s)
    p_op = gl.convert_layout(p.to(q_desc.dtype), p_layout)
    acc = gl.zeros([BLOCK, HEAD_DIM], gl.float32, layout=o_layout)
    for t in range(1, n_tiles):
        slot = t % STAGES
        prev = (t - 1) % STAGES
        mbarrier.wait(ready.index(slot), (t // STAGES) & 1)
        # Tile t's scores, then tile t-1's PV product, both in flight.
        s = warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)),
                          gl.zeros([BLOCK, BLOCK], gl.float32, layout=s_layout), use_acc=False, is_async=True)
        acc = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))  # the scores (issued first) only
        # Tile t's softmax on this warpgroup while the tensor cores run tile t-1's PV product.
        p, alpha, m_i, l_i = _fold_scores(s, q_pos, gl.load(blocks + t) * BLOCK, m_i, l_i, qk_scale, BLOCK, cols_s)
        p_op = gl.convert_layout(p.to(q_desc.dtype), p_layout)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        acc = acc * gl.convert_layout(alpha, rows_o)[:, None]
        # Tile t-1's K and V are read: its slot takes tile t-1+STAGES.
        refill = t - 1 + STAGES
        j_refill = gl.load(blocks + refill, mask=refill < n_tiles, other=0)
        _load_tile(k_desc, v_desc, k_smem, v_smem, ready, prev, kv_row0 + j_refill * BLOCK, refill < n_tiles)
    acc = warpgroup_mma(p_op, v_smem.index((n_tiles - 1) % STAGES), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
    mbarrier.invalidate(q_bar)

    out = acc / gl.convert_layout(l_i, rows_o)[:, None]
    q_smem.store(out.to(q_desc.dtype))  # Q is no longer read: its slot stages the output
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [q_row, 0], q_smem)
    gl.store(Lse + pid_bh * N + q_pos, (m_i + gl.log2(l_i)) * 0.6931471805599453)
    tma.store_wait(pendings=0)


def tile_layout(block: int, head_dim: int):
    return gl.NVMMASharedLayout.get_default_for([block, head_dim], gl.bfloat16)


def launch_gluon(var: "harness.Variant", q, k, v, plan, out, lse, scale):
    """The Gluon kernel on contiguous [b, h, n, d] bf16 tensors (as the harness makes them)."""
    b, hq, n, d = q.shape
    hkv, B = k.shape[1], plan.block_size
    layout = tile_layout(B, d)
    descs = [TensorDescriptor.from_tensor(x.view(-1, d), [B, d], layout) for x in (q, k, v, out)]
    return _slash_fwd_gluon_kernel[(n // B, b * hq)](
        *descs, lse, plan.kv_count, plan.kv_blocks, hq, hq // hkv, n, n // B, plan.kv_blocks.shape[-1],
        scale * LOG2E, HEAD_DIM=d, BLOCK=B, STAGES=var.num_stages, num_warps=var.num_warps)


GLUON_VARIANTS: Dict[str, "harness.Variant"] = {
    "g_s2": harness.Variant("Gluon: TMA ring of 2, async wgmma, softmax(t) over PV(t-1) (80 KB)", num_stages=2,
                            kernel="gluon"),
    "g_s3": harness.Variant("Gluon: as g_s2 with a ring of 3 (112 KB: still two programs per SM)", num_stages=3,
                            kernel="gluon"),
}


def compile_sm90(names, head_dim: int = 128, block: int = 64) -> Dict:
    """Cross-compile the Gluon variants for sm_90a (no GPU): shared memory, and whether the PTX
    holds wgmma and TMA (cp.async.bulk.tensor) instructions."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    desc = f"tensordesc<bf16[{block},{head_dim}],{tile_layout(block, head_dim)!r}>"
    sig = {"q_desc": desc, "k_desc": desc, "v_desc": desc, "o_desc": desc, "Lse": "*fp32", "KVCnt": "*i32",
           "KVIdx": "*i32", **{p: "i32" for p in ("HQ", "GROUP", "N", "NQB", "MAX_S")}, "qk_scale": "fp32",
           **{p: "constexpr" for p in ("HEAD_DIM", "BLOCK", "STAGES")}}
    out: Dict = {}
    for name in names:
        var = GLUON_VARIANTS[name]
        entry = out[name] = {}
        src = GluonASTSource(_slash_fwd_gluon_kernel, sig,
                             {"HEAD_DIM": head_dim, "BLOCK": block, "STAGES": var.num_stages})
        kernel = harness.attempt(entry, "compile", lambda: triton.compile(
            src, target=GPUTarget("cuda", 90, 32), options={"num_warps": var.num_warps}))
        if kernel is not None:
            ptx = kernel.asm["ptx"]
            entry.update(shared_bytes=kernel.metadata.shared, num_warps=kernel.metadata.num_warps,
                         wgmma=ptx.count("wgmma.mma_async"), tma_loads=ptx.count("cp.async.bulk.tensor"),
                         local_memory_in_ttgir="ttg.local_alloc" in kernel.asm["ttgir"])
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    harness.register_variants(GLUON_VARIANTS, launch_gluon)
    if "--compile-sm90" in argv:
        compiled = compile_sm90(list(GLUON_VARIANTS))
        for name, e in compiled.items():
            print(f"sm_90a {name}: {e}")
        if "--out" in argv:
            harness.write_json(argv[argv.index("--out") + 1], {"benchmark": "spike_gluon_compile_sm90",
                                                               "triton": triton.__version__, "variants": compiled})
        return 0 if all("errors" not in e for e in compiled.values()) else 1
    if not ("--variants" in argv or any(a.startswith("--variants=") for a in argv)):
        argv = [*argv, "--variants", ",".join(["a", *GLUON_VARIANTS])]
    if not ("--out" in argv or any(a.startswith("--out=") for a in argv)):
        argv = [*argv, "--out", os.path.join(harness.RESULTS_DIR, "spike_gluon_local.json")]
    return harness.main(argv)


if __name__ == "__main__":
    sys.exit(main())
