"""Find the config folder and compose the project's Hydra config outside `train.py` (tests,
benchmarks, notebooks)."""
from __future__ import annotations

import os

from omegaconf import DictConfig, OmegaConf

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONF_DIR = next((d for d in (os.path.join(_PACKAGE, "conf"),  # an installed wheel: hcp/conf
                             os.path.join(os.path.dirname(_PACKAGE), "conf"))  # a source tree: conf/
                 if os.path.isfile(os.path.join(d, "config.yaml"))),
                os.path.join(os.path.dirname(_PACKAGE), "conf"))
"""The Hydra config folder: `conf/` of the source tree, or `hcp/conf` of an installed package
(pyproject.toml ships `conf/` there as package data)."""


def config_groups(conf_dir: str = CONF_DIR) -> set[str]:
    """Names of the config groups (`data`, `recipe`, ...): the sub-folders of `conf_dir`."""
    return {d for d in os.listdir(conf_dir) if os.path.isdir(os.path.join(conf_dir, d))}


def compose_config(overrides=(), run_dir: str = "/tmp/hcp-run", resolve: bool = True) -> DictConfig:
    """The config `python train.py OVERRIDES` would get, with `checkpoint.dir` under `run_dir`
    (Hydra's runtime resolvers do not exist outside an app) and `logger=none` unless overridden.

    Raises:
        hcp.config.errors.ConfigError: an override names a key the schema does not declare.
        hydra.errors.ConfigCompositionException: an unknown group option or a wrong type.
    """
    from hydra import compose, initialize_config_dir

    from hcp.config.keys import check_overrides
    from hcp.config.schema import register

    check_overrides(list(overrides), config_groups(), CONF_DIR)
    register()
    with initialize_config_dir(version_base="1.3", config_dir=CONF_DIR):
        cfg = compose("config", overrides=[f"checkpoint.dir={run_dir}/checkpoints", "logger=none",
                                           *overrides])
    if resolve:
        OmegaConf.resolve(cfg)
    return cfg
