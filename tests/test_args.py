import argparse
import dataclasses
import json
import os
import subprocess
import sys

import pytest

from megatron_lm_tree import REPO, require_tarball, unpack
from megatron_mtraining import MTrainingConfig
from megatron_mtraining.config import ENVIRONMENT_VARIABLES, Settings
from megatron_mtraining.integration import add_mtraining_args, integration_options

@pytest.fixture(autouse=True)
def no_launcher_env(monkeypatch):
    """The environment read at start-up holds none of the plugin's variables."""
    import types

    from megatron_mtraining import config

    monkeypatch.setattr(config, "ENVIRONMENT", types.MappingProxyType({}))


def parse(*argv):
    return add_mtraining_args(argparse.ArgumentParser(allow_abbrev=False)).parse_args(list(argv))


def flag(field):
    return "--mtraining-" + field.replace("_", "-")


def test_defaults_round_trip():
    args = parse()
    assert MTrainingConfig.from_args(args) == MTrainingConfig()
    assert integration_options(args) == dict(enabled=False, dense_layers=0, log_interval=0)
    assert args.mtraining_deterministic is True


def test_small_max_vertical_alone_lowers_the_vertical_floor():
    assert MTrainingConfig.from_args(parse("--mtraining-max-vertical", "128")).min_vertical == 128
    assert MTrainingConfig.from_args(parse()).min_vertical == 256


def test_every_config_field_has_a_flag_with_its_default():
    parser = add_mtraining_args(argparse.ArgumentParser())
    for f in dataclasses.fields(MTrainingConfig):
        if f.name == "settings":  # its fields have flags (below)
            continue
        actions = [a for a in parser._actions if a.dest == "mtraining_" + f.name]
        assert flag(f.name) in sum((a.option_strings for a in actions), [])
        assert all(a.default == f.default for a in actions)
    for f in dataclasses.fields(Settings):  # unset (None): the environment variable decides
        if not f.metadata.get("flag", True):  # ring_arrival_hook: a callable (benchmarks), no flag
            continue
        actions = [a for a in parser._actions if a.dest == "mtraining_" + f.name]
        assert flag(f.name) in sum((a.option_strings for a in actions), [])
        assert all(a.default is None for a in actions)
    group = next(g for g in parser._action_groups if g.title == "MTraining sparse attention")
    for action in group._group_actions:
        assert action.help and (action.option_strings[0].startswith("--no-") or "default" in action.help)
    parser.format_help()  # help strings format (no stray %)


def test_every_flag_reaches_the_config():
    args = parse("--mtraining", "--mtraining-top-p", "0.5", "--mtraining-last-q", "32",
                 "--mtraining-block-size", "128", "--mtraining-max-vertical", "512", "--mtraining-max-slash", "64",
                 "--mtraining-min-vertical", "8", "--mtraining-min-slash", "2", "--mtraining-sink-tokens", "2",
                 "--mtraining-local-window", "3", "--mtraining-layout", "zigzag", "--mtraining-inner-ring-size", "4",
                 "--mtraining-index", "fixed", "--mtraining-dense-layers", "2", "--mtraining-log-interval", "10",
                 "--mtraining-dense-max-seq-length", "8192", "--no-mtraining-deterministic")
    assert MTrainingConfig.from_args(args) == MTrainingConfig(
        top_p=0.5, last_q=32, block_size=128, max_vertical=512, max_slash=64, min_vertical=8, min_slash=2,
        sink_tokens=2, local_window=3, layout="zigzag", inner_ring_size=4, index="fixed", dense_max_seq_length=8192,
        deterministic=False)
    assert integration_options(args) == dict(enabled=True, dense_layers=2, log_interval=10)
    assert parse("--no-mtraining-deterministic", "--mtraining-deterministic").mtraining_deterministic is True


@pytest.mark.parametrize("env, expected", [
    ({}, None),
    ({"LOCAL_WORLD_SIZE": "4"}, 4),
    ({"GPUS_PER_NODE": "8"}, 8),
    ({"LOCAL_WORLD_SIZE": "2", "GPUS_PER_NODE": "8"}, 2),
])
def test_inner_ring_size_from_launcher_env(env, expected):
    assert MTrainingConfig.from_args(parse(), env).inner_ring_size == expected
    assert MTrainingConfig.from_args(parse("--mtraining-inner-ring-size", "1"), env).inner_ring_size == 1


def test_bad_launcher_env_names_the_variable():
    with pytest.raises(ValueError, match="GPUS_PER_NODE.*--mtraining-inner-ring-size"):
        MTrainingConfig.from_args(parse(), {"GPUS_PER_NODE": "eight"})


@pytest.mark.parametrize("argv", [
    ("--mtraining-block-size", "32"), ("--mtraining-layout", "ring"), ("--mtraining-index", "topk"),
    ("--mtraining-top-p", "high"), ("--mtraining-last-q", "1.5"),
])
def test_argparse_rejects_bad_values(argv, capsys):
    with pytest.raises(SystemExit):
        parse(*argv)
    assert argv[0] in capsys.readouterr().err


@pytest.mark.parametrize("argv, flags", [
    (("--mtraining-top-p", "1.5"), ["--mtraining-top-p"]),
    (("--mtraining-last-q", "0"), ["--mtraining-last-q"]),
    (("--mtraining-sink-tokens", "-1"), ["--mtraining-sink-tokens"]),
    (("--mtraining-max-slash", "0", "--mtraining-min-slash", "0", "--mtraining-local-window", "0"),
     ["--mtraining-max-slash"]),
    (("--mtraining-max-vertical", "4", "--mtraining-min-vertical", "8"),
     ["--mtraining-max-vertical", "--mtraining-min-vertical"]),
    (("--mtraining-inner-ring-size", "0"), ["--mtraining-inner-ring-size"]),
    (("--mtraining-dense-max-seq-length", "-1"), ["--mtraining-dense-max-seq-length"]),
])
def test_invalid_config_errors_name_the_flag(argv, flags):
    with pytest.raises(ValueError) as err:
        MTrainingConfig.from_args(parse(*argv))
    for name in flags:
        assert name in str(err.value)


@pytest.mark.parametrize("argv, message", [
    (("--mtraining-dense-layers", "-1"), "--mtraining-dense-layers"),
    (("--mtraining-log-interval", "-5"), "--mtraining-log-interval"),
])
def test_invalid_integration_options(argv, message):
    with pytest.raises(ValueError, match=message):
        integration_options(parse(*argv))


def megatron_like_parser():
    """A few of Megatron-LM's own flags, including the neighbours most likely to clash."""
    parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    group = parser.add_argument_group(title="network size")
    group.add_argument("--num-layers", type=int, default=None)
    group.add_argument("--seq-length", type=int, default=None)
    group = parser.add_argument_group(title="distributed")
    group.add_argument("--context-parallel-size", type=int, default=1)
    group.add_argument("--cp-comm-type", nargs="+", type=str, default=["p2p"])
    group.add_argument("--hierarchical-context-parallel-sizes", nargs="+", type=int, default=None)
    group = parser.add_argument_group(title="misc")
    group.add_argument("--deterministic-mode", action="store_true")
    group.add_argument("--log-interval", type=int, default=100)
    group.add_argument("--attention-backend", type=str, default="auto")
    group.add_argument("--spec", type=str, default=None, nargs="*")
    return parser


def test_composes_with_megatron_like_parser():
    parser = add_mtraining_args(megatron_like_parser())
    args = parser.parse_args(["--num-layers", "4", "--context-parallel-size", "2", "--log-interval", "7",
                              "--mtraining", "--mtraining-log-interval", "3", "--mtraining-dense-layers", "1",
                              "--deterministic-mode", "--no-mtraining-deterministic"])
    assert (args.log_interval, args.mtraining_log_interval, args.context_parallel_size) == (7, 3, 2)
    assert args.deterministic_mode and not args.mtraining_deterministic
    assert integration_options(args) == dict(enabled=True, dense_layers=1, log_interval=3)
    assert MTrainingConfig.from_args(args) == MTrainingConfig(deterministic=False)
    args.mtraining_dense_layers = 5
    with pytest.raises(ValueError, match="--num-layers"):
        integration_options(args)


# Megatron-LM's own parse_args with the plugin as its extra_args_provider (the launcher's way in),
# in a subprocess with the real tree first on the path (the megatron-core wheel has no
# megatron.training). Python 3.11 lacks typing.override, which the tree's training code imports.
_PARSE_ARGS_DRIVER = r'''
import json, sys, typing
if not hasattr(typing, "override"):
    typing.override = lambda function: function
from megatron.training.arguments import parse_args
from megatron_mtraining import MTrainingConfig
from megatron_mtraining.integration import add_mtraining_args, integration_options
sys.argv = ["pretrain_gpt.py", "--num-layers", "2", "--mtraining", "--mtraining-top-p", "0.8",
            "--mtraining-dense-layers", "1"]
args = parse_args(extra_args_provider=add_mtraining_args, ignore_unknown_args=True)
print(json.dumps({"same_config": MTrainingConfig.from_args(args) == MTrainingConfig(top_p=0.8),
                  "options": integration_options(args), "num_layers": args.num_layers}))
'''


def test_composes_with_megatron_parse_args(tmp_path):
    tree = unpack(require_tarball("Megatron-LM's parse_args with add_mtraining_args"), tmp_path / "tree")
    env = {k: v for k, v in os.environ.items() if k not in ENVIRONMENT_VARIABLES}
    env.update(PYTHONPATH=os.pathsep.join([str(tree), str(REPO)]), PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", _PARSE_ARGS_DRIVER], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report == {"same_config": True, "options": dict(enabled=True, dense_layers=1, log_interval=0),
                      "num_layers": 2}
