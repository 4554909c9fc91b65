"""Run an unmodified Megatron-LM training script with the MTraining flags and hooks.

    python -m megatron_mtraining.launch path/to/pretrain_gpt.py <Megatron args> --mtraining ...
    python -m torch.distributed.run --nproc-per-node 8 -m megatron_mtraining.launch pretrain_gpt.py <args> --mtraining ...

This does at run time what ``patches/megatron-lm-core_r0.19.x-mtraining.patch`` does in a fork;
no Megatron source is edited. Every change is a logged, reversible attribute replacement:

1. ``megatron.training.arguments.parse_args`` (and every loaded ``megatron.*`` module that
   imported it by name, e.g. ``megatron.training.initialize``) is wrapped so that the
   ``extra_args_provider`` the script passes is chained with ``add_mtraining_args``; the
   ``--mtraining*`` flags are then accepted. They are not added twice when the parser already
   has ``--mtraining`` (a patched fork, or a script that registers them itself).
2. ``megatron.training.initialize.initialize_megatron`` (and its by-name imports, e.g. in
   ``megatron.training.training``) is wrapped: after it returns, if ``get_args().mtraining`` is
   set, it calls ``integration.enable.enable_mtraining(args)`` (config, ``patches.install``,
   telemetry) and wraps ``GPTModel.__init__`` so its ``transformer_layer_spec`` goes through
   the returned hook (``get_gpt_layer_spec(config, base_spec=spec, dense_layers=...)``).
3. The script runs as ``__main__`` (``runpy.run_path``) with ``sys.argv = [script, *args]`` and
   its directory first on ``sys.path``, like ``python script.py``.

When the script returns (or raises), everything is restored.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import os
import re
import runpy
import sys
from typing import Any, Callable, List, Optional, Sequence, Tuple

logger = logging.getLogger(__name__)

__all__ = ["main", "LaunchError"]

_USAGE = ("usage: python -m megatron_mtraining.launch SCRIPT.py [script args ...] [--mtraining ...]\n"
          "  e.g. python -m torch.distributed.run --nproc-per-node 8 -m megatron_mtraining.launch pretrain_gpt.py "
          "<Megatron args> --mtraining --mtraining-top-p 0.9")

_ARGUMENTS = "megatron.training.arguments"
_INITIALIZE = "megatron.training.initialize"
_GPT_MODEL = "megatron.core.models.gpt.gpt_model"


class LaunchError(RuntimeError):
    """A launcher usage or environment error (reported without a traceback by ``main``)."""


class _Patcher:
    """Reversible attribute replacements, restored in reverse order."""

    def __init__(self) -> None:
        self.applied: List[Tuple[Any, str, Any, Any]] = []

    def replace(self, obj, attribute: str, replacement, reason: str) -> None:
        original = getattr(obj, attribute)
        setattr(obj, attribute, replacement)
        self.applied.append((obj, attribute, original, replacement))
        name = getattr(obj, "__name__", repr(obj))
        logger.info("megatron_mtraining.launch: replaced %s.%s (%s)", name, attribute, reason)

    def replace_everywhere(self, module, attribute: str, replacement, reason: str) -> None:
        """Replace ``module.attribute`` and the same object in loaded megatron modules that
        imported it by name."""
        original = getattr(module, attribute)
        self.replace(module, attribute, replacement, reason)
        for name, mod in list(sys.modules.items()):
            if mod is None or mod is module or not (name == "megatron" or name.startswith("megatron.")):
                continue
            for attr, val in list(vars(mod).items()):
                if val is original:
                    self.replace(mod, attr, replacement, f"{reason}; imported by name")

    def restore(self) -> None:
        while self.applied:
            obj, attribute, original, replacement = self.applied.pop()
            if getattr(obj, attribute, None) is not replacement:
                logger.warning("megatron_mtraining.launch: %s.%s changed after patching; restoring anyway",
                               getattr(obj, "__name__", repr(obj)), attribute)
            setattr(obj, attribute, original)
            logger.info("megatron_mtraining.launch: restored %s.%s", getattr(obj, "__name__", repr(obj)),
                        attribute)


def _has_option(parser, option: str) -> bool:
    return option in getattr(parser, "_option_string_actions", {})


def _chain_provider(script_provider: Optional[Callable]) -> Callable:
    """The script's extra_args_provider (if any) followed by ``add_mtraining_args``."""
    from .integration.args import add_mtraining_args

    def extra_args_provider(parser):
        if script_provider is not None:
            result = script_provider(parser)
            parser = parser if result is None else result
        if not _has_option(parser, "--mtraining"):
            parser = add_mtraining_args(parser)
        return parser

    extra_args_provider.__mtraining_launch__ = True
    return extra_args_provider


def _wrap_parse_args(original: Callable) -> Callable:
    @functools.wraps(original)
    def parse_args(extra_args_provider=None, *args, **kwargs):
        if not getattr(extra_args_provider, "__mtraining_launch__", False):
            extra_args_provider = _chain_provider(extra_args_provider)
        return original(extra_args_provider, *args, **kwargs)

    parse_args.__mtraining_launch__ = True
    return parse_args


def _wrap_gpt_init(original: Callable, spec_hook: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        try:
            bound = signature.bind_partial(self, *args, **kwargs)
        except TypeError:
            return original(self, *args, **kwargs)  # let the original report the bad call
        if bound.arguments.get("transformer_layer_spec") is not None:
            bound.arguments["transformer_layer_spec"] = spec_hook(bound.arguments["transformer_layer_spec"])
        return original(*bound.args, **bound.kwargs)

    __init__.__mtraining_launch__ = True
    return __init__


class _Launcher:
    def __init__(self) -> None:
        self.patcher = _Patcher()
        self.installed_patches = False
        self.gpt_hooked = False
        self.spec_hook = None

    def _enable(self) -> None:
        """After initialize_megatron: install the MTraining patches and the GPT spec hook."""
        import megatron.training as megatron_training

        from .integration import patches
        from .integration.enable import enable_mtraining

        args = megatron_training.get_args()
        if not getattr(args, "mtraining", False):
            return
        if not patches.installed():
            self.installed_patches = True
        self.spec_hook = enable_mtraining(args)
        if not self.gpt_hooked:
            gpt_model = importlib.import_module(_GPT_MODEL)
            hook = lambda spec: self.spec_hook(spec)  # noqa: E731  (the latest settings)
            self.patcher.replace(gpt_model.GPTModel, "__init__", _wrap_gpt_init(gpt_model.GPTModel.__init__, hook),
                                 "transformer_layer_spec -> MTrainingAttention core attention")
            self.gpt_hooked = True
        logger.info("megatron_mtraining.launch: MTraining sparse attention enabled: %s", self.spec_hook.config)
        _print_rank_0(f"> MTraining sparse attention enabled: {self.spec_hook.config}")

    def _wrap_initialize(self, original: Callable) -> Callable:
        @functools.wraps(original)
        def initialize_megatron(*args, **kwargs):
            result = original(*args, **kwargs)
            self._enable()
            return result

        initialize_megatron.__mtraining_launch__ = True
        return initialize_megatron

    def setup(self) -> None:
        try:
            import megatron.training  # noqa: F401
            arguments = importlib.import_module(_ARGUMENTS)
            initialize = importlib.import_module(_INITIALIZE)
        except ImportError as err:
            raise LaunchError(_megatron_import_error(err)) from err
        self.patcher.replace_everywhere(arguments, "parse_args", _wrap_parse_args(arguments.parse_args),
                                        "extra_args_provider chained with add_mtraining_args")
        self.patcher.replace_everywhere(initialize, "initialize_megatron",
                                        self._wrap_initialize(initialize.initialize_megatron),
                                        "MTraining patches and GPT spec hook after initialization")

    def teardown(self, finished: bool = False) -> None:
        """Undo setup; ``finished``: the script returned, so every rank is here and the telemetry's
        last log iteration (if the run ended on one) is logged first."""
        try:
            if self.installed_patches:
                from .integration import patches

                patches.uninstall()
                self.installed_patches = False
            from .integration import telemetry

            telemetry.disable_telemetry(flush=finished)
        finally:
            self.patcher.restore()


# megatron-core 0.17 and later declare Requires-Python >= 3.12 (used when neither the checkout nor
# the installed distribution says it).
_PYTHON_312_FROM = (0, 17)


def _megatron_core_version(core_dir: str) -> Optional[Tuple[int, int, int]]:
    """(major, minor, patch) from ``megatron/core/package_info.py``, read without importing it."""
    try:
        with open(os.path.join(core_dir, "package_info.py"), encoding="utf-8") as fh:
            text = fh.read()
    except OSError:
        return None
    parts = [re.search(rf"^{name} = (\d+)", text, re.M) for name in ("MAJOR", "MINOR", "PATCH")]
    return tuple(int(m.group(1)) for m in parts) if all(parts) else None


def _requires_python(checkout: str, version: Tuple[int, int, int]) -> Optional[str]:
    """The Requires-Python of the megatron-core at ``version``: from the checkout's pyproject.toml,
    else from the installed megatron-core distribution of that version, else the known bound."""
    try:
        import tomllib

        with open(os.path.join(checkout, "pyproject.toml"), "rb") as fh:
            declared = tomllib.load(fh).get("project", {}).get("requires-python")
        if declared:
            return declared
    except (ImportError, OSError, ValueError):
        pass
    try:
        from importlib import metadata

        dist = metadata.distribution("megatron-core")
        if tuple(int(x) for x in re.findall(r"\d+", dist.version)[:3]) == version and dist.metadata["Requires-Python"]:
            return dist.metadata["Requires-Python"]
    except Exception:  # no such distribution, or unreadable metadata: fall back to the known bound
        pass
    return ">=3.12" if version[:2] >= _PYTHON_312_FROM else None


def _python_satisfies(requirement: str) -> bool:
    try:
        from packaging.specifiers import SpecifierSet
    except ImportError:  # packaging ships with pip and setuptools; without it, assume the usual ">=X.Y"
        match = re.fullmatch(r"\s*>=\s*(\d+)\.(\d+)\s*", requirement)
        return not match or sys.version_info[:2] >= (int(match.group(1)), int(match.group(2)))
    return SpecifierSet(requirement).contains(".".join(map(str, sys.version_info[:3])))


def _megatron_import_error(err: ImportError) -> str:
    """Why ``megatron.training`` did not import, naming the real cause: no Megatron-LM on the path,
    a Megatron-LM whose megatron-core needs a newer Python than this one, or an error inside it."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("megatron.training")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return (f"megatron.training is not importable ({err}). The launcher needs Megatron-LM's `megatron` "
                "package (the Megatron-LM checkout, not only megatron-core) on PYTHONPATH, e.g. "
                "PYTHONPATH=/path/to/Megatron-LM")
    megatron_dir = os.path.dirname(list(spec.submodule_search_locations)[0])
    checkout = os.path.dirname(megatron_dir)
    version = _megatron_core_version(os.path.join(megatron_dir, "core"))
    requirement = _requires_python(checkout, version) if version is not None else None
    running = ".".join(map(str, sys.version_info[:3]))
    if requirement and not _python_satisfies(requirement):
        return (f"megatron.training (Megatron-LM at {checkout}) does not import on this Python: its megatron-core "
                f"{'.'.join(map(str, version))} requires Python {requirement} (Requires-Python), and this is "
                f"Python {running} ({sys.executable}). Run the launcher with a Python that satisfies {requirement} "
                f"(with the plugin and megatron-core installed there), or use a Megatron-LM release whose "
                f"megatron-core supports Python {running}. The import failed with: {err}")
    return (f"megatron.training (Megatron-LM at {checkout}) was found but failed to import: {err}. "
            "PYTHONPATH is fine; a dependency of Megatron-LM is missing or incompatible (see the error).")


def _print_rank_0(message: str) -> None:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
            return
    except Exception:  # pragma: no cover - printing must never fail
        pass
    print(message, flush=True)


def _parse_argv(argv: Sequence[str]) -> Tuple[str, List[str]]:
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        raise LaunchError("missing the training script path.\n" + _USAGE)
    script = argv[0]
    if not os.path.isfile(script):
        raise LaunchError(f"training script not found: {script}\n" + _USAGE)
    return script, argv[1:]


def run(argv: Sequence[str]) -> Any:
    """Run ``argv[0]`` (a training script) with ``argv[1:]`` under the MTraining hooks; return
    the script's globals. Raises LaunchError on usage / environment errors."""
    script, rest = _parse_argv(argv)
    script = os.path.abspath(script)
    launcher = _Launcher()
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    finished = False
    try:
        launcher.setup()
        sys.argv = [script] + rest
        sys.path.insert(0, os.path.dirname(script))
        result = runpy.run_path(script, run_name="__main__")
        finished = True
        return result
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path
        launcher.teardown(finished)


def _help() -> str:
    """The usage line and the --mtraining flags the launcher adds to the script's parser."""
    import argparse

    from .integration.args import add_mtraining_args

    parser = argparse.ArgumentParser(prog="python -m megatron_mtraining.launch SCRIPT.py", add_help=False,
                                     usage=argparse.SUPPRESS)
    add_mtraining_args(parser)
    return _USAGE + "\n\nThe script keeps its own arguments; the launcher adds these:\n" + parser.format_help()


def main(argv: Optional[Sequence[str]] = None) -> None:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] in ("-h", "--help"):
        print(_help())
        return
    # Show the plugin's INFO logs (every replaced / restored attribute) without touching the
    # root logger, which Megatron configures itself.
    plugin_logger = logging.getLogger("megatron_mtraining")
    handler = None
    if not plugin_logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler.setLevel(logging.INFO)
        plugin_logger.addHandler(handler)
        saved_level = plugin_logger.level
        if plugin_logger.getEffectiveLevel() > logging.INFO:
            plugin_logger.setLevel(logging.INFO)
    try:
        run(argv)
    except LaunchError as err:
        print(f"megatron_mtraining.launch: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    finally:
        if handler is not None:
            plugin_logger.removeHandler(handler)
            plugin_logger.setLevel(saved_level)


if __name__ == "__main__":
    main()
