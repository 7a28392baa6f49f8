"""The layout space `layout=auto` searches (hcp.preflight.auto_layout): placements, island sizes
and each module's layout, with the fields the user pinned held fixed. Pure: no process group.

What is enumerated, for a world of W ranks on nodes of N ranks:
- placement: `colocated` (every module on all W ranks) and `non_colocated` (the encoder and its
  projector on ranks [0, E), the LLM on [E, W)), E a multiple of N when W > N, else 1..W-1;
- the LLM: tp a divisor of N (TP stays inside a node), cp a power of two, pp a divisor of its
  layers (even split), dp the rest; recompute none / selective / full; dp_shard off / on;
- the encoder: tp a divisor of N, cp 1, pp 1 (colocated) or a divisor of its used layers up to
  `MAX_ENCODER_PP` (an island), dp the rest; recompute none / full; dp_shard off / on;
- the projector: the encoder's tp and dp_shard, cp 1, pp 1 (it runs with its encoder): a pin of
  its tp or dp_shard holds the encoder's; other projector pins may only restate those values.
Each module's layout must pass the layout rules on resolved layouts (`hcp.config.layouts.
check_resolved`); whole candidates pass them again, and the winner the full validation.

Pinning (`pinned_fields`): a field given on the command line (`llm.layout.tp=8`, `placement=
non_colocated`, `vision.layout.num_ranks=16`) keeps its value; the recipe's values are only the
"given" layout the table compares with.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from hcp.config.errors import ConfigError
from hcp.config.layouts import RECOMPUTES, ResolvedLayout, check_resolved, num_layers
from hcp.config.modules import BUILT_IN, module_names

FIELDS = ("tp", "cp", "pp", "dp", "dp_shard", "recompute", "num_ranks", "pp_layers")
"""Layout fields a command-line override pins."""
MAX_ENCODER_PP = 4
ENCODER_RECOMPUTES = ("none", "full")
"""Encoder recompute that training runs (`hcp.train.support`: selective is the LLM's only)."""
PROJECTOR_FIXED = {"cp": 1, "pp": 1, "pp_layers": [1], "dp": -1, "recompute": "none"}
"""Projector fields the search does not vary (`projector_for`); a pin may only restate them."""
_PIN = re.compile(r"^(vision|projector|llm)\.layout\.(" + "|".join(FIELDS) + r")$")


@dataclass(frozen=True)
class Candidate:
    """One point of the space: a placement and every module's resolved layout (graph order)."""

    placement: str
    layouts: tuple[tuple[str, ResolvedLayout], ...]

    @property
    def by_module(self) -> dict[str, ResolvedLayout]:
        return dict(self.layouts)


def pinned_fields(cfg, overrides) -> dict[str, object]:
    """{key: value} of the layout fields and `placement` set on the command line (Hydra's task
    overrides, e.g. `llm.layout.tp=8`), each with its resolved value in `cfg`; `pp_layers`
    pins `pp` too."""
    out = {}
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if key == "placement" or _PIN.match(key):
            module, _, field = key.partition(".layout.")
            value = cfg.placement if key == "placement" else cfg[module].layout[field]
            out[key] = list(value) if field == "pp_layers" and value is not None else value
            if field == "pp_layers" and value is not None:
                out[f"{module}.layout.pp"] = len(value)
    return out


def check_searchable(cfg, pinned: dict) -> None:
    """`layout=auto` searches LLaVA's vision -> projector -> llm graph or an LLM alone; named
    encoders and projectors are not searched. Raises ConfigError."""
    if set(module_names(cfg)) - set(BUILT_IN):
        raise ConfigError("layout", "auto", "searches the vision -> projector -> llm graph or an LLM "
                          "alone, not named encoders or projectors", "set every layout by hand "
                          "(layout=manual), or try layouts with a `mode=plan -m` sweep")
    for key, value in pinned.items():
        field = key.partition("projector.layout.")[2]
        if field and field not in ("tp", "dp_shard") and value != PROJECTOR_FIXED.get(field):
            raise ConfigError(key, value, "the projector runs with its encoder under layout=auto (its tp "
                              "and dp_shard, cp 1, pp 1, the encoder's ranks)", "pin vision.layout.* "
                              "instead, or set every layout by hand (layout=manual)")
    if pinned.get("placement") == "non_colocated" and cfg.get("vision") is None:
        raise ConfigError("placement", "non_colocated", "a text-only LLM has no encoder island",
                          "use placement=colocated")


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def _powers(limit: int) -> list[int]:
    return [1 << k for k in range(limit.bit_length()) if 1 << k <= limit]


def _allowed(pinned: dict, key: str, values) -> list:
    return [v for v in values if v == pinned[key]] if key in pinned else list(values)


def module_options(cfg, module: str, ranks: int, offset: int, placement: str, pinned: dict,
                   node: int) -> list[ResolvedLayout]:
    """Every layout of `module` over `ranks` ranks from `offset` that the pins allow and the
    per-module layout rules accept (module docstring)."""
    p = f"{module}.layout."
    layers = num_layers(cfg, module)
    encoder = module == "vision"
    tps = _allowed(pinned, p + "tp", _divisors(node, node))
    shards = _allowed(pinned, p + "dp_shard", (False, True))
    if encoder:  # the projector runs with its encoder: its pins hold the encoder's tp and dp_shard
        tps = _allowed(pinned, "projector.layout.tp", tps)
        shards = _allowed(pinned, "projector.layout.dp_shard", shards)
    cps = _allowed(pinned, p + "cp", [1] if encoder else _powers(ranks))
    pp_cap = 1 if encoder and placement == "colocated" else MAX_ENCODER_PP if encoder else layers
    pps = _allowed(pinned, p + "pp", _divisors(layers, pp_cap))
    recomputes = _allowed(pinned, p + "recompute", ENCODER_RECOMPUTES if encoder else RECOMPUTES)
    out = []
    for tp in tps:
        for cp in cps:
            for pp in pps:
                if ranks % (tp * cp * pp):
                    continue
                dp = ranks // (tp * cp * pp)
                if p + "dp" in pinned and pinned[p + "dp"] not in (-1, dp):
                    continue
                split = tuple(pinned.get(p + "pp_layers") or (layers // pp,) * pp)
                for recompute in recomputes:
                    for shard in shards:
                        if shard and dp * cp == 1 and p + "dp_shard" not in pinned \
                                and "projector.layout.dp_shard" not in pinned:
                            continue  # nothing to shard over: the same as off
                        lay = ResolvedLayout(module, tp, cp, pp, dp, offset, ranks, split, "allgather",
                                             False, recompute, shard)
                        try:
                            check_resolved(cfg, {module: lay})
                        except ConfigError:
                            continue
                        out.append(lay)
    return out


def projector_for(vision: ResolvedLayout) -> ResolvedLayout:
    """The projector's layout next to `vision`, as resolution gives it: the encoder's ranks
    (colocated: all; non_colocated: its island), tp and dp_shard, one stage."""
    return ResolvedLayout("projector", vision.tp, 1, 1, vision.num_ranks // vision.tp, vision.rank_offset,
                          vision.num_ranks, (1,), "allgather", False, "none", vision.dp_shard)


def island_sizes(cfg, world: int, node: int, pinned: dict) -> list[int]:
    """Encoder island sizes E under non_colocated (module docstring), or the pinned one."""
    if "vision.layout.num_ranks" in pinned:
        return [int(pinned["vision.layout.num_ranks"])]
    step = node if world > node else 1
    return list(range(step, world, step))


def placements(cfg, pinned: dict) -> list[str]:
    """The placements to search: the pinned one, else both when there is an encoder."""
    if "placement" in pinned:
        return [pinned["placement"]]
    return ["colocated", "non_colocated"] if cfg.get("vision") is not None else ["colocated"]


def combine(cfg, placement: str, vision: ResolvedLayout | None, llm: ResolvedLayout) -> Candidate | None:
    """The candidate of these layouts (the projector follows the encoder), or None when the
    whole fails a layout rule (`check_resolved`: the lanes of each edge)."""
    layouts = {"llm": llm} if vision is None else {"vision": vision, "projector": projector_for(vision), "llm": llm}
    try:
        check_resolved(cfg, layouts)
    except ConfigError:
        return None
    return Candidate(placement, tuple(layouts.items()))
