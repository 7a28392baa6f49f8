#!/usr/bin/env bash
# The README's test command: set up, then run the whole suite (slow tests included), or only the
# tests named: `bash scripts/test.sh tests/test_config.py -x` (pytest's testpaths is tests/).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python}" -m pytest "$@"
