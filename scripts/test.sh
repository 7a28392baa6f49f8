#!/usr/bin/env bash
# The README's test command: set up, then run the whole suite (slow tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python}" -m pytest tests "$@"
