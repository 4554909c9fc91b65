"""sparse_ring_attention: sparse attention over a context-parallel group.

Every rank holds its layout's tokens of q, k, v and the same global index (a vertical-slash
``VSIndex`` or a block-sparse ``BlockIndex``). The K/V chunks go round the ring (flat or
hierarchical, ``schedule.py``); at each step the index is converted for (this rank's blocks, the
source rank's blocks) and the step kernel merges the partial result into fp32 accumulators. The
backward recomputes from the saved lse; dQ stays local, dK/dV travel home with their K/V. The
result equals ``sparse_attention`` on the full sequence.

Per-step fixed costs: the plan of step 0 is built before the ring starts (a conversion error is
raised before any transfer); the others just before their step (``SparseSteps.prepare``), so the
host enqueues them while the GPU runs the previous step. The forward's first step writes the fp32
output rather than merging into zeroed buffers, and so does the backward's first dQ step where dQ
has its own kernel (Triton).

``RingAttentionFunction`` (the autograd around the ring schedules) and the call's agreement items
(``call_items``) are shared with ``dense.py``'s ``dense_ring_attention``.
"""

from __future__ import annotations

import math
from typing import Callable, List, Optional, Union

import torch
import torch.distributed as dist

from ..attention import check_attention_inputs, check_qkv
from ..block_index import BlockIndex, check_index
from ..config import Settings, settings_or_default
from ..documents import Documents
from ..index import VSIndex
from ..kernels.step_plan import build_step_plan
from ..kernels.relayout import copy_into, sequence_major_empty
from ..kernels.dispatch import resolve_backend
from ..kernels.step import backward_delta, step_backward_keys, step_backward_queries, step_forward
from ..layout import check_layout, layout_table, local_block_ids
from ..collective import agreement
from ..collective.agreement import Checksum, host_word
from . import instrument
from .comm import check_inner_size, ring_topology
from .schedule import ring_backward, ring_forward

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _block_ids_on(device, seq_len: int, layout: str, world_size: int, block_size: int):
    """Every rank's global block ids, int32 on ``device`` (the plans' dtype: no cast per step); a
    ``layout_table``, so steady-state calls copy nothing from the host."""
    return layout_table("ring block ids", device, (seq_len, layout, world_size, block_size), lambda: [
        local_block_ids(seq_len, layout, world_size, r, block_size).to(torch.int32) for r in range(world_size)])


def _all_block_ids_on(device, seq_len: int, layout: str, world_size: int, block_size: int):
    """Every rank's block ids one after the other (rank r's at slot r), a ``layout_table`` too."""
    return layout_table("ring block ids, all ranks", device, (seq_len, layout, world_size, block_size),
                        lambda: torch.cat(_block_ids_on(device, seq_len, layout, world_size, block_size)))


def _device_of(q) -> torch.device:
    """q's device; the CPU for a q so malformed that it is not a tensor (its error is raised anyway)."""
    return q.device if isinstance(q, torch.Tensor) else torch.device("cpu")


def cp_group_of(group):
    """``(group, size)``: the CP group (None when there is no process group or one rank)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None, 1
    group = group if group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    return (group if world > 1 else None), world


def call_items(function: str, q, k, v, layout: str, inner_size, softmax_scale,
               index: Union[VSIndex, BlockIndex, None], documents: Optional[Documents]):
    """The agreement items of a ring call (``agreement.agree``): everything that changes the math."""
    dtype = _DTYPES.index(q.dtype) if q.dtype in _DTYPES else host_word(str(q.dtype))
    items = [("function", host_word(function), function),
             ("q shape", host_word(tuple(q.shape)), tuple(q.shape)),
             ("k shape", host_word(tuple(k.shape)), tuple(k.shape)),
             ("v shape", host_word(tuple(v.shape)), tuple(v.shape)),
             ("dtype", dtype, q.dtype),
             ("layout", host_word(layout), layout),
             ("inner_size", host_word(inner_size), inner_size),
             ("softmax scale", host_word(float(softmax_scale)), softmax_scale),
             ("cu_seqlens given", documents is not None, documents is not None)]
    # A fixed list of items (zeros for what a call does not have), so every rank names them alike.
    given = documents is not None
    cu_seqlens = documents.cu_seqlens if given else None
    items += [("cu_seqlens length", int(cu_seqlens.numel()) if given else 0, int(cu_seqlens.numel()) if given else 0),
              ("cu_seqlens values", Checksum(cu_seqlens) if given else 0, "on the device" if given else None)]
    names = ["block size", "index batch and heads", "slash capacity", "vertical capacity", "slash counts (n_slash)",
             "slash offsets", "vertical counts (n_vertical)", "vertical columns"]
    if index is None:
        items += [(name, 0, None) for name in names]
    elif isinstance(index, BlockIndex):  # the same eight slots; the kind is hashed into the second
        shape = ("block index",) + tuple(index.key_blocks.shape[:3])
        items += [("block size", int(index.block_size), index.block_size),
                  ("index kind, batch, heads and query blocks", host_word(shape), shape),
                  ("key-block capacity", int(index.capacity), index.capacity),
                  ("unused", 0, None),
                  ("key-block counts (n_key_blocks)", Checksum(index.n_key_blocks), "on the device"),
                  ("key blocks", Checksum(index.key_blocks, index.n_key_blocks), "on the device"),
                  ("unused", 0, None), ("unused", 0, None)]
    else:
        items += [("block size", int(index.block_size), index.block_size),
                  ("index batch and heads", host_word(tuple(index.slash.shape[:2])), tuple(index.slash.shape[:2])),
                  ("slash capacity", int(index.slash.shape[-1]), index.slash.shape[-1]),
                  ("vertical capacity", int(index.vertical.shape[-1]), index.vertical.shape[-1]),
                  ("slash counts (n_slash)", Checksum(index.n_slash), "on the device"),
                  ("slash offsets", Checksum(index.slash, index.n_slash), "on the device"),
                  ("vertical counts (n_vertical)", Checksum(index.n_vertical), "on the device"),
                  ("vertical columns", Checksum(index.vertical, index.n_vertical), "on the device")]
    return items


class SparseSteps:
    """Ring steps of sparse attention: one converted index (plan) per source rank, built by
    ``build_plan(source)`` on first use (``prepare``) and kept for the backward."""

    def __init__(self, build_plan: Callable, world_size: int, softmax_scale: float, backend: str,
                 build_query_plan: Optional[Callable] = None, settings: Settings = Settings()):
        self._build_plan = build_plan
        self._build_query_plan = build_query_plan  # this rank's queries against every source's keys
        self.plans: List = [None] * world_size
        self.softmax_scale, self.backend, self.settings = softmax_scale, backend, settings

    def prepare(self, source: int) -> None:
        if self.plans[source] is None:
            self.plans[source] = self._build_plan(source)

    def plan(self, source: int):
        self.prepare(source)
        return self.plans[source]

    # The forward's first step writes ``out``/``lse`` instead of merging into them: no memset of the
    # fp32 buffers, no read of them in that step (the merge into "nothing yet", lse -inf, gives the
    # step's own values exactly).
    first_step_writes = True

    @property
    def first_dq_step_writes(self) -> bool:
        """The backward's first dQ step writes ``dq`` instead of adding into it (as the forward's
        first step). Not on the PyTorch path, whose dQ comes with the key side (``step_backward_keys``,
        adding into a zeroed buffer)."""
        return self.backend != "torch"

    def forward(self, q, k, v, source, out, lse, accumulate: bool = True):
        step_forward(self.backend, q, k, v, self.plan(source), out, lse, self.softmax_scale, accumulate=accumulate,
                     settings=self.settings)

    def delta(self, out, d_out):
        return backward_delta(self.backend, out, d_out)

    def backward_queries(self, q, k, v, d_out, out, lse, delta, source, dq, accumulate_dq: bool = True):
        step_backward_queries(self.backend, q, k, v, d_out, lse, delta, self.plan(source), dq, self.softmax_scale,
                              accumulate_dq=accumulate_dq, settings=self.settings)

    def backward_keys(self, q, k, v, d_out, out, lse, delta, source, dq, dk, dv):
        step_backward_keys(self.backend, q, k, v, d_out, lse, delta, self.plan(source), dq, dk, dv,
                           self.softmax_scale, settings=self.settings)

    def dq_in_one_pass(self, q, k) -> bool:
        """Whether the backward keeps every source's K/V and computes dQ once, after the ring, in
        q's dtype (``backward_all_queries``), instead of adding each step's into an fp32 buffer:
        no read-modify-write of that buffer per step and no cast at the end, one launch instead of
        W. Where the whole sequence's K/V take no more memory than the fp32 dQ buffer they replace
        (2 x W x kv heads x itemsize <= 4 x query heads: W <= the GQA group for bf16), on the
        Triton kernels (the PyTorch path computes dQ with the key side)."""
        world = len(self.plans)
        return (self.backend == "triton" and world > 1 and self._build_query_plan is not None
                and 2 * world * k.shape[1] * k.element_size() <= 4 * q.shape[1])

    def backward_all_queries(self, q, k_all, v_all, d_out, lse, delta, dq):
        """dQ of this rank's queries against ``k_all``/``v_all`` (every source's K/V, source s at
        slot s), written in ``dq``'s dtype."""
        step_backward_queries(self.backend, q, k_all, v_all, d_out, lse, delta, self._build_query_plan(), dq,
                              self.softmax_scale, accumulate_dq=False, settings=self.settings)


class RingAttentionFunction(torch.autograd.Function):
    """Autograd around the ring schedules for any ``steps`` object (sparse or dense). Steps with
    ``first_step_writes`` (the forward) or ``first_dq_step_writes`` (the backward's dQ) take
    ``accumulate``/``accumulate_dq`` and get uninitialised fp32 buffers that their first step
    writes in full. ``sequence_major_grads``: the gradients of q, k, v are
    ``[b, h, s, d]`` views of ``[s, b, h, d]`` memory (``relayout.sequence_major_empty``), written
    there by the last kernel or cast that touches them."""

    @staticmethod
    def forward(ctx, q, k, v, topo, steps, verdict=None, sequence_major_grads=False):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        b, hq, n, d = q.shape
        writes = getattr(steps, "first_step_writes", False)
        if writes:
            out = torch.empty(b, hq, n, d, dtype=torch.float32, device=q.device)
            lse = torch.empty((b, hq, n), dtype=torch.float32, device=q.device)
        else:
            out = torch.zeros(b, hq, n, d, dtype=torch.float32, device=q.device)
            lse = torch.full((b, hq, n), float("-inf"), dtype=torch.float32, device=q.device)
        done = [0]  # steps run so far

        def step(k_src, v_src, source):
            if writes:
                steps.forward(q, k_src, v_src, source, out, lse, accumulate=done[0] > 0)
            else:
                steps.forward(q, k_src, v_src, source, out, lse)
            done[0] += 1

        prepare = getattr(steps, "prepare", None)
        with torch.profiler.record_function("mtraining::ring forward"):  # a range in profiler traces
            ring_forward(topo, (k, v), lambda kv, source: step(kv[0], kv[1], source), prepare)
        # Deferred agreement: NaN if the ranks disagreed; the backward raises the verdict's error.
        out = agreement.poison(out, None if verdict is None else verdict.bad, q.dtype)
        ctx.verdict_group = None if verdict is None else verdict.group
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.topo, ctx.steps, ctx.sequence_major_grads = topo, steps, sequence_major_grads
        return out

    @staticmethod
    def backward(ctx, d_out):
        if ctx.verdict_group is not None:  # this call's or an earlier one's over its group (never waits)
            agreement.check_deferred(ctx.verdict_group)
        q, k, v, out, lse = ctx.saved_tensors
        d_out = d_out.contiguous()
        delta = ctx.steps.delta(out, d_out)
        writes = getattr(ctx.steps, "first_dq_step_writes", False)
        one_pass = getattr(ctx.steps, "dq_in_one_pass", None)
        one_pass = one_pass is not None and one_pass(q, k)

        def gradient_like(x):  # in x's dtype; in [s, b, h, d] memory order where the caller asked
            return sequence_major_empty(x.shape, x.dtype, x.device) if ctx.sequence_major_grads else torch.empty_like(x)

        def keys(kv, source):  # fresh sums: the schedule adds the ones that arrived
            dk = torch.zeros(kv[0].shape, dtype=torch.float32, device=q.device)
            dv = torch.zeros(kv[1].shape, dtype=torch.float32, device=q.device)
            ctx.steps.backward_keys(q, kv[0], kv[1], d_out, out, lse, delta, source, dq, dk, dv)
            return dk, dv

        done = [0]  # steps whose queries part has run
        if one_pass:  # keep every source's K/V; after the last step's sums left, dQ over them all
            W, (b, hkv, n, d) = ctx.topo.world_size, k.shape
            k_all, v_all = k.new_empty(b, hkv, W, n, d), v.new_empty(b, hkv, W, n, d)
            dq = gradient_like(q)  # written once, in q's dtype

            def queries(kv, source):
                copy_into(kv[0], k_all[:, :, source])  # the row copy: PyTorch's strided copy is ~2.5x slower
                copy_into(kv[1], v_all[:, :, source])
                done[0] += 1
                if done[0] == W:  # (its time is every step's dQ: the step timer shares it among them)
                    with instrument.measure("backward", instrument.SPREAD, W - 1):
                        ctx.steps.backward_all_queries(q, k_all.view(b, hkv, W * n, d), v_all.view(b, hkv, W * n, d),
                                                       d_out, lse, delta, dq)
        else:
            dq = (torch.empty if writes else torch.zeros)(q.shape, dtype=torch.float32, device=q.device)

            def queries(kv, source):  # after the step's sums were sent on: their transfer hides behind it
                ctx.steps.backward_queries(q, kv[0], kv[1], d_out, out, lse, delta, source, dq,
                                           accumulate_dq=not writes or done[0] > 0)
                done[0] += 1

        with torch.profiler.record_function("mtraining::ring backward"):
            dk, dv = ring_backward(ctx.topo, (k, v), keys, home_dtype=k.dtype, queries=queries)
        if not one_pass and (dq.dtype != q.dtype or ctx.sequence_major_grads):
            dq = copy_into(dq, gradient_like(q))  # the fp32 sums cast
        if ctx.sequence_major_grads:
            dk, dv = copy_into(dk, gradient_like(k)), copy_into(dv, gradient_like(v))
        return dq, dk, dv, None, None, None, None


def sparse_ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: Union[VSIndex, BlockIndex],
                          group=None, layout: str = "striped", inner_size: Optional[int] = None,
                          softmax_scale: Optional[float] = None, backend: str = "auto",
                          cu_seqlens: Union[Documents, torch.Tensor, None] = None,
                          sequence_major_grads: bool = False, settings: Optional[Settings] = None) -> torch.Tensor:
    """Sparse attention across the context-parallel ``group`` (docs/design.md §3-4).

    q ``[b, hq, n_local, d]`` and k/v ``[b, hkv, n_local, d]`` hold this rank's tokens in the
    ``layout``'s local order ("striped" or "zigzag"); ``index`` is the same global ``VSIndex``
    or ``BlockIndex`` (built for the global length) on every rank. ``inner_size`` (ranks per
    node, dividing the group size) selects the hierarchical ring; None runs one flat ring.
    Returns this rank's output ``[b, hq, n_local, d]`` in q's dtype, equal to
    ``sparse_attention`` on the full sequence at these positions.
    ``cu_seqlens``: packed documents of the GLOBAL sequence, the same on every rank: a
    ``documents.Documents`` (built once per batch, its values checked there) or its int32 tensor
    ``[0, e1, ..., N]`` (its values checked where that is free, as in ``sparse_attention``). Key
    blocks of earlier documents are skipped in every step. ``sequence_major_grads``: the
    gradients of q, k, v come back as ``[b, h, s, d]`` views of ``[s, b, h, d]`` memory, for a
    caller whose tensors were ``[s, b, h, d]`` (Megatron): its permute back is then contiguous.
    ``settings``: how it runs (``config.Settings``: kernels, agreement, transfer timeout, value
    checks); None: the environment's (``config.environment_settings``, read at start-up).

    On every call the ranks agree on everything that changes the math (shapes, dtype, layout,
    block size, inner_size, softmax scale, the index contents, cu_seqlens' presence and values)
    before any transfer: one all-reduce of a few int64 words (``agreement.py``). A rank whose
    own checks fail tells its peers there, so every rank raises (that rank its own error, the others
    ``RingAgreementError``). On GPUs with NCCL the verdict is read without a host
    synchronisation (deferred: NaN output, then the error at the next call or the backward).
    """
    settings = settings_or_default(settings, "sparse_ring_attention")
    cp_group, world = cp_group_of(group)
    if cp_group is not None:
        agreement.check_deferred(cp_group)
    with agreement.OwnChecks(cp_group, settings) as checks:  # on failure the peers are told in the agreement below
        if cp_group is not None:
            check_inner_size(inner_size, world)
        backend = resolve_backend(backend, q.device)
        check_qkv(q, k, v, backend)
        if not isinstance(index, (VSIndex, BlockIndex)):
            raise ValueError(f"index must be a VSIndex or a BlockIndex, got {type(index).__name__}")
        seq_len = q.shape[2] * world
        check_layout(seq_len, layout, world, index.block_size)  # names the global length
        check_attention_inputs(q, k, v, index, backend)
        check_index(index, seq_len, settings.validate)  # values: the CPU always; a GPU with validate (synchronises)
        # No collective here: the agreement below compares the ranks' documents.
        documents = Documents.of(cu_seqlens, seq_len, validate=settings.validate)
        if softmax_scale is None:
            softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    verdict = checks.agree("sparse_ring_attention", lambda: call_items(
        "sparse_ring_attention", q, k, v, layout, world if inner_size is None else inner_size, softmax_scale, index,
        documents), _device_of(q))
    # After the agreement: the same rings.
    topo = ring_topology(group, inner_size, settings.ring_timeout_s, settings.ring_arrival_hook)
    B, nb = index.block_size, seq_len // index.block_size
    blocks = _block_ids_on(q.device, seq_len, layout, topo.world_size, B)
    bitmap = index.slash_bitmap(nb)
    tables = None if documents is None else documents.blocks(B, q.device)

    def build_plan(source: int):
        return build_step_plan(index, blocks[topo.rank], blocks[source], nb, slash_bitmap=bitmap, documents=tables)

    def build_query_plan():  # every source's keys, source s's blocks at slot s (the backward's dQ in one pass)
        return build_step_plan(index, blocks[topo.rank], _all_block_ids_on(q.device, seq_len, layout, topo.world_size, B),
                               nb, slash_bitmap=bitmap, documents=tables)

    steps = SparseSteps(build_plan, topo.world_size, float(softmax_scale), backend, build_query_plan, settings)
    with instrument.measure("forward", "plan", 0):  # step 0's (own K/V): an error comes before any transfer
        steps.prepare(topo.rank)
    return RingAttentionFunction.apply(q, k, v, topo, steps, verdict, sequence_major_grads)
