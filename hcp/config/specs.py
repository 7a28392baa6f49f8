"""The module graph resolved once into typed objects (docs/design.md 1: module, stream).

`resolve_modules(cfg, layouts)` runs after validation (`hcp.config.validate`): in the launching
process (`hcp.entry.run`, plan mode) and once per rank in the trainer. The layers below config
take the `ModuleSpecs` it returns instead of looking up module blocks of `cfg` by name
(`hcp.config.modules.module_cfg` is config's own). Field names are the YAML's.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Iterator

from omegaconf import DictConfig, OmegaConf

from hcp.config.layouts import ResolvedLayout
from hcp.config.schema import LayoutConfig
from hcp.config.modules import Stream, kind, module_cfg, module_key, module_names, streams


@dataclass(frozen=True)
class EncoderArch:
    """An encoder's architecture (`vision`, `encoders.<name>`): what its builder reads.
    `layout` is its layout block as configured (recompute, cp_comm, ...); the resolved one is
    `ModuleSpec.layout`."""

    arch: str
    image_size: int
    patch_size: int
    num_channels: int
    hidden_size: int
    num_layers: int
    num_heads: int
    ffn_hidden_size: int
    select_layer: int
    norm_eps: float
    layout: Any


@dataclass(frozen=True)
class ProjectorArch:
    """A projector's architecture (`projector`, `projectors.<name>`); `layout` as in
    `EncoderArch`."""

    type: str
    pool: int
    layout: Any


@dataclass(frozen=True)
class LLMArch:
    """The LLM's architecture (`llm`); `layout` as in `EncoderArch`."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    rope_theta: float
    norm_eps: float
    tie_embeddings: bool
    attention_backend: str
    layout: Any


ARCHS = {"encoder": EncoderArch, "projector": ProjectorArch, "llm": LLMArch}
"""Module kind -> the dataclass of its architecture (`ModuleSpec.arch`)."""


def typed(block, schema: type):
    """A config block (structured or not: a rank's plain container) as an instance of its
    schema dataclass (`hcp.config.schema`), the schema's defaults for keys it lacks."""
    values = OmegaConf.to_container(block, resolve=True) if isinstance(block, DictConfig) else block
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), values))


def arch_of(kind_: str, block):
    """The typed architecture of one module's config block (validated: `hcp.config.validate`);
    its layout block becomes a plain object too (`hcp.config.schema.LayoutConfig`)."""
    values = {f.name: block.get(f.name) for f in fields(ARCHS[kind_])}
    if isinstance(values["layout"], DictConfig):
        values["layout"] = typed(values["layout"], LayoutConfig)
    return ARCHS[kind_](**values)


@dataclass(frozen=True)
class ModuleSpec:
    """One module (`vision`, `encoders.<name>`, `projector`, `projectors.<name>`, `llm`).

    `arch` is its architecture, which the model builders read (`EncoderArch`, `ProjectorArch`
    or `LLMArch`, by kind); `layout` is None when resolved without layouts (data
    preparation). `pool` and `source` (the encoder feeding it) are a projector's (1 and None
    elsewhere)."""

    name: str
    kind: str
    """`encoder`, `projector` or `llm`."""
    key: str
    """The config path of its block, for error messages: `vision`, `encoders.vision2`."""
    arch: EncoderArch | ProjectorArch | LLMArch
    layout: ResolvedLayout | None
    freeze: bool
    init_from: str | None
    optim: dict
    """The module's own optimizer settings it sets: {"lr": ..., "weight_decay": ...} or fewer."""
    hidden_size: int
    """Its width; 0 for a projector (it maps its encoder's width to the LLM's)."""
    pool: int = 1
    source: str | None = None


@dataclass(frozen=True)
class ModuleSpecs:
    """Every module of a run in graph order (encoders, projectors, llm), the graph's edges
    (`graph.edges`, pairs src, dst) and the streams into the LLM (`hcp.config.modules.streams`;
    none for a text-only LM)."""

    modules: tuple[ModuleSpec, ...]
    edges: tuple[tuple[str, str], ...]
    streams: tuple[Stream, ...]

    def __getitem__(self, name: str) -> ModuleSpec:
        for m in self.modules:
            if m.name == name:
                return m
        raise KeyError(f"no module {name!r} (modules: {list(self.names)})")

    def __iter__(self) -> Iterator[ModuleSpec]:
        return iter(self.modules)

    def __contains__(self, name: str) -> bool:
        return name in self.names

    @property
    def names(self) -> tuple[str, ...]:
        """Module names in graph order."""
        return tuple(m.name for m in self.modules)

    def of_kind(self, kind_: str) -> tuple[ModuleSpec, ...]:
        """The modules of one kind (`encoder`, `projector` or `llm`), in graph order."""
        return tuple(m for m in self.modules if m.kind == kind_)

    @property
    def llm(self) -> ModuleSpec:
        """The LLM's spec (every config has one)."""
        return self["llm"]

    @property
    def layouts(self) -> dict[str, ResolvedLayout]:
        """{module: its resolved layout}, graph order (`hcp.config.layouts.resolve_layouts`)."""
        return {m.name: m.layout for m in self.modules}

    @property
    def several_streams(self) -> bool:
        """Whether the graph is more than vision -> projector -> llm: named encoders or several
        streams (a join, a branch)."""
        return "vision" in self and (len(self.of_kind("encoder")) > 1 or len(self.streams) > 1)

    def rows(self, stream: Stream) -> int:
        """Rows (placeholder tokens) one input of `stream.encoder` gives the stream: the
        encoder's patch grid side divided by the projector's `pool`, squared."""
        side = (int(self[stream.encoder].arch.image_size)
                // int(self[stream.encoder].arch.patch_size))
        return (side // self[stream.projector].pool) ** 2


def _spec(cfg, name: str, layouts, edges) -> ModuleSpec:
    block, k = module_cfg(cfg, name), kind(cfg, name)
    own = block.get("optim") or {}
    return ModuleSpec(
        name=name, kind=k, key=module_key(cfg, name), arch=arch_of(k, block),
        layout=layouts[name] if layouts is not None else None,
        freeze=bool(block.get("freeze", False)), init_from=block.get("init_from"),
        hidden_size=int(block.get("hidden_size") or 0),
        optim={f: float(own[f]) for f in ("lr", "weight_decay") if own.get(f) is not None},
        pool=int(block.get("pool", 1) or 1) if k == "projector" else 1,
        source=next((s for s, d in edges if d == name), None) if k == "projector" else None)


def resolve_modules(cfg, layouts: dict | None = None) -> ModuleSpecs:
    """The `ModuleSpecs` of a validated `cfg`; `layouts` are `validate`'s (or `resolve_layouts`')
    result, None where no layout is needed (data preparation)."""
    edges = tuple((str(s), str(d)) for s, d in cfg.graph.edges)
    flows = streams(edges) if cfg.get("vision") is not None else ()
    return ModuleSpecs(tuple(_spec(cfg, m, layouts, edges) for m in module_names(cfg)), edges,
                       flows)
