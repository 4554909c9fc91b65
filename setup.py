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
    print(f"WARNING (megatron-mtraining): {msg}; installing the pure-Python package "
          "(the PyTorch index conversion is used instead of megatron_mtraining._C)", file=sys.stderr)


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


setup(
    name="megatron-mtraining",
    version="0.1.0",
    description="Vertical-slash sparse attention for Megatron-LM (MTraining)",
    packages=find_packages(include=["megatron_mtraining*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "triton>=3.0", "megatron-core>=0.16", "pybind11>=2.10"],
    extras_require={"test": ["pytest"]},
    zip_safe=False,
    **_extension_kwargs(),
)
