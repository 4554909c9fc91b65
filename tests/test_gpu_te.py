"""Transformer Engine's fused RoPE under MTraining's striped context-parallel layout (GPU + TE).

Megatron with TE layers applies RoPE through TE's fused kernel (``--apply-rope-fusion``, its default
with TE). With ``patches.install`` each CP rank must still rotate each of its tokens by the token's
true position: on one sequence, the rows that the patched ``get_pos_emb_on_this_cp_rank`` slices
(reached through ``RotaryEmbedding.forward`` exactly as a model does); on packed (THD) sequences, the
patched ``apply_rotary_pos_emb`` (positions restart per document). Each case compares, per rank, the
fused kernel's output with (a) the unfused path on the same rank and (b) the single-device
reference: the unfused RoPE over the whole sequence, then this rank's striped tokens taken from it.
Skipped without a GPU or without Transformer Engine.
"""

import types

import pytest
import torch

pytestmark = pytest.mark.gpu

te = pytest.importorskip("transformer_engine.pytorch") if torch.cuda.is_available() else None
pytest.importorskip("megatron.core")

from megatron_batch import FakeGroup  # noqa: E402

HEAD_DIM, HEADS = 128, 4


def _config(fused):
    return types.SimpleNamespace(apply_rope_fusion=fused, rotary_interleaved=False, multi_latent_attention=False,
                                 mrope_section=None)


@pytest.fixture
def striped(clean_mtraining_state):
    import megatron.core.models.common.embeddings.rotary_pos_embedding  # noqa: F401  (imported before patching)
    from megatron_mtraining.config import MTrainingConfig
    from megatron_mtraining.integration import patches

    patches.install(MTrainingConfig(layout="striped", block_size=64))
    yield


@pytest.mark.parametrize("cp", [2, 4])
def test_fused_rope_one_sequence_striped(striped, cp):
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_mtraining.layout import local_positions

    seq = 64 * cp * 6
    torch.manual_seed(cp)
    rope = RotaryEmbedding(kv_channels=HEAD_DIM, rotary_percent=1.0, rotary_base=1000000,
                           cp_group=FakeGroup(1, 0)).cuda()
    full_freqs = rope(seq, cp_group=FakeGroup(1, 0))
    x = torch.randn(seq, 1, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    reference = rope_utils.apply_rotary_pos_emb(x.float(), full_freqs, _config(False), cp_group=FakeGroup(1, 0))
    for rank in range(cp):
        group = FakeGroup(cp, rank)
        freqs = rope(seq, cp_group=group)  # the patched slicer, as GPTModel reaches it
        pos = local_positions(seq, "striped", cp, rank, 64).cuda()
        assert freqs.shape[0] == seq // cp
        local = x.index_select(0, pos)
        fused = rope_utils.apply_rotary_pos_emb(local, freqs, _config(True), cp_group=group)
        unfused = rope_utils.apply_rotary_pos_emb(local, freqs, _config(False), cp_group=group)
        expect = reference.index_select(0, pos)
        torch.testing.assert_close(fused.float(), unfused.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(fused.float(), expect, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("cp", [2, 4])
def test_fused_rope_packed_documents_striped(striped, cp):
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_mtraining.layout import local_positions

    seq = 64 * cp * 6
    bounds = [0, 100, 101, seq // 2 + 37, seq]  # not block-aligned, a one-token document
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device="cuda")
    max_doc = max(b - a for a, b in zip(bounds, bounds[1:]))
    rope = RotaryEmbedding(kv_channels=HEAD_DIM, rotary_percent=1.0, rotary_base=1000000,
                           cp_group=FakeGroup(1, 0)).cuda()
    freqs = rope(max_doc, packed_seq=True)
    torch.manual_seed(cp)
    x = torch.randn(seq, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    # Single device: each document rotated from position 0.
    reference = torch.cat([rope_utils.apply_rotary_pos_emb(x[a:b, None].float(), freqs[:b - a], _config(False),
                                                           cp_group=FakeGroup(1, 0))[:, 0]
                           for a, b in zip(bounds, bounds[1:])])
    for rank in range(cp):
        group = FakeGroup(cp, rank)
        pos = local_positions(seq, "striped", cp, rank, 64).cuda()
        local = x.index_select(0, pos)
        fused = rope_utils.apply_rotary_pos_emb(local, freqs, _config(True), cu_seqlens=cu_seqlens, cp_group=group)
        unfused = rope_utils.apply_rotary_pos_emb(local, freqs, _config(False), cu_seqlens=cu_seqlens,
                                                  cp_group=group)
        expect = reference.index_select(0, pos)
        torch.testing.assert_close(fused.float(), unfused.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(fused.float(), expect, atol=2e-2, rtol=2e-2)


def test_unpatched_fused_thd_rope_is_not_the_striped_positions(clean_mtraining_state):
    """The control: TE's own THD RoPE over CP derives positions for its per-document zigzag split,
    so without the patch the striped tokens get other rows (the check above can fail)."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_mtraining.layout import local_positions

    cp, seq = 2, 64 * 2 * 6
    cu_seqlens = torch.tensor([0, seq // 2, seq], dtype=torch.int32, device="cuda")
    rope = RotaryEmbedding(kv_channels=HEAD_DIM, rotary_percent=1.0, rotary_base=1000000,
                           cp_group=FakeGroup(1, 0)).cuda()
    freqs = rope(seq // 2, packed_seq=True)
    x = torch.randn(seq, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    reference = torch.cat([rope_utils.apply_rotary_pos_emb(x[a:b, None].float(), freqs[:b - a], _config(False),
                                                           cp_group=FakeGroup(1, 0))[:, 0]
                           for a, b in ((0, seq // 2), (seq // 2, seq))])
    pos = local_positions(seq, "striped", cp, 1, 64).cuda()
    te_own = rope_utils.apply_rotary_pos_emb(x.index_select(0, pos), freqs, _config(True), cu_seqlens=cu_seqlens,
                                             cp_group=FakeGroup(cp, 1))
    assert (te_own.float() - reference.index_select(0, pos)).abs().max() > 0.1


def test_transformer_engine_version_is_supported():
    import transformer_engine

    from megatron_mtraining.integration.transformer_engine import check_transformer_engine

    assert check_transformer_engine(required=True) == transformer_engine.__version__
