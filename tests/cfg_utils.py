"""Compose the project's Hydra config in tests exactly as `train.py` does."""
from __future__ import annotations

import os

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from hcp.config.schema import register

CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")
REPO = os.path.dirname(CONF_DIR)


def compose_cfg(overrides=(), resolve=True, run_dir="/tmp/hcp-test-run"):
    """The composed config for `overrides`; `checkpoint.dir` defaults under `run_dir` because
    Hydra's runtime resolvers are not available outside an app."""
    register()
    with initialize_config_dir(version_base="1.3", config_dir=CONF_DIR):
        cfg = compose("config", overrides=[f"checkpoint.dir={run_dir}/checkpoints", "logger=none",
                                           *overrides])
    if resolve:
        OmegaConf.resolve(cfg)
    return cfg
