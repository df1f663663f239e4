#!/usr/bin/env bash
# Install the right PyTorch build into the given Python's environment, so nobody has to think about it:
#   - a machine with an NVIDIA driver: the default (CUDA) build from PyPI;
#   - a machine that keeps CPU wheels on disk (pip's find-links): that CPU build, no download;
#   - any other Linux machine: the CPU build from PyTorch's CPU index (a plain `torch` would pull GBs of CUDA);
#   - macOS: PyPI's build (CPU/MPS).
set -euo pipefail
PY=${1:-python3}
if "$PY" -c "import torch" 2>/dev/null; then
  echo "torch already installed: $("$PY" -c 'import torch; print(torch.__version__)')"; exit 0
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  exec "$PY" -m pip install torch
fi
for dir in ${PIP_FIND_LINKS:-} /opt/wheels; do
  wheel=$(ls "$dir"/torch-*+cpu-*.whl 2>/dev/null | sort -V | head -n 1 || true)
  if [ -n "$wheel" ]; then
    version=$(basename "$wheel" | cut -d- -f2 | cut -d+ -f1)
    exec "$PY" -m pip install --find-links "$dir" "torch==$version"
  fi
done
if [ "$(uname -s)" = "Linux" ]; then
  exec "$PY" -m pip install torch --index-url https://download.pytorch.org/whl/cpu
fi
exec "$PY" -m pip install torch
