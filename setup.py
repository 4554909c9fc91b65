# Install with `pip install --no-build-isolation .` (or `-e .`): the compiled extension
# megatron_mtraining._C must be built against the torch it runs with. Build isolation would
# install a separate, possibly CUDA-heavy torch into a throwaway build env and compile against
# that one instead.
#
# The extension is optional: with MTRAINING_NO_EXT=1, without torch at build time, or when the
# build fails, the pure-Python package is installed anyway (megatron_mtraining/_ext.py then falls
# back to PyTorch). CUDA kernels are compiled when both a CUDA toolkit and a CUDA build of torch
# are present; TORCH_CUDA_ARCH_LIST picks the GPUs (default "8.0;9.0").
import os
import sys

from setuptools import find_packages, setup


def _warn(msg: str) -> None:
    # A banner, so that it stands out of the build log (pip shows it with -v; at run time the
    # package warns again the first time it needs the extension, and _ext.status() says why).
    bar = "=" * 78
    print(f"\n{bar}\nmegatron-mtraining: the C++/CUDA extension megatron_mtraining._C is NOT built:\n  {msg}.\n"
          "The pure-Python package is installed; the PyTorch index conversion runs instead.\n"
          f"{bar}\n", file=sys.stderr)


def _check_build_tools() -> None:
    """Building a wheel (pip install, editable or not) with setuptools < 70.1 needs the `wheel`
    package, which --no-build-isolation does not install: say so instead of setuptools'
    "invalid command 'bdist_wheel'"."""
    if not any(cmd in sys.argv for cmd in ("bdist_wheel", "editable_wheel")):
        return
    import setuptools
    version = tuple(int(part) for part in setuptools.__version__.split(".")[:2] if part.isdigit())
    if version >= (70, 1):
        return  # bdist_wheel is part of setuptools
    try:
        import wheel  # noqa: F401
    except ImportError:
        sys.exit(f"megatron-mtraining: building needs the `wheel` package with setuptools "
                 f"{setuptools.__version__} (< 70.1). Install the build requirements first:\n"
                 "    pip install 'setuptools>=64' wheel pybind11\n"
                 "then: pip install --no-build-isolation -e .")


def _extension_kwargs() -> dict:
    if os.environ.get("MTRAINING_NO_EXT", "0") not in ("", "0"):
        _warn("MTRAINING_NO_EXT is set, not building the compiled extension")
        return {}
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as exc:
        _warn(f"torch is not importable at build time ({exc}); use pip install --no-build-isolation")
        return {}

    sources = ["csrc/bindings.cpp", "csrc/convert_cpu.cpp"]
    # No -std flag: torch adds the standard its own headers need (C++17 code here compiles as
    # C++17 or C++20; torch >= 2.10 headers require C++20).
    args = {"cxx": ["-O3"]}
    with_cuda = cpp_extension.CUDA_HOME is not None and torch.version.cuda is not None
    if with_cuda:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
        sources.append("csrc/convert_cuda.cu")
        args = {"cxx": ["-O3", "-DWITH_CUDA"], "nvcc": ["-O3", "-DWITH_CUDA"]}
        ext = cpp_extension.CUDAExtension("megatron_mtraining._C", sources, extra_compile_args=args)
    else:
        ext = cpp_extension.CppExtension("megatron_mtraining._C", sources, extra_compile_args=args)
    print(f"megatron-mtraining: building megatron_mtraining._C ({'CPU + CUDA' if with_cuda else 'CPU only'})",
          file=sys.stderr)

    class OptionalBuildExtension(cpp_extension.BuildExtension):
        """Turns a failed compile into a warning, so the package still installs."""

        def run(self):
            try:
                super().run()
            except Exception as exc:  # compiler missing, compile error, ...
                _warn(f"building megatron_mtraining._C failed ({type(exc).__name__}: {exc})")

    return {"ext_modules": [ext], "cmdclass": {"build_ext": OptionalBuildExtension}}


_check_build_tools()

# Tested: CPU (CI) Python 3.11, torch 2.13.0, triton 3.6.0, megatron-core 0.16.1; GPU machines
# Python 3.12, torch 2.11.0+cu130, triton 3.6.0, megatron-core 0.19.2. numpy < 2.4: Triton 3.6's
# CPU interpreter fails with numpy 2.4. triton ships for Linux only.
INSTALL_REQUIRES = [
    "torch>=2.11,<2.14",
    "triton>=3.6,<3.7; platform_system == 'Linux'",
    "numpy<2.4",
    "megatron-core>=0.16,<0.20",
]

# Tested with transformers 5.25.0 and safetensors 0.8.0.
HF_REQUIRES = ["transformers>=4.57", "safetensors>=0.4"]

setup(
    name="megatron-mtraining",
    version="0.1.0",
    description="Vertical-slash sparse attention for Megatron-LM (MTraining)",
    packages=find_packages(include=["megatron_mtraining*"]),
    # The planner's device profiles (python -m megatron_mtraining.plan reads them at run time).
    package_data={"megatron_mtraining.plan": ["profiles/*.json"]},
    # 3.11 and 3.12 are tested; megatron.training (launcher, example, fork patch) needs
    # megatron-core >= 0.17, which needs Python >= 3.12.
    python_requires=">=3.11",
    install_requires=INSTALL_REQUIRES,
    # hf: the Hugging Face converter and the evaluation (python -m megatron_mtraining.convert /
    # .evaluate); training needs neither. The tests use it too (tiny models built from configs).
    extras_require={"test": ["pytest>=7", "einops", *HF_REQUIRES], "hf": HF_REQUIRES},
    classifiers=["Programming Language :: Python :: 3.11", "Programming Language :: Python :: 3.12"],
    zip_safe=False,
    **_extension_kwargs(),
)
