#!/usr/bin/env bash
# Creates the project's virtual environment (default .venv) and installs the package into it.
#
# * Where torch and triton already import (the GPU machines), the venv sees the system
#   packages and only what is missing is added (megatron-core from ./.whl when carried there).
# * Elsewhere (CPU machines, CI) it installs PyTorch 2.13 CPU (the machine's local wheel),
#   triton 3.6.0 (the GPU image's version; its CPU interpreter runs the kernels in tests),
#   megatron-core, pybind11, pytest, pytest-xdist (make test runs the suite on 2 workers), einops,
#   ninja, and transformers + safetensors (the package's "hf" extra: the converter's tests build
#   tiny Hugging Face models from configs).
# * numpy < 2.4: Triton 3.6's interpreter converts 1-element arrays to scalars, which numpy 2.4
#   turned into an error.
# * The package is installed editable with --no-build-isolation: the C++/CUDA extension must be
#   compiled against the torch it will run with, which build isolation would replace.
set -euo pipefail
VENV=${1:-.venv}
PYTHON=${PYTHON:-python3}
cd "$(dirname "$0")/.."

if "$PYTHON" -c "import torch, triton" >/dev/null 2>&1 && "$PYTHON" -c "import torch; assert torch.cuda.is_available()" >/dev/null 2>&1; then
    echo "[setup] torch and triton importable with CUDA: reusing the host's packages"
    "$PYTHON" -m venv "$VENV"
    # The host python may itself be a venv (--system-site-packages would skip its packages):
    # a .pth file puts the host's site-packages behind the project venv's own.
    "$PYTHON" -c "import site; print('\n'.join(site.getsitepackages()))" \
        > "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_host_packages.pth"
    PIP="$VENV/bin/python -m pip"
    if ! "$VENV/bin/python" -c "import megatron.core" >/dev/null 2>&1; then
        if ls .whl/megatron_core-*.whl >/dev/null 2>&1; then
            $PIP install -q --no-index --no-deps .whl/megatron_core-*.whl
        else
            $PIP install -q --no-deps "megatron-core>=0.16" || echo "[setup] megatron-core not installed (Megatron integration unavailable)"
        fi
    fi
    for mod in pybind11 pytest einops safetensors transformers; do
        "$VENV/bin/python" -c "import $mod" >/dev/null 2>&1 || $PIP install -q "$mod" || true
    done
    "$VENV/bin/python" -c "import xdist" >/dev/null 2>&1 || $PIP install -q "pytest-xdist==3.8.0" || true
else
    echo "[setup] installing CPU dependencies into $VENV (torch, triton, megatron-core, ...:" \
         "a few minutes the first time, once)"
    "$PYTHON" -m venv "$VENV"
    PIP="$VENV/bin/python -m pip"
    $PIP install -q --disable-pip-version-check \
        "torch==2.13.0" "triton==3.6.0" "numpy<2.4" "megatron-core>=0.16" \
        "pybind11>=2.10" "pytest>=7" "pytest-xdist==3.8.0" "einops" "ninja" "setuptools>=64" "wheel" \
        "transformers==5.25.0" "safetensors==0.8.0" 2>&1 \
        | grep -v "^WARNING: Location" || true
    "$VENV/bin/python" -c "import torch, triton, megatron.core, pytest, xdist, transformers, safetensors" \
        || { echo "[setup] dependency installation failed" >&2; exit 1; }
fi

echo "[setup] building and installing megatron_mtraining (editable, with the csrc extension)"
$PIP install -q --no-build-isolation --no-deps -e . 2>&1 | grep -v "^WARNING: Location" || true
"$VENV/bin/python" -c "import megatron_mtraining, megatron_mtraining._ext as e; print('[setup] extension:', e.status())"
