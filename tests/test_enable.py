"""enable_mtraining(args): the one set-up call shared by the launcher, the fork patch and the
example script."""

import argparse

import pytest

pytest.importorskip("megatron.core")

from megatron_mtraining.integration import patches, telemetry  # noqa: E402
from megatron_mtraining.integration.args import add_mtraining_args  # noqa: E402
from megatron_mtraining.integration.core_attention import MTrainingAttention  # noqa: E402
from megatron_mtraining.integration.enable import enable_mtraining  # noqa: E402


def parse(*argv):
    return add_mtraining_args(argparse.ArgumentParser()).parse_args(["--mtraining", *argv])


@pytest.fixture(autouse=True)
def clean():
    yield
    telemetry.disable_telemetry()
    patches.uninstall()


def test_installs_patches_and_returns_the_spec_hook():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    hook = enable_mtraining(parse("--mtraining-top-p", "0.8", "--mtraining-dense-layers", "1"))
    assert patches.installed() and hook.config.top_p == 0.8 and hook.dense_layers == 1
    spec = hook(get_gpt_layer_local_spec())
    core = spec.submodules.self_attention.submodules.core_attention
    assert core.module is MTrainingAttention
    assert core.params == {"mtraining_config": hook.config, "dense_layers": 1}
    assert telemetry.get_telemetry() is None  # --mtraining-log-interval 0: off


def test_the_launch_path_installs_the_config_its_spec_hook_carries():
    """The launcher (and the fork patch, and the example script) take both configs from one
    ``enable_mtraining``: the patches and the layer spec get the same object, so they cannot
    disagree on the layout or block size; a spec left from an earlier call with other flags is
    refused by the attention's check (``engine.check_placement``), naming both values."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_mtraining.integration.patches import engine

    hook = enable_mtraining(parse("--mtraining-layout", "zigzag", "--mtraining-block-size", "128"))
    spec = hook(get_gpt_layer_local_spec())
    in_spec = spec.submodules.self_attention.submodules.core_attention.params["mtraining_config"]
    assert engine.current_config() is hook.config and in_spec is hook.config
    engine.check_placement(in_spec, "the spec")  # agrees
    again = enable_mtraining(parse("--mtraining-layout", "striped"))
    assert engine.current_config() is again.config
    with pytest.raises(ValueError, match=r"layout 'striped' in the config given to install\(\) \(batch split, "
                                         r"RoPE\), 'zigzag' in the old spec; block_size 64 .*, 128 in the old spec"):
        engine.check_placement(in_spec, "the old spec")


def test_log_interval_turns_on_telemetry():
    enable_mtraining(parse("--mtraining-log-interval", "7"))
    assert telemetry.get_telemetry().log_interval == 7


def test_bad_flags_raise_before_installing():
    with pytest.raises(ValueError, match="--mtraining-top-p"):
        enable_mtraining(parse("--mtraining-top-p", "1.5"))
    assert not patches.installed()


def test_start_up_validation_runs_on_the_parsed_arguments():
    """Megatron's argument names match TransformerConfig's fields: every way in validates."""
    args = parse()
    args.attention_dropout, args.seq_length, args.context_parallel_size = 0.1, 4096, 2
    with pytest.raises(ValueError, match="attention_dropout must be 0"):
        enable_mtraining(args)
    args.attention_dropout, args.seq_length = 0.0, 4096 + 64
    with pytest.raises(ValueError, match="not divisible by block_size \\* CP = 128"):
        enable_mtraining(args)
    assert not patches.installed()
    args.seq_length = 4096
    enable_mtraining(args)
    assert patches.installed()
