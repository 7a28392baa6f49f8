"""The layout space `layout=auto` searches (hcp.preflight.auto_layout): placements, island sizes
and each module's layout, with the fields the user pinned held fixed. Pure: no process group.

What is enumerated, for a world of W ranks on nodes of N ranks, over every module of the graph
(`vision` and each `encoders.<name>`, each with the projectors it feeds; `llm`):
- placement: `colocated` (every module on all W ranks) and `non_colocated` (each encoder and its
  projectors on an island of E_e ranks, in graph order from rank 0, the LLM on the rest), each
  E_e a multiple of N when W > N, else 1..W-1;
- the LLM: tp a divisor of N (TP stays inside a node), cp a power of two, pp a divisor of its
  layers (even split), dp the rest; recompute none / selective / full; dp_shard off / on;
- each encoder: tp a divisor of N, cp a power of two up to its tokens per input (patches + CLS;
  1 when a projector it feeds pools, which encoder CP does not train), pp 1 (colocated) or a
  divisor of its used layers up to `MAX_ENCODER_PP` (an island), dp the rest; recompute none /
  full; dp_shard off / on. Several encoders colocated (`hcp.train.support`): no dp_shard, and
  one recompute for the whole encoder side;
- each projector: its encoder's tp, cp and dp_shard, pp 1 (it runs with its encoder; its
  recompute: the encoder side's when several encoders are colocated, else none): a pin of its
  tp, cp or dp_shard holds the encoder's; other projector pins may only restate those values.
Each module's layout must pass the layout rules on resolved layouts (`hcp.config.layouts.
check_resolved`; the LLM's, `hcp.config.validate.check_longest_sample` too: its CP group or pool
holds the longest sample); whole candidates pass them again, and the winner the full validation.

Pinning (`pinned_fields`): a field given on the command line (`llm.layout.tp=8`, `placement=
non_colocated`, `vision.layout.num_ranks=16`, `encoders.vision2.layout.tp=2`) keeps its value;
the recipe's values are only the "given" layout the table compares with.
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

from hcp.config.errors import ConfigError
from hcp.config.layouts import RECOMPUTES, ResolvedLayout, check_resolved, num_layers
from hcp.config.modules import encoder_names, module_key, patches, projector_names
from hcp.config.specs import resolve_modules
from hcp.config.validate import check_longest_sample
from hcp.parallel.encoder_cp import LEAD

FIELDS = ("tp", "cp", "pp", "dp", "dp_shard", "recompute", "num_ranks", "pp_layers")
"""Layout fields a command-line override pins."""
MAX_ENCODER_PP = 4
ENCODER_RECOMPUTES = ("none", "full")
"""Encoder recompute that training runs (`hcp.train.support`: selective is the LLM's only)."""
FOLLOWS = ("tp", "cp", "dp_shard")
"""Projector fields that follow its encoder: a pin of one holds the encoder's."""
PROJECTOR_FIXED = {"pp": 1, "pp_layers": [1], "dp": -1}
"""Projector fields the search does not vary (`projector_for`); a pin may only restate them."""
_PIN = re.compile(r"^(vision|projector|llm|(?:encoders|projectors)\.[A-Za-z_][A-Za-z0-9_]*)"
                  r"\.layout\.("
                  + "|".join(FIELDS) + r")$")


@dataclass(frozen=True)
class Candidate:
    """One point of the space: a placement and every module's resolved layout (graph order)."""

    placement: str
    layouts: tuple[tuple[str, ResolvedLayout], ...]
    projectors: tuple[str, ...] = ()
    """The projectors among `layouts` (they run with their encoders)."""

    @property
    def by_module(self) -> dict[str, ResolvedLayout]:
        return dict(self.layouts)


@dataclass(frozen=True)
class Side:
    """One encoder and the projectors it feeds (graph order): the unit an island holds."""

    encoder: str
    projectors: tuple[str, ...]


def sides(cfg) -> tuple[Side, ...]:
    """Every encoder of `cfg` (graph order) with the projectors its edges feed."""
    edges = [tuple(e) for e in cfg.graph.edges]
    return tuple(Side(e, tuple(d for s, d in edges if s == e)) for e in encoder_names(cfg))


def tied(cfg, placement: str) -> bool:
    """Whether the encoder side shares one recompute and has no dp_shard: several encoders or
    streams colocated (`hcp.train.support`)."""
    return placement == "colocated" and (len(encoder_names(cfg)) > 1 or
                                         sum(len(s.projectors) for s in sides(cfg)) > 1)


def pinned_fields(cfg, overrides) -> dict[str, object]:
    """{key: value} of the layout fields and `placement` set on the command line (Hydra's task
    overrides, e.g. `llm.layout.tp=8`, `encoders.vision2.layout.cp=2`), each with its resolved
    value in `cfg`; `pp_layers` pins `pp` too."""
    out = {}
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if key == "placement" or _PIN.match(key):
            block, _, field = key.partition(".layout.")
            value = cfg.placement if key == "placement" else _block(cfg, block).layout[field]
            out[key] = list(value) if field == "pp_layers" and value is not None else value
            if field == "pp_layers" and value is not None:
                out[f"{block}.layout.pp"] = len(value)
    return out


def _block(cfg, path: str):
    group, _, name = path.partition(".")
    return cfg[group][name] if name else cfg[group]


def check_searchable(cfg, pinned: dict) -> None:
    """Raise ConfigError for pins the search cannot hold: a projector field that does not
    follow its encoder set to another value than the search gives it, a non_colocated
    placement of a text-only LLM, or a pin of a module the config does not have."""
    projectors = {module_key(cfg, p) for s in sides(cfg) for p in s.projectors}
    for key, value in pinned.items():
        block, _, field = key.partition(".layout.")
        if (field and block not in projectors | {module_key(cfg, s.encoder)
                                                 for s in sides(cfg)} | {"llm"}):
            raise ConfigError(key, value, f"the config has no module {block}",
                              "pin a configured module")
        fixed = {**PROJECTOR_FIXED, "recompute": "none"}
        if block in projectors and field not in FOLLOWS and value != fixed.get(field):
            raise ConfigError(key, value,
                              "a projector runs with its encoder under layout=auto (its tp, "
                              "cp and dp_shard, pp 1, the encoder's ranks, the encoder side's "
                              "recompute or none)",
                              "pin the encoder's layout instead, or set every layout by hand "
                              "(layout=manual)")
    if pinned.get("placement") == "non_colocated" and cfg.get("vision") is None:
        raise ConfigError("placement", "non_colocated", "a text-only LLM has no encoder island",
                          "use placement=colocated")


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def _powers(limit: int) -> list[int]:
    return [1 << k for k in range(limit.bit_length()) if 1 << k <= limit]


def _allowed(pinned: dict, key: str, values) -> list:
    return [v for v in values if v == pinned[key]] if key in pinned else list(values)


def _encoder_choices(cfg, side: Side, ranks: int, pinned: dict, node: int, tie: bool) -> dict:
    """{field: values} of an encoder's tp, cp, recompute and dp_shard (module docstring): its
    own pins, and its projectors' pins of the fields that follow it."""
    p = f"{module_key(cfg, side.encoder)}.layout."
    specs = resolve_modules(cfg)
    pools = [specs[q].pool for q in side.projectors]
    tokens = patches(specs[side.encoder].arch) + LEAD
    out = {"tp": _divisors(node, node),
           "cp": [1] if max(pools, default=1) > 1 else _powers(min(ranks, tokens)),
           "recompute": list(ENCODER_RECOMPUTES),
           "dp_shard": [False] if tie and p + "dp_shard" not in pinned else [False, True]}
    for field in out:
        keys = [p + field] + [f"{module_key(cfg, q)}.layout.{field}" for q in side.projectors
                              if field in FOLLOWS or tie]
        for key in keys:
            out[field] = _allowed(pinned, key, out[field])
    return out


def module_options(cfg, module: str, ranks: int, offset: int, placement: str, pinned: dict,
                   node: int) -> list[ResolvedLayout]:
    """Every layout of `module` (an encoder or the LLM) over `ranks` ranks from `offset` that the
    pins allow and the per-module layout rules accept (module docstring)."""
    p = f"{module_key(cfg, module)}.layout."
    layers = num_layers(cfg, module)
    encoder = module != "llm"
    if encoder:
        side = next(s for s in sides(cfg) if s.encoder == module)
        choice = _encoder_choices(cfg, side, ranks, pinned, node, tied(cfg, placement))
    else:
        choice = {"tp": _allowed(pinned, p + "tp", _divisors(node, node)),
                  "cp": _allowed(pinned, p + "cp", _powers(ranks)),
                  "recompute": _allowed(pinned, p + "recompute", RECOMPUTES),
                  "dp_shard": _allowed(pinned, p + "dp_shard", (False, True))}
    pp_cap = 1 if encoder and placement == "colocated" else MAX_ENCODER_PP if encoder else layers
    pps = _allowed(pinned, p + "pp", _divisors(layers, pp_cap))
    out = []
    for tp, cp, pp in itertools.product(choice["tp"], choice["cp"], pps):
        if ranks % (tp * cp * pp):
            continue
        dp = ranks // (tp * cp * pp)
        if p + "dp" in pinned and pinned[p + "dp"] not in (-1, dp):
            continue
        split = tuple(pinned.get(p + "pp_layers") or (layers // pp,) * pp)
        for recompute, shard in itertools.product(choice["recompute"], choice["dp_shard"]):
            if shard and dp * cp == 1 and len(choice["dp_shard"]) == 2:
                continue  # nothing to shard over: the same as off
            lay = ResolvedLayout(module, tp, cp, pp, dp, offset, ranks, split, "allgather", False,
                                 recompute, shard)
            try:
                check_resolved(cfg, {module: lay})
                if not encoder:
                    check_longest_sample(cfg, lay)
            except ConfigError:
                continue
            out.append(lay)
    return out


def projector_for(encoder: ResolvedLayout, projector: str,
                  recompute: str = "none") -> ResolvedLayout:
    """The layout of `projector` next to its encoder's, as resolution gives it: the encoder's
    ranks (colocated: all; non_colocated: its island), tp, cp and dp_shard, one stage."""
    return ResolvedLayout(projector, encoder.tp, encoder.cp, 1,
                          encoder.num_ranks // (encoder.tp * encoder.cp), encoder.rank_offset,
                          encoder.num_ranks, (1,), "allgather", False, recompute, encoder.dp_shard)


def side_layouts(cfg, placement: str, encoders: tuple[ResolvedLayout, ...]) -> tuple:
    """((module, layout), ...) of the encoder side: the encoders' layouts (one per `sides(cfg)`)
    and each projector's next to its encoder (`projector_for`), graph order."""
    tie = tied(cfg, placement)
    by = {lay.module: lay for lay in encoders}
    projectors = [(q, projector_for(by[s.encoder], q, by[s.encoder].recompute if tie else "none"))
                  for s in sides(cfg) for q in s.projectors]
    order = {q: k for k, q in enumerate(projector_names(cfg))}
    return (tuple((lay.module, lay) for lay in encoders)
            + tuple(sorted(projectors, key=lambda x: order[x[0]])))


def encoder_options(cfg, placement: str, islands: tuple[int, ...], pinned: dict, node: int,
                    world: int) -> list[tuple[ResolvedLayout, ...]]:
    """Every combination of the encoders' layouts (one per `sides(cfg)`): colocated all on the
    `world` ranks, one recompute when `tied`; non_colocated encoder e on an island of
    `islands[e]` ranks, the islands from rank 0 in graph order."""
    per, offset = [], 0
    for side, size in zip(sides(cfg), islands
                          if placement == "non_colocated" else [world] * len(sides(cfg))):
        per.append(module_options(cfg, side.encoder, size, offset, placement, pinned, node))
        offset += size if placement == "non_colocated" else 0
    combos = itertools.product(*per)
    if tied(cfg, placement):
        return [c for c in combos if len({lay.recompute for lay in c}) == 1]
    return list(combos)


def island_sizes(cfg, world: int, node: int, pinned: dict) -> list[tuple[int, ...]]:
    """Encoder island sizes (E_e per encoder, graph order) under non_colocated (module
    docstring; a pinned `num_ranks` holds), that leave the LLM at least one rank."""
    step = node if world > node else 1
    options = []
    for side in sides(cfg):
        key = f"{module_key(cfg, side.encoder)}.layout.num_ranks"
        options.append([int(pinned[key])] if key in pinned else list(range(step, world, step)))
    return [sizes for sizes in itertools.product(*options) if sum(sizes) < world]


def placements(cfg, pinned: dict) -> list[str]:
    """The placements to search: the pinned one, else both when there is an encoder."""
    if "placement" in pinned:
        return [pinned["placement"]]
    return ["colocated", "non_colocated"] if cfg.get("vision") is not None else ["colocated"]


def combine(cfg, placement: str, encoders: tuple[ResolvedLayout, ...],
            llm: ResolvedLayout) -> Candidate | None:
    """The candidate of these layouts (each projector follows its encoder), or None when the
    whole fails a layout rule (`check_resolved`: the lanes of each edge)."""
    layouts = dict(side_layouts(cfg, placement, encoders)) | {"llm": llm}
    try:
        check_resolved(cfg, layouts)
    except ConfigError:
        return None
    return Candidate(placement, tuple(layouts.items()), projector_names(cfg))
