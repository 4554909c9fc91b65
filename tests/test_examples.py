"""Checks of examples/ (fast; no GPU): static checks of the shell launchers, and of the
self-contained ``pretrain_gpt_mtraining.py`` (see its section below)."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
import types
import warnings
from pathlib import Path

import pytest

from megatron_mtraining.integration.args import add_mtraining_args

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SCRIPTS = sorted(EXAMPLES.glob("pretrain_*.sh"))  # the launchers; examples/common.sh is what they source
COMMON = EXAMPLES / "common.sh"
EXPECTED = {"pretrain_qwen2.5_3b_512k_mtraining.sh", "pretrain_llama3.1_8b_512k_mtraining.sh",
            "pretrain_small_mtraining.sh"}
BASH = shutil.which("bash")

pytestmark = pytest.mark.skipif(BASH is None, reason="bash not available")
ids = [p.name for p in SCRIPTS]


def _code(path: Path) -> str:
    """Script text without comment-only lines."""
    return "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("#"))


def _launcher_code(path: Path) -> str:
    """What a launcher runs: its own code and the helper it sources."""
    assert 'source "$(dirname "${BASH_SOURCE[0]}")/common.sh"' in path.read_text(), path.name
    return _code(path) + "\n" + _code(COMMON)


def test_expected_scripts_present():
    assert EXPECTED <= {p.name for p in SCRIPTS}
    assert (EXAMPLES / "README.md").is_file()


@pytest.mark.parametrize("script", SCRIPTS, ids=ids)
def test_bash_syntax(script):
    for path in (script, COMMON):
        r = subprocess.run([BASH, "-n", str(path)], capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
    r = subprocess.run([BASH, "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=ids)
def test_uses_launcher_and_mtraining(script):
    assert "set -euo pipefail" in _code(script)
    code = _launcher_code(script)
    assert re.search(r"-m megatron_mtraining\.launch \"\$MEGATRON_LM/pretrain_gpt\.py\"", code)
    assert re.search(r"(?<![\w-])--mtraining(?![\w-])", code)
    for flag in ("--mtraining-top-p", "--mtraining-layout", "--mtraining-block-size",
                 "--mtraining-log-interval", "--mtraining-inner-ring-size", "--attention-dropout 0",
                 "--context-parallel-size", "--bf16", "--micro-batch-size 1", "--mock-data"):
        assert flag in code, flag
    for var in ("GPUS_PER_NODE", "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "DATA_PATH",
                "TOKENIZER_MODEL", "CHECKPOINT_PATH"):
        assert "${" + var in code, var
    assert "--use-flash-attn" not in code


def _run_env(script, **env):
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    base.update(env)
    return subprocess.run(["env", "-i", *(f"{k}={v}" for k, v in base.items()), BASH, str(script)],
                          capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("script", SCRIPTS, ids=ids)
def test_missing_megatron_lm_fails_clearly(script, tmp_path):
    r = _run_env(script)
    assert r.returncode != 0
    assert "MEGATRON_LM is not set" in r.stderr
    r = _run_env(script, MEGATRON_LM=str(tmp_path))     # exists, but no pretrain_gpt.py
    assert r.returncode != 0
    assert "does not contain pretrain_gpt.py" in r.stderr


def test_mtraining_flags_exist():
    parser = add_mtraining_args(argparse.ArgumentParser())
    known = set(parser._option_string_actions)
    seen = set()
    for script in SCRIPTS:
        used = set(re.findall(r"(?<![\w-])--mtraining[\w-]*", _launcher_code(script)))
        assert used, script.name
        unknown = used - known
        assert not unknown, f"{script.name}: {sorted(unknown)} not defined by add_mtraining_args"
        seen |= used
    assert {"--mtraining", "--mtraining-top-p", "--mtraining-layout", "--mtraining-block-size"} <= seen


@pytest.mark.parametrize("script", SCRIPTS, ids=ids)
def test_mtraining_values_parse(script):
    """The literal --mtraining* values in the script are accepted by the parser (choices, types)."""
    parser = add_mtraining_args(argparse.ArgumentParser())
    code = _launcher_code(script)
    argv = ["--mtraining"]
    for flag in ("--mtraining-top-p", "--mtraining-layout", "--mtraining-block-size"):
        m = re.search(re.escape(flag) + r"\s+(\S+)", code)
        assert m, flag
        argv += [flag, m.group(1)]
    args = parser.parse_args(argv)
    assert args.mtraining and args.mtraining_top_p == 0.9
    assert args.mtraining_layout == "striped" and args.mtraining_block_size == 64


def test_common_helper_is_sourced_not_run():
    r = subprocess.run([BASH, str(COMMON)], capture_output=True, text=True, timeout=30)
    assert r.returncode != 0 and "sourced by examples/pretrain_*.sh, not run" in r.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=ids)
def test_launcher_holds_only_its_own_settings(script):
    """The checks, the command and its shared flags live in examples/common.sh, once."""
    code = _code(script)
    assert len(script.read_text().splitlines()) <= 70, script.name
    for shared in ("torch.distributed.run", "MEGATRON_LM", "DRY_RUN", "TRANSFORMER_IMPL=", "--mtraining",
                   "--context-parallel-size", "--transformer-impl", "--mock-data", "exec "):
        assert shared not in code, f"{script.name} repeats {shared!r} (it belongs in common.sh)"
    assert code.rstrip().endswith('mtraining_launch "$@"')


# ------------------------------------------------------------ layer implementation (TE or local)
# Fake modules on PYTHONPATH stand for Transformer Engine and apex: the launchers only ask whether
# `import transformer_engine.pytorch` / `import fused_weight_gradient_mlp_cuda` succeed.

LOCAL_FLAGS = ["--transformer-impl", "local", "--no-rope-fusion", "--no-persist-layer-norm"]


def _fake_modules(root: Path, te: bool = False, apex: bool = False) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    if te:
        (root / "transformer_engine").mkdir(exist_ok=True)
        (root / "transformer_engine" / "__init__.py").write_text('__version__ = "2.20.2"\n')
        (root / "transformer_engine" / "pytorch.py").write_text("")
    if apex:
        (root / "fused_weight_gradient_mlp_cuda.py").write_text("")
    return root


def _dry_run(script, tmp_path, te=False, apex=False, **env):
    tree = tmp_path / "megatron_lm"
    (tree / "megatron" / "training").mkdir(parents=True, exist_ok=True)
    (tree / "pretrain_gpt.py").write_text("")
    fake = _fake_modules(tmp_path / "fake", te=te, apex=apex)
    env = {"DRY_RUN": "1", "GPUS_PER_NODE": "2", "MEGATRON_LM": str(tree), "PYTHON": sys.executable,
           "PYTHONPATH": str(fake), **env}
    r = _run_env(script, **env)
    return r, (shlex.split(r.stdout) if r.returncode == 0 else None)


def _impl_lines(stderr: str):
    return [line for line in stderr.splitlines() if "layers:" in line]


@pytest.mark.parametrize("script", SCRIPTS, ids=ids)
def test_layers_default_to_transformer_engine_when_it_imports(script, tmp_path):
    r, cmd = _dry_run(script, tmp_path, te=True)
    assert r.returncode == 0, r.stderr
    assert cmd[cmd.index("--transformer-impl") + 1] == "transformer_engine"
    assert cmd.count("--transformer-impl") == 1
    assert "--no-rope-fusion" not in cmd and "--no-persist-layer-norm" not in cmd  # Megatron's defaults
    assert "--no-gradient-accumulation-fusion" in cmd  # no apex: megatron-core's output layer needs it off
    lines = _impl_lines(r.stderr)
    assert len(lines) == 1 and "Transformer Engine 2.20.2" in lines[0], r.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=ids)
def test_layers_fall_back_to_local_without_transformer_engine(script, tmp_path):
    r, cmd = _dry_run(script, tmp_path)
    assert r.returncode == 0, r.stderr
    at = cmd.index("--transformer-impl")
    assert cmd[at:at + 4] == LOCAL_FLAGS and cmd.count("--transformer-impl") == 1
    assert "--no-gradient-accumulation-fusion" in cmd
    lines = _impl_lines(r.stderr)
    assert len(lines) == 1, r.stderr
    assert "layers: local" in lines[0] and "Transformer Engine does not import" in lines[0]
    assert "import transformer_engine.pytorch" in lines[0]


def test_layers_override_and_apex(tmp_path):
    script = EXAMPLES / "pretrain_small_mtraining.sh"
    r, cmd = _dry_run(script, tmp_path / "a", te=True, TRANSFORMER_IMPL="local")
    assert r.returncode == 0, r.stderr
    at = cmd.index("--transformer-impl")
    assert cmd[at:at + 4] == LOCAL_FLAGS and len(_impl_lines(r.stderr)) == 1
    # With apex's kernel, Megatron's gradient-accumulation fusion stays on.
    r, cmd = _dry_run(script, tmp_path / "b", te=True, apex=True)
    assert r.returncode == 0 and "--no-gradient-accumulation-fusion" not in cmd, r.stderr
    # TE asked for where it does not import: a dry run prints the TE command (for a machine that has
    # TE), a real run stops before anything starts.
    r, cmd = _dry_run(script, tmp_path / "c", TRANSFORMER_IMPL="transformer_engine")
    assert r.returncode == 0, r.stderr
    assert cmd[cmd.index("--transformer-impl") + 1] == "transformer_engine" and "--no-rope-fusion" not in cmd
    assert "not importable here" in r.stderr
    r, _ = _dry_run(script, tmp_path / "d", TRANSFORMER_IMPL="transformer_engine", DRY_RUN="0")
    assert r.returncode == 1 and not r.stdout
    assert "TRANSFORMER_IMPL=transformer_engine but Transformer Engine does not import" in r.stderr
    r, _ = _dry_run(script, tmp_path / "e", TRANSFORMER_IMPL="te")
    assert r.returncode == 1 and "TRANSFORMER_IMPL=te is none of auto, transformer_engine, local" in r.stderr


def _without_mtraining_flags(cmd):
    out, skip = [], False
    for token in cmd:
        if skip:
            skip = False
            continue
        if token.startswith("--mtraining"):
            skip = token != "--mtraining"  # every --mtraining-* flag of the launchers takes a value
            continue
        out.append(token)
    return out


def _plan_lines(stderr: str):
    return [line for line in stderr.splitlines() if line.startswith("[mtraining plan]")]


def test_launchers_print_the_planners_line_and_run_the_baseline_with_mtraining_0(tmp_path):
    """At start-up a launcher prints the planner's prediction for its own settings (one line on
    stderr, the command itself unchanged); MTRAINING=0 runs the same command without MTraining's
    flags: Megatron's own context parallelism, the baseline."""
    script = EXAMPLES / "pretrain_qwen2.5_3b_512k_mtraining.sh"
    r, cmd = _dry_run(script, tmp_path / "plan", te=True, GPUS_PER_NODE="8", PLAN_PROFILE="nvidia-h200")
    assert r.returncode == 0, r.stderr
    lines = _plan_lines(r.stderr)
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("[mtraining plan] nvidia-h200 x 8, 524288 tokens: this run (mtraining_flat, "
                               "TP 1 x CP 8, recompute full) predicted"), lines[0]
    assert "fastest that fits" in lines[0]
    r, base = _dry_run(script, tmp_path / "plan", te=True, GPUS_PER_NODE="8", PLAN_PROFILE="nvidia-h200", MTRAINING="0")
    assert r.returncode == 0, r.stderr
    assert base == _without_mtraining_flags(cmd) and "--mtraining" not in base and "--cp-comm-type" in base
    assert "this run (dense_te_p2p, TP 1 x CP 8, recompute full)" in _plan_lines(r.stderr)[0]
    # No line where nvidia-smi is missing (auto, the default) or with PLAN_PROFILE=none.
    for env in ({}, {"PLAN_PROFILE": "none"}):
        r, again = _dry_run(script, tmp_path / "plan", te=True, GPUS_PER_NODE="8", PATH="/usr/bin:/bin", **env)
        assert r.returncode == 0 and again == cmd and not _plan_lines(r.stderr), r.stderr
    # A profile the planner does not know: its error, and the run goes on.
    r, again = _dry_run(script, tmp_path / "plan", te=True, GPUS_PER_NODE="8", PLAN_PROFILE="a100")
    assert r.returncode == 0 and again == cmd
    assert "unknown GPU profile 'a100'" in r.stderr and "training goes on" in r.stderr
    r, _ = _dry_run(script, tmp_path / "plan", MTRAINING="yes")
    assert r.returncode == 1 and "MTRAINING=yes is neither 1" in r.stderr


def test_qwen_launcher_describes_the_real_tied_model_and_llama_unties(tmp_path):
    """Qwen2.5-3B ties its embeddings (3.09B parameters); Llama-3.1-8B does not."""
    _, qwen = _dry_run(EXAMPLES / "pretrain_qwen2.5_3b_512k_mtraining.sh", tmp_path / "q")
    _, llama = _dry_run(EXAMPLES / "pretrain_llama3.1_8b_512k_mtraining.sh", tmp_path / "l")
    assert "--untie-embeddings-and-output-weights" not in qwen and "--add-qkv-bias" in qwen
    assert "--untie-embeddings-and-output-weights" in llama


def _converted(folder: Path, padded=151680, divisor=128, tokenizer="/models/qwen2.5-3b") -> Path:
    folder.mkdir(parents=True)
    (folder / "latest_checkpointed_iteration.txt").write_text("release")
    (folder / "mtraining_conversion.json").write_text(json.dumps(
        {"padded_vocab_size": padded, "make_vocab_size_divisible_by": divisor, "tokenizer": tokenizer}))
    return folder


@pytest.mark.parametrize("script", [EXAMPLES / "pretrain_qwen2.5_3b_512k_mtraining.sh",
                                    EXAMPLES / "pretrain_llama3.1_8b_512k_mtraining.sh"], ids=lambda p: p.stem)
def test_pretrained_starts_a_continued_pretraining_run(script, tmp_path):
    """PRETRAINED=CKPT adds --pretrained-checkpoint with the conversion's vocabulary padding (the
    mock data's --vocab-size becomes its rows, the real data's tokenizer defaults to its), keeps
    --load (the run resumes from its own checkpoints once there are some), and refuses a folder
    that is not a converted checkpoint."""
    ckpt = _converted(tmp_path / "ckpt")
    r, cmd = _dry_run(script, tmp_path / "a", PRETRAINED=str(ckpt))
    assert r.returncode == 0, r.stderr
    assert cmd[cmd.index("--pretrained-checkpoint") + 1] == str(ckpt)
    assert cmd[len(cmd) - 1 - cmd[::-1].index("--vocab-size") + 1] == "151680"
    assert cmd[cmd.index("--make-vocab-size-divisible-by") + 1] == "128" and "--load" in cmd
    assert f"continued pretraining from {ckpt}" in r.stderr
    r, cmd = _dry_run(script, tmp_path / "b", PRETRAINED=str(ckpt), DATA_PATH="/data/text_document")
    assert r.returncode == 0, r.stderr
    assert cmd[cmd.index("--tokenizer-model") + 1] == "/models/qwen2.5-3b" and "--mock-data" not in cmd
    r, _ = _dry_run(script, tmp_path / "c", PRETRAINED=str(tmp_path))
    assert r.returncode == 1 and "is not a converted checkpoint" in r.stderr and "hf-to-megatron" in r.stderr


# ---------------------------------------------------------------------------- pretrain_gpt_mtraining.py
# The self-contained training script. megatron.training is CUDA-only (and not in megatron-core
# 0.16), so these tests run the script's pure parts, its entry point against fake
# ``megatron.training`` modules of both pretrain() APIs, and its model / batch / loss functions
# on a CPU GPTModel of megatron-core.

PRETRAIN = EXAMPLES / "pretrain_gpt_mtraining.py"


def _load_pretrain_script(name="pretrain_gpt_mtraining_under_test"):
    spec = importlib.util.spec_from_file_location(name, PRETRAIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def pretrain_script(monkeypatch):
    """The script imported as a module, with ``megatron.training`` unimportable (as on CPU)."""
    monkeypatch.setitem(sys.modules, "megatron.training", None)
    module = _load_pretrain_script()
    yield module
    try:
        from megatron_mtraining.integration import patches
    except ImportError:  # pragma: no cover - megatron-core missing
        return
    patches.uninstall()


def test_pretrain_script_static():
    src = PRETRAIN.read_text()
    tree = ast.parse(src, filename=str(PRETRAIN))
    doc = ast.get_docstring(tree)
    assert doc and "torch.distributed.run --nproc-per-node" in doc and "--mtraining" in doc
    assert "--mtraining-index dense" in doc
    guards = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
    assert guards and "main()" in ast.unparse(guards[0])
    # Only the plugin and light modules at import time; megatron is imported inside functions.
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            assert not any(n.startswith("megatron.") or n == "megatron" for n in names), ast.unparse(node)
    for needle in ("add_mtraining_args", "get_gpt_layer_spec", "enable_mtraining(args)",
                   "pretrain_cfg_container_from_args", "parse_and_validate_args",
                   "get_batch_on_this_cp_rank", "ModelType.encoder_or_decoder", "MockGPTDataset",
                   "BlendedMegatronDatasetBuilder"):
        assert needle in src, needle


def test_pretrain_script_imports_without_megatron_training(pretrain_script):
    assert pretrain_script.BATCH_KEYS == ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")
    assert pretrain_script.train_valid_test_datasets_provider.is_distributed is True
    with pytest.raises(SystemExit) as exc:
        pretrain_script.main()
    msg = str(exc.value)
    assert "megatron.training is not importable" in msg and "0.19" in msg


def test_pretrain_script_extra_args_provider(pretrain_script):
    parser = pretrain_script.extra_args_provider(argparse.ArgumentParser())
    args = parser.parse_args(["--mtraining", "--mtraining-index", "dense"])
    assert args.mtraining and args.mtraining_index == "dense"
    assert pretrain_script.extra_args_provider(parser) is parser  # a parser that has them already


def _ns(**overrides):
    base = dict(mtraining=False, transformer_impl="local", context_parallel_size=1, sft=False,
                dataloader_inter_document_masking=False, hybrid_context_parallel=False, mtp_num_layers=None,
                reset_attention_mask=False, mtraining_dense_layers=0, num_layers=2)
    base.update(overrides)
    return argparse.Namespace(**base)


def test_pretrain_script_check_args(pretrain_script):
    check, error = pretrain_script.check_args, pretrain_script.ConfigError
    check(_ns(mtraining=True, context_parallel_size=4), te_available=False)
    check(_ns(), te_available=False)  # dense baseline, CP = 1, local attention
    check(_ns(transformer_impl="transformer_engine", context_parallel_size=4), te_available=True)
    with pytest.raises(error, match="--mtraining --mtraining-index dense"):
        check(_ns(context_parallel_size=4), te_available=False)  # dense CP baseline without TE
    with pytest.raises(error, match="--transformer-impl local.*--mtraining-index dense"):
        check(_ns(transformer_impl="transformer_engine", context_parallel_size=2), te_available=False)
    with pytest.raises(error, match="--transformer-impl local"):
        check(_ns(mtraining=True, transformer_impl="transformer_engine"), te_available=False)
    with pytest.raises(error, match="inference_optimized"):
        check(_ns(transformer_impl="inference_optimized"), te_available=True)
    with pytest.raises(error, match="--sft.*--mtp-num-layers"):
        check(_ns(sft=True, mtp_num_layers=1), te_available=False)
    with pytest.raises(error, match="--reset-attention-mask"):
        check(_ns(mtraining=True, reset_attention_mask=True), te_available=False)
    check(_ns(reset_attention_mask=True), te_available=False)  # Megatron's attention honours the mask


def test_pretrain_script_api_detection(pretrain_script):
    def new_api(cfg_container, train_valid_test_dataset_provider, model_type, forward_step_func,
                model_provider=None):
        pass

    def old_api(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func,
                process_non_loss_data_func=None, extra_args_provider=None, args_defaults={}):
        pass

    assert pretrain_script.api_of(new_api) == "config"
    assert pretrain_script.api_of(old_api) == "legacy"
    with pytest.raises(SystemExit, match="0.19"):
        pretrain_script.api_of(lambda config, provider: None)


# ----------------------------------------------------------- with megatron-core (0.16 on CPU)


def _transformer_config(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                  use_cpu_initialization=True, gradient_accumulation_fusion=False, bias_dropout_fusion=False,
                  masked_softmax_fusion=False, apply_rope_fusion=False, attention_dropout=0.0, hidden_dropout=0.0)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def _core_attention(spec):
    return spec.submodules.self_attention.submodules.core_attention


def test_pretrain_script_layer_spec(pretrain_script):
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_mtraining import MTrainingConfig
    from megatron_mtraining.integration.core_attention import MTrainingAttention

    config = _transformer_config(normalization="RMSNorm")
    dense = pretrain_script.get_layer_spec(_ns(), config)
    assert _core_attention(dense) is DotProductAttention
    cfg = MTrainingConfig(index="dense", block_size=64)
    sparse = pretrain_script.get_layer_spec(_ns(mtraining=True, mtraining_dense_layers=1), config,
                                            mtraining_config=cfg)
    assert _core_attention(sparse).module is MTrainingAttention
    assert _core_attention(sparse).params == {"mtraining_config": cfg, "dense_layers": 1}
    assert type(sparse.submodules.input_layernorm) is type(dense.submodules.input_layernorm)  # noqa: E721
    assert _core_attention(pretrain_script.get_layer_spec(_ns(), config)) is DotProductAttention  # untouched


# Fake megatron.training modules. The pretrain() signatures are those of megatron-core 0.19.2
# (cfg_container first) and of older Megatron-LM (dataset provider, model provider, ...).
_FAKE_TRAINING_SRC = '''
import argparse
import sys
import types
import warnings

CALLS = []
ARGS = None
TIMERS = {}


def get_args():
    return ARGS


def get_tokenizer():
    return "tokenizer"


class _Timer:
    def start(self, barrier=False):
        pass

    def stop(self, barrier=False):
        pass


def get_timers():
    def timers(name, log_level=0):
        return TIMERS.setdefault(name, _Timer())
    return timers


def _parse(extra_args_provider):
    parser = argparse.ArgumentParser(prog="fake")
    parser.add_argument("--transformer-impl", default="transformer_engine")
    parser.add_argument("--context-parallel-size", type=int, default=1)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--attention-dropout", type=float, default=0.1)
    parser.add_argument("--reset-attention-mask", action="store_true")
    parser.add_argument("--no-create-attention-mask-in-dataloader", action="store_false",
                        dest="create_attention_mask_in_dataloader")
    parser = extra_args_provider(parser)
    return parser.parse_args(sys.argv[1:])


def parse_and_validate_args(extra_args_provider=None, ignore_unknown_args=False, args_defaults={}):
    global ARGS
    ARGS = _parse(extra_args_provider)
    return ARGS


def core_transformer_config_from_args(args, config_class=None):
    return types.SimpleNamespace(attention_dropout=args.attention_dropout,
                                 context_parallel_size=args.context_parallel_size)


def pretrain_cfg_container_from_args(args, model_cfg=None):
    warnings.warn("\\n        It is recommended to use a ModelConfig (e.g. HybridModelConfig) instead")
    return ("cfg", args)


def pretrain_config(cfg_container, train_valid_test_dataset_provider, model_type, forward_step_func,
                    model_provider=None, process_non_loss_data_func=None, get_embedding_ranks=None):
    CALLS.append(dict(api="config", cfg_container=cfg_container, datasets=train_valid_test_dataset_provider,
                      model_type=model_type, forward_step=forward_step_func, model_provider=model_provider))


def pretrain_legacy(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func,
                    process_non_loss_data_func=None, extra_args_provider=None, args_defaults={}):
    global ARGS
    ARGS = _parse(extra_args_provider)
    CALLS.append(dict(api="legacy", datasets=train_valid_test_dataset_provider, model_provider=model_provider,
                      model_type=model_type, forward_step=forward_step_func,
                      extra_args_provider=extra_args_provider))
'''


@pytest.fixture
def fake_training(monkeypatch):
    """``megatron.training`` (+ arguments, argument_utils, utils) as fakes; ``api`` picks pretrain."""
    pytest.importorskip("megatron.core")
    import megatron

    pkg = types.ModuleType("megatron.training")
    pkg.__path__ = []
    exec(textwrap.dedent(_FAKE_TRAINING_SRC), pkg.__dict__)
    pkg.pretrain = pkg.pretrain_config
    monkeypatch.setitem(sys.modules, "megatron.training", pkg)
    monkeypatch.setattr(megatron, "training", pkg, raising=False)
    for short, names in (("arguments", ("parse_and_validate_args", "core_transformer_config_from_args")),
                         ("argument_utils", ("pretrain_cfg_container_from_args",)), ("utils", ())):
        mod = types.ModuleType(f"megatron.training.{short}")
        for name in names:
            setattr(mod, name, getattr(pkg, name))
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
        setattr(pkg, short, mod)
    module = _load_pretrain_script()
    yield types.SimpleNamespace(pkg=pkg, script=module, monkeypatch=monkeypatch)
    from megatron_mtraining.integration import patches

    patches.uninstall()


def _main(fake, *argv):
    fake.monkeypatch.setattr(sys, "argv", ["pretrain_gpt_mtraining.py", *argv])
    fake.script.main()
    return fake.pkg.CALLS[-1]


def test_pretrain_script_main_config_api(fake_training):
    from megatron.core.enums import ModelType

    from megatron_mtraining.integration import patches

    s = fake_training.script
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the ModelConfig recommendation is filtered by the script
        call = _main(fake_training, "--transformer-impl", "local", "--context-parallel-size", "2",
                     "--attention-dropout", "0", "--mtraining", "--mtraining-top-p", "0.8")
    args = fake_training.pkg.ARGS
    assert call["api"] == "config" and call["cfg_container"] == ("cfg", args)
    assert call["model_type"] == ModelType.encoder_or_decoder
    assert call["model_provider"] is s.model_provider and call["forward_step"] is s.forward_step
    assert call["datasets"] is s.train_valid_test_datasets_provider
    assert patches.installed()  # before pretrain() builds model and data
    assert s._state["mtraining_config"].top_p == pytest.approx(0.8)
    assert args.create_attention_mask_in_dataloader is False  # no O(seq^2) mask


def test_pretrain_script_main_dense_baseline(fake_training):
    from megatron_mtraining.integration import patches

    _main(fake_training, "--transformer-impl", "local")
    assert not patches.installed() and fake_training.script._state["mtraining_config"] is None


@pytest.mark.parametrize("argv, message", [
    (("--transformer-impl", "local", "--context-parallel-size", "2"), "--mtraining --mtraining-index dense"),
    (("--transformer-impl", "local", "--mtraining"), "attention_dropout must be 0"),
    (("--transformer-impl", "local", "--attention-dropout", "0", "--mtraining", "--seq-length", "100"),
     "seq_length 100 is not divisible"),
])
def test_pretrain_script_main_errors(fake_training, argv, message):
    from megatron_mtraining.integration import patches

    with pytest.raises(SystemExit) as exc:
        _main(fake_training, *argv)
    assert message in str(exc.value) and "pretrain_gpt_mtraining.py: error" in str(exc.value)
    assert not fake_training.pkg.CALLS and not patches.installed()


def test_pretrain_script_main_legacy_api(fake_training):
    from megatron_mtraining.integration import patches

    fake_training.pkg.pretrain = fake_training.pkg.pretrain_legacy
    call = _main(fake_training, "--transformer-impl", "local", "--mtraining")
    assert call["api"] == "legacy" and call["extra_args_provider"] is fake_training.script.extra_args_provider
    assert call["model_provider"] is fake_training.script.model_provider
    assert fake_training.pkg.ARGS.mtraining is True
    assert not patches.installed()  # done by model_provider, after initialization


SEQ, VOCAB, MBS = 128, 96, 2


def _model_args(**overrides):
    args = _ns(transformer_impl="local", seq_length=SEQ, padded_vocab_size=VOCAB, max_position_embeddings=SEQ,
               fp16_lm_cross_entropy=False, untie_embeddings_and_output_weights=True, position_embedding_type="rope",
               rotary_percent=1.0, rotary_base=10000, use_rope_scaling=False, rope_scaling_factor=8.0,
               rotary_seq_len_interpolation_factor=None, create_attention_mask_in_dataloader=True,
               check_for_nan_in_loss_and_grad=True, attention_dropout=0.0)
    vars(args).update(overrides)
    return args


def test_pretrain_script_model_forward_and_loss(fake_training, megatron_cpu):
    """model_provider -> forward_step -> loss_func on a CPU GPTModel (megatron-core's local spec),
    MTraining's dense index against Megatron's attention: same loss; the loss in the 0.19 form."""
    import torch

    from megatron_mtraining.integration.core_attention import MTrainingAttention

    pkg, s = fake_training.pkg, fake_training.script
    config = _transformer_config()
    pkg.arguments.core_transformer_config_from_args = lambda args, config_class=None: config
    pkg.utils.is_first_or_last_pipeline_stage = lambda vp_stage: True
    pkg.utils.get_batch_on_this_tp_rank = lambda it: dict(next(it))  # the older helper (no 0.19 one in 0.16)

    g = torch.Generator().manual_seed(0)
    data = dict(tokens=torch.randint(0, VOCAB, (MBS, SEQ), generator=g),
                labels=torch.randint(0, VOCAB, (MBS, SEQ), generator=g),
                loss_mask=torch.ones(MBS, SEQ), attention_mask=None,
                position_ids=torch.arange(SEQ).expand(MBS, SEQ))
    data["loss_mask"][:, -3:] = 0

    results = {}
    for mtraining in (False, True):
        s._state.update(configured=False, mtraining_config=None)
        pkg.ARGS = _model_args(mtraining=mtraining, mtraining_index="dense", mtraining_block_size=64)
        torch.manual_seed(1234)
        model = s.model_provider(pre_process=True, post_process=True, config=config)
        assert pkg.ARGS.create_attention_mask_in_dataloader is False
        cores = [layer.self_attention.core_attention for layer in model.decoder.layers]
        assert all(isinstance(c, MTrainingAttention) == mtraining for c in cores)
        output, loss_fn = s.forward_step(iter([data]), model)
        assert output.shape == (MBS, SEQ)
        loss, num_tokens, report = loss_fn(output)
        assert int(num_tokens) == MBS * (SEQ - 3)
        assert loss.item() == pytest.approx((output.float() * data["loss_mask"]).sum().item(), rel=1e-6)
        assert set(report) == {"lm loss"} and report["lm loss"].shape == (2,)
        assert report["lm loss"][1].item() == MBS * (SEQ - 3)
        results[mtraining] = loss.item()
    assert results[True] == pytest.approx(results[False], rel=1e-5)


def test_the_planners_line_knows_the_vocabulary_with_real_data_too(tmp_path):
    """With DATA_PATH the command has no --vocab-size (the tokenizer sets it): the planner's line must
    still size the output layer by the model's vocabulary (128256 for Llama-3.1-8B), not a default."""
    script = EXAMPLES / "pretrain_llama3.1_8b_512k_mtraining.sh"
    r, cmd = _dry_run(script, tmp_path / "mock", te=True, GPUS_PER_NODE="8", PLAN_PROFILE="nvidia-h200")
    assert r.returncode == 0, r.stderr
    mock = _plan_lines(r.stderr)
    r, cmd = _dry_run(script, tmp_path / "data", te=True, GPUS_PER_NODE="8", PLAN_PROFILE="nvidia-h200",
                      DATA_PATH="/data/llama_text_document", TOKENIZER_MODEL="meta-llama/Llama-3.1-8B")
    assert r.returncode == 0, r.stderr
    assert "--vocab-size" not in cmd and "--vocab" not in cmd
    assert len(mock) == 1 and _plan_lines(r.stderr) == mock
