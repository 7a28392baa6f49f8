"""Unknown config keys: fail naming the closest known key, with or without Hydra's `+`.

Hydra's structured config rejects `trainer.max_step=10` itself, but its hint
(`+trainer.max_step=10`) adds the key past the schema and the run trains with the typo ignored. Two
checks close both paths: `check_overrides` reads the command line before Hydra composes (so the
typo's message names the closest key instead of Hydra's `+` hint) and `check_known_keys` walks the
composed config against the schema (a key added with `+`, or by a YAML file, that no field
declares).
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import typing

from hcp.config.errors import ConfigError
from hcp.config.schema import HCPConfig


def _dataclass_of(tp):
    """The dataclass inside `tp` (`Optional[X]`, `X`), else None (also for `Dict[str, X]`:
    `_named_of`)."""
    if dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) is dict:
        return None
    for arg in typing.get_args(tp):
        if dataclasses.is_dataclass(arg):
            return arg
    return None


def _named_of(tp):
    """X of a `Dict[str, X]` field whose values are dataclasses (named modules), else None."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is dict and len(args) == 2 and dataclasses.is_dataclass(args[1]):
        return args[1]
    return None


def _fields(cls) -> dict:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def known_keys(cls=HCPConfig, prefix: str = "") -> list[str]:
    """Every dotted key the schema declares, nested sections included (`trainer.max_steps`)."""
    keys = []
    for name, tp in _fields(cls).items():
        keys.append(prefix + name)
        sub = _dataclass_of(tp)
        if sub is not None:
            keys += known_keys(sub, f"{prefix}{name}.")
    return keys


def _unknown(key: str, value) -> ConfigError:
    close = difflib.get_close_matches(key, known_keys(), n=1, cutoff=0.6)
    if not close:  # compare the last part with the section's own keys
        section, _, leaf = key.rpartition(".")
        siblings = [k for k in known_keys() if k.rpartition(".")[0] == section]
        close = [k for k in siblings if k.rpartition(".")[2] in difflib.get_close_matches(
            leaf, [s.rpartition(".")[2] for s in siblings], n=1, cutoff=0.5)]
    fix = f"did you mean `{close[0]}`?" if close else "see hcp/config/schema.py for the keys"
    return ConfigError(key, value, "no such config key (a `+` does not make it one)", fix)


def lookup(key: str, value=None):
    """The schema field type of dotted `key`, or raise ConfigError naming the closest key.

    A key below a field that is not a dataclass (a list index, `launcher.nproc_per_node`) is
    left to Hydra's own type checks."""
    cls, parts = HCPConfig, key.split(".")
    for i, part in enumerate(parts):
        fields = _fields(cls)
        if part not in fields:
            raise _unknown(key, value)
        sub = _dataclass_of(fields[part])
        named = _named_of(fields[part])
        if named is not None and i + 2 < len(parts):  # encoders.NAME.key: check key in X
            return lookup_in(named, parts[i + 2:], key, value)
        if sub is None:
            scalar = {a for a in (typing.get_args(fields[part]) or (fields[part],))
                      if a is not type(None)}
            # `packing.profile`: no section
            if i < len(parts) - 1 and scalar <= {str, int, float, bool}:
                raise _unknown(key, value)
            return fields[part]
        if i == len(parts) - 1:
            return sub
        cls = sub
    return cls


def lookup_in(cls, parts: list[str], key: str, value=None):
    """`lookup` of `parts` below dataclass `cls` (the rest of `key`, named in errors)."""
    for i, part in enumerate(parts):
        fields = _fields(cls)
        if part not in fields:
            raise ConfigError(key, value, "no such config key (a `+` does not make it one)",
                              f"the keys of {cls.__name__} are {sorted(fields)}")
        sub = _dataclass_of(fields[part])
        if sub is None or i == len(parts) - 1:
            return sub or fields[part]
        cls = sub
    return cls


def check_known_keys(cfg, cls=HCPConfig, prefix: str = "") -> None:
    """Raise ConfigError for any key of the composed `cfg` the schema does not declare."""
    fields = _fields(cls)
    for key in cfg:
        value = cfg._get_node(key)
        if key not in fields:
            raise _unknown(prefix + str(key), value._value() if hasattr(value, "_value") else value)
        sub = _dataclass_of(fields[key])
        if sub is not None and hasattr(value, "keys") and not value._is_none():
            check_known_keys(value, sub, f"{prefix}{key}.")
        named = _named_of(fields[key])
        if named is not None and hasattr(value, "keys") and not value._is_none():
            for name in value:
                check_known_keys(value[name], named, f"{prefix}{key}.{name}.")


_SWEEP = (",", "(", "[", "{", "$")
"""Characters of Hydra's sweep and interpolation syntax: such a value is left to Hydra."""


def _describe(tp) -> str:
    """A schema type in words, for errors: `Optional[list[int]]` -> `a list of integers or null`."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is typing.Union:
        return " or ".join([_describe(a) for a in args] + ["null"])
    if dataclasses.is_dataclass(tp):
        return f"a mapping of {tp.__name__}'s keys ({', '.join(_fields(tp))})"
    if typing.get_origin(tp) is list:
        inner = _describe(args[0]).split(" ", 1) if args else ["", "value"]
        head, _, rest = inner[1].partition(" ")
        return f"a list of {head}s" + (f" {rest}" if rest else "")
    if typing.get_origin(tp) is dict:
        return "a mapping"
    return {int: "an integer", float: "a number", bool: "true or false",
            str: "a string"}.get(tp, str(tp))


def _base(tp):
    """`X` of `Optional[X]`, else `tp`."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if typing.get_origin(tp) is typing.Union and len(args) == 1 else tp


def _example(key: str, tp) -> str:
    """The fix for a wrongly typed `key`: a section's key or mapping (`llm.layout.tp=1`), else
    the type in words with a sample value where one is obvious (`KEY=4`, `KEY=[1, 2]`)."""
    base = _base(tp)
    if dataclasses.is_dataclass(base):
        first = dataclasses.fields(base)[0]
        return (f"set one of its keys, e.g. {key}.{first.name}={first.default}, or give a mapping, "
                f"e.g. '{key}={{{first.name}: {first.default}}}'")
    samples = {int: "4", float: "1e-4", bool: "true"}
    sample = samples.get(base)
    if typing.get_origin(base) is list and typing.get_args(base)[0] in samples:
        sample = f"[{samples[typing.get_args(base)[0]]}, {samples[typing.get_args(base)[0]]}]"
    return f"give {key} {_describe(tp)}" + (f", e.g. {key}={sample}" if sample else "")


def field_type(key: str):
    """The schema type of the field that dotted `key` names exactly, else None (a key below a
    list or a free-form field, whose type Hydra checks)."""
    cls, parts, i = HCPConfig, key.split("."), 0
    while i < len(parts):
        fields = _fields(cls)
        if parts[i] not in fields:
            return None
        tp = fields[parts[i]]
        if i == len(parts) - 1:
            return tp
        named = _named_of(tp)
        if named is not None:  # encoders.NAME.rest
            if i + 2 == len(parts):
                return named
            cls, i = named, i + 2
            continue
        cls = _dataclass_of(tp)
        if cls is None:
            return None
        i += 1
    return None


def _check_value(raw: str, key: str, value: str) -> None:
    """Raise ConfigError when override `raw` (`key=value`) gives field `key` a value of the
    wrong type, e.g. `trainer.max_steps=abc` or `'llm.layout=[2,2]'` (Hydra's own message for
    this is a multi-line block, or "Cannot merge DictConfig with ListConfig"). Sweeps,
    interpolations and values Hydra cannot parse are left to Hydra."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import MISSING, OmegaConf

    lookup(key, value)  # an unknown key: the closest one
    exact = field_type(key)
    if exact is None or not value or "$" in value:
        return
    try:
        override = OverridesParser.create().parse_overrides([raw.lstrip("~")])[0]
    except Exception:  # noqa: BLE001 - a syntax error: Hydra's own message
        return
    if override.is_sweep_override():
        return
    parsed = override.value()
    one = dataclasses.make_dataclass("_One", [("v", exact, dataclasses.field(default=MISSING))])
    try:
        OmegaConf.merge(OmegaConf.structured(one), {"v": parsed})
    except Exception as e:  # noqa: BLE001 - OmegaConf's validation and merge errors
        inner = str(getattr(e, "full_key", None) or "v").split(".")[1:]  # below the field: name it
        for part in inner:
            if (not isinstance(parsed, dict)
                or part not in parsed or field_type(f"{key}.{part}") is None):
                break
            key, parsed, exact = f"{key}.{part}", parsed[part], field_type(f"{key}.{part}")
        raise ConfigError(key, parsed, f"expects {_describe(exact)}",
                          _example(key, exact)) from None


def _check_group_choice(group: str, value: str, conf_dir: str, prefix: str = "") -> None:
    """Raise ConfigError when `group=value` names no `conf/<group>/<value>.yaml` (a recipe: no
    `recipes/<value>.yaml`); the suggestion keeps the override's `prefix` (`+recipe=...` needs
    its `+`)."""
    from hcp.config.recipes import GROUP, RECIPES_DIR

    if not value or value == "null" or any(c in value for c in _SWEEP):
        return
    folder, where = ((RECIPES_DIR, "recipes") if group == GROUP else
                     (os.path.join(conf_dir, group), f"conf/{group}"))
    options = sorted(f[:-5] for f in os.listdir(folder) if f.endswith(".yaml"))
    if value not in options:
        close = difflib.get_close_matches(value, options, n=1, cutoff=0.5)
        hint = f"did you mean `{prefix}{group}={close[0]}`? " if close else ""
        raise ConfigError(group, value, f"no such {group} ({where}/{value}.yaml)",
                          f"{hint}use one of {', '.join(options)}")


def check_overrides(overrides: list[str], config_groups: set[str],
                    conf_dir: str | None = None) -> None:
    """Check command-line overrides (`a.b=1`, `+a.b=1`, `++a.b=1`, `~a.b`) against the schema
    before Hydra composes: keys, value types, and (given `conf_dir`) group choices
    (`+recipe=llava_tiny` must name `recipes/llava_tiny.yaml`). Sweeps (`a=1,2`),
    interpolations and Hydra's own keys (`hydra.*`, `hydra/...`) are left to Hydra.

    Raises:
        ConfigError: an override names a key no schema field declares (the fix names the
            closest), a value of the wrong type (`_check_value`), or a group option that does
            not exist (the fix lists the options).
    """
    for raw in overrides:
        key, _, value = raw.lstrip("~+").partition("=")
        key, value = key.strip(), value.strip()
        if key.startswith("@"):
            continue
        key = key.split("@", 1)[0]
        if not key or key == "hydra" or key.startswith(("hydra.", "hydra/")) or "/" in key:
            continue
        if key in config_groups:
            if conf_dir is not None and not raw.startswith("~"):
                _check_group_choice(key, value, conf_dir, raw[:len(raw) - len(raw.lstrip("+"))])
            continue
        if raw.startswith("~"):
            lookup(key, value)
        else:
            _check_value(raw, key, value)
