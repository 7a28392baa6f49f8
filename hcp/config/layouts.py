"""Per-module layouts: where each module sits and how its ranks are split (docs/design.md: layout).

`resolve_layouts(cfg, world_size)` turns every present module's `layout` block plus the run-wide
`placement` into a `ResolvedLayout` (all sizes known, dp inferred, an explicit rank range).
`check_layouts(cfg, world_size)` does the same and then checks every cross-field layout rule.
Every rule raises `ConfigError(field, value, problem, fix)` before any process starts.

Placement (`colocated`: every module on every rank; `non_colocated`: disjoint islands) decides
which ranks each module spans: `hcp.config.spans`.
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass

from hcp.config.errors import ConfigError, check_choice
from hcp.config.modules import kind, module_cfg, module_key, module_names
from hcp.config.spans import check_projector_islands, colocated_spans, non_colocated_spans

PLACEMENTS = ("colocated", "non_colocated")
PACKINGS = ("first_fit", "dynamic_cp")
CP_COMMS = ("allgather", "p2p")
RECOMPUTES = ("none", "selective", "full")
NON_ENCODERS = ("projector", "llm")
"""The built-in modules that are not encoders (named ones: `hcp.config.modules.kind`)."""


@dataclass(frozen=True)
class ResolvedLayout:
    """A module's layout with every size known. Rank counts are in ranks.

    The grid is `[rank_offset, rank_offset + num_ranks)` with num_ranks = tp*cp*dp*pp.
    """

    module: str
    tp: int
    cp: int
    pp: int
    dp: int
    rank_offset: int
    num_ranks: int
    pp_layers: tuple[int, ...]
    """Layers per pipeline stage (the projector counts as one layer)."""
    cp_comm: str
    sequence_parallel: bool
    recompute: str
    dp_shard: bool

    @property
    def ranks(self) -> range:
        """The module's ranks, ascending."""
        return range(self.rank_offset, self.rank_offset + self.num_ranks)

    @property
    def cp_pool(self) -> int:
        """Ranks per dynamic-CP pool: dp * cp."""
        return self.dp * self.cp


def present_modules(cfg) -> tuple[str, ...]:
    """Configured modules in graph order (`hcp.config.modules.module_names`: encoders,
    projectors, llm)."""
    return module_names(cfg)


def num_layers(cfg, module: str) -> int:
    """Pipeline-splittable layers of a module: the projector is one layer; an encoder holds only
    the blocks up to its `select_layer` (-2 on 24 blocks: 23), the LLM `num_layers`."""
    if kind(cfg, module) == "projector":
        return 1
    if module == "llm":
        return int(cfg.llm.num_layers)
    return int(module_cfg(cfg, module).num_layers + module_cfg(cfg, module).select_layer + 1)


def world_size_of(cfg, auto_nproc: int = 4) -> int:
    """Ranks the launcher provides: `launcher.nnodes * launcher.nproc_per_node`, the same in plan
    mode as in training.

    `nproc_per_node=auto` means `auto_nproc` on one node (what `python train.py` starts here: the
    launcher passes its device count, 4 on CPU) and `cluster.gpus_per_node` on several (each
    node of the cluster starts one rank per GPU).
    Raises ConfigError for a non-integer, non-`auto` nproc_per_node or a size below 1.
    """
    nproc = cfg.launcher.nproc_per_node
    if nproc == "auto":
        nproc = cfg.cluster.gpus_per_node if cfg.launcher.nnodes > 1 else auto_nproc
    try:
        nproc = int(nproc)
    except (TypeError, ValueError):
        raise ConfigError("launcher.nproc_per_node", nproc, "not an integer",
                          "use `auto` or an int") from None
    if nproc < 1 or cfg.launcher.nnodes < 1:
        raise ConfigError("launcher.nproc_per_node", nproc, "nodes and ranks per node must be >= 1",
                          "use positive values")
    return int(cfg.launcher.nnodes) * nproc


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, min(n, 128) + 1) if n % d == 0]


def _edges(cfg, modules) -> list[tuple[str, str]]:
    """The graph's edges; raises ConfigError for an edge naming an absent module."""
    edges = [tuple(e) for e in cfg.graph.edges]
    for src, dst in edges:
        for name in (src, dst):
            if name not in modules:
                raise ConfigError("graph.edges", [list(e) for e in edges],
                                  f"edge {src}->{dst} names `{name}`, which is absent (None or "
                                  f"unknown)",
                                  f"use only modules {list(modules)} or set graph.edges=[]")
    return edges


def _indivisible(m: str, lay, count: int, product: str) -> ConfigError:
    """The error for tp*cp*pp not dividing a module's `count` ranks under an inferred dp: it names
    the size the user set (the largest axis other than 1 that a valid value could replace) and
    lists that axis's valid values given the others."""
    sizes = {axis: int(lay[axis]) for axis in ("tp", "cp", "pp")}
    model = sizes["tp"] * sizes["cp"] * sizes["pp"]
    fixable = [a for a, v in sizes.items() if v > 1 and count % (model // v) == 0]
    axis = max(fixable or [a for a, v in sizes.items() if v > 1] or ["tp"], key=lambda a: sizes[a])
    others = model // sizes[axis]
    valid = _divisors(count // others) if count % others == 0 else []
    problem = (f"{m} spans {count} ranks, not divisible by {product} (dp=-1 is inferred from the "
               f"rest)")
    if not valid:
        return ConfigError(f"{m}.layout.{axis}", sizes[axis], problem,
                           f"choose tp, cp, pp whose product divides {count}")
    return ConfigError(f"{m}.layout.{axis}", sizes[axis], problem,
                       f"use {m}.layout.{axis} in {{values}}", valid)


def _resolve_one(cfg, m: str, offset: int, count: int) -> ResolvedLayout:
    lay = module_cfg(cfg, m).layout
    for axis in ("tp", "cp", "pp"):
        if lay[axis] < 1:
            raise ConfigError(f"{m}.layout.{axis}", lay[axis], "sizes must be >= 1",
                              "use a positive size")
    model = lay.tp * lay.cp * lay.pp
    product = f"tp*cp*pp = {lay.tp}*{lay.cp}*{lay.pp} = {model}"
    if lay.dp == -1:
        if count % model:
            raise _indivisible(m, lay, count, product)
        dp = count // model
    elif lay.dp < 1 or lay.dp * model != count:
        raise ConfigError(f"{m}.layout.dp", lay.dp,
                          f"{product} times dp = {model * lay.dp} differs from the {count} ranks "
                          f"{m} spans",
                          f"use dp=-1 (infers {count / model:g}) or change the sizes")
    else:
        dp = int(lay.dp)
    layers = num_layers(cfg, m)
    if lay.pp_layers is not None:
        split = tuple(int(n) for n in lay.pp_layers)
        if len(split) != lay.pp or sum(split) != layers or min(split) < 1:
            other_pp = len(split) != lay.pp and sum(split) == layers and min(split) >= 1
            raise ConfigError(f"{m}.layout.pp_layers", list(split),
                              f"{m}.layout.pp={lay.pp} needs one count per stage, each >= 1, "
                              f"summing to {layers} ({m}'s layers)",
                              f"give {lay.pp} count(s) >= 1 with sum {layers}"
                              + (f", or set {m}.layout.pp={len(split)}" if other_pp else ""))
    elif layers % lay.pp:
        raise ConfigError(f"{m}.layout.pp", lay.pp, f"{m} has {layers} layers, not divisible by it",
                          f"use {m}.layout.pp in {{values}} or give {m}.layout.pp_layers",
                          _divisors(layers))
    else:
        split = (layers // lay.pp,) * lay.pp
    return ResolvedLayout(m, int(lay.tp), int(lay.cp), int(lay.pp), dp, offset, count, split,
                          lay.cp_comm, bool(lay.sequence_parallel), lay.recompute,
                          bool(lay.dp_shard))


def _named_keys(cfg, error: ConfigError) -> ConfigError:
    """`error` with a named module's field and mentions spelled as typed (`vision2.layout.tp`
    -> `encoders.vision2.layout.tp`); the rules below name modules by module name."""
    named = [m for m in module_names(cfg) if module_key(cfg, m) != m]
    if not named:
        return error
    pattern = re.compile(r"(?<![\w.])("
                         + "|".join(map(re.escape, named)) + r")\.(?=layout|num_heads|ffn)")
    spell = lambda text: pattern.sub(  # noqa: E731
        lambda mt: module_key(cfg, mt.group(1)) + ".", str(text))
    return ConfigError(spell(error.field), error.value, spell(error.problem),
                       spell(error.fix_template), error.candidates)


def _spelled(layouts_of):
    """`layouts_of(cfg, world_size)` whose ConfigError spells named modules' fields as typed
    (`encoders.NAME...`, `_named_keys`)."""
    @functools.wraps(layouts_of)
    def spelled(cfg, world_size: int) -> dict[str, ResolvedLayout]:
        try:
            return layouts_of(cfg, world_size)
        except ConfigError as e:
            raise _named_keys(cfg, e) from None
    return spelled


@_spelled
def resolve_layouts(cfg, world_size: int) -> dict[str, ResolvedLayout]:
    """Resolve every present module's layout over `world_size` ranks, in graph order.

    Raises ConfigError: unknown placement; an edge naming an absent module; colocated modules not
    spanning identical ranks; islands overlapping, leaving the world or leaving ranks unused;
    tp*cp*pp*dp differing from the module's rank count; layers not divisible by pp (or a bad
    `pp_layers`).
    """
    check_choice("placement", cfg.placement, PLACEMENTS)
    modules = present_modules(cfg)
    edges = _edges(cfg, modules)
    if cfg.placement == "colocated":
        spans = colocated_spans(cfg, modules, world_size)
    else:
        spans = non_colocated_spans(cfg, modules, edges, world_size)
    # The LLM first: the tiny LLaVA's encoder layouts follow llm.layout by interpolation, so a
    # bad size is reported under the key the user typed.
    resolved = {m: _resolve_one(cfg, m, *spans[m])
                for m in sorted(modules, key=lambda m: m != "llm")}
    return {m: resolved[m] for m in modules}


def _tp_divides(m: str, tp: int, quantities: dict[str, int], padding: tuple[str, ...] = ()) -> None:
    """Every quantity must divide by tp; the fix lists the tp values that divide them ALL."""
    for name, n in quantities.items():
        if n % tp:
            extra = ("; it would need padding to a multiple of tp, which hcp does not do"
                     if name in padding else "")
            raise ConfigError(f"{m}.layout.tp", tp, f"{name}={n} is not divisible by it{extra}",
                              f"use {m}.layout.tp in {{values}}",
                              _divisors(math.gcd(*quantities.values())))


def _check_tensor_parallel(cfg, lay: ResolvedLayout) -> None:
    m, tp = lay.module, lay.tp
    if m == "llm":
        c = cfg.llm
        _tp_divides(m, tp, {"llm.num_heads": c.num_heads, "llm.num_kv_heads": c.num_kv_heads,
                            "llm.ffn_hidden_size": c.ffn_hidden_size,
                            "llm.vocab_size": c.vocab_size},
                    padding=("llm.vocab_size",))
    elif kind(cfg, m) == "projector":
        _tp_divides(m, tp, {"llm.hidden_size": cfg.llm.hidden_size})
    else:
        c = module_cfg(cfg, m)
        _tp_divides(m, tp, {f"{module_key(cfg, m)}.num_heads": c.num_heads,
                            f"{module_key(cfg, m)}.ffn_hidden_size": c.ffn_hidden_size})


def _check_tokens(cfg, lay: ResolvedLayout) -> None:
    tokens = cfg.trainer.micro_batch_tokens
    if lay.cp > 1 and tokens % (2 * lay.cp):
        raise ConfigError("trainer.micro_batch_tokens", tokens,
                          f"{lay.module}.layout.cp={lay.cp} splits every document into 2*cp = "
                          f"{2 * lay.cp} chunks; the capacity is not divisible by it and would "
                          f"need padding",
                          f"use a multiple of {2 * lay.cp}")
    if lay.sequence_parallel and tokens % lay.tp:
        raise ConfigError("trainer.micro_batch_tokens", tokens,
                          f"{lay.module}.layout.sequence_parallel shards tokens over tp={lay.tp}; "
                          f"the capacity is not divisible by it and would need padding",
                          f"use a multiple of {lay.tp}")


def _check_lanes(cfg, layouts: dict[str, ResolvedLayout]) -> None:
    batch = cfg.trainer.global_batch_size
    for lay in layouts.values():
        if lay.module == "llm" and cfg.packing == "dynamic_cp":
            continue  # no static LLM lanes: the planner places every sample in the pool
        if batch % lay.dp:
            raise ConfigError("trainer.global_batch_size", batch,
                              f"not divisible by {lay.module}'s dp={lay.dp} (each lane takes a "
                              f"block of samples)",
                              f"use a multiple of {lay.dp}")
    for src, dst in (tuple(e) for e in cfg.graph.edges):
        if src not in layouts or dst not in layouts:  # a search checking one module at a time
            continue
        a, b = layouts[src].dp, layouts[dst].dp
        if max(a, b) % min(a, b):
            raise ConfigError(f"{dst}.layout.dp", b,
                              f"edge {src}->{dst}: dp {a} and {b}, neither divides the other, so "
                              f"lanes cannot map in blocks",
                              "make one of the two dp sizes a multiple of the other")


def _check_dynamic_cp(cfg, layouts: dict[str, ResolvedLayout]) -> None:
    """The dynamic-CP pool dp * cp must be a power of two: the error names llm.layout.cp when cp
    is not one, else llm.layout.dp (set, or inferred from the LLM's ranks), with sizes that fit."""
    if cfg.packing != "dynamic_cp" or "llm" not in layouts:  # a search checks one module at a time
        return
    lay = layouts["llm"]
    if not lay.cp_pool & (lay.cp_pool - 1):
        return
    pool = (f"packing=dynamic_cp needs the CP pool dp*cp = {lay.dp}*{lay.cp} = {lay.cp_pool} to be "
            f"a power of two")
    if lay.cp & (lay.cp - 1):
        low, high = _powers_near(lay.cp)
        raise ConfigError("llm.layout.cp", lay.cp, pool,
                          f"use llm.layout.cp={low} or {high} (and a "
                          "power-of-two dp)")
    low, high = _powers_near(lay.dp)
    model, odd = lay.tp * lay.cp * lay.pp, lay.dp // (lay.dp & -lay.dp)  # odd: dp's odd factor
    how = (f"inferred from the LLM's {lay.num_ranks} ranks / tp*cp*pp = {model}"
           if cfg.llm.layout.dp == -1 else "set")
    raise ConfigError("llm.layout.dp", lay.dp, f"{pool} (dp {how})",
                      f"run the LLM on {low * model} or {high * model} ranks "
                      f"(launcher.nproc_per_node, with llm.layout.dp=-1 or {low} or {high}), or "
                      f"move dp's factor {odd} into llm.layout.tp or pp (dp then {lay.dp // odd})")


def _powers_near(n: int) -> tuple[int, int]:
    """The powers of two just below and just above `n` (n >= 1 not a power of two)."""
    low = 1 << (n.bit_length() - 1)
    return low, 2 * low


def _check_launcher(cfg, world_size: int) -> None:
    nnodes, nproc = cfg.launcher.nnodes, cfg.launcher.nproc_per_node
    if nproc != "auto" and nnodes * int(nproc) != world_size:
        raise ConfigError("launcher.nproc_per_node", nproc,
                          f"launcher.nnodes*nproc_per_node = {nnodes}*{nproc} differs from the "
                          f"{world_size} ranks provided", "match the launcher to the job's ranks")
    if world_size % nnodes:
        raise ConfigError("launcher.nnodes", nnodes,
                          f"{world_size} ranks do not split evenly over it",
                          "match launcher.nnodes to the job's nodes")


@_spelled
def check_layouts(cfg, world_size: int) -> dict[str, ResolvedLayout]:
    """Check every layout rule for `world_size` ranks; return the resolved layouts.

    Raises ConfigError (field, value, problem, fix) for the rules of `resolve_layouts` and: unknown
    packing, cp_comm or recompute; a world size differing from the launcher's nodes x ranks per
    node; heads, KV heads, FFN width or vocabulary (no padding) not divisible by tp;
    `trainer.micro_batch_tokens` not divisible by 2*cp (nor by tp under sequence parallelism);
    the global batch not divisible by a module's dp (the LLM's only under first_fit); an edge
    whose two dp sizes do not divide; under `packing=dynamic_cp` an LLM CP pool dp*cp that is
    not a power of two; outside mode=plan/calibrate, a projector on an island of its own
    (`hcp.config.spans.check_projector_islands`, before the island-size rules).
    """
    check_choice("packing", cfg.packing, PACKINGS)
    for m in present_modules(cfg):
        check_choice(f"{m}.layout.cp_comm", module_cfg(cfg, m).layout.cp_comm, CP_COMMS)
        check_choice(f"{m}.layout.recompute", module_cfg(cfg, m).layout.recompute, RECOMPUTES)
    _check_launcher(cfg, world_size)
    if cfg.placement in PLACEMENTS:  # training's projector rule first (an unknown placement: below)
        modules = present_modules(cfg)
        check_projector_islands(cfg, modules, _edges(cfg, modules))
    layouts = resolve_layouts(cfg, world_size)
    check_resolved(cfg, layouts)
    return layouts


def check_resolved(cfg, layouts: dict[str, ResolvedLayout]) -> None:
    """The rules on resolved layouts (no cfg copy needed, so a layout search can run them on
    thousands of candidates): the dynamic-CP pool, tp dividing each module's widths, the token
    capacity under cp / sequence parallelism, and the lanes. Raises ConfigError."""
    _check_dynamic_cp(cfg, layouts)  # the pool first: its fix changes cp, which the token rule uses
    for lay in sorted(layouts.values(), key=lambda lay: lay.module != "llm"):
        _check_tensor_parallel(cfg, lay)
        _check_tokens(cfg, lay)
    _check_lanes(cfg, layouts)
