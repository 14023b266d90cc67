#!/usr/bin/env bash
# Create .venv and install llmflow with its test extras. Installs a CPU build of torch first when
# the machine has no NVIDIA GPU (a bare `torch` requirement would pull a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="${LLMFLOW_TORCH_VERSION:-2.13.0}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=".venv/bin/python -m pip --disable-pip-version-check -q"
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    $PIP install "torch==${TORCH_VERSION}"
  elif curl -fsS -m 5 -o /dev/null https://download.pytorch.org/whl/cpu/ 2>/dev/null; then
    $PIP install "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu
  else
    # No PyTorch index reachable (an offline mirror): the mirror's wheel for this version.
    $PIP install "torch==${TORCH_VERSION}"
  fi
fi
$PIP install -e ".[test]"
echo "llmflow is installed in .venv ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
