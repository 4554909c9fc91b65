import os
import sys

import pytest
import torch

# Modules the tests share with the benchmarks and the demo, which live beside them rather than in
# the package: the synthetic data (benchmarks/synthetic.py, benchmarks/corpus.py) and the demo's
# loop and checkpoints (examples/demo/). Appended, so that nothing installed is shadowed.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _folder in (os.path.join(REPO, "benchmarks"), os.path.join(REPO, "examples", "demo")):
    if _folder not in sys.path:
        sys.path.append(_folder)

# Without a GPU the Triton kernels run in Triton's CPU interpreter. It must be chosen before
# any kernel is decorated, so before megatron_mtraining's kernels are imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    # One language patch per interpreted kernel launch instead of one per helper call (the same
    # computation, about a quarter less time: tests/triton_interpreter.py).
    from triton_interpreter import install as _patch_interpreter_once

    _patch_interpreter_once()

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def pytest_sessionstart(session):
    """A broken Triton interpreter fails the run: its tests would skip, and the run read green.
    MTRAINING_ALLOW_BROKEN_INTERPRETER=1 lets them skip instead (their reasons are listed). A run of
    the GPU tests alone (``-m gpu``) does not use the interpreter."""
    from dist_utils import interpreter_works

    if session.config.getoption("markexpr", "").strip() == "gpu":
        return
    if not interpreter_works() and os.environ.get("MTRAINING_ALLOW_BROKEN_INTERPRETER") != "1":
        import numpy

        pytest.exit(f"Triton's CPU interpreter does not work with numpy {numpy.__version__} (it needs numpy < 2.4), "
                    "and every test of the Triton kernels on the CPU and in the gloo workers needs it: install "
                    "numpy < 2.4, or set MTRAINING_ALLOW_BROKEN_INTERPRETER=1 to skip those tests.", returncode=1)


# The files that take longest on a 2-core CPU machine, longest first. `make test` runs the suite
# on 2 pytest-xdist workers, one file per worker at a time (--dist loadfile) in collection order
# (--no-loadscope-reorder): starting these first keeps one long file from running alone at the end.
LONGEST_FIRST = ("test_megatron_core_0_19.py", "test_faults_ring.py", "test_approx.py", "test_resume.py",
                 "test_ring_scaling.py", "test_sparse_attention.py", "test_megatron_pipeline.py",
                 "test_quality_packed.py", "test_documents.py", "test_megatron_tp.py", "test_failures.py",
                 "test_quality_benchmark.py", "test_ring.py", "test_real_megatron_lm.py", "test_mutations.py",
                 "test_approx_oracle.py")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
    # A stable sort: the order inside each file, and of the other files, is kept.
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))


@pytest.fixture(scope="module")
def megatron_cpu():
    """A gloo world of size 1 with megatron-core's parallel state and the CPU shims, for tests
    that build megatron-core models on the CPU (skipped without megatron-core)."""
    pytest.importorskip("megatron.core")
    import tempfile

    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_mtraining.testing.cpu_shims import apply_cpu_shims

    owns_dist = not dist.is_initialized()
    tmp = tempfile.TemporaryDirectory(prefix="mtraining-megatron-")
    if owns_dist:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp.name, 'store')}", rank=0, world_size=1)
    shims = apply_cpu_shims()
    parallel_state.initialize_model_parallel()
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        shims.remove()
        if owns_dist:
            dist.destroy_process_group()
        tmp.cleanup()


@pytest.fixture
def clean_mtraining_state():
    """Each test starts and ends without the plugin's Megatron patches or packed-document state
    (tests that install them use it). The MTraining config travels in the layer spec: there is
    no module-level config to reset."""
    from megatron_mtraining.integration import packing, patches

    patches.uninstall()
    packing.reset_packing()
    yield
    patches.uninstall()
    packing.reset_packing()
