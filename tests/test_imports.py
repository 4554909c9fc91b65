"""The package's import graph: no cycles, no upward imports, kernels that never import each other.

The graph is read from the source with ``ast`` (nothing is imported): one node per module of
``megatron_mtraining``, one edge per intra-package import. Every import statement counts,
the lazy ones inside functions too: a lazy import only defers the cycle or the dependency to
the first call, it does not remove it. An edge goes to the module named, not to the packages
above it that Python initialises on the way (``from ..kernels.step_plan import x`` is an edge to
``kernels.step_plan``, not to ``kernels/__init__``), and ``from pkg import name`` is an edge to
``pkg.name`` when that is a module, else to ``pkg``.

Layers, lowest first (a module may import its own layer and the ones below):
  0 data         config, index, block_index, layout, documents, _ext (and the compiled _C)
  1 kernels      kernels/ (with its own tiers, below)
  2 functions    attention: the single-device attention functions
  3 collective   collective/: what every computation over the CP group shares, the per-call
                 agreement of the ranks' inputs and the transport's error and timeout
  4 approximator approx, block_approx: scores over the CP group, agrees through collective/ (never the ring's)
  5 ring         ring/
  6 integration  integration/ (Megatron)
  7 entry        the package facade (__init__), launch, plan/ (the step-time planner's CLI),
                 testing/ (shims the tests share)

Inside kernels/, tiers (a module imports only kernels modules of a LOWER tier, so the kernels of
tier 3 never import one another; they share code through tiers 0-2):
  0 common; 1 dispatch; 2 triton_common, hopper_common, reference; 3 the kernels (triton_*,
  hopper_fwd, hopper_bwd, column_words, torch_step, dense_kernels, block_plan); 4 step_plan; 5 step; 6 __init__.
"""

from __future__ import annotations

import ast
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "megatron_mtraining"

LAYERS = {"data": 0, "kernels": 1, "functions": 2, "collective": 3, "approximator": 4, "ring": 5, "integration": 6,
          "entry": 7}
# The first component under the package -> its layer.
TOP_LEVEL = {
    "config": "data", "index": "data", "block_index": "data", "layout": "data", "documents": "data", "_ext": "data",
    "_C": "data",
    "kernels": "kernels",
    "attention": "functions",
    "collective": "collective", "approx": "approximator", "block_approx": "approximator", "ring": "ring",
    "integration": "integration",
    "launch": "entry", "plan": "entry", "testing": "entry", "convert": "integration", "evaluate": "entry",
}
KERNEL_TIERS = {
    "common": 0,
    "dispatch": 1,
    "triton_common": 2, "hopper_common": 2, "reference": 2, "column_partials": 2,
    "triton_fwd": 3, "triton_bwd": 3, "triton_delta": 3, "triton_approx": 3, "column_words": 3,
    "hopper_fwd": 3, "hopper_bwd": 3, "torch_step": 3, "dense_kernels": 3, "block_plan": 3,
    "step_plan": 4,
    "step": 5,
    "__init__": 6,
}


def package_modules(root: str) -> dict:
    """Module name -> (file path, is a package's __init__) for every .py file of the package."""
    modules = {}
    base = os.path.join(root, PACKAGE)
    for folder, dirs, files in os.walk(base):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__pycache__")))
        parts = [PACKAGE] + os.path.relpath(folder, base).split(os.sep)
        parts = [p for p in parts if p != "."]
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            if name == "__init__.py":
                modules[".".join(parts)] = (os.path.join(folder, name), True)
            else:
                modules[".".join(parts + [name[:-3]])] = (os.path.join(folder, name), False)
    return modules


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` names (before its ``names``)."""
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    if node.level - 1 > len(package) - 1:
        raise ValueError(f"{module}: relative import beyond the top-level package")
    base = package[:len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph(root: str = REPO) -> dict:
    """Module -> {imported module: first line} over the package (every import, lazy ones included)."""
    modules = package_modules(root)
    known = set(modules) | {f"{PACKAGE}._C"}  # the compiled extension has no .py file
    graph = {}
    for module, (path, is_package) in modules.items():
        with open(path) as f:
            tree = ast.parse(f.read(), filename=path)
        edges = {}
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(module, is_package, node)
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
            for target in targets:
                if target == PACKAGE or target.startswith(PACKAGE + "."):
                    # ``import a.b.c`` names a.b.c; keep the longest known prefix.
                    while target not in known and "." in target:
                        target = target.rsplit(".", 1)[0]
                    if target != module:
                        edges.setdefault(target, node.lineno)
        graph[module] = edges
    return graph


def find_cycles(graph: dict) -> list:
    """Every strongly connected component with more than one module (Tarjan), as sorted lists."""
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def layer_of(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1:
        return LAYERS["entry"]  # the package facade
    if parts[1] not in TOP_LEVEL:
        raise KeyError(f"{module}: no layer; add {parts[1]!r} to TOP_LEVEL in tests/test_imports.py")
    return LAYERS[TOP_LEVEL[parts[1]]]


def kernel_tier(module: str) -> int:
    name = module.split(".")[2] if module.count(".") >= 2 else "__init__"
    if name not in KERNEL_TIERS:
        raise KeyError(f"{module}: no kernels tier; add {name!r} to KERNEL_TIERS in tests/test_imports.py")
    return KERNEL_TIERS[name]


def violations(graph: dict) -> list:
    """Upward imports between layers and kernels tier breaches."""
    found = []
    for module, edges in sorted(graph.items()):
        for target, line in sorted(edges.items()):
            where = f"{module}:{line} imports {target}"
            if layer_of(target) > layer_of(module):
                found.append(f"{where} (upward: layer {layer_of(module)} -> {layer_of(target)})")
            in_kernels = [m.startswith(f"{PACKAGE}.kernels") for m in (module, target)]
            if all(in_kernels) and kernel_tier(target) >= kernel_tier(module):
                found.append(f"{where} (kernels tier {kernel_tier(module)} -> {kernel_tier(target)}: only lower tiers)")
    return found


def test_the_graph_is_read_from_the_whole_package():
    graph = import_graph()
    # Spot checks that the walker sees package modules, relative imports, lazy ones and
    # ``from pkg import module``.
    assert f"{PACKAGE}.kernels.dispatch" in graph[f"{PACKAGE}.kernels.step"]
    assert f"{PACKAGE}.kernels.hopper_fwd" in graph[f"{PACKAGE}.kernels.step"]  # lazy, inside step_forward
    assert f"{PACKAGE}.kernels.triton_approx" in graph[f"{PACKAGE}.approx"]  # lazy
    assert f"{PACKAGE}.collective.agreement" in graph[f"{PACKAGE}.approx"]  # from .collective import agreement
    assert f"{PACKAGE}._ext" in graph[f"{PACKAGE}.kernels.step_plan"]  # from .. import _ext
    assert len(graph) > 40


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles (lazy imports count):\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_upward_imports_and_kernels_never_import_each_other():
    found = violations(import_graph())
    assert not found, "\n".join(found)


def test_the_checks_fail_on_a_cycle_an_upward_import_and_a_sibling_kernel(tmp_path):
    """The walker on a made-up package: each rule catches what it is for."""
    def write(rel, text):
        path = tmp_path / PACKAGE / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    write("__init__.py", "")
    write("config.py", "def f():\n    from .ring import comm\n")  # lazy, upward
    write("kernels/__init__.py", "")
    write("kernels/triton_fwd.py", "from . import triton_bwd\n")  # a sibling kernel
    write("kernels/triton_bwd.py", "from .triton_fwd import x\n")  # ... and back: a cycle
    write("kernels/common.py", "")
    write("ring/__init__.py", "")
    write("ring/comm.py", "from ..config import f\n")  # closes config <-> ring.comm
    write("integration/__init__.py", "from ..testing import shims\n")
    write("approx.py", "from .ring.comm import x\n")  # the approximator reaching into the ring
    write("testing/__init__.py", "")
    write("testing/shims.py", "")
    graph = import_graph(str(tmp_path))
    cycles = find_cycles(graph)
    assert [f"{PACKAGE}.kernels.triton_bwd", f"{PACKAGE}.kernels.triton_fwd"] in cycles
    assert [f"{PACKAGE}.config", f"{PACKAGE}.ring.comm"] in cycles
    found = "\n".join(violations(graph))
    assert f"{PACKAGE}.config:2 imports {PACKAGE}.ring.comm (upward: layer 0 -> 5)" in found
    assert f"{PACKAGE}.approx:1 imports {PACKAGE}.ring.comm (upward: layer 4 -> 5)" in found
    assert f"{PACKAGE}.kernels.triton_fwd:1 imports {PACKAGE}.kernels.triton_bwd (kernels tier 3 -> 3" in found
    assert f"imports {PACKAGE}.testing.shims (upward: layer 6 -> 7)" in found


def test_a_module_without_a_layer_is_named():
    with pytest.raises(KeyError, match="add 'newroom' to TOP_LEVEL"):
        layer_of(f"{PACKAGE}.newroom.x")
