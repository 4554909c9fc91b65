"""enable_mtraining(args): the one set-up call shared by the launcher, the fork patch and the
example script."""

import argparse

import pytest

pytest.importorskip("megatron.core")

from megatron_mtraining.integration import patches, telemetry  # noqa: E402
from megatron_mtraining.integration.args import add_mtraining_args  # noqa: E402
from megatron_mtraining.integration.attention import MTrainingAttention  # noqa: E402
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
