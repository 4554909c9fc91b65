"""The environment is read once, in one place: ``config.py`` (``ENVIRONMENT``, at import), and each
variable reaches the code through the config (``Settings`` / ``MTrainingConfig``), never through a
read at call time. The table in docs/design.md lists the same variables and flags."""

import ast
import datetime
import os
import re
import types

import pytest
import torch

from megatron_mtraining import MTrainingConfig, config
from megatron_mtraining.collective import agreement, transport
from megatron_mtraining.config import ENVIRONMENT_VARIABLES, Settings
from megatron_mtraining.index import value_checks
from megatron_mtraining.ring import comm

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO, "megatron_mtraining")
CUDA = torch.device("cuda")  # a name only


def _environment_reads(path: str):
    """(line, what) of every read of the process environment in one source file."""
    tree = ast.parse(open(path).read(), path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv", "environb"):
            found.append((node.lineno, f"os.{node.attr}"))
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            found += [(node.lineno, f"from os import {a.name}") for a in node.names
                      if a.name in ("environ", "getenv", "environb")]
    return found


def test_only_config_reads_the_environment():
    reads = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, REPO)
                if _environment_reads(path):
                    reads[rel] = _environment_reads(path)
    assert set(reads) == {"megatron_mtraining/config.py"}, reads


def test_the_scan_finds_reads(tmp_path):
    """The scan above is not vacuous: each way of reading the environment is found."""
    source = tmp_path / "m.py"
    source.write_text("import os\nfrom os import getenv\na = os.environ.get('X')\nb = os.getenv('Y')\n")
    assert sorted(what for _, what in _environment_reads(str(source))) == ["from os import getenv", "os.environ",
                                                                             "os.getenv"]


def test_the_environment_is_a_snapshot():
    assert isinstance(config.ENVIRONMENT, types.MappingProxyType)
    assert set(config.ENVIRONMENT) <= set(ENVIRONMENT_VARIABLES)
    with pytest.raises(TypeError):
        config.ENVIRONMENT["MTRAINING_VALIDATE"] = "1"  # read once: nothing writes it later


def test_a_config_given_no_settings_takes_the_environments(monkeypatch):
    assert MTrainingConfig().settings == config.environment_settings()
    monkeypatch.setattr(config, "ENVIRONMENT", types.MappingProxyType({"MTRAINING_BACKWARD_KERNEL": "triton",
                                                                       "GPUS_PER_NODE": "4"}))
    built = MTrainingConfig.from_env(block_size=128)
    assert built.settings.backward_kernel == "triton" and built.inner_ring_size == 4 and built.block_size == 128
    assert MTrainingConfig.from_env(inner_ring_size=2, backward_kernel="hopper").settings.backward_kernel == "hopper"


@pytest.mark.parametrize("variable, value, field, want", [
    ("MTRAINING_FORWARD_KERNEL", "triton", "forward_kernel", "triton"),
    ("MTRAINING_BACKWARD_KERNEL", "hopper", "backward_kernel", "hopper"),
    ("MTRAINING_RING_AGREEMENT", "eager", "ring_agreement", "eager"),
    ("MTRAINING_RING_TIMEOUT_S", "2.5", "ring_timeout_s", 2.5),
    ("MTRAINING_VALIDATE", "1", "validate", True),
    ("MTRAINING_VALIDATE", "0", "validate", False),
])
def test_each_variable_sets_its_field_and_its_flag_wins(variable, value, field, want):
    assert getattr(Settings.from_env({variable: value}), field) == want
    assert getattr(Settings.from_env({}), field) == getattr(Settings(), field)
    flag = ENVIRONMENT_VARIABLES[variable]
    assert flag == "--mtraining-" + field.replace("_", "-")
    other = {"forward_kernel": "auto", "backward_kernel": "auto", "ring_agreement": "deferred",
             "ring_timeout_s": 9.0, "validate": not want}[field]
    args = types.SimpleNamespace(**{"mtraining_" + field: other})
    assert getattr(MTrainingConfig.from_args(args, {variable: value}).settings, field) == other
    assert getattr(MTrainingConfig.from_args(types.SimpleNamespace(), {variable: value}).settings, field) == want


@pytest.mark.parametrize("variable, value, message", [
    ("MTRAINING_FORWARD_KERNEL", "cudnn", "MTRAINING_FORWARD_KERNEL must be one of"),
    ("MTRAINING_RING_AGREEMENT", "lazy", "MTRAINING_RING_AGREEMENT must be one of"),
    ("MTRAINING_RING_TIMEOUT_S", "-3", "MTRAINING_RING_TIMEOUT_S must be a positive number"),
    ("MTRAINING_RING_TIMEOUT_S", "soon", "MTRAINING_RING_TIMEOUT_S must be a positive number"),
    ("MTRAINING_VALIDATE", "yes", "MTRAINING_VALIDATE must be 0 or 1"),
])
def test_a_bad_value_names_the_variable(variable, value, message):
    with pytest.raises(ValueError, match=message):
        Settings.from_env({variable: value})


def test_bad_settings_are_refused():
    for bad in (dict(forward_kernel="cudnn"), dict(ring_agreement="lazy"), dict(ring_timeout_s=0),
                dict(ring_timeout_s=True), dict(validate="1")):
        with pytest.raises(ValueError, match="Settings: "):
            Settings(**bad)
    with pytest.raises(ValueError, match="settings must be a Settings"):
        MTrainingConfig(settings={"validate": True})
    from megatron_mtraining import sparse_attention, VSIndex

    q = torch.zeros(1, 1, 64, 16)
    with pytest.raises(ValueError, match="sparse_attention: settings must be a megatron_mtraining.config.Settings"):
        sparse_attention(q, q, q, VSIndex.dense(1, 1, 64, 64), settings="eager")


def test_the_agreement_mode_comes_from_the_settings(monkeypatch):
    monkeypatch.setattr(agreement.dist, "get_backend", lambda group: "nccl")
    assert agreement.mode(CUDA, None, Settings()) == "deferred"
    assert agreement.mode(CUDA, None, Settings.from_env({"MTRAINING_RING_AGREEMENT": "eager"})) == "eager"
    assert agreement.mode(CUDA, None, Settings.from_env({"MTRAINING_VALIDATE": "1"})) == "eager"  # checks synchronise
    assert agreement.mode(torch.device("cpu"), None, Settings(ring_agreement="deferred")) == "deferred"
    monkeypatch.setattr(agreement.dist, "get_backend", lambda group: "gloo")
    assert agreement.mode(torch.device("cpu"), None, Settings()) == "eager"


def test_validate_turns_the_value_checks_on_for_gpu_tensors():
    assert not value_checks(CUDA, Settings().validate)
    assert value_checks(CUDA, Settings.from_env({"MTRAINING_VALIDATE": "1"}).validate)
    assert value_checks(torch.device("cpu"), False)  # free there: always


class _Work:
    def __init__(self):
        self.waited = []

    def wait(self, timeout=None):
        self.waited.append(timeout)


def test_the_ring_timeout_reaches_the_transfers():
    work = _Work()
    transport.wait_work(work, Settings().ring_timeout_s)
    transport.wait_work(work, Settings.from_env({"MTRAINING_RING_TIMEOUT_S": "10"}).ring_timeout_s)
    assert work.waited == [None, datetime.timedelta(seconds=10)]
    # A ring's transfers wait with the timeout of the topology the call asked for.
    topo = comm.RingTopology(2, 0, comm.Ring(None, [0, 1], 0), comm.Ring(None, [0], 0))
    timed = topo.with_timeout(3.0)
    assert timed.inner.timeout_s == 3.0 and topo.inner.timeout_s is None and timed.inner.group is topo.inner.group
    work = _Work()
    comm.Pending([torch.zeros(1)], [work], ring=timed.inner).wait()
    assert work.waited == [datetime.timedelta(seconds=3)]


def test_triton_interpret_and_the_launcher_variables():
    assert config.interpreting({"TRITON_INTERPRET": "1"}) and not config.interpreting({})
    assert config.ranks_per_node({"LOCAL_WORLD_SIZE": "4", "GPUS_PER_NODE": "8"}) == 4
    assert config.ranks_per_node({"GPUS_PER_NODE": "8"}) == 8 and config.ranks_per_node({}) is None
    assert config.resume_policy({}) == "warn" and config.resume_policy({"MTRAINING_RESUME_CHANGES": "error"}) == "error"
    with pytest.raises(ValueError, match="MTRAINING_RESUME_CHANGES must be one of"):
        config.resume_policy({"MTRAINING_RESUME_CHANGES": "maybe"})


def test_the_design_doc_lists_every_variable_and_its_flag():
    text = open(os.path.join(REPO, "docs", "design.md")).read()
    section = text[re.search(r"^## (\d+\. )?Environment variables", text, re.M).start():]
    section = section[:section.index("\n## ", 1)] if "\n## " in section[1:] else section
    rows = dict(re.findall(r"^\| `([A-Z_]+)` \| ([^|]+) \|", section, re.M))
    assert set(rows) == set(ENVIRONMENT_VARIABLES), rows
    for variable, flag in ENVIRONMENT_VARIABLES.items():
        assert (flag or "none") in rows[variable], (variable, rows[variable])
