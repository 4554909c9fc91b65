"""install()/uninstall() of the Megatron patches (CPU, no process groups: CP size/rank mocked)."""

import logging
import sys
import types

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core import parallel_state  # noqa: E402
from megatron.core import utils as core_utils  # noqa: E402
from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding  # noqa: E402

from megatron_mtraining.config import MTrainingConfig  # noqa: E402
from megatron_mtraining.integration import patches  # noqa: E402
from megatron_mtraining.layout import local_positions, shard_sequence  # noqa: E402
from megatron_batch import FakeGroup, cp_split  # noqa: E402

try:
    from megatron.core.models.common.embeddings import yarn_rotary_pos_embedding
except ImportError:  # pragma: no cover
    yarn_rotary_pos_embedding = None

BLOCK = 64
NEW_BATCH_NAME = "_get_batch_on_this_cp_rank_per_sequence_balancing"
BATCH_ATTR = NEW_BATCH_NAME if hasattr(core_utils, NEW_BATCH_NAME) else "get_batch_on_this_cp_rank"


ROPE_MODULES = [m for m in (rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding)
                if m is not None and hasattr(m, "get_pos_emb_on_this_cp_rank")]


@pytest.fixture(autouse=True)
def clean_install():
    patches.uninstall()
    yield
    patches.uninstall()


def cfg(**kw):
    return MTrainingConfig(block_size=BLOCK, **kw)


def snapshot():
    snap = {(m.__name__, "get_pos_emb_on_this_cp_rank"): m.get_pos_emb_on_this_cp_rank for m in ROPE_MODULES}
    snap[(core_utils.__name__, BATCH_ATTR)] = getattr(core_utils, BATCH_ATTR)
    return snap


def current(snap):
    return {k: getattr(sys.modules[k[0]], k[1]) for k in snap}


def mock_cp(monkeypatch, size, rank):
    monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: size)
    monkeypatch.setattr(parallel_state, "get_context_parallel_rank", lambda: rank)


# ------------------------------------------------------------------------------ install / uninstall

def test_install_uninstall_restores_identity():
    before = snapshot()
    assert not patches.installed()
    patches.install(cfg())
    assert patches.installed()
    after = current(before)
    for key, fn in after.items():
        assert fn is not before[key], f"{key} not patched"
    # rope_utils and its by-name importers share one replacement
    assert len({id(m.get_pos_emb_on_this_cp_rank) for m in ROPE_MODULES}) == 1
    patches.uninstall()
    assert not patches.installed()
    for key, fn in current(before).items():
        assert fn is before[key], f"{key} not restored"
    patches.uninstall()  # repeat is harmless
    assert all(fn is before[k] for k, fn in current(before).items())


def test_install_is_idempotent_and_logs_once(caplog):
    before = snapshot()
    with caplog.at_level(logging.INFO, logger=patches.__name__):
        patches.install(cfg())
        first = current(before)
        n_logs = len([r for r in caplog.records if "replaced" in r.getMessage()])
        patches.install(cfg())
        assert current(before) == first
        assert len([r for r in caplog.records if "replaced" in r.getMessage()]) == n_logs
    replaced = [r.getMessage() for r in caplog.records if "replaced" in r.getMessage()]
    assert n_logs >= len(before)  # plus any other module that imported a patched function by name
    for name, attr in before:
        assert sum(f"{name}.{attr} " in msg for msg in replaced) == 1, (name, attr)
    assert all(r.levelno == logging.INFO for r in caplog.records if "replaced" in r.getMessage())
    patches.uninstall()
    assert all(fn is before[k] for k, fn in current(before).items())


def test_reinstall_updates_config(monkeypatch):
    patches.install(cfg(layout="zigzag"))
    patches.install(cfg(layout="striped"))
    mock_cp(monkeypatch, 2, 1)
    emb = torch.arange(256.0).reshape(256, 1, 1, 1)
    out = rotary_pos_embedding.get_pos_emb_on_this_cp_rank(emb, 0, None)
    assert torch.equal(out.flatten().long(), local_positions(256, "striped", 2, 1, BLOCK))


def test_scan_patches_other_by_name_importers():
    original = rope_utils.get_pos_emb_on_this_cp_rank
    fake = types.ModuleType("megatron.core._mtraining_fake_importer")
    fake.slicer = original
    sys.modules[fake.__name__] = fake
    try:
        patches.install(cfg())
        assert fake.slicer is rope_utils.get_pos_emb_on_this_cp_rank is not original
        patches.uninstall()
        assert fake.slicer is original
    finally:
        del sys.modules[fake.__name__]


# ------------------------------------------------------------------------------ batch split

def make_batch(b=2, s=256):
    return {
        "tokens": torch.arange(b * s).reshape(b, s),
        "labels": torch.arange(b * s).reshape(b, s) + 1000,
        "loss_mask": torch.rand(b, s),
        "position_ids": torch.arange(s).repeat(b, 1),
        "attention_mask": torch.rand(b, 1, s, s) > 0.5,
    }


@pytest.mark.parametrize("rank", [0, 1])
def test_batch_split_is_striped(monkeypatch, rank):
    mock_cp(monkeypatch, 2, rank)
    full = make_batch()
    patches.install(cfg(layout="striped"))
    out = cp_split(dict(full))
    for key, val in full.items():
        dim = 2 if key == "attention_mask" else 1
        assert torch.equal(out[key], shard_sequence(val, dim, "striped", 2, rank, BLOCK)), key
    assert out["attention_mask"].shape == (2, 1, 128, 256)


def test_batch_split_with_cp_group(monkeypatch):
    mock_cp(monkeypatch, 1, 0)  # must not be used when a group is passed
    full = make_batch()
    patches.install(cfg(layout="striped"))
    out = cp_split(dict(full), cp_group=FakeGroup(4, 3))
    assert torch.equal(out["tokens"], shard_sequence(full["tokens"], 1, "striped", 4, 3, BLOCK))


@pytest.mark.parametrize("rank", [0, 1])
def test_batch_split_zigzag_keeps_megatron(monkeypatch, rank):
    mock_cp(monkeypatch, 2, rank)
    full = make_batch()
    expected = cp_split(dict(full))  # Megatron's own split
    patches.install(cfg(layout="zigzag"))
    out = cp_split(dict(full))
    for key in full:
        assert torch.equal(out[key], expected[key]), key
        dim = 2 if key == "attention_mask" else 1
        assert torch.equal(out[key], shard_sequence(full[key], dim, "zigzag", 2, rank, BLOCK)), key


@pytest.mark.parametrize("layout,s", [("striped", 192), ("zigzag", 192)])
def test_batch_split_rejects_indivisible_length(monkeypatch, layout, s):
    mock_cp(monkeypatch, 2, 0)
    patches.install(cfg(layout=layout))
    with pytest.raises(ValueError, match="not divisible"):
        cp_split(make_batch(s=s))


def test_batch_split_cp1_unchanged(monkeypatch):
    mock_cp(monkeypatch, 1, 0)
    full = make_batch(s=100)
    patches.install(cfg())
    out = cp_split(dict(full))
    assert all(torch.equal(out[k], full[k]) for k in full)


@pytest.mark.parametrize("layout", ["striped", "zigzag"])
def test_batch_split_keeps_thd_metadata(monkeypatch, layout):
    """--dataloader-inter-document-masking: cu_seqlens / max_seqlen pass the split unchanged (global
    documents), in both layouts (megatron-core <= 0.16's own zigzag split would cut them too)."""
    mock_cp(monkeypatch, 2, 1)
    full = make_batch(b=1)
    del full["attention_mask"]
    cu = torch.tensor([[0, 10, 200, 256]], dtype=torch.int32)
    patches.install(cfg(layout=layout))
    out = cp_split(dict(full, cu_seqlens=cu, max_seqlen=torch.tensor([190])))
    assert out["cu_seqlens"] is cu and out["max_seqlen"].tolist() == [190]
    assert torch.equal(out["tokens"], shard_sequence(full["tokens"], 1, layout, 2, 1, BLOCK))


@pytest.mark.parametrize("layout", ["striped", "zigzag"])
def test_thd_split_follows_layout(monkeypatch, layout):
    """--sft: the THD split cuts the flat packed sequence in the MTraining layout (no per-document
    zigzag, no Transformer Engine); cu_seqlens stay global."""
    mock_cp(monkeypatch, 2, 0)
    patches.install(cfg(layout=layout))
    full = make_batch(b=1)
    del full["attention_mask"]
    cu = torch.tensor([0, 10, 200, 256], dtype=torch.int32)
    if hasattr(core_utils, "get_thd_batch_on_this_cp_rank"):  # megatron-core <= 0.16
        out, psp = core_utils.get_thd_batch_on_this_cp_rank(dict(full), cu, None, torch.tensor([190]))
        assert psp.qkv_format == "thd" and psp.cu_seqlens_q is cu
    else:
        out = core_utils._get_batch_on_this_cp_rank_per_document_balancing(
            dict(full, cu_seqlens=cu[None], cu_seqlens_padded=None, max_seqlen=torch.tensor([190])), cp_group=None)
        assert torch.equal(out["cu_seqlens"][0], cu)
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        assert torch.equal(out[key], shard_sequence(full[key], 1, layout, 2, 0, BLOCK)), key


def test_thd_patches_are_reversible():
    from megatron.core.transformer import attention as core_attention

    before = (rope_utils.apply_rotary_pos_emb, core_attention.apply_rotary_pos_emb,
              rotary_pos_embedding.apply_rotary_pos_emb)
    thd_name = ("get_thd_batch_on_this_cp_rank" if hasattr(core_utils, "get_thd_batch_on_this_cp_rank")
                else "_get_batch_on_this_cp_rank_per_document_balancing")
    thd_split = getattr(core_utils, thd_name)
    patches.install(cfg())
    after = (rope_utils.apply_rotary_pos_emb, core_attention.apply_rotary_pos_emb,
             rotary_pos_embedding.apply_rotary_pos_emb)
    assert len(set(map(id, after))) == 1 and after[0] is not before[0]
    assert getattr(core_utils, thd_name) is not thd_split
    patches.uninstall()
    assert (rope_utils.apply_rotary_pos_emb, core_attention.apply_rotary_pos_emb,
            rotary_pos_embedding.apply_rotary_pos_emb) == before
    assert getattr(core_utils, thd_name) is thd_split


def test_rope_apply_unchanged_without_thd_over_cp(monkeypatch):
    """Unpacked inputs, and THD at CP = 1, take Megatron's own RoPE (the same numbers)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
                               apply_rope_fusion=False)
    freqs = torch.randn(256, 1, 1, 16)
    t = torch.randn(256, 1, 4, 16)
    cu = torch.tensor([0, 100, 256], dtype=torch.int32)
    expected = (rope_utils.apply_rotary_pos_emb(t, freqs, config, cp_group=FakeGroup(2, 0)),
                rope_utils.apply_rotary_pos_emb(t[:, 0], freqs[:156], config, cu_seqlens=cu, cp_group=FakeGroup(1, 0)))
    patches.install(cfg())
    assert torch.equal(rope_utils.apply_rotary_pos_emb(t, freqs, config, cp_group=FakeGroup(2, 0)), expected[0])
    assert torch.equal(rope_utils.apply_rotary_pos_emb(t[:, 0], freqs[:156], config, cu_seqlens=cu,
                                                       cp_group=FakeGroup(1, 0)), expected[1])


def test_batch_split_skips_metadata(monkeypatch):
    mock_cp(monkeypatch, 2, 1)
    batch = make_batch()
    batch["dataset_id"] = torch.zeros(2, dtype=torch.long)
    batch["cu_seqlens"] = None
    patches.install(cfg())
    out = cp_split(batch)
    assert out["dataset_id"].shape == (2,) and out["cu_seqlens"] is None
    assert out["tokens"].shape == (2, 128)


# ------------------------------------------------------------------------------ RoPE

@pytest.mark.parametrize("layout", ["striped", "zigzag"])
@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_rope_slicing_follows_layout(layout, rank):
    patches.install(cfg(layout=layout))
    emb = torch.randn(512, 1, 1, 8)
    pos = local_positions(512, layout, 4, rank, BLOCK)
    for mod in ROPE_MODULES:
        out = mod.get_pos_emb_on_this_cp_rank(emb, 0, FakeGroup(4, rank))
        assert out.device == emb.device
        assert torch.equal(out, emb[pos]), mod.__name__
    # other seq_dim
    out = rotary_pos_embedding.get_pos_emb_on_this_cp_rank(emb.transpose(0, 3), 3, FakeGroup(4, rank))
    assert torch.equal(out, emb.transpose(0, 3)[..., pos])


def test_rotary_embedding_forward_uses_patch():
    """RotaryEmbedding.forward looks the slicer up in its own module: the patch reaches it."""
    from megatron_mtraining.testing.cpu_shims import apply_cpu_shims

    with apply_cpu_shims():  # RoPE calls torch.cuda.current_device()
        rope = rotary_pos_embedding.RotaryEmbedding(kv_channels=8, rotary_percent=1.0,
                                                    use_cpu_initialization=True)
        full = rope(256)
        patches.install(cfg())
        local = rope(256, cp_group=FakeGroup(2, 1))
    assert torch.equal(local, full[local_positions(256, "striped", 2, 1, BLOCK)])


def test_yarn_module_patched():
    if yarn_rotary_pos_embedding is None or not hasattr(yarn_rotary_pos_embedding, "get_pos_emb_on_this_cp_rank"):
        pytest.skip("YaRN module does not import get_pos_emb_on_this_cp_rank")
    original = yarn_rotary_pos_embedding.get_pos_emb_on_this_cp_rank
    patches.install(cfg())
    assert yarn_rotary_pos_embedding.get_pos_emb_on_this_cp_rank is not original
    patches.uninstall()
    assert yarn_rotary_pos_embedding.get_pos_emb_on_this_cp_rank is original


def test_rope_rejects_indivisible_length():
    patches.install(cfg())
    with pytest.raises(ValueError, match="RoPE"):
        rotary_pos_embedding.get_pos_emb_on_this_cp_rank(torch.randn(200, 1, 1, 8), 0, FakeGroup(2, 0))


# ------------------------------------------------------------------------------ validation

def tcfg(**kw):
    base = dict(attention_dropout=0.0, hierarchical_context_parallel_sizes=None, mtp_num_layers=None,
                cp_comm_type=None, context_parallel_size=2)
    base.update(kw)
    return types.SimpleNamespace(**base)


def test_validate_accepts_good_config():
    patches.validate_megatron_config(tcfg(), cfg(), seq_length=256)
    patches.validate_megatron_config(tcfg(cp_comm_type="p2p"), cfg(layout="zigzag"), seq_length=256)
    patches.validate_megatron_config(types.SimpleNamespace(), cfg(), seq_length=128, cp_size=2)


def test_validate_with_real_transformer_config():
    from megatron.core.transformer.transformer_config import TransformerConfig

    tc = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, attention_dropout=0.0,
                           use_cpu_initialization=True)
    patches.validate_megatron_config(tc, cfg(), seq_length=128, cp_size=2)
    with pytest.raises(ValueError, match="attention_dropout"):
        patches.validate_megatron_config(TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4),
                                         cfg(), seq_length=128)


@pytest.mark.parametrize("kw,seq,layout,match", [
    ({}, 192, "striped", r"block_size \* CP = 128"),
    ({}, 384, "zigzag", r"2 \* CP \* block_size = 256"),
    ({"attention_dropout": 0.1}, 256, "striped", "attention_dropout"),
    ({"hierarchical_context_parallel_sizes": [2, 1]}, 256, "striped", "hierarchical"),
    ({"mtp_num_layers": 1}, 256, "striped", "mtp_num_layers"),
    ({"cp_comm_type": "a2a"}, 256, "striped", "Transformer Engine"),
    ({"cp_comm_type": ["p2p", "all_gather"]}, 256, "striped", "Transformer Engine"),
    ({"hybrid_context_parallel": True}, 256, "striped", "--hybrid-context-parallel"),
    ({"reset_attention_mask": True, "pipeline_model_parallel_size": 2}, 256, "striped",
     "--reset-attention-mask with pipeline parallelism.*--dataloader-inter-document-masking"),
    ({"reset_attention_mask": True, "micro_batch_size": 2}, 256, "striped", "--micro-batch-size 1"),
])
def test_validate_errors(kw, seq, layout, match):
    with pytest.raises(ValueError, match=match):
        patches.validate_megatron_config(tcfg(**kw), cfg(layout=layout), seq_length=seq)


@pytest.mark.parametrize("kw", [
    {"sft": True}, {"sft": True, "pipeline_model_parallel_size": 2, "micro_batch_size": 4},
    {"dataloader_inter_document_masking": True, "pipeline_model_parallel_size": 2, "micro_batch_size": 2},
    {"reset_attention_mask": True, "reset_position_ids": True, "eod_mask_loss": True, "micro_batch_size": 1,
     "pipeline_model_parallel_size": 1},
    {"reset_attention_mask": True, "dataloader_inter_document_masking": True, "micro_batch_size": 2},
    {"reset_position_ids": True, "eod_mask_loss": True, "micro_batch_size": 8, "pipeline_model_parallel_size": 4},
])
def test_validate_accepts_packed_documents(kw):
    """Packed documents reach MTraining as cu_seqlens (integration/packing.py): THD batches with any
    micro-batch and pipeline size, --reset-attention-mask with one micro-batch sample and one stage."""
    patches.validate_megatron_config(tcfg(**kw), cfg(), seq_length=256)


def test_validate_mtp_ok_without_cp():
    patches.validate_megatron_config(tcfg(mtp_num_layers=1, context_parallel_size=1), cfg(), seq_length=64)


def test_validate_lists_every_problem():
    with pytest.raises(ValueError) as err:
        patches.validate_megatron_config(tcfg(attention_dropout=0.1, cp_comm_type="a2a"), cfg(), seq_length=100)
    msg = str(err.value)
    assert "attention_dropout" in msg and "Transformer Engine" in msg and "not divisible" in msg


def test_newer_megatron_patches_per_sequence_balancing_only(monkeypatch):
    """megatron-core >= 0.17 layout: the dispatcher stays, its per-sequence helper is replaced."""
    calls = []

    def per_sequence_balancing(batch, cp_group=None):
        calls.append(cp_group)
        return batch

    public = core_utils.get_batch_on_this_cp_rank
    monkeypatch.setattr(core_utils, NEW_BATCH_NAME, per_sequence_balancing, raising=False)
    mock_cp(monkeypatch, 2, 1)
    patches.install(cfg())
    assert core_utils.get_batch_on_this_cp_rank is public
    helper = getattr(core_utils, NEW_BATCH_NAME)
    assert helper is not per_sequence_balancing
    full = make_batch()
    out = helper(dict(full), None)
    assert torch.equal(out["tokens"], shard_sequence(full["tokens"], 1, "striped", 2, 1, BLOCK))
    patches.uninstall()
    assert getattr(core_utils, NEW_BATCH_NAME) is per_sequence_balancing


def test_unstepped_distributed_optimizer_gets_states_before_a_load():
    """Without Apex/TE Megatron's DistributedOptimizer holds torch's Adam, whose states appear at the
    first step; loading a checkpoint into it before that failed on the GPU machines (megatron-core
    0.19: `assert len(steps) == 1` in state_dict, KeyError 'step' in the legacy load). The patch
    gives it states first, through Megatron's own helper, only when loading."""
    distrib = pytest.importorskip("megatron.core.optimizer.distrib_optimizer")
    from megatron_mtraining.integration import patches

    calls = []

    def sharded_state_dict(self, model_sharded_state_dict, is_loading=False, sharding_type=None, metadata=None):
        calls.append(("sharded", is_loading, len(self.optimizer.state)))
        steps = {int(s["step"]) for s in self.optimizer.state_dict()["state"].values()}
        assert len(steps) == 1  # what Megatron's state_dict() asserts without Apex/TE
        return {}

    class Stand_in:  # the attributes the helper and the wrapper read
        _init_optimizer_states_with_dummy_values = distrib.DistributedOptimizer._init_optimizer_states_with_dummy_values

        def __init__(self):
            self.param = torch.nn.Parameter(torch.ones(3))
            self.optimizer = torch.optim.AdamW([self.param], lr=0.1, weight_decay=0.1)

    wrapped = patches.optimizer.make_optimizer_state_before_load(sharded_state_dict)
    opt = Stand_in()
    with pytest.raises(AssertionError):
        sharded_state_dict(opt, {}, True)          # the unpatched failure
    wrapped(opt, {}, True)                         # positional is_loading, as ChainedOptimizer passes it
    assert calls[-1] == ("sharded", True, 1)
    saving = Stand_in()
    with pytest.raises(AssertionError):
        wrapped(saving, {}, is_loading=False)      # saving an unstepped optimizer is left alone
    assert len(saving.optimizer.state) == 0
    # The patch applies exactly where Megatron runs torch's Adam.
    entries = [p for p in patches.PATCHES if p.module_name == "megatron.core.optimizer.distrib_optimizer"]
    assert entries and all(p.when(distrib) == (not distrib.HAVE_APEX_OR_TE) for p in entries)


def test_resumed_torch_adam_keeps_the_checkpoint_step_one_tensor_per_parameter():
    """Megatron's DistributedOptimizer without Apex/TE (torch's AdamW): the parameter-state loaders
    must not overwrite the ``step`` that ``load_state_dict`` took from the checkpoint (megatron-core
    copies a stale one, or raises KeyError 'step' where the source has none), and every parameter's
    state needs its own ``step`` tensor (torch increments it in place once per parameter). The full
    save / resume comparison is tests/test_resume_distrib_optimizer.py."""
    import types

    distrib = pytest.importorskip("megatron.core.optimizer.distrib_optimizer")
    from megatron_mtraining.integration import patches

    class Stand_in:  # the attributes Megatron's setter and the wrappers read
        def __init__(self):
            self.params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
            self.optimizer = torch.optim.AdamW(self.params, lr=0.1, weight_decay=0.1)
            self.model_param_group_index_map = {"a": (0, 0), "b": (0, 1)}
            self.config = types.SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=False)

        def load_state_dict(self, step):  # what megatron-core's does with 'step' (torch: no copy)
            shared = torch.tensor(float(step))
            for param in self.params:
                self.optimizer.state[param].update(step=shared, exp_avg=torch.zeros_like(param),
                                                   exp_avg_sq=torch.zeros_like(param))

    opt = Stand_in()
    patches.optimizer.make_load_state_dict_with_own_steps(Stand_in.load_state_dict)(opt, 2)
    steps = [opt.optimizer.state[p]["step"] for p in opt.params]
    assert [s.item() for s in steps] == [2.0, 2.0] and steps[0] is not steps[1]
    for p in opt.params:
        p.grad = torch.ones_like(p)
    opt.optimizer.step()
    assert [opt.optimizer.state[p]["step"].item() for p in opt.params] == [3.0, 3.0]

    setter = patches.optimizer.make_param_state_setter_keeping_step(
        distrib.DistributedOptimizer._set_main_param_and_optimizer_states)
    stale = {"param": torch.full((3,), 5.0), "exp_avg": torch.full((3,), 6.0), "exp_avg_sq": torch.full((3,), 7.0),
             "step": torch.tensor(1.0)}                                     # dp_reshardable: a stale step
    with torch.no_grad():  # as Megatron's loaders call it
        setter(opt, "a", stale)
    state = opt.optimizer.state[opt.params[0]]
    assert state["step"].item() == 3.0 and torch.equal(state["exp_avg"], stale["exp_avg"])
    assert torch.equal(opt.params[0].detach(), stale["param"])
    with torch.no_grad():  # dp_zero_gather_scatter: no step at all
        setter(opt, "b", {"param": torch.zeros(2), "exp_avg": torch.zeros(2), "exp_avg_sq": torch.zeros(2)})
    assert opt.optimizer.state[opt.params[1]]["step"].item() == 3.0


def test_optimizer_patch_is_installed_and_removed_without_apex_or_te():
    distrib = pytest.importorskip("megatron.core.optimizer.distrib_optimizer")
    if distrib.HAVE_APEX_OR_TE:
        pytest.skip("Apex or Transformer Engine is installed: Megatron's own optimizer path is used")
    from megatron_mtraining import MTrainingConfig
    from megatron_mtraining.integration import patches

    names = ("sharded_state_dict", "load_parameter_state_from_dp_zero", "_set_main_param_and_optimizer_states",
             "load_state_dict")
    originals = {name: vars(distrib.DistributedOptimizer)[name] for name in names}
    patches.install(MTrainingConfig())
    try:
        for name in names:
            assert getattr(getattr(distrib.DistributedOptimizer, name), "__mtraining_patch__", False), name
    finally:
        patches.uninstall()
    for name in names:
        assert vars(distrib.DistributedOptimizer)[name] is originals[name], name
