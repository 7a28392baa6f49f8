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


_NAMED = {"encoders": "+encoder@encoders.{name}=vit_tiny", "projectors": "'+projectors={{{name}:{{}}}}'"}
"""Named-module sections and how a command line adds a module to each (README, several encoders)."""


def check_module_names(overrides: list[str]) -> None:
    """Raise ConfigError when an override sets a key of a named module (`encoders.NAME.*`,
    `projectors.NAME.*`) that the composed config does not have (a typo, or a module the
    command line never adds). Hydra's own message says to add it with `+`, which then fails on
    the type; this one names the modules there are and how to add one. The names come from
    composing the command line without those overrides; a composition that fails is left to
    Hydra's run.

    Raises:
        ConfigError: the field is the override's key; the fix names the closest module or the
            override that adds one.
    """
    import difflib

    from hcp.config.errors import ConfigError

    def section(raw):
        key = raw.lstrip("~+").partition("=")[0].strip()
        parts = key.split(".")
        return (parts[0], parts[1], key, raw.partition("=")[2]) if len(parts) > 2 and parts[0] in _NAMED else None

    named = [(raw, section(raw)) for raw in overrides if not raw.startswith("+") and section(raw)]
    if not named:
        return
    try:
        cfg = compose_config([o for o in overrides if (o, section(o)) not in named], resolve=False)
    except Exception:  # noqa: BLE001 - Hydra's run reports what fails to compose
        return
    for raw, (group, name, key, value) in named:
        there = sorted(cfg[group] or {})
        if name in there:
            continue
        close = difflib.get_close_matches(name, there, n=1, cutoff=0.5)
        fix = (f"did you mean `{group}.{close[0]}`?" if close else
               f"add it on the command line first: {_NAMED[group].format(name=name)}")
        raise ConfigError(key, value, f"this config has no {group[:-1]} named `{name}` "
                          f"({group}: {there or 'none'})", fix)
