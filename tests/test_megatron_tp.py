"""Tensor parallelism with context parallelism: a megatron-core GPTModel at TP = 2 x CP = 2 (gloo, CPU).

Megatron splits the attention heads over the TP ranks (each holds ``num_attention_heads / TP``
query heads and ``num_query_groups / TP`` key/value heads) and, with ``--sequence-parallel``,
the sequence of the layers around attention; the CP ring runs within each TP rank's group of CP
ranks (CP groups are strided by TP in Megatron's rank order). MTraining's attention and its
index approximator must see only the rank's own heads and ring over the CP group only.

The references run at TP = 2 and CP = 1 with the same seed, so each TP rank builds the same
weight shards in both runs (``use_cpu_initialization`` draws the full weight and keeps the rank's
slice):
* dense index: megatron-core's own attention (``DotProductAttention`` with its causal mask);
* ``vs`` index: the plugin at CP = 1 (the approximator at CP = 2 equals the single-process one).
Logits (gathered over the vocabulary), loss and every gradient (per TP rank, summed over the CP
ranks) must agree, with and without sequence parallelism, in both layouts.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

pytest.importorskip("megatron.core")

from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from megatron_mtraining import MTrainingConfig  # noqa: E402
from megatron_mtraining.integration import patches  # noqa: E402
from megatron_mtraining.testing.cpu_shims import apply_cpu_shims  # noqa: E402
from megatron_mtraining.integration.spec import get_gpt_layer_spec  # noqa: E402
from megatron_batch import cp_split  # noqa: E402
from oracle import rel_err  # noqa: E402

SEQ, VOCAB, BLOCK, TP = 512, 128, 64, 2
TOL = 1e-5


def transformer_config(tp: int, cp: int, sequence_parallel: bool) -> TransformerConfig:
    return TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                             tensor_model_parallel_size=tp, context_parallel_size=cp,
                             sequence_parallel=sequence_parallel, use_cpu_initialization=True,
                             gradient_accumulation_fusion=False, bias_dropout_fusion=False,
                             masked_softmax_fusion=False, apply_rope_fusion=False, attention_dropout=0.0,
                             hidden_dropout=0.0)


def mt_config(index: str, layout: str) -> MTrainingConfig:
    return MTrainingConfig(index=index, layout=layout, block_size=BLOCK, top_p=0.5, max_slash=2, max_vertical=32,
                           min_vertical=0, last_q=64)


def sample(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return dict(tokens=torch.randint(0, VOCAB, (1, SEQ), generator=g),
                labels=torch.randint(0, VOCAB, (1, SEQ), generator=g),
                position_ids=torch.arange(SEQ)[None])


def _torch_norm_under_sequence_parallel(cls, config, hidden_size, eps=1e-5, **kwargs):
    """Test-only stand-in for megatron-core's torch norm, which refuses ``sequence_parallel`` (only
    Apex's and TE's norms mark their weights for the TP all-reduce of their gradients). A norm is
    per token, so the forward is the same; the references here run with the same setting, so the
    gradients compare without that all-reduce."""
    return torch.nn.LayerNorm(hidden_size, eps=eps)


def _worker(rank, world_size, cases, data):
    """Every case at TP = 2 x CP = world_size / 2: (local logits, loss summed over CP, this TP rank's
    gradients summed over CP, TP rank, CP rank)."""
    from megatron.core.transformer import torch_norm

    cp = world_size // TP
    shims = apply_cpu_shims()
    shims._patch(torch_norm.WrappedTorchNorm, "__new__", _torch_norm_under_sequence_parallel)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP, context_parallel_size=cp)
    try:
        cp_group = parallel_state.get_context_parallel_group()
        results = []
        for cfg, sequence_parallel in cases:
            if cfg is None:  # megatron-core's own attention (CP = 1 only)
                spec = get_gpt_layer_local_spec()
            else:
                patches.install(cfg)
                spec = get_gpt_layer_spec(cfg)
            torch.manual_seed(1234)
            model = GPTModel(config=transformer_config(TP, cp, sequence_parallel), transformer_layer_spec=spec,
                             vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope",
                             parallel_output=False)
            batch = cp_split(dict(data), cp_group) if cp > 1 else dict(data)
            mask = None
            if cfg is None:
                mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
            logits = model(batch["tokens"], batch["position_ids"], mask)
            loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), batch["labels"].reshape(-1),
                                   reduction="sum") / SEQ
            loss.backward()
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
            loss = loss.detach()
            if cp > 1:
                dist.all_reduce(loss, group=cp_group)
                for g in grads.values():
                    dist.all_reduce(g, group=cp_group)
            results.append((logits.detach(), loss, grads, parallel_state.get_tensor_model_parallel_rank(),
                            parallel_state.get_context_parallel_rank()))
            patches.uninstall()
        return results
    finally:
        parallel_state.destroy_model_parallel()
        patches.uninstall()
        shims.remove()


SETTINGS = [  # (layout, index, sequence parallel)
    ("striped", "dense", False), ("striped", "dense", True), ("zigzag", "dense", True),
    ("striped", "vs", True), ("zigzag", "vs", False),
]


def test_tensor_parallel_2_with_context_parallel_2_equals_tensor_parallel_only():
    from dist_utils import run_distributed

    from megatron_mtraining.layout import gather_sequence

    data = sample(3)
    # References at TP = 2, CP = 1: megatron-core's attention for the dense index, the plugin for vs.
    ref_cases = []
    for layout, index, sp in SETTINGS:
        ref_cases.append((None if index == "dense" else mt_config(index, layout), sp))
    refs = run_distributed(_worker, TP, ref_cases, data, timeout=300)
    got = run_distributed(_worker, 2 * TP, [(mt_config(i, lay), sp) for lay, i, sp in SETTINGS], data, timeout=300)

    for i, (layout, index, sp) in enumerate(SETTINGS):
        what = f"TP=2 CP=2 {layout}/{index}/sequence_parallel={sp}"
        for tp_rank in range(TP):
            ref_logits, ref_loss, ref_grads, ref_tp, _ = refs[tp_rank][i]
            assert ref_tp == tp_rank
            mine = sorted((r[i] for r in got if r[i][3] == tp_rank), key=lambda r: r[4])  # this TP rank, by CP rank
            assert len(mine) == 2, what
            # Logits are [s, b, V] per CP rank in the layout's token order ([b, s, V] from GPTModel).
            logits = gather_sequence([r[0] for r in mine], 1, layout, BLOCK)
            assert rel_err(logits, ref_logits) < TOL, (what, tp_rank)
            assert abs(mine[0][1].item() - ref_loss.item()) <= TOL * abs(ref_loss.item()), (what, tp_rank)
            assert mine[0][2].keys() == ref_grads.keys(), what
            for name, g in ref_grads.items():
                assert rel_err(mine[0][2][name], g) < TOL, (what, tp_rank, name)
                assert torch.equal(mine[1][2][name], mine[0][2][name]), (what, tp_rank, name)
        # The two TP ranks hold different heads: their attention weight shards differ.
        qkv = [n for n in refs[0][i][2] if "linear_qkv.weight" in n][0]
        assert not torch.equal(refs[0][i][2][qkv], refs[1][i][2][qkv]), what
