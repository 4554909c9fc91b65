"""Packed documents on Transformer Engine layers over CP = 2 or 4 (NCCL), one process per GPU:
`python -m torch.distributed.run --nproc_per_node 2 tests/te_packed_gpu_worker.py` (CP = the world size).

The reference is Megatron's own attention on TE layers (``TEDotProductAttention``: TE's fused
attention over a THD batch, ``PackedSeqParams``, TE's own fused THD RoPE) at CP = 1, computed on
every rank. MTraining (the dense index: exact document-causal attention) replaces the core
attention of the same TE layer spec at CP = world size, with the same weights, through Megatron's real
batch splits patched by ``patches.install``:

* ``thd``      ``--sft``: THD batch, the per-document CP split;
* ``thd-seq``  ``--dataloader-inter-document-masking``: THD batch split like an unpacked one;

each with TE's fused RoPE (``apply_rope_fusion``, Megatron's default on TE layers). Logits (gathered
over the ranks), the loss and every parameter gradient (summed over the CP group) must match the
reference within bf16 tolerance: a wrong position, document boundary or layout moves them by
O(1). (The ``--reset-attention-mask`` path keeps global RoPE positions, so TE's THD attention is not
its reference; its attention is the one checked here and its RoPE the one-sequence path of
tests/test_gpu_te.py.) Prints one line per case; exits non-zero on any failure.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [TESTS, os.path.dirname(TESTS)]

from megatron.core import parallel_state, tensor_parallel  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec  # noqa: E402
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from megatron_mtraining import MTrainingConfig  # noqa: E402
from megatron_mtraining.integration import packing, patches  # noqa: E402
from megatron_mtraining.integration.spec import get_gpt_layer_spec  # noqa: E402
from megatron_mtraining.layout import gather_sequence  # noqa: E402

SEQ, VOCAB, EOD, BLOCK = 1024, 256, 7, 64
CU = (0, 70, 200, 201, 590, 768, 1024)  # documents not block-aligned, one of a single token
TOL = {"logits": 3e-2, "loss": 1e-2, "grads": 6e-2}


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def build(spec, cp):
    config = TransformerConfig(num_layers=2, hidden_size=512, num_attention_heads=4, num_query_groups=2,
                               kv_channels=128, ffn_hidden_size=1024, bf16=True, params_dtype=torch.bfloat16,
                               context_parallel_size=cp, attention_dropout=0.0, hidden_dropout=0.0,
                               apply_rope_fusion=True, normalization="RMSNorm", add_qkv_bias=True)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                    position_embedding_type="rope", rotary_base=10000).cuda()


def sample():
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(EOD + 1, VOCAB, (SEQ,), generator=g)
    tokens[[end - 1 for end in CU[1:-1]]] = EOD
    reset_ids = torch.cat([torch.arange(b - a) for a, b in zip(CU, CU[1:])])
    return dict(tokens=tokens[None].cuda(), labels=torch.randint(0, VOCAB, (1, SEQ), generator=g).cuda(),
                loss_mask=torch.ones(1, SEQ).cuda(), position_ids=reset_ids[None].cuda())


def thd_params(cu):
    longest = max(b - a for a, b in zip(CU, CU[1:]))
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                           max_seqlen_kv=longest)


def forward_backward(model, batch, psp):
    model.zero_grad(set_to_none=True)
    logits = model(batch["tokens"], batch["position_ids"], None, packed_seq_params=psp)
    losses = F.cross_entropy(logits.float().reshape(-1, VOCAB), batch["labels"].reshape(-1), reduction="none")
    loss = (losses * batch["loss_mask"].reshape(-1)).sum() / SEQ
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad.detach().float() for n, p in model.named_parameters()}


def split(data, kind, group):
    cu = torch.tensor(CU, dtype=torch.int32, device="cuda")
    batch = {k: v.clone() for k, v in data.items()}
    longest = torch.tensor([max(b - a for a, b in zip(CU, CU[1:]))], device="cuda")
    batch.update(cu_seqlens=cu[None], cu_seqlens_padded=None, max_seqlen=longest)
    from megatron.core import utils as core_utils
    batch = core_utils.get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=group,
                                                 use_per_sequence_balancing=kind == "thd-seq")
    return batch, thd_params(cu)


def main():
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    assert world in (2, 4), "run with --nproc_per_node 2 or 4 (CP = the world size)"
    data = sample()
    te_spec = get_gpt_layer_with_transformer_engine_spec()

    # The reference: TE's attention, THD, CP = 1 (the same on every rank).
    parallel_state.initialize_model_parallel(context_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)
    reference = build(te_spec, 1)
    state = {k: v for k, v in reference.state_dict().items()}
    ref = forward_backward(reference, data, thd_params(torch.tensor(CU, dtype=torch.int32, device="cuda")))
    parallel_state.destroy_model_parallel()

    failed = 0
    parallel_state.initialize_model_parallel(context_parallel_size=world)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    group = parallel_state.get_context_parallel_group()
    for kind in ("thd", "thd-seq"):
        config = MTrainingConfig(index="dense", layout="striped", block_size=BLOCK)
        patches.install(config)
        packing.reset_packing()
        model = build(get_gpt_layer_spec(config, base_spec=te_spec), world)
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not [k for k in missing + unexpected if not k.endswith("_extra_state")], (missing, unexpected)
        batch, psp = split(data, kind, group)
        logits, loss, grads = forward_backward(model, batch, psp)
        dist.all_reduce(loss, group=group)
        for g in grads.values():
            dist.all_reduce(g, group=group)
        gathered = [torch.empty_like(logits) for _ in range(world)]
        dist.all_gather(gathered, logits.contiguous(), group=group)
        full = gather_sequence(gathered, 1, "striped", BLOCK)  # logits [1, tokens, vocab]
        errors = {"logits": rel(full, ref[0]), "loss": abs(loss.item() - ref[1].item()) / abs(ref[1].item()),
                  "grads": max(rel(grads[n], g) for n, g in ref[2].items())}
        worst = max(ref[2], key=lambda n: rel(grads[n], ref[2][n]))
        ok = all(errors[k] < TOL[k] for k in TOL)
        failed += not ok
        if rank == 0:
            print(f"TE layers, CP={world} striped, {kind}: logits {errors['logits']:.2e} loss {errors['loss']:.2e} "
                  f"grads {errors['grads']:.2e} ({worst}) -> {'ok' if ok else 'FAIL'}", flush=True)
        patches.uninstall()
        packing.reset_packing()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
