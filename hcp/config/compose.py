"""Find the config folder and compose the project's Hydra config outside `train.py` (tests,
benchmarks, notebooks)."""
from __future__ import annotations

import os

from omegaconf import DictConfig, OmegaConf

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONF_DIR = next((d for d in (os.path.join(_PACKAGE, "conf"),  # an installed wheel: hcp/conf
                             # a source tree: conf/
                             os.path.join(os.path.dirname(_PACKAGE), "conf"))
                 if os.path.isfile(os.path.join(d, "config.yaml"))),
                os.path.join(os.path.dirname(_PACKAGE), "conf"))
"""The Hydra config folder: `conf/` of the source tree, or `hcp/conf` of an installed package
(pyproject.toml ships `conf/` there as package data)."""


def config_groups(conf_dir: str = CONF_DIR) -> set[str]:
    """Names of the config groups (`data`, `model`, ...): the sub-folders of `conf_dir`, and
    `recipe` (`recipes/`, `hcp.config.recipes`)."""
    from hcp.config.recipes import GROUP

    return {d for d in os.listdir(conf_dir) if os.path.isdir(os.path.join(conf_dir, d))} | {GROUP}


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


_NAMED = {"encoders": "+encoder@encoders.{name}=vit_tiny",
          "projectors": "'+projectors={{{name}:{{}}}}'"}
"""Named-module sections and how a command line adds a module to each (README, several encoders)."""
_NULLABLE = ("vision", "projector")
"""Module sections a recipe or model may set to null (`model=llama_tiny`: a text-only LM)."""


def check_module_names(overrides: list[str]) -> None:
    """Raise ConfigError when an override sets a key of a named module (`encoders.NAME.*`,
    `projectors.NAME.*`) that the composed config does not have (a typo, or a module the
    command line never adds), or a key of `vision` / `projector` where the chosen recipe or
    model sets it to null (a text-only LM: Hydra's own error was an AssertionError traceback).
    Hydra's own message for a named module says to add it with `+`, which then fails on the
    type; this one names the modules there are and how to add one. The names come from
    composing the command line without those overrides (only when a recipe or model is chosen
    for `vision` / `projector`: the base config has both); a composition that fails is left to
    Hydra's run.

    Raises:
        ConfigError: the field is the override's key; the fix names the closest module, the
            override that adds one, or a model that has the module.
    """
    import difflib

    from hcp.config.errors import ConfigError

    def key_of(raw):
        return raw.lstrip("~+").partition("=")[0].strip()

    def section(raw):
        parts = key_of(raw).split(".")
        return ((parts[0], parts[1], key_of(raw), raw.partition("=")[2]) if len(parts) > 2
                and parts[0] in _NAMED else None)

    chosen = any(key_of(o) in ("recipe", "model") for o in overrides)
    nullable = [raw for raw in overrides if chosen and not raw.startswith("+")
                and key_of(raw).split(".")[0] in _NULLABLE and "." in key_of(raw)]
    named = [(raw, section(raw)) for raw in overrides if not raw.startswith("+") and section(raw)]
    if not named and not nullable:
        return
    try:
        cfg = compose_config([o for o in overrides if (o, section(o)) not in named
                              and o not in nullable],
                             resolve=False)
    except Exception:  # noqa: BLE001 - Hydra's run reports what fails to compose
        return
    for raw in nullable:
        if cfg[key_of(raw).split(".")[0]] is None:
            raise ConfigError(key_of(raw), raw.partition("=")[2], f"this config has no "
                              f"`{key_of(raw).split('.')[0]}` (it is null: a text-only LM)",
                              "drop the override, or choose a model with an encoder (e.g. "
                              "+recipe=llava_tiny)")
    for raw, (group, name, key, value) in named:
        there = sorted(cfg[group] or {})
        if name in there:
            continue
        close = difflib.get_close_matches(name, there, n=1, cutoff=0.5)
        fix = (f"did you mean `{group}.{close[0]}`?" if close else
               f"add it on the command line first: {_NAMED[group].format(name=name)}")
        raise ConfigError(key, value, f"this config has no {group[:-1]} named `{name}` "
                          f"({group}: {there or 'none'})", fix)
