"""The pre-attention indexer inside a megatron-core GPTModel: swapped through the spec, and
bit-identical under activation recompute (full and selective). CPU, gloo world of size 1."""

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402

from megatron_mtraining import MTrainingConfig, VSIndex  # noqa: E402
from megatron_mtraining.integration.indexer import MTrainingIndexer  # noqa: E402
from megatron_mtraining.integration.spec import get_gpt_layer_spec  # noqa: E402
from test_megatron_attention import (  # noqa: E402
    SEQ, VOCAB, batch, core_attentions, logits_and_grads, rel_err, transformer_config,
)

SPARSE = MTrainingConfig(index="vs", block_size=64, top_p=0.5, max_slash=2, max_vertical=16, min_vertical=0, last_q=64)

RECOMPUTE = {
    "none": {},
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "selective": dict(recompute_granularity="selective"),  # default recompute_modules: core_attn
}


def build(spec, **config_overrides) -> GPTModel:
    torch.manual_seed(1234)
    return GPTModel(config=transformer_config(**config_overrides), transformer_layer_spec=spec,
                    vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope")


def index_tensors(index: VSIndex):
    return [t.clone() for t in (index.slash, index.n_slash, index.vertical, index.n_vertical)]


def record_indices(model):
    """Every index each layer's indexer returns, through forward hooks on the indexers."""
    seen = {}
    for attn in core_attentions(model):
        seen[attn.layer_number] = []
        attn.indexer.register_forward_hook(
            lambda module, args, index, store=seen[attn.layer_number]: store.append(index_tensors(index)))
    return seen


def train_step(model, data):
    tokens, position_ids, _, labels = data
    model.zero_grad(set_to_none=True)
    loss = model(tokens, position_ids, None, labels=labels).float().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_rebuilds_the_same_index_and_gradients(megatron_cpu, mode):
    data = batch(5)
    reference = build(get_gpt_layer_spec(SPARSE))
    model = build(get_gpt_layer_spec(SPARSE), **RECOMPUTE[mode])
    model.load_state_dict(reference.state_dict())
    ref_seen, seen = record_indices(reference), record_indices(model)
    ref_loss, ref_grads = train_step(reference, data)
    loss, grads = train_step(model, data)

    for layer, calls in seen.items():
        # The forward and the recompute each build the index; both equal the plain run's, bit for bit.
        assert len(calls) == 2, (mode, layer, len(calls))
        assert len(ref_seen[layer]) == 1
        for call in calls:
            for got, want in zip(call, ref_seen[layer][0]):
                assert torch.equal(got, want), (mode, layer)
    dens = [a.last_index.density(SEQ).mean().item() for a in core_attentions(model)]
    assert all(0 < d < 1 for d in dens), dens  # the sparse index, not the dense one
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name, ref_grad in ref_grads.items():
        assert rel_err(grads[name], ref_grad) < 1e-6, (mode, name)


class DenseIndexer(MTrainingIndexer):
    """A replacement index step: always the dense index (exact causal attention)."""

    def forward(self, q, k, group=None):
        return VSIndex.dense(q.shape[0], q.shape[1], q.shape[2], self.mtraining_config.block_size, device=q.device)


def test_indexer_is_swapped_through_the_spec(megatron_cpu):
    data = batch(6)
    reference = build(get_gpt_layer_local_spec())
    model = build(get_gpt_layer_spec(SPARSE, indexer=DenseIndexer))
    model.load_state_dict(reference.state_dict())
    assert all(type(a.indexer) is DenseIndexer for a in core_attentions(model))
    assert "DenseIndexer" in repr(model)
    ref_logits, ref_loss, ref_grads = logits_and_grads(reference, data)
    logits, loss, grads = logits_and_grads(model, data)
    assert rel_err(logits, ref_logits) < 1e-5
    for name, ref_grad in ref_grads.items():
        assert rel_err(grads[name], ref_grad) < 1e-5, name


def test_default_indexer_shows_its_settings(megatron_cpu):
    model = build(get_gpt_layer_spec(SPARSE, dense_layers=1))
    first, second = core_attentions(model)
    assert isinstance(first.indexer, MTrainingIndexer) and "index=dense" in repr(first.indexer)
    assert "index=vs" in repr(second.indexer) and "top_p=0.5" in repr(second.indexer)
    assert not list(first.indexer.parameters())
