"""The module graph of a config: which modules exist, what kind each is, and the streams of rows
into the LLM (docs/design.md 1: module, edge, join, branch; docs/design.md 3: config shape).

Modules are `vision` and `projector` (the default encoder side, LLaVA's), every named
`encoders.<name>` (a ViT-style encoder with its own architecture and layout: a second vision
tower, a second modality) and `projectors.<name>`, and `llm`. `graph.edges` wires them: every
edge is `encoder -> projector` or `projector -> llm`; each projector has one encoder and feeds
the LLM. A *stream* is a projector with its edge into the LLM: its rows fill its own
placeholder tokens in the merged sequence. Several streams into the LLM form a join (two
encoders, each with its projector); one encoder feeding several projectors is a branch (the
tower runs once, its gradient is the sum of its consumers').

Data conventions of an encoder `e` (hcp.data.llava): a record gives its inputs under
`record_key(e)` (`image` for `vision`, else the name) and the text marks each input with
`placeholder(e)` (`<image>` for `vision`, else `<name>`); each placeholder expands, for every
stream of `e` in edge order, into that stream's rows per input
(`hcp.config.specs.ModuleSpecs.rows`).

`check_graph(cfg)` raises `ConfigError(field, value, problem, fix)` for bad names and edges,
before any rank starts.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from hcp.config.errors import ConfigError

BUILT_IN = ("vision", "projector", "llm")
"""Modules with their own top-level key (hcp.config.schema.MODULES)."""
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*$")


def encoder_names(cfg) -> tuple[str, ...]:
    """Configured encoder modules: `vision` (unless null), then `encoders.*` in config order."""
    return (("vision",) if cfg.get("vision") is not None else ()) + tuple(cfg.get("encoders") or ())


def projector_names(cfg) -> tuple[str, ...]:
    """Configured projector modules: `projector` (unless null), then `projectors.*`."""
    return (("projector",)
            if cfg.get("projector") is not None else ()) + tuple(cfg.get("projectors") or ())


def module_names(cfg) -> tuple[str, ...]:
    """Every configured module in graph order: encoders, projectors, then `llm`."""
    return encoder_names(cfg) + projector_names(cfg) + ("llm",)


def module_cfg(cfg, module: str):
    """The config block of `module` (`cfg.vision`, `cfg.encoders.<name>`, ...).

    Raises KeyError for a module the config does not have."""
    if module in BUILT_IN and cfg.get(module) is not None:
        return cfg[module]
    for group in ("encoders", "projectors"):
        if module in (cfg.get(group) or {}):
            return cfg[group][module]
    raise KeyError(f"no module {module!r} in the config (modules: {list(module_names(cfg))})")


def kind(cfg, module: str) -> str:
    """`encoder`, `projector` or `llm`. Raises KeyError for an unknown module."""
    if module == "llm":
        return "llm"
    if module in encoder_names(cfg):
        return "encoder"
    if module in projector_names(cfg):
        return "projector"
    raise KeyError(f"no module {module!r} in the config (modules: {list(module_names(cfg))})")


@dataclass(frozen=True)
class Stream:
    """Rows of one projector into the LLM."""

    projector: str
    encoder: str
    """The encoder that feeds it."""


def streams(edges) -> tuple[Stream, ...]:
    """The streams into `llm` of `edges` (pairs src, dst), in the order of their edges into the
    LLM (the default LLaVA graph: `(Stream('projector', 'vision'),)`). A projector whose encoder
    no edge names is left out (`check_graph` refuses such graphs)."""
    edges = [tuple(e) for e in edges]
    source = {dst: src for src, dst in edges if dst != "llm"}
    return tuple(Stream(src, source[src]) for src, dst in edges if dst == "llm" and src in source)


def placeholder(encoder: str) -> str:
    """The text placeholder of one input of `encoder`: `<image>` for `vision`, else `<name>`."""
    return "<image>" if encoder == "vision" else f"<{encoder}>"


def record_key(encoder: str) -> str:
    """The LLaVA record key of `encoder`'s inputs: `image` for `vision`, else its name."""
    return "image" if encoder == "vision" else encoder


def patches(enc_cfg) -> int:
    """Patches per input of an encoder: (image_size / patch_size)^2."""
    return (enc_cfg.image_size // enc_cfg.patch_size) ** 2


def _check_names(cfg) -> None:
    seen = {}
    for group in ("encoders", "projectors"):
        for name in cfg.get(group) or ():
            key = f"{group}.{name}"
            if not _NAME.match(str(name)):
                raise ConfigError(key, name, "a module name must be an identifier (it names "
                                  "parameters, process groups and the data's placeholder)",
                                  "use letters, digits and _, e.g. vision2")
            if name in BUILT_IN:
                raise ConfigError(key, name,
                                  f"`{name}` is a built-in module with its own top-level "
                                  "key", f"configure it under `{name}:`, or pick another name")
            if name in seen:
                raise ConfigError(key, name, f"the name is also used by {seen[name]}",
                                  "give every module its own name")
            seen[name] = key
    if seen and cfg.get("vision") is None:
        raise ConfigError("vision", None, f"named modules {sorted(seen)} need the default encoder "
                          "side (`vision` with `projector`)", "configure vision and projector, "
                          "or configure your encoder as `vision`")


def check_graph(cfg) -> None:
    """Raise ConfigError unless module names and `graph.edges` form an encoder -> projector ->
    llm graph: identifier names unique over all modules; every edge names configured modules, is
    `encoder -> projector` or `projector -> llm`, and appears once; every projector has exactly
    one encoder and one edge into the LLM; every encoder feeds at least one projector."""
    _check_names(cfg)
    names = module_names(cfg)
    edges = [tuple(e) for e in cfg.graph.edges]
    shown = [list(e) for e in edges]
    for edge in edges:
        if len(edge) != 2:
            raise ConfigError("graph.edges", shown, f"edge {list(edge)} is not a pair [src, dst]",
                              "write each edge as [src, dst]")
        for name in edge:
            if name not in names:
                raise ConfigError("graph.edges", list(edge), f"module {name!r} is not configured",
                                  f"use modules among {sorted(names)} or configure {name}")
        src, dst = edge
        allowed = {"encoder": "projector", "projector": "llm"}.get(kind(cfg, src))
        if kind(cfg, dst) != allowed:
            raise ConfigError("graph.edges", list(edge), f"edge {src}->{dst} goes from an "
                              f"{kind(cfg, src)} to {'an' if kind(cfg, dst) == 'llm' else 'a'} "
                              f"{kind(cfg, dst)}; edges go encoder -> projector -> llm",
                              f"route {src} through a projector into the llm"
                              if kind(cfg, src) == "encoder" else "remove the edge")
    if len(set(edges)) != len(edges):
        dup = next(e for e in edges if edges.count(e) > 1)
        raise ConfigError("graph.edges", shown, f"edge {list(dup)} appears twice", "list it once")
    for p in projector_names(cfg):
        into = [s for s, d in edges if d == p]
        out = [d for s, d in edges if s == p]
        if len(into) != 1 or not out:
            problem = (f"projector {p} is fed by {into or 'no encoder'}; it needs exactly one"
                       if len(into) != 1 else f"projector {p} feeds nothing")
            raise ConfigError("graph.edges", shown, problem,
                              f"add exactly one [ENCODER, {p}] and one [{p}, llm] edge"
                              if edges
                              else f"add [ENCODER, {p}] and [{p}, llm], or set {p} to null")
    for e in encoder_names(cfg):
        if not any(s == e for s, _ in edges):
            raise ConfigError("graph.edges", shown, f"encoder {e} feeds no projector",
                              f"add an edge [{e}, PROJECTOR] (and [PROJECTOR, llm])")


def set_layout(cfg, module: str, values: dict) -> None:
    """Write `values` ({field: value}) into `module`'s layout block of `cfg` (in place, as CLI
    overrides would; `cfg` open for new keys). Raises KeyError for a module `cfg` does not have."""
    node = module_cfg(cfg, module).layout
    for k, v in values.items():
        node[k] = v


def module_key(cfg, module: str) -> str:
    """The config path of `module`'s block, for error messages: `vision`, `encoders.vision2`."""
    if module in BUILT_IN:
        return module
    return f"encoders.{module}" if module in (cfg.get("encoders") or {}) else f"projectors.{module}"
