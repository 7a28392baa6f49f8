"""`layout=auto`: search placement, island sizes and every module's layout for the fastest
estimated step that fits, before any process group starts. Pure: no process group.

    python train.py +recipe=llava_hetero mode=plan layout=auto
    python train.py +recipe=llava_hetero mode=plan layout=auto llm.layout.tp=8   # tp pinned
    python train.py +recipe=llava_tiny_two_encoders mode=plan layout=auto
    encoders.vision2.layout.tp=2

The space and the pins: `hcp.preflight.auto_space` (a field given on the command line stays fixed);
the estimate: `hcp.preflight.auto_cost` under `packing_profile`'s hardware (`h100`, or a profile
of `mode=calibrate`). Branch and bound: the (placement, island sizes) groups and, inside each,
the (encoder layouts, LLM layout) pairs are visited in order of a cheap lower bound on their
step; LLM layouts
whose own stages exceed `cluster.device_memory_gib` are dropped first, a pair is checked for
memory before it is simulated, and the search stops where the bound reaches the `top`-th best
step found. Each layout that enters the ranking passes the full validation and training's
support check (`hcp.config.validate.validate`, `hcp.train.support.check_trainable`), so the
search never returns a layout that training refuses. `prune=False` scores every pair (tests).
"""
from __future__ import annotations

import copy
import heapq
import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
from omegaconf import open_dict

from hcp.config.errors import ConfigError
from hcp.config.layouts import check_layouts
from hcp.config.modules import projector_names, set_layout
from hcp.config.specs import resolve_modules
from hcp.preflight.auto_cost import Score, Scorer, combine_bounds, price_step, priced_on
from hcp.preflight.auto_space import (Candidate, check_searchable, combine, encoder_options,
                                      island_sizes, module_options, pinned_fields, placements)

TOP = 10
"""Rows of the ranked table."""
_FIELDS = ("tp", "cp", "pp", "dp", "pp_layers", "recompute", "dp_shard")


@dataclass
class SearchResult:
    """The ranked candidates (best first, each with its `Score`) and what the search did."""

    ranked: list[tuple[Candidate, Score]]
    counts: dict = field(default_factory=dict)
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    """Wall and CPU (this process's) seconds of the search."""
    lengths: np.ndarray | None = None
    lengths_from: str = ""
    """The priced global batch's lengths and where they come from (`auto_cost.data_lengths`)."""


def apply_layout(cfg, cand: Candidate) -> None:
    """Write `cand` into `cfg` (in place): placement and every module's layout fields; under
    non_colocated each encoder's island size (`<encoder>.layout.num_ranks`), the LLM the rest."""
    with open_dict(cfg):
        cfg.placement = cand.placement
        for m, lay in cand.layouts:
            values = {k: list(lay.pp_layers)
                      if k == "pp_layers" else getattr(lay, k) for k in _FIELDS}
            island = cand.placement == "non_colocated" and m != "llm" and m not in cand.projectors
            values.update(rank_offset=None, num_ranks=lay.num_ranks if island else None)
            if m in cand.projectors:
                # an explicit dp would head an island of its own (hcp.config.spans)
                values["dp"] = -1
            set_layout(cfg, m, values)


def check_candidate(cfg, cand: Candidate, world: int) -> None:
    """Raise ConfigError unless `cand` passes every rule and training runs it: `cfg` with the
    candidate applied, through validation and `check_trainable`; the resolved layouts must be
    the candidate's own."""
    from hcp.config.validate import validate
    from hcp.train.support import check_trainable

    trial = copy.deepcopy(cfg)
    apply_layout(trial, cand)
    layouts = validate(trial, world)
    check_trainable(trial, resolve_modules(trial, layouts))
    if layouts != cand.by_module:
        raise ConfigError("layout", "auto",
                          f"resolution gives {layouts}, not the candidate {cand.by_module}",
                          "report this as a bug")


def _groups(cfg, world: int, pinned: dict, scorer: Scorer, node: int):
    """[(placement, encoder layout combinations, LLM layouts)] of each placement and island
    sizes; LLM layouts whose stages alone exceed the device memory dropped (counted in
    `dropped`)."""
    out, dropped = [], 0
    for placement in placements(cfg, pinned):
        for islands in ([()] if placement == "colocated"
                        else island_sizes(scorer.cfg, world, node, pinned)):
            split = sum(islands)
            encoders = encoder_options(scorer.cfg, placement, islands, pinned, node, world)
            llm = module_options(scorer.cfg, "llm", world - split, split, placement, pinned, node)
            fits = [lay for lay in llm if scorer.llm_memory(lay) <= scorer.cap]
            dropped += len(encoders) * (len(llm) - len(fits))
            if encoders and fits:
                out.append((placement, encoders, fits))
    return out, dropped


def search(cfg, world: int, pinned: dict, top: int = TOP, prune: bool = True,
           profile: str | None = None) -> SearchResult:
    """The `top` fastest candidates that fit and pass every rule (module docstring), best first
    (ties: `_order`; no row `dominates` another). Raises ConfigError when none does."""
    start, cpu = time.perf_counter(), time.process_time()
    check_searchable(cfg, pinned)
    scorer = Scorer(cfg, world, profile or cfg.packing_profile)
    node = min(int(cfg.cluster.gpus_per_node), world)
    groups, dropped = _groups(cfg, world, pinned, scorer, node)
    groups.sort(key=lambda g: combine_bounds(g[0], min(scorer.encoder_part(e, g[0]) for e in g[1]),
                                             min(scorer.llm_bound(x) for x in g[2])))
    space = int(sum(len(e) * len(x) for _, e, x in groups)) + dropped
    ranked, counts, error = _rank(cfg, world, groups, scorer, top, prune, inline=False)
    # a ranked layout failed the full rules: rank again, checking each as it enters
    if error is not None:
        ranked, counts, error = _rank(cfg, world, groups, scorer, top, prune, inline=True)
    counts = {"space": space, "llm_memory_dropped": dropped, **counts,
              "memory_correction": scorer.correction}
    if not ranked and error is not None:
        raise error  # a rule outside the layouts (the model, the trainer) fails them all
    if not ranked and space == 0 and pinned:  # the pins, not memory, empty the space
        raise ConfigError("layout", "auto",
                          f"the pinned fields {pinned} leave no candidate on {world} ranks "
                          f"(every searched layout keeps tp within a node of {node} and dividing "
                          f"the heads, pp dividing the layers, dp x cp x tp x pp equal to the "
                          f"module's ranks)",
                          "change or drop a pin (layout=manual checks and names each field)")
    if not ranked:
        raise ConfigError("layout", "auto", f"no layout of the searched space ({counts['space']} "
                          f"candidates on {world} ranks) fits cluster.device_memory_gib="
                          f"{cfg.cluster.device_memory_gib} and passes the layout rules",
                          "unpin fields, add ranks (launcher.*) or lower "
                          "trainer.micro_batch_tokens")
    return SearchResult(ranked, counts, time.perf_counter() - start, time.process_time() - cpu,
                        scorer.lens, scorer.lengths_from)


def _rank(cfg, world: int, groups, scorer: Scorer, top: int, prune: bool, inline: bool):
    """(the `top` best candidates, counts, the first full-rule error or None): branch and bound
    over `groups` (module docstring). Inside a group, each LLM layout walks the encoder
    combinations in order of their bound (a heap of one entry per LLM layout: the bounds
    combine monotonically), its own bound refined by simulation the first time it leads.
    The full rules (`check_candidate`) run on the final ranking, or (`inline`) on each
    candidate as it enters it, so that the pruning threshold then comes from layouts that
    pass them."""
    counts = {"memory_rejected": 0, "rule_rejected": 0, "scored": 0, "llm_simulated": 0}
    ranked: list[tuple[Candidate, Score]] = []
    error = None

    def threshold() -> float:
        return ranked[top - 1][1].step_time_s if prune and len(ranked) >= top else float("inf")

    def passes(cand) -> bool:
        nonlocal error
        try:
            check_candidate(cfg, cand, world)
            return True
        except ConfigError as e:
            counts["rule_rejected"] += 1
            error = error or e
            return False

    for placement, encoders, llm in groups:
        enc = np.array([scorer.encoder_part(e, placement) for e in encoders])
        order = np.argsort(enc, kind="stable")
        exact = [scorer.has_lane(x) for x in llm]
        part = [scorer.llm_part(x) if e else scorer.llm_bound(x) for x, e in zip(llm, exact)]
        nxt = [0] * len(llm)
        heap = [(float(combine_bounds(placement, enc[order[0]], part[j])), j)
                for j in range(len(llm))]
        heapq.heapify(heap)
        while heap and heap[0][0] < threshold():
            _, j = heapq.heappop(heap)
            if not exact[j]:  # refine the LLM's bound by simulating it, then look again
                part[j], exact[j] = scorer.llm_part(llm[j]), True
                counts["llm_simulated"] += 1
                heapq.heappush(heap,
                               (float(combine_bounds(placement, enc[order[nxt[j]]], part[j])), j))
                continue
            i = order[nxt[j]]
            nxt[j] += 1
            if nxt[j] < len(order):
                heapq.heappush(heap,
                               (float(combine_bounds(placement, enc[order[nxt[j]]], part[j])), j))
            cand = combine(scorer.cfg, placement, encoders[i], llm[j])
            if cand is None:
                counts["rule_rejected"] += 1
                continue
            if max(scorer.memory(cand).values()) > scorer.cap:
                counts["memory_rejected"] += 1
                continue
            score = scorer.score(cand)
            counts["scored"] += 1
            item = (cand, score)
            if len(ranked) >= top and _order(item) >= _order(ranked[-1]):
                continue
            if any(dominates(other, item) for other in ranked):
                continue
            if inline and not passes(cand):
                continue
            ranked = [other for other in ranked if not dominates(item, other)]
            ranked.append(item)
            ranked.sort(key=_order)
            del ranked[top:]
    if not inline:
        ranked = [item for item in ranked if passes(item[0])]
    return ranked, counts, error


def dominates(a: tuple[Candidate, Score], b: tuple[Candidate, Score]) -> bool:
    """Whether the ranking drops `b` for `a` (both `(candidate, score)`): the same layouts but
    for recompute, `a` at least as fast with at most `b`'s memory in every role and first in
    `_order`. Recompute trades time for memory; one that buys no memory is no choice: the
    LLM's `selective` under the models (`hcp.preflight.memory`: the recomputed attention core
    keeps nothing beyond its output; `CostModel.core_fwd` runs again in backward)."""
    (ca, sa), (cb, sb) = a, b
    if ca == cb or _but_recompute(ca) != _but_recompute(cb) or sa.step_time_s > sb.step_time_s:
        return False
    return all(sa.memory_gib[k] <= v for k, v in sb.memory_gib.items()) and _order(a) < _order(b)


def _but_recompute(cand: Candidate) -> tuple:
    return cand.placement, tuple((m, replace(lay, recompute="none")) for m, lay in cand.layouts)


def _order(item) -> tuple:
    """Faster first; among equal estimates the simpler layout (no recompute, no FSDP, fewer
    stages), then less memory."""
    cand, score = item
    simpler = sum(("none", "selective", "full").index(lay.recompute) + lay.dp_shard + lay.pp
                  for _, lay in cand.layouts)
    return score.step_time_s, simpler, max(score.memory_gib.values())


def describe(cand: Candidate) -> dict[str, str]:
    """{module: short layout text} of the encoders and the LLM (projectors run with their
    encoders), e.g. `tp8 cp2 pp2 dp2 sel` / `r0-15 tp1 pp2 dp8 fsdp full`."""
    out = {}
    for m, lay in cand.layouts:
        if m in cand.projectors:
            continue
        where = (f"r{lay.rank_offset}-{lay.rank_offset + lay.num_ranks - 1} "
                 if cand.placement == "non_colocated" else "")
        extra = (" fsdp" if lay.dp_shard
                 else "") + ("" if lay.recompute == "none" else f" {lay.recompute[:4]}")
        out[m] = f"{where}tp{lay.tp} cp{lay.cp} pp{lay.pp} dp{lay.dp}{extra}"
    return out


def _encoders_text(d: dict) -> str:
    """The encoders' layouts of a `describe` result in one cell (`name: layout` when several)."""
    named = [(m, t) for m, t in d.items() if m != "llm"]
    if len(named) == 1:
        return named[0][1]
    return " | ".join(f"{m}: {t}" for m, t in named) or "-"


def _row(cand: Candidate, score: Score) -> dict:
    return {"placement": cand.placement, "describe": describe(cand),
            "layouts": {m: {k: (list(v) if k == "pp_layers" else v) for k, v in asdict(lay).items()
                            if k in _FIELDS + ("num_ranks", "rank_offset")}
                            for m, lay in cand.layouts},
            **asdict(score)}


def format_table(rows: list[dict], given: dict | None) -> str:
    """The ranked table: rank, placement, layouts (the encoders', the LLM's), step, TFLOPS/GPU,
    memory per role, bubble, route bytes (MB); the given layout last."""
    every = rows + ([given] if given is not None and "describe" in given else [])
    width = max([30] + [len(_encoders_text(r["describe"])) for r in every])
    mem_width = max([22] + [len(" ".join(f"{k} {v:.1f}" for k, v in r["memory_gib"].items())) + 4
                            for r in every])
    head = (f"  {'#':>5} {'placement':<13} {'encoder layouts':<{width}} {'llm':<30} {'step s':>8} "
            f"{'TFLOPS':>7} {'memory GiB by role':<{mem_width}} {'bubble':>6} {'route MB':>9}")
    lines = [head]

    def line(tag, r):
        if "error" in r:
            return f"  {tag:>5} {r['error']}"
        mem = (" ".join(f"{k} {v:.1f}" for k, v in r["memory_gib"].items())
               + ("" if r["fits"] else " (!)"))
        d = r["describe"]
        return (f"  {tag:>5} {r['placement']:<13} {_encoders_text(d):<{width}} {d['llm']:<30} "
                f"{r['step_time_s']:>8.4g} {r['tflops_per_gpu']:>7.1f} {mem:<{mem_width}} "
                f"{r['bubble_fraction']:>6.1%} {r['route_bytes'] / 1e6:>9.1f}")

    lines += [line(str(k + 1), r) for k, r in enumerate(rows)]
    if given is not None:
        lines.append(line("given", given))
    return "\n".join(lines)


def score_given(cfg, world: int, scorer: Scorer) -> dict:
    """The configured (recipe's) layout's row, or {"error": ...} when it breaks a rule."""
    try:
        layouts = check_layouts(cfg, world)
    except ConfigError as e:
        return {"error": f"given layout: {e}"}
    cand = Candidate(cfg.placement, tuple(layouts.items()), projector_names(cfg))
    return _row(cand, price_step(cfg, layouts, world, scorer))


def choose_layout(cfg, overrides, world: int, run_dir=None, verbose: bool = True,
                  top: int = TOP) -> dict:
    """`layout=auto` on `world` ranks: search (`overrides`: the command line's, which pin
    fields), print (`verbose`) the ranked table and why the winner wins, write the report to
    `run_dir/auto_layout.json` (`run_dir` given), and write the winner into `cfg` (in place).
    Returns the report. Raises ConfigError when no layout fits."""
    pinned = pinned_fields(cfg, overrides)
    given_cfg = copy.deepcopy(cfg)
    result = search(cfg, world, pinned, top)
    rows = [_row(c, s) for c, s in result.ranked]
    scorer = Scorer(cfg, world, cfg.packing_profile, result.lengths)
    scorer.lengths_from = result.lengths_from
    given = score_given(given_cfg, world, scorer)
    best = rows[0]
    why = f"{best['critical']} is the critical path; {best['why']}"
    if "step_time_s" in given:
        why += f"; {given['step_time_s'] / best['step_time_s']:.2f}x the given layout's speed"
    report = {"world_size": world, "pinned": pinned, "counts": result.counts,
              "lengths_from": result.lengths_from, "search_seconds": result.seconds,
              "search_cpu_seconds": result.cpu_seconds, "ranked": rows, "given": given, "why": why}
    c = result.counts
    say = print if verbose else (lambda *a, **k: None)
    say(f"hcp: layout=auto on {world} ranks: {c['space']} candidates ({c['llm_memory_dropped']} "
        f"dropped "
          f"by LLM memory, {c['memory_rejected']} by rank memory, {c['rule_rejected']} by layout "
          f"rules, {c['scored']} simulated, the rest pruned by bound) in {result.seconds:.1f} s "
          f"({result.cpu_seconds:.1f} CPU s); pinned: {pinned or 'none'}; "
          f"{priced_on(scorer, cfg, here=cfg.mode == 'train')}"
          + (f"; memory estimates x{c['memory_correction']:.3f} (rehearse.report)"
             if cfg.rehearse.report else ""))
    say(format_table(rows, given))
    say(f"hcp: layout=auto chose {best['placement']}: "
          + "; ".join(f"{m} {d}" for m, d in best["describe"].items()) + f" ({why})")
    apply_layout(cfg, result.ranked[0][0])
    if run_dir is not None:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        (Path(run_dir) / "auto_layout.json").write_text(json.dumps(report, indent=1, default=str))
    return report

