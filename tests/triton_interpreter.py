"""Triton's CPU interpreter for the tests, without two of its costs that compute nothing.

1. Triton 3.6's interpreter rebinds the builtins of ``triton.language`` to itself around each kernel
   launch (``GridExecutor.__call__`` calls ``_patch_lang`` and restores the modules afterwards), and
   again at every call of a ``@triton.jit`` helper inside the kernel (``InterpretedFunction.__call__``)
   while the modules are still patched: that second patch rebinds nothing new (a builtin already
   rebound no longer counts as one) but scans the modules with ``inspect.getmembers`` each time,
   tens of thousands of scans per test. It is skipped while every language module the helper sees
   is patched: by the launch, or by an earlier helper's patch in the same launch (one that saw a
   module the launch did not, as Triton's own ``tl.zeros`` sees ``triton.language.core``: Triton
   never restores that patch, so it is in place until the launch ends).
2. Every integer ``+``, ``-`` and ``*`` of a kernel also computes an overflow check in int64
   (``sanitize_overflow``) whose only use is a ``device_assert``, which the interpreter drops
   (its options have ``debug`` False, and it never sets them otherwise). The check is not computed
   while ``debug`` is False, so nothing that could fail is dropped.

What runs, on which values, is Triton's own code: outputs and gradients are bitwise the same.
``install()`` changes nothing where the interpreter is not in use, and it leaves a Triton whose
interpreter differs from 3.6's as it is (it returns False).
"""

from __future__ import annotations

import dataclasses

_MARK = "__mtraining_tests_patch_once__"


def install() -> bool:
    """Patch the interpreter (once per process); True when it is (now or already) patched."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    current = getattr(interpreter, "_patch_lang", None)
    if getattr(current, _MARK, False):
        return True
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    expected = all(hasattr(interpreter, name) for name in ("GridExecutor", "InterpretedFunction", "tl"))
    if current is None or not expected or not dataclasses.is_dataclass(options) \
            or not hasattr(options, "sanitize_overflow"):
        return False
    original = current
    languages = (interpreter.tl, interpreter.tl.core)
    langs_of = {}   # function -> the language modules in its globals (what _patch_lang patches)
    launches = []   # the language modules patched during the launch running now (one at a time)

    class _LaunchScope:
        """The launch's scope: restoring it also ends the launch."""

        def __init__(self, scope):
            self.scope = scope

        def restore(self):
            launches.pop()
            self.scope.restore()

    def patch_lang(fn):
        langs = langs_of.get(fn)
        if langs is None:
            langs = langs_of[fn] = frozenset(id(v) for v in fn.__globals__.values() if any(v is m for m in languages))
        if launches:  # a helper called inside a launch: Triton drops the scope it gets
            if not langs <= launches[-1]:
                original(fn)  # its patch, never restored, stays in place for the rest of the launch
                launches[-1] = launches[-1] | langs
            return None
        scope = original(fn)
        launches.append(langs)
        return _LaunchScope(scope)

    setattr(patch_lang, _MARK, True)
    interpreter._patch_lang = patch_lang
    if not options.debug:  # the overflow check only feeds device_assert, a no-op without debug
        builder.options = dataclasses.replace(options, sanitize_overflow=False)
    return True
