#!/usr/bin/env bash
# Install PyTorch into the given interpreter without pulling a multi-GB CUDA build onto a
# machine that has no NVIDIA GPU.  Usage: tools/install_torch.sh PYTHON VERSION
set -euo pipefail
py=$1
version=$2
if "$py" -c "import torch" 2>/dev/null; then
    echo "torch $("$py" -c 'import torch; print(torch.__version__)') is already installed"
    exit 0
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "NVIDIA GPU found: installing the CUDA build of torch $version"
    "$py" -m pip install "torch==$version"
elif [ "$(uname -s)" = Darwin ]; then
    echo "macOS: PyPI's torch $version is the CPU/MPS build"
    "$py" -m pip install "torch==$version"
else
    echo "No NVIDIA GPU: installing the CPU build of torch $version"
    # A local wheel or mirror (pip's find-links) first, then PyTorch's CPU index.
    "$py" -m pip install "torch==$version+cpu" 2>/dev/null \
        || "$py" -m pip install "torch==$version" \
            --index-url https://download.pytorch.org/whl/cpu \
            --extra-index-url https://pypi.org/simple
fi
