#!/usr/bin/env bash
# One-time set-up, safe to re-run. Installs torch only when none is importable:
# a GPU container keeps the torch it ships. Without a GPU (no nvidia-smi) it takes the CPU build
# torch==2.13.0+cpu: from pip's configured indexes and wheel folders when they hold it, else from
# PyTorch's CPU index (about 200 MB, where PyPI's default Linux wheel pulls multi-GB CUDA
# libraries). HCP_TORCH_SPEC installs that spec instead (e.g. HCP_TORCH_SPEC="torch==2.8.0").
# hcp declares no hard torch dependency (pyproject.toml): the install below never pulls a torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
CPU=torch==2.13.0+cpu
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  if [ -n "${HCP_TORCH_SPEC:-}" ] || command -v nvidia-smi >/dev/null 2>&1; then
    "$PY" -m pip install --quiet "${HCP_TORCH_SPEC:-torch==2.13.0}"
  elif ! "$PY" -m pip install --quiet "$CPU" 2>/dev/null; then
    "$PY" -m pip install --quiet "$CPU" --index-url https://download.pytorch.org/whl/cpu
  fi
fi
"$PY" -m pip install --quiet -e ".[test]"
