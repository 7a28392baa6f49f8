#!/usr/bin/env bash
# One-time set-up, safe to re-run. Installs torch only when none is importable:
# a GPU container keeps the torch it ships; on a CPU machine we take the CPU build
# (HCP_TORCH_SPEC overrides, e.g. HCP_TORCH_SPEC="torch==2.5.1").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install --quiet "${HCP_TORCH_SPEC:-torch==2.13.0}"
fi
"$PY" -m pip install --quiet -e ".[test]"
