"""megatron_mtraining.launch against a fake ``megatron.training`` (megatron-core has none).

The fake modules mimic Megatron-LM's call chain: ``pretrain`` (training.py, which imported
``initialize_megatron`` by name) -> ``initialize_megatron`` (initialize.py, which imported
``parse_args`` by name) -> ``parse_args(extra_args_provider)``. The real
``megatron.core.models.gpt.gpt_model.GPTModel`` is used with a recording ``__init__``.
"""

import json
import sys
import textwrap
import types

import pytest

pytest.importorskip("megatron.core")

import megatron  # noqa: E402
from megatron.core.models.gpt import gpt_model  # noqa: E402

from megatron_mtraining import launch  # noqa: E402
from megatron_mtraining.integration import patches  # noqa: E402

_ARGUMENTS_SRC = '''
import argparse
import sys

def parse_args(extra_args_provider=None, ignore_unknown_args=False):
    parser = argparse.ArgumentParser(prog="pretrain_gpt.py")
    parser.add_argument("--num-layers", type=int, default=2)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    if ignore_unknown_args:
        args, _ = parser.parse_known_args(sys.argv[1:])
    else:
        args = parser.parse_args(sys.argv[1:])
    return args
'''

_GLOBAL_VARS_SRC = '''
_ARGS = None

def get_args():
    return _ARGS

def set_args(args):
    global _ARGS
    _ARGS = args
'''

_INITIALIZE_SRC = '''
from megatron.training.arguments import parse_args
from megatron.training.global_vars import set_args

def initialize_megatron(extra_args_provider=None, ignore_unknown_args=False):
    set_args(parse_args(extra_args_provider, ignore_unknown_args))
'''

_TRAINING_SRC = '''
from megatron.training.initialize import initialize_megatron
from megatron.training.global_vars import get_args

def pretrain(model_provider, extra_args_provider=None):
    initialize_megatron(extra_args_provider=extra_args_provider)
    return model_provider(get_args())
'''

_SCRIPT_SRC = '''
import json
import sys

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.training import get_args, pretrain
from megatron_mtraining.integration import patches


def core_attention_name(spec):
    core = spec.submodules.self_attention.submodules.core_attention
    return getattr(core, "module", core).__name__  # a ModuleSpec (MTraining's carries its config) or a class


def my_provider(parser):
    group = parser.add_argument_group(title="script")
    group.add_argument("--my-flag", type=int, default=0)
    group.add_argument("--out", type=str, required=True)
    return parser


def model_provider(args):
    kw = GPTModel(config=None, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=8)
    pos = GPTModel(None, get_gpt_layer_local_spec(), 8)
    return kw, pos


if __name__ == "__main__":
    kw, pos = pretrain(model_provider, extra_args_provider=my_provider)
    args = get_args()
    result = dict(argv=sys.argv[1:], my_flag=args.my_flag, mtraining=args.mtraining,
                  top_p=args.mtraining_top_p, installed=patches.installed(),
                  kw_core=core_attention_name(kw.seen_spec), pos_core=core_attention_name(pos.seen_spec),
                  local_core=core_attention_name(get_gpt_layer_local_spec()))
    with open(args.out, "w") as f:
        json.dump(result, f)
'''


@pytest.fixture
def fake_megatron(monkeypatch):
    """Fake megatron.training package in sys.modules; the real GPTModel with a recording __init__."""
    pkg = types.ModuleType("megatron.training")
    pkg.__path__ = []
    monkeypatch.setitem(sys.modules, "megatron.training", pkg)
    monkeypatch.setattr(megatron, "training", pkg, raising=False)
    mods = {}
    for short, src in (("arguments", _ARGUMENTS_SRC), ("global_vars", _GLOBAL_VARS_SRC),
                       ("initialize", _INITIALIZE_SRC), ("training", _TRAINING_SRC)):
        name = f"megatron.training.{short}"
        mod = types.ModuleType(name)
        monkeypatch.setitem(sys.modules, name, mod)
        setattr(pkg, short, mod)
        exec(textwrap.dedent(src), mod.__dict__)
        mods[short] = mod
    pkg.get_args = mods["global_vars"].get_args
    pkg.pretrain = mods["training"].pretrain
    pkg.initialize_megatron = mods["initialize"].initialize_megatron

    def recording_init(self, config, transformer_layer_spec, vocab_size, *args, **kwargs):
        object.__setattr__(self, "seen_spec", transformer_layer_spec)

    monkeypatch.setattr(gpt_model.GPTModel, "__init__", recording_init)
    originals = dict(parse_args=mods["arguments"].parse_args,
                     initialize_megatron=mods["initialize"].initialize_megatron,
                     gpt_init=recording_init)
    yield types.SimpleNamespace(pkg=pkg, originals=originals, **mods)
    patches.uninstall()


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "pretrain_gpt.py"
    path.write_text(_SCRIPT_SRC)
    return path


def _check_restored(fake, saved_argv, saved_path):
    o = fake.originals
    assert fake.arguments.parse_args is o["parse_args"]
    assert fake.initialize.parse_args is o["parse_args"]
    assert fake.initialize.initialize_megatron is o["initialize_megatron"]
    assert fake.training.initialize_megatron is o["initialize_megatron"]
    assert fake.pkg.initialize_megatron is o["initialize_megatron"]
    assert gpt_model.GPTModel.__dict__["__init__"] is o["gpt_init"]
    assert not patches.installed()
    assert sys.argv == saved_argv
    assert sys.path == saved_path


def _run(script, out, *flags):
    launch.main([str(script), "--num-layers", "4", "--my-flag", "3", "--out", str(out), *flags])
    return json.loads(out.read_text())


def test_launch_with_mtraining(fake_megatron, script, tmp_path):
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    assert not patches.installed()
    res = _run(script, tmp_path / "r.json", "--mtraining", "--mtraining-top-p", "0.8",
               "--mtraining-dense-layers", "1")
    assert res["argv"][:4] == ["--num-layers", "4", "--my-flag", "3"]
    assert res["my_flag"] == 3
    assert res["mtraining"] is True
    assert res["top_p"] == pytest.approx(0.8)
    assert res["installed"] is True
    assert res["kw_core"] == "MTrainingAttention"
    assert res["pos_core"] == "MTrainingAttention"
    assert res["local_core"] != "MTrainingAttention"  # the hook copies; the stock spec is untouched
    _check_restored(fake_megatron, saved_argv, saved_path)


def test_launch_without_mtraining(fake_megatron, script, tmp_path):
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    res = _run(script, tmp_path / "r.json", "--mtraining-top-p", "0.7")
    assert res["my_flag"] == 3
    assert res["mtraining"] is False
    assert res["top_p"] == pytest.approx(0.7)  # flags accepted even when off
    assert res["installed"] is False
    assert res["kw_core"] != "MTrainingAttention"
    assert res["pos_core"] != "MTrainingAttention"
    _check_restored(fake_megatron, saved_argv, saved_path)


def test_flags_not_added_twice(fake_megatron, script, tmp_path):
    """A parser that already has --mtraining (patched fork, or the script's own provider)."""
    from megatron_mtraining.integration.args import add_mtraining_args

    src = script.read_text().replace("    return parser\n", "    return add_mtraining_args(parser)\n", 1)
    src = "from megatron_mtraining.integration.args import add_mtraining_args\n" + src
    script.write_text(src)
    assert add_mtraining_args  # imported for the script
    res = _run(script, tmp_path / "r.json", "--mtraining")
    assert res["installed"] is True and res["kw_core"] == "MTrainingAttention"


def test_a_finished_run_logs_its_last_telemetry_iteration(fake_megatron, script, tmp_path, monkeypatch):
    """The last log iteration is logged by the next forward; a run that ends on one has none, so the
    launcher flushes it when the script returns (never after an error: the ranks may not all be there)."""
    from megatron_mtraining.integration import telemetry

    flushes = []
    monkeypatch.setattr(telemetry, "disable_telemetry", lambda flush=False: flushes.append(flush))
    _run(script, tmp_path / "r.json", "--mtraining")
    assert flushes[-1] is True
    script.write_text(script.read_text() + "\n    raise RuntimeError('boom')\n")
    with pytest.raises(RuntimeError, match="boom"):
        _run(script, tmp_path / "r.json", "--mtraining")
    assert flushes[-1] is False


def test_script_error_restores(fake_megatron, script, tmp_path):
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    with pytest.raises(SystemExit) as exc:  # argparse error: unknown flag
        _run(script, tmp_path / "r.json", "--mtraining", "--no-such-flag")
    assert exc.value.code == 2
    _check_restored(fake_megatron, saved_argv, saved_path)

    script.write_text(script.read_text() + "\n    raise RuntimeError('boom')\n")
    with pytest.raises(RuntimeError, match="boom"):
        _run(script, tmp_path / "r.json", "--mtraining")
    _check_restored(fake_megatron, saved_argv, saved_path)


def test_usage_errors(fake_megatron, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        launch.main([])
    assert exc.value.code == 2
    assert "missing the training script path" in capsys.readouterr().err

    with pytest.raises(SystemExit) as exc:
        launch.main([str(tmp_path / "nope.py"), "--mtraining"])
    assert exc.value.code == 2
    assert "training script not found" in capsys.readouterr().err


def test_megatron_training_missing(monkeypatch, script, capsys):
    monkeypatch.setitem(sys.modules, "megatron.training", None)  # import raises ImportError
    with pytest.raises(SystemExit) as exc:
        launch.main([str(script), "--mtraining"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "megatron.training is not importable" in err and "PYTHONPATH" in err


def test_help_lists_the_mtraining_flags_and_exits_cleanly(capsys):
    launch.main(["--help"])  # returns: no SystemExit, no training script needed
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m megatron_mtraining.launch SCRIPT.py")
    assert "--mtraining-top-p" in out and "--no-mtraining-deterministic" in out


# ------------------------------------------------------------------ the module alias and import diagnostics

def _run_launcher(tmp_path, *argv, pythonpath=()):
    """``python -m megatron_mtraining.launch`` in a fresh process (the published entry point)."""
    import os
    import subprocess

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*map(str, pythonpath), repo]))
    return subprocess.run([sys.executable, "-m", "megatron_mtraining.launch", *argv], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_published_module_is_the_launcher(tmp_path):
    import importlib.util

    assert importlib.util.find_spec("megatron_mtraining.integration.launch") is None  # one launcher module
    assert launch.__all__ == ["main", "LaunchError"] and callable(launch.run)
    proc = _run_launcher(tmp_path, "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m megatron_mtraining.launch SCRIPT.py")
    assert "--mtraining-top-p" in proc.stdout


def _fake_checkout(root, minor, requires_python, failure):
    """A Megatron-LM checkout whose megatron.training raises ``failure`` on import."""
    (root / "megatron" / "core").mkdir(parents=True)
    (root / "megatron" / "training").mkdir()
    (root / "megatron" / "__init__.py").write_text("")
    (root / "megatron" / "core" / "__init__.py").write_text("")
    (root / "megatron" / "core" / "package_info.py").write_text(f"MAJOR = 0\nMINOR = {minor}\nPATCH = 2\n")
    (root / "megatron" / "training" / "__init__.py").write_text(f"raise {failure}\n")
    if requires_python is not None:
        (root / "pyproject.toml").write_text(f'[project]\nname = "megatron-core"\n'
                                             f'requires-python = "{requires_python}"\n')
    (root / "pretrain_gpt.py").write_text("print('never runs')\n")
    return root


@pytest.mark.parametrize("requires_python", [">=99.0", None])
def test_too_old_python_is_named_not_pythonpath(tmp_path, requires_python):
    """A Megatron-LM checkout whose megatron-core needs a newer Python (megatron-core >= 0.17 needs
    3.12; from its pyproject.toml when present) fails with that cause, not a PYTHONPATH hint."""
    minor = 19 if requires_python is None else 16
    if requires_python is None and sys.version_info >= (3, 12):
        pytest.skip("the known bound (megatron-core >= 0.17 needs Python 3.12) holds on this Python")
    tree = _fake_checkout(tmp_path / "Megatron-LM", minor, requires_python,
                          "ImportError(\"cannot import name 'override' from 'typing'\")")
    proc = _run_launcher(tmp_path, str(tree / "pretrain_gpt.py"), "--mtraining", pythonpath=[tree])
    assert proc.returncode == 2
    expected = requires_python or ">=3.12"
    running = ".".join(map(str, sys.version_info[:3]))
    assert f"megatron-core 0.{minor}.2 requires Python {expected} (Requires-Python)" in proc.stderr, proc.stderr
    assert f"this is Python {running}" in proc.stderr and "override" in proc.stderr
    assert "PYTHONPATH" not in proc.stderr


def test_an_error_inside_megatron_lm_is_not_blamed_on_pythonpath(tmp_path):
    tree = _fake_checkout(tmp_path / "Megatron-LM", 16, ">=3.8", "ModuleNotFoundError(\"No module named 'einops'\")")
    proc = _run_launcher(tmp_path, str(tree / "pretrain_gpt.py"), "--mtraining", pythonpath=[tree])
    assert proc.returncode == 2
    assert "was found but failed to import: No module named 'einops'" in proc.stderr, proc.stderr
    assert "PYTHONPATH is fine" in proc.stderr
