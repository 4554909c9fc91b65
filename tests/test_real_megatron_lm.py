"""The real Megatron-LM tree (branch core_r0.19.0, megatron-core 0.19.1) on the CPU: the patched
fork's own argument parser, and ``pretrain_gpt.py`` through the launcher (unmodified tree) and as
the patched fork, each run up to the first step that needs a GPU.

The tree comes from ``megatron-lm-core_r0.19.0.tar.gz``, looked up at
``$MTRAINING_MEGATRON_LM_TARBALL``, else ``<repo>/../shared/third_party/``, else ``<repo>/.carry/``
(``tests/megatron_lm_tree.py``); every test here skips without it, saying what it would have run.
It is unpacked twice into pytest's tmp dir: as shipped, and with
``patches/megatron-lm-core_r0.19.x-mtraining.patch`` applied (``git apply``).

Megatron-LM runs in subprocesses with the tree first on ``PYTHONPATH`` (its megatron 0.19.1 then
shadows the installed megatron-core). The shims, each for one difference between this CPU machine
and the GPU machines, and nothing else:

* ``typing.override`` (Python 3.12) for Python 3.11: the tree's ``megatron/training/models``
  import it (only when this Python lacks it);
* ``get_device_arch_version() -> 9`` (Hopper) in ``megatron.training.arguments``: ``validate_args``
  asks the GPU about it when CP > 1;
* ``initialize_megatron``, which asserts CUDA first and then sets up NCCL, is replaced by a stub
  that only records the call (``pretrain_gpt.py`` has already parsed, validated and set the args);
* ``set_jit_fusion_options``, the step of ``pretrain()`` right after initialisation and MTraining's
  set-up (the launcher's hook, or the patch's block), stops the run: from there on ``pretrain()``
  puts tensors on CUDA.

The checks: the patched parser (``parse_and_validate_args``, the call ``pretrain_gpt.py`` makes)
takes every flag the plugin registers, with the plugin's values; without the plugin, ``--mtraining``
fails naming the interpreter and how to install it; the command lines of ``examples/*.sh`` and of
``scripts/gpu_megatron_lm.sh`` (its DRY_RUN) pass Megatron's ``validate_args`` and MTraining's
start-up validation; and ``pretrain_gpt.py`` reaches MTraining's set-up (patches installed,
``MTrainingAttention`` in the spec every GPTModel gets) through both ways in, with the real
megatron-core 0.19.1 modules.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_lm_tree import REPO, apply_patch, require_tarball, unpack

from megatron_mtraining.integration.args import add_mtraining_args

EXAMPLES = REPO / "examples"
SMALL = EXAMPLES / "pretrain_small_mtraining.sh"
GPU_SCRIPT = REPO / "scripts" / "gpu_megatron_lm.sh"
BASH = shutil.which("bash")
TIMEOUT = 240

_SHIMS = r'''
import sys
import typing

if not hasattr(typing, "override"):  # Python < 3.12; the tree's megatron/training/models import it
    def _override(function):
        return function

    typing.override = _override
'''

# Argument parsing of the patched tree, in one process (megatron is imported once).
# argv: REQUEST_JSON OUT_JSON
_PARSER_DRIVER = _SHIMS + r'''
import contextlib
import io
import json
import os

request_path, report_path = sys.argv[1:3]
request = json.load(open(request_path))
report = {"python": sys.executable}

import megatron.core.package_info
import megatron.training.arguments as arguments

report["megatron_core_version"] = megatron.core.package_info.__version__
report["arguments_file"] = arguments.__file__
arguments.get_device_arch_version = lambda: 9  # validate_args asks the GPU (Hopper) when CP > 1


def parse(argv, world_size="1"):
    os.environ["WORLD_SIZE"] = world_size
    sys.argv = ["pretrain_gpt.py", *argv]
    return arguments.parse_args()


# 1. Without the plugin (as in a Python that does not have it): only --mtraining, which fails.
class NotInstalled:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.split(".")[0] == "megatron_mtraining":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


assert not any(name.startswith("megatron_mtraining") for name in sys.modules)
sys.meta_path.insert(0, NotInstalled)
err = io.StringIO()
with contextlib.redirect_stderr(err):
    try:
        parse(request["missing_argv"])
        report["missing"] = {"code": None}
    except SystemExit as exc:
        report["missing"] = {"code": exc.code}
report["missing"]["stderr"] = err.getvalue()
sys.meta_path.remove(NotInstalled)

# 2. With the plugin: every flag it registers, through pretrain_gpt.py's own call.
with contextlib.redirect_stdout(io.StringIO()):
    os.environ["WORLD_SIZE"] = "1"
    sys.argv = ["pretrain_gpt.py", *request["flags_argv"]]
    args = arguments.parse_and_validate_args(args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
report["values"] = {dest: getattr(args, dest, "<missing>") for dest in request["dests"]}
parser = arguments.add_megatron_arguments(arguments.argparse.ArgumentParser(allow_abbrev=False))
report["options"] = sorted(o for o in parser._option_string_actions if "mtraining" in o)

# 3. Command lines of the examples and the GPU script: Megatron's and MTraining's start-up checks.
from megatron_mtraining.config import MTrainingConfig
from megatron_mtraining.integration import patches
from megatron_mtraining.integration.args import integration_options

report["commands"] = {}
for label, world_size, argv in request["commands"]:
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            args = parse(argv, world_size)
            arguments.validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
        if args.mtraining:
            config = MTrainingConfig.from_args(args)
            integration_options(args)
            patches.validate_megatron_config(args, config, seq_length=args.seq_length)
        # A baseline command (MTRAINING=0) runs Megatron's own CP attention: --mtraining off.
        report["commands"][label] = dict(ok=args.mtraining != label.endswith(" baseline"),
                                         cp_comm_type=args.cp_comm_type, cp=args.context_parallel_size,
                                         tp=args.tensor_model_parallel_size, dp=args.data_parallel_size,
                                         seq=args.seq_length, impl=args.transformer_impl,
                                         rope_fusion=args.apply_rope_fusion)
    except BaseException as exc:  # SystemExit from argparse included
        report["commands"][label] = dict(ok=False, error=f"{type(exc).__name__}: {exc}")
json.dump(report, open(report_path, "w"), indent=1, default=repr)
'''

# pretrain_gpt.py up to the first step that needs a GPU. argv: MODE (launch | fork) OUT_JSON SCRIPT ARGS...
_PRETRAIN_DRIVER = _SHIMS + r'''
import dataclasses
import json
import os
import runpy

mode, out_path, script, *script_args = sys.argv[1:]
record = {"mode": mode, "initialize_calls": 0, "enable_calls": 0, "stopped": False}

import megatron.training  # imports .initialize and .training, which import initialize_megatron by name
import megatron.training.arguments as arguments
import megatron.training.initialize as initialize
import megatron.training.training as training
from megatron.core.models.gpt import gpt_model
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

from megatron_mtraining.integration import enable, patches


class StopBeforeGPU(Exception):
    pass


arguments.get_device_arch_version = lambda: 9  # validate_args asks the GPU (Hopper) when CP > 1
real_initialize = initialize.initialize_megatron


def cpu_initialize_megatron(*args, **kwargs):
    """The real one asserts CUDA, then sets up NCCL; pretrain_gpt.py has set the args already."""
    record["initialize_calls"] += 1
    record["args_set_at_initialize"] = megatron.training.get_args() is not None


for name, module in list(sys.modules.items()):
    if module is not None and (name == "megatron" or name.startswith("megatron.")):
        for attribute, value in list(vars(module).items()):
            if value is real_initialize:
                setattr(module, attribute, cpu_initialize_megatron)

real_enable = enable.enable_mtraining
hooks = []


def recording_enable(args):
    record["enable_calls"] += 1
    record["initialize_calls_at_enable"] = record["initialize_calls"]
    hooks.append(real_enable(args))
    return hooks[-1]


enable.enable_mtraining = recording_enable


def core_attention(spec):
    core = spec.submodules.self_attention.submodules.core_attention
    return getattr(core, "module", core).__name__  # a ModuleSpec (MTraining's carries its config) or a class


def stop(*args, **kwargs):
    """Stands for training.set_jit_fusion_options: what MTraining set up, then stop."""
    args = megatron.training.get_args()
    record["args"] = {k: v for k, v in vars(args).items()
                      if k.startswith("mtraining") or k in ("seq_length", "context_parallel_size", "world_size",
                                                            "transformer_impl", "attention_dropout")}
    record["patches_installed"] = patches.installed()
    record["core_attention_stock"] = core_attention(get_gpt_layer_local_spec())
    if hooks:
        record["config"] = dataclasses.asdict(hooks[-1].config)
        record["dense_layers"] = hooks[-1].dense_layers
        record["core_attention_hooked"] = core_attention(hooks[-1](get_gpt_layer_local_spec()))
    record["gpt_init_wrapped"] = bool(getattr(gpt_model.GPTModel.__init__, "__mtraining_launch__", False))
    fork_hook = getattr(gpt_model, "transformer_layer_spec_hook", None)
    record["fork_hook_is_enabled_hook"] = bool(hooks) and fork_hook is hooks[-1]
    raise StopBeforeGPU


assert callable(training.set_jit_fusion_options)
training.set_jit_fusion_options = stop

import megatron.core.package_info

record["megatron_core_version"] = megatron.core.package_info.__version__
record["megatron_training_file"] = megatron.training.__file__
try:
    if mode == "launch":
        from megatron_mtraining import launch

        launch.main([script, *script_args])
    else:
        sys.argv = [script, *script_args]
        sys.path.insert(0, os.path.dirname(script))
        runpy.run_path(script, run_name="__main__")
    record["error"] = "pretrain_gpt.py returned without reaching set_jit_fusion_options"
except StopBeforeGPU:
    record["stopped"] = True
except BaseException as exc:
    import traceback

    record["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"
record["after"] = {"patches_installed": patches.installed(),
                   "gpt_init_wrapped": bool(getattr(gpt_model.GPTModel.__init__, "__mtraining_launch__", False)),
                   "parse_args_wrapped": bool(getattr(arguments.parse_args, "__mtraining_launch__", False))}
json.dump(record, open(out_path, "w"), indent=1, default=repr)
'''


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    """(unmodified tree, patched tree), unpacked from the tarball."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed: not run: the real Megatron-LM tree checks")
    tarball = require_tarball("the real Megatron-LM core_r0.19.0 checks (patched parser, examples' and "
                              "scripts/gpu_megatron_lm.sh's command lines, pretrain_gpt.py through the "
                              "launcher and as the patched fork up to the GPU)")
    pristine = unpack(tarball, tmp_path_factory.mktemp("megatron_lm"))
    patched = unpack(tarball, tmp_path_factory.mktemp("megatron_lm_mtraining"))
    apply_patch(patched)
    return pristine, patched


def _python_env(tree: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "LOCAL_", "TORCHELASTIC"))}
    env.update({"PYTHONPATH": str(tree), "PYTHONWARNINGS": "ignore", "CUDA_DEVICE_MAX_CONNECTIONS": "1",
                "RANK": "0", "WORLD_SIZE": "1", "NO_VCS_VERSION": "1", **extra})
    return env


def _run(cmd, env, cwd) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT)
    return proc


def _dry_run(script: Path, **env) -> list:
    """The command an example prints with DRY_RUN=1, as argv."""
    full = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHON": sys.executable, "DRY_RUN": "1", **env}
    proc = subprocess.run([BASH, str(script)], env=full, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"{script.name} DRY_RUN failed:\n{proc.stdout}\n{proc.stderr}"
    return shlex.split(proc.stdout)


def _megatron_argv(command: list) -> tuple:
    """(nproc_per_node, argv after pretrain_gpt.py) of a torch.distributed.run command."""
    assert command[1:3] == ["-m", "torch.distributed.run"], command[:4]
    script = next(i for i, token in enumerate(command) if token.endswith("pretrain_gpt.py"))
    return command[command.index("--nproc_per_node") + 1], command[script + 1:]


def _plugin_flags() -> tuple:
    """argv that sets every flag the plugin registers to a non-default value, their dests, and the
    plugin parser's own values for that argv."""
    parser = add_mtraining_args(argparse.ArgumentParser())
    argv, dests = [], set()
    for action in parser._actions:
        if not any(o.startswith("--") and "mtraining" in o for o in action.option_strings):
            continue
        dests.add(action.dest)
        option = action.option_strings[0]
        if action.nargs == 0:  # --mtraining, --mtraining-deterministic / --no-mtraining-deterministic
            if action.const != action.default:
                argv.append(option)
        elif action.choices:
            argv += [option, str(next(c for c in action.choices if c != action.default))]
        elif action.type is float:
            argv += [option, str(30.0 if action.default is None else action.default / 2)]
        elif action.type is int:
            argv += [option, str(2 if action.default is None else action.default + 1)]
        else:
            raise AssertionError(f"no test value for {option} ({action})")
    expected = vars(parser.parse_args(argv))
    defaults = vars(parser.parse_args([]))
    unchanged = sorted(d for d in dests if expected[d] == defaults[d])
    assert not unchanged, f"the test sets no non-default value for {unchanged}"
    return argv, sorted(dests), {d: expected[d] for d in dests}, sorted(parser._option_string_actions)


def _planner_flags(script_name: str, name: str, tp: int) -> list:
    """The Megatron flags the planner gives a configuration of a flagship launcher's model at 512K on 8 H200s."""
    from megatron_mtraining.plan import Cluster, ModelShape, Workload, configurations, load_profile

    shape = ModelShape() if "qwen" in script_name else ModelShape(
        hidden=4096, heads=32, kv_groups=8, head_dim=128, layers=32, ffn=14336, vocab=128256, qkv_bias=False)
    rows = configurations(shape, Workload(524288, layers="transformer_engine"), Cluster(8, 8),
                          load_profile("nvidia-h200"), tp=tp)["rows"]
    return next(r for r in rows if r["name"] == name)["megatron_flags"]


@pytest.fixture(scope="module")
def parser_report(trees, tmp_path_factory):
    pristine, patched = trees
    tmp = tmp_path_factory.mktemp("parser")
    base = _megatron_argv(_dry_run(SMALL, MEGATRON_LM=str(patched), GPUS_PER_NODE="1",
                                   MTRAINING_ENTRY="fork"))[1]
    flags_argv, dests, expected, plugin_options = _plugin_flags()
    commands = []
    for script in sorted(EXAMPLES.glob("pretrain_*.sh")):
        for entry, tree in (("launcher", pristine), ("fork", patched)):
            for gpus, tp in (("1", "1"), ("8", "1"), ("8", "2")):
                nproc, argv = _megatron_argv(_dry_run(script, MEGATRON_LM=str(tree), GPUS_PER_NODE=gpus,
                                                      MTRAINING_ENTRY=entry, TP=tp))
                commands.append([f"{script.name} {entry} x{gpus}" + (f" tp{tp}" if tp != "1" else ""), nproc, argv])
            # The command for a machine with Transformer Engine (the default there; a dry run prints
            # it here, where TE does not import).
            nproc, argv = _megatron_argv(_dry_run(script, MEGATRON_LM=str(tree), GPUS_PER_NODE="8",
                                                  MTRAINING_ENTRY=entry, TRANSFORMER_IMPL="transformer_engine"))
            commands.append([f"{script.name} {entry} x8 te", nproc, argv])
            if "512k" in script.name:  # the flagship runs: 4 and 8 GPUs, and their baselines (MTRAINING=0)
                for gpus, mtraining in (("4", "1"), ("4", "0"), ("8", "0")):
                    nproc, argv = _megatron_argv(_dry_run(script, MEGATRON_LM=str(tree), GPUS_PER_NODE=gpus,
                                                          MTRAINING_ENTRY=entry, MTRAINING=mtraining,
                                                          TRANSFORMER_IMPL="transformer_engine"))
                    commands.append([f"{script.name} {entry} x{gpus} te" + (" baseline" if mtraining == "0" else ""),
                                     nproc, argv])
                # The planner's flags for a configuration, appended to the launcher's (later flags win), as
                # its start-up line tells a user to: TE's all-to-all on one node, MTraining at TP 2.
                for name, tp, mtraining in (("dense_te_a2a_p2p", 1, "0"), ("mtraining_flat", 2, "1")):
                    nproc, argv = _megatron_argv(_dry_run(script, MEGATRON_LM=str(tree), GPUS_PER_NODE="8",
                                                          MTRAINING_ENTRY=entry, MTRAINING=mtraining,
                                                          TRANSFORMER_IMPL="transformer_engine"))
                    commands.append([f"{script.name} {entry} x8 te planner {name} tp{tp}"
                                     + (" baseline" if mtraining == "0" else ""), nproc,
                                     argv + _planner_flags(script.name, name, tp)])
    gpu_out = _gpu_script_dry_run(tmp)
    assert "[megatron-lm] layers: local (--transformer-impl local: Transformer Engine does not import)" in gpu_out
    # On the GPU machines (TE installed) the runs use TE layers: their CP=2 commands, printed here.
    gpu_te_out = _gpu_script_dry_run(tmp / "te", TRANSFORMER_IMPL="transformer_engine", CP_SIZES="2")
    assert "[megatron-lm] layers: Transformer Engine (not importable here: dry run)" in gpu_te_out
    for prefix, out in (("gpu_megatron_lm.sh", gpu_out), ("gpu_megatron_lm.sh te", gpu_te_out)):
        for line in out.splitlines():
            if line.startswith("[dry-run] "):
                label, command = line[len("[dry-run] "):].split(": CUDA_VISIBLE_DEVICES=", 1)
                nproc, argv = _megatron_argv(shlex.split(command)[1:])
                commands.append([f"{prefix} {label}", nproc, argv])
    assert sum(c[0].startswith("gpu_megatron_lm.sh te ") for c in commands) == 6, gpu_te_out
    assert sum(c[0].startswith("gpu_megatron_lm.sh") for c in commands) == 18, gpu_out
    request = tmp / "request.json"
    request.write_text(json.dumps(dict(missing_argv=base, flags_argv=base + flags_argv, dests=dests,
                                       commands=commands)))
    (tmp / "driver.py").write_text(_PARSER_DRIVER)
    out = tmp / "report.json"
    proc = _run([sys.executable, str(tmp / "driver.py"), str(request), str(out)], _python_env(patched), tmp)
    assert proc.returncode == 0 and out.exists(), f"parser driver failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    report = json.loads(out.read_text())
    report.update(expected=expected, plugin_options=plugin_options, commands_sent=[c[0] for c in commands],
                  tree=str(patched))
    return report


def _gpu_script_dry_run(tmp: Path, **extra) -> str:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", str(tmp)),
           "PYTHON": sys.executable, "DRY_RUN": "1", "OUT": str(tmp / "gpu_out"), "BUILD_DIR": str(tmp / "build"),
           **extra}
    tarball = require_tarball("scripts/gpu_megatron_lm.sh DRY_RUN")
    env["MTRAINING_MEGATRON_LM_TARBALL"] = str(tarball)
    proc = subprocess.run([BASH, str(GPU_SCRIPT)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"gpu_megatron_lm.sh DRY_RUN failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_real_tree_is_the_one_parsed(parser_report):
    assert parser_report["megatron_core_version"] == "0.19.1"
    assert parser_report["arguments_file"].startswith(parser_report["tree"])


def test_patched_parser_takes_every_mtraining_flag(parser_report):
    """parse_and_validate_args of the patched fork (pretrain_gpt.py's call) registers exactly the
    plugin's flags and parses each one, at a non-default value, as the plugin's parser does."""
    mtraining_options = sorted(o for o in parser_report["plugin_options"] if "mtraining" in o)
    assert parser_report["options"] == mtraining_options
    assert parser_report["values"] == parser_report["expected"]


def test_patched_parser_without_plugin_names_interpreter(parser_report):
    missing = parser_report["missing"]
    assert missing["code"] == 2, missing
    err = missing["stderr"]
    python = parser_report["python"]
    assert "--mtraining needs the MTraining plugin" in err, err
    assert "No module named 'megatron_mtraining" in err, err
    assert f"this Python, {python}, cannot import" in err, err
    assert f"{python} -m pip install --no-build-isolation -e" in err, err
    assert "torch.distributed.run" in err, err


def test_example_and_gpu_script_commands_pass_megatron_validation(parser_report):
    """Every launcher command line (examples/pretrain_*.sh at 1 and 8 GPUs, at 8 with TP=2, and at 8
    on Transformer Engine layers; the flagship launchers at 4 GPUs on TE layers and, with MTRAINING=0,
    their baselines at 4 and 8 (Megatron's own CP, --mtraining off), and at 8 with the planner's flags
    appended (TE's all-to-all; MTraining at TP 2); launcher and fork entries; scripts/gpu_megatron_lm.sh's 12 runs and
    its 6 CP=2 runs on TE layers) passes Megatron-LM's parse_args + validate_args and MTraining's
    start-up checks, with --mtraining on."""
    results = parser_report["commands"]
    assert sorted(results) == sorted(parser_report["commands_sent"])
    failed = {label: r for label, r in results.items() if not r.get("ok")}
    assert not failed, json.dumps(failed, indent=1)
    assert results["pretrain_small_mtraining.sh launcher x8"]["cp"] == 8
    for script in ("pretrain_small_mtraining.sh", "pretrain_qwen2.5_3b_512k_mtraining.sh",
                   "pretrain_llama3.1_8b_512k_mtraining.sh"):
        assert {k: results[f"{script} fork x8 tp2"][k] for k in ("tp", "cp", "dp")} == dict(tp=2, cp=4, dp=1), script
    for script in ("pretrain_small_mtraining.sh", "pretrain_qwen2.5_3b_512k_mtraining.sh",
                   "pretrain_llama3.1_8b_512k_mtraining.sh"):
        for entry in ("launcher", "fork"):
            # Transformer Engine layers with Megatron's defaults: fused RoPE (Megatron turns it off
            # itself for YaRN, the Qwen launcher's --position-embedding-type); local ones without it.
            assert results[f"{script} {entry} x8 te"]["impl"] == "transformer_engine", script
            assert results[f"{script} {entry} x8 te"]["rope_fusion"] is ("qwen" not in script), script
            assert (results[f"{script} {entry} x8"]["impl"], results[f"{script} {entry} x8"]["rope_fusion"]) == (
                "local", False), script
    for script in ("pretrain_qwen2.5_3b_512k_mtraining.sh", "pretrain_llama3.1_8b_512k_mtraining.sh"):
        for entry in ("launcher", "fork"):
            for gpus in (4, 8):
                baseline = results[f"{script} {entry} x{gpus} te baseline"]
                assert (baseline["cp"], baseline["cp_comm_type"], baseline["impl"]) == (
                    gpus, ["p2p"], "transformer_engine"), script  # Megatron keeps it as a list
            assert results[f"{script} {entry} x4 te"]["cp"] == 4
            # The planner's flags pass too: TE's all-to-all over one node's CP group, MTraining at TP 2.
            assert results[f"{script} {entry} x8 te planner dense_te_a2a_p2p tp1 baseline"]["cp_comm_type"] == ["a2a"]
            assert {k: results[f"{script} {entry} x8 te planner mtraining_flat tp2"][k] for k in ("tp", "cp")} == dict(
                tp=2, cp=4)
    assert results["gpu_megatron_lm.sh launcher_cp2 save"]["cp"] == 2
    assert results["gpu_megatron_lm.sh fork_cp1 full"]["cp"] == 1
    gpu = {label: r for label, r in results.items() if label.startswith("gpu_megatron_lm.sh")}
    assert {r["impl"] for label, r in gpu.items() if " te " in label} == {"transformer_engine"}
    assert {r["impl"] for label, r in gpu.items() if " te " not in label} == {"local"}
    assert results["gpu_megatron_lm.sh te fork_cp2 resume"]["cp"] == 2


def _pretrain(mode: str, tree: Path, tmp: Path) -> dict:
    """pretrain_gpt.py of ``tree`` with the small example's arguments, as rank 0 of a CP=2 job."""
    command = _dry_run(SMALL, MEGATRON_LM=str(tree), GPUS_PER_NODE="2",
                       MTRAINING_ENTRY="launcher" if mode == "launch" else "fork")
    nproc, argv = _megatron_argv(command)
    argv += ["--mtraining-dense-layers", "1", "--mtraining-top-p", "0.8"]
    driver = tmp / "driver.py"
    driver.write_text(_PRETRAIN_DRIVER)
    out = tmp / "record.json"
    env = _python_env(tree, WORLD_SIZE=nproc, LOCAL_WORLD_SIZE=nproc, LOCAL_RANK="0")
    proc = _run([sys.executable, str(driver), mode, str(out), str(tree / "pretrain_gpt.py"), *argv], env, tmp)
    assert out.exists(), f"driver failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    record = json.loads(out.read_text())
    assert record["stopped"], f"{record.get('error')}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert record["megatron_core_version"] == "0.19.1"
    assert record["megatron_training_file"].startswith(str(tree))
    # initialize_megatron ran once, with the args parsed and set; MTraining's set-up came after it.
    assert record["initialize_calls"] == 1 and record["args_set_at_initialize"]
    assert record["enable_calls"] == 1 and record["initialize_calls_at_enable"] == 1
    args = record["args"]
    assert args["mtraining"] is True and args["mtraining_top_p"] == 0.8 and args["mtraining_dense_layers"] == 1
    assert args["context_parallel_size"] == 2 and args["world_size"] == 2 and args["attention_dropout"] == 0
    assert record["patches_installed"] is True
    assert record["config"]["top_p"] == 0.8 and record["config"]["layout"] == "striped"
    assert record["dense_layers"] == 1
    assert record["core_attention_hooked"] == "MTrainingAttention"
    assert record["core_attention_stock"] != "MTrainingAttention"
    return record


def test_launcher_runs_real_pretrain_gpt_up_to_gpu(trees, tmp_path):
    """python -m megatron_mtraining.launch <unmodified tree>/pretrain_gpt.py <the small example's args>:
    the flags are accepted by the real parse_and_validate_args, MTraining is set up right after
    initialize_megatron and every GPTModel's spec is hooked; all of it is undone when the run ends."""
    record = _pretrain("launch", trees[0], tmp_path)
    assert record["gpt_init_wrapped"] is True
    assert record["after"] == {"patches_installed": False, "gpt_init_wrapped": False, "parse_args_wrapped": False}


def test_fork_runs_real_pretrain_gpt_up_to_gpu(trees, tmp_path):
    """<patched tree>/pretrain_gpt.py --mtraining ...: the patched pretrain() sets MTraining up after
    initialize_megatron and hands the spec hook to GPTModel (gpt_model.transformer_layer_spec_hook)."""
    record = _pretrain("fork", trees[1], tmp_path)
    assert record["fork_hook_is_enabled_hook"] is True
    assert record["gpt_init_wrapped"] is False  # no launcher involved
