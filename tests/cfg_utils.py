"""Compose the project's Hydra config in tests exactly as `train.py` does."""
from __future__ import annotations

import os

from hcp.config.compose import CONF_DIR, compose_config

REPO = os.path.dirname(CONF_DIR)


def compose_cfg(overrides=(), resolve=True, run_dir="/tmp/hcp-test-run"):
    """`hcp.config.compose.compose_config` with a test run directory."""
    return compose_config(overrides, run_dir=run_dir, resolve=resolve)
