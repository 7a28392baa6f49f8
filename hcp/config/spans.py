"""Which ranks each module spans (docs/design.md: placement), before its layout is split.

- `colocated`: every module spans ranks [0, world_size).
- `non_colocated`: the world is cut into contiguous, disjoint islands that cover it. A module with
  `layout.num_ranks` or `layout.rank_offset` (or an explicit `dp`, which fixes its size to
  tp*cp*pp*dp) heads its own island; a module with neither key that is the destination of an
  edge from an encoder joins that encoder's island (LLaVA's projector shares the vision island);
  at most one island may leave its size open and gets the remaining ranks. Islands with an
  explicit `rank_offset` are placed first, the others in graph order at the lowest free rank.

Errors name the module's config path (`encoders.vision2.layout.num_ranks` for a named encoder).
`check_projector_islands` refuses, outside `mode=plan`/`calibrate`, a projector heading an island
of its own (training runs a projector on its encoder's island) before any island-size rule.
"""
from __future__ import annotations

from hcp.config.errors import ConfigError
from hcp.config.modules import kind, module_cfg, module_key


def colocated_spans(cfg, modules, world_size) -> dict[str, tuple[int, int]]:
    """Every module on [0, world_size): {module: (rank_offset, num_ranks)}. Raises ConfigError
    for a `num_ranks` or `rank_offset` that says otherwise."""
    for m in modules:
        lay = module_cfg(cfg, m).layout
        if lay.num_ranks not in (None, world_size):
            raise ConfigError(f"{module_key(cfg, m)}.layout.num_ranks", lay.num_ranks,
                              f"placement=colocated: every module spans all {world_size} ranks",
                              f"remove it (or set it to {world_size}), or set "
                              f"placement=non_colocated")
        if lay.rank_offset not in (None, 0):
            raise ConfigError(f"{module_key(cfg, m)}.layout.rank_offset", lay.rank_offset,
                              "placement=colocated: every module starts at rank 0",
                              "remove it, or set placement=non_colocated")
    return {m: (0, world_size) for m in modules}


def _island_heads(cfg, modules, edges) -> dict[str, str]:
    """Map each module to the module heading its island (itself or the encoder it joins)."""
    head = {}
    for m in modules:
        lay = module_cfg(cfg, m).layout
        if lay.num_ranks is None and lay.rank_offset is None:
            src = next((s for s, d in edges if d == m and kind(cfg, s) == "encoder"), None)
            if src is not None:
                head[m] = head[src]
                continue
        head[m] = m
    return head


def projector_island_error(cfg, m: str) -> ConfigError:
    """The ConfigError for projector `m` heading an island of its own (its own `num_ranks`,
    `rank_offset` or `dp` under non_colocated), which training does not run."""
    key, lay = module_key(cfg, m), module_cfg(cfg, m).layout
    return ConfigError(f"{key}.layout", {k: lay.get(k) for k in ("num_ranks", "rank_offset", "dp")},
                       f"{m} would run on an island of its own; a projector runs on the "
                       "last stage of its encoder's island (routes go from an encoder "
                       "island into the LLM only)", f"remove {key}.layout.num_ranks, "
                       f"rank_offset and dp (it takes its encoder's layout)")


def check_projector_islands(cfg, modules, edges) -> None:
    """Outside `mode=plan` and `mode=calibrate` (the modes that do not train), raise
    `projector_island_error` for the first projector heading an island of its own under
    `placement=non_colocated`; checked before the island-size rules so that their fixes are
    not the first thing a user follows."""
    if cfg.placement != "non_colocated" or cfg.get("mode") in ("plan", "calibrate"):
        return
    for m, h in _island_heads(cfg, modules, edges).items():
        if m == h and kind(cfg, m) == "projector":
            raise projector_island_error(cfg, m)


def _island_size(cfg, m) -> int | None:
    """The island's rank count from `num_ranks` or an explicit dp, else None (inferred)."""
    lay = module_cfg(cfg, m).layout
    if lay.num_ranks is not None:
        if lay.num_ranks < 1:
            raise ConfigError(f"{module_key(cfg, m)}.layout.num_ranks", lay.num_ranks,
                              "an island needs >= 1 rank", "use a positive rank count")
        return int(lay.num_ranks)
    if lay.dp != -1:
        return int(lay.tp * lay.cp * lay.pp * lay.dp)
    return None


def _lowest_free(used: dict[int, str], key: str, size: int, world_size: int) -> int:
    """Lowest rank r with ranks [r, r + size) unclaimed; raises ConfigError (field `key`'s
    `layout.num_ranks`) when none is."""
    run = 0
    for r in range(world_size):
        run = 0 if r in used else run + 1
        if run == size:
            return r - size + 1
    raise ConfigError(f"{key}.layout.num_ranks", size,
                      f"no {size} contiguous ranks remain free after the other islands",
                      "shrink the islands or give explicit rank_offset values that fit")


def non_colocated_spans(cfg, modules, edges, world_size) -> dict[str, tuple[int, int]]:
    """{module: (rank_offset, num_ranks)} of its island (module docstring). Raises ConfigError
    for islands left open more than once, overlapping, leaving the world or leaving ranks
    unused."""
    head = _island_heads(cfg, modules, edges)
    islands = list(dict.fromkeys(head.values()))
    sizes = {h: _island_size(cfg, h) for h in islands}
    open_ = [h for h in islands if sizes[h] is None]
    if len(open_) > 1:  # leave the LLM's island open if it is, else the last one
        keep = "llm" if "llm" in open_ else open_[-1]
        to_set = [module_key(cfg, h) for h in open_ if h != keep]
        plural = len(to_set) > 1
        raise ConfigError(f"{to_set[0]}.layout.num_ranks", None,
                          f"the islands of {open_} all leave their size to be inferred; at most "
                          f"one may",
                          f"set {' and '.join(k + '.layout.num_ranks' for k in to_set)} "
                          f"(or {'their' if plural else 'its'} dp)")
    if open_:
        rest = world_size - sum(s for s in sizes.values() if s is not None)
        if rest < 1:  # name the largest island of a set size: the one to shrink
            big = max((h for h in islands if sizes[h] is not None), key=lambda h: sizes[h])
            lay = module_cfg(cfg, big).layout
            field = "num_ranks" if lay.num_ranks is not None else "dp"
            o = module_cfg(cfg, open_[0]).layout   # the open island needs tp * cp * pp ranks
            need = int(o.tp) * int(o.cp) * int(o.pp)
            most = sizes[big] + rest - need
            key = f"{module_key(cfg, big)}.layout.{field}"
            # the sizes (or dp) that leave the open island room; `validate` offers only those
            # that pass every other rule too (the global batch's divisibility, ...)
            per = 1 if field == "num_ranks" else sizes[big] // int(lay.dp)
            values = [v for v in range(1, most // per + 1)]
            more = f"run on at least {world_size - rest + need} ranks (launcher.nproc_per_node)"
            raise ConfigError(key, getattr(lay, field),
                              f"the islands of a set size already take {world_size - rest} of "
                              f"{world_size} ranks, leaving none for the "
                              f"{module_key(cfg, open_[0])} island, which needs at least tp * cp * "
                              f"pp = {need}",
                              f"use {key} in {{values}}, or {more}" if values else more,
                              values or None)
        sizes[open_[0]] = rest
    used: dict[int, str] = {}
    offsets = {}
    explicit = [h for h in islands if module_cfg(cfg, h).layout.rank_offset is not None]
    for h in explicit + [h for h in islands if h not in explicit]:
        offset = module_cfg(cfg, h).layout.rank_offset
        if offset is None:
            offset = _lowest_free(used, module_key(cfg, h), sizes[h], world_size)
        if offset < 0 or offset + sizes[h] > world_size:
            raise ConfigError(f"{module_key(cfg, h)}.layout.rank_offset", offset,
                              f"island [{offset}, {offset + sizes[h]}) of {h} leaves the world "
                              f"[0, {world_size})", "lower the offset or the island size")
        for r in range(offset, offset + sizes[h]):
            if r in used:
                raise ConfigError(f"{module_key(cfg, h)}.layout.rank_offset", offset,
                                  f"island [{offset}, {offset + sizes[h]}) of {h} overlaps the "
                                  f"island of {used[r]} at rank {r}", "make the islands disjoint")
            used[r] = h
        offsets[h] = offset
    unused = [r for r in range(world_size) if r not in used]
    if unused:
        raise ConfigError(f"{module_key(cfg, islands[-1])}.layout.num_ranks", sizes[islands[-1]],
                          f"the islands leave {len(unused)} of {world_size} ranks unused "
                          f"(first: {unused[0]})",
                          "grow an island (num_ranks) so that they cover the world")
    return {m: (offsets[head[m]], sizes[head[m]]) for m in modules}
