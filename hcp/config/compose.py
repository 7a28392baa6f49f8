"""Compose the project's Hydra config outside `train.py` (tests, benchmarks, notebooks)."""
from __future__ import annotations

import os

from omegaconf import DictConfig, OmegaConf

CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                        "conf")


def compose_config(overrides=(), run_dir: str = "/tmp/hcp-run", resolve: bool = True) -> DictConfig:
    """The config `python train.py OVERRIDES` would get, with `checkpoint.dir` under `run_dir`
    (Hydra's runtime resolvers do not exist outside an app) and `logger=none` unless overridden.

    Raises:
        hydra.errors.ConfigCompositionException: an unknown key, group option or wrong type.
    """
    from hydra import compose, initialize_config_dir

    from hcp.config.schema import register

    register()
    with initialize_config_dir(version_base="1.3", config_dir=CONF_DIR):
        cfg = compose("config", overrides=[f"checkpoint.dir={run_dir}/checkpoints", "logger=none",
                                           *overrides])
    if resolve:
        OmegaConf.resolve(cfg)
    return cfg
