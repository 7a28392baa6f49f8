"""Compose the project's Hydra config in tests exactly as `train.py` does."""
from __future__ import annotations

import os

from hcp.config.compose import CONF_DIR, compose_config

REPO = os.path.dirname(CONF_DIR)


def compose_cfg(overrides=(), resolve=True, run_dir="/tmp/hcp-test-run"):
    """`hcp.config.compose.compose_config` with a test run directory."""
    return compose_config(overrides, run_dir=run_dir, resolve=resolve)


CLI_RUN = ("trainer.max_steps=10", "logger=none", "trainer.log_every=1", "trainer.eval_every=0",
           "trainer.eval_samples=16", "trainer.progress_bar=false")
"""Overrides of a short CLI training run whose every step's loss is logged."""


def cli_metrics(run_dir, recipe: str, extra=(), timeout: float = 400) -> list[dict]:
    """Run `python train.py +recipe=RECIPE` with `CLI_RUN` and `extra` overrides into `run_dir`
    (a pathlib.Path) and return its logged steps (metrics.jsonl records with a loss).
    Fails the test with the end of stderr when the run fails."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "train.py", f"+recipe={recipe}", *CLI_RUN, *extra,
                           f"hydra.run.dir={run_dir}"], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(run_dir / "metrics.jsonl") as f:
        return [r for r in map(json.loads, f) if "loss" in r]
