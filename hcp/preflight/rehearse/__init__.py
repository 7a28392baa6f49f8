"""`python train.py +recipe=R mode=rehearse`: every rank of the recipe's full world runs the
real training code, one forked process per rank, on torch's fake process group; its
collectives, sends/receives and group creations are recorded and checked against every other
rank's (`checks`), its peak memory is tracked and its FLOPs counted (`runner`), and the verdict
is printed and written to `rehearsal.json` (`report`).

`rehearse.ranks` restricts it to a subset (a quick look: sends and receives are matched only
between rehearsed ranks, and the other ranks are not shown). `rehearse.by_class=true` covers the
whole world with one rehearsed rank per class (`classes`): every rank's plan slice is computed
first on that rank (its planner alone, in its own process), ranks r and t are one class when
they run the same modules at the same stages and a permutation pi of the world's ranks that
swaps their grid coordinates (tp, cp, dp) maps every process group onto a process group and
r's plan slice of every step onto t's; t's trace is then r's with every group and peer renamed
by pi, and every check (collectives per group, send/receive rendezvous, group creations, memory
against the device) runs on all ranks. Why that is a proof, under one assumption: a rank's code
depends on its rank only through its plan slice and its grid coordinates, and on the
coordinates only through the process groups they put it in (their ranks and its place in
them; no branch on a coordinate's value, no shard shaped by it). pi maps both of r's onto t's,
so t runs r's code on renamed groups and peers and issues r's ops renamed, and its tensors
have r's shapes (same memory and FLOPs). A rank whose plan differs (a lane with no image, a
dynamic-CP pool position, a planner that misbehaves on one rank) fails the comparison and is
rehearsed as its own class. The assumption is what tests/test_rehearse_classes.py checks on 8-rank
worlds (derived traces equal an all-rank rehearsal's op by op).

`rehearse.device=cuda` runs the ranks on fake CUDA tensors (`fake_cuda`: the CUDA code path on
the CPU wheel) and records each rank's device reads, host-to-device copies, device mismatches,
attention kernels and wire dtypes (`device`); a device read inside a micro-batch after the
first step fails the rehearsal (docs/rehearsal.md)."""
from __future__ import annotations

import os
import time
from dataclasses import asdict

from hcp.config.errors import ConfigError


def check_rehearse(cfg, world: int) -> list[int]:
    """The ranks to rehearse (`rehearse.ranks`, default all of `world`).

    Raises:
        ConfigError: `rehearse.steps` < 1, `rehearse.jobs` < 1, `rehearse.device` not cpu or
            cuda, a rank outside the world, or
            `rehearse.ranks` with `rehearse.by_class` (a class rehearsal covers the world)."""
    rc = cfg.rehearse
    if rc.steps < 1:
        raise ConfigError("rehearse.steps", rc.steps, "a rehearsal runs at least one step",
                          "use rehearse.steps=1 or more")
    if rc.jobs is not None and rc.jobs < 1:
        raise ConfigError("rehearse.jobs", rc.jobs, "at least one process runs",
                          "use rehearse.jobs=1 or more (null: one per core)")
    if rc.get("device", "cpu") not in ("cpu", "cuda"):
        raise ConfigError("rehearse.device", rc.device, "ranks rehearse on fake cpu or cuda "
                          "tensors", "use rehearse.device=cpu or rehearse.device=cuda")
    if rc.get("by_class") and rc.ranks is not None:
        raise ConfigError("rehearse.ranks", list(rc.ranks),
                          "rehearse.by_class=true rehearses one rank per class "
                          "of the whole world",
                          "drop rehearse.ranks, or set rehearse.by_class=false")
    ranks = list(range(world)) if rc.ranks is None else sorted({int(r) for r in rc.ranks})
    bad = [r for r in ranks if not 0 <= r < world]
    if bad or not ranks:
        problem = (f"ranks {bad} are outside the job's world of {world}" if bad
                   else "no rank to rehearse")
        raise ConfigError("rehearse.ranks", list(rc.ranks), problem,
                          f"list ranks in 0..{world - 1}, or null for all of them")
    return ranks


def run_rehearsal(cfg, run_dir: str, world: int, progress: bool = True) -> list:
    """Rehearse `cfg`'s job of `world` ranks; print the report, write `rehearsal.json` into
    `run_dir`; return its mismatches (`hcp.preflight.rehearse.checks.Mismatch`; none: passed). The
    layouts must already be validated and the data prepared."""
    from hcp.config.layouts import resolve_layouts
    from hcp.config.specs import resolve_modules
    from hcp.parallel.roles import role_table
    from hcp.preflight.plan_mode import running_layouts
    from hcp.preflight.estimate import cost_model, hardware
    from hcp.preflight.rehearse.report import (find_mismatches, format_report, job_facts,
                                               micro_batch_flops, role_rows, write_json)
    from hcp.preflight.rehearse.runner import default_jobs, rehearsal_config, rehearse_ranks

    ranks = check_rehearse(cfg, world)
    layouts = resolve_layouts(cfg, world)
    running = running_layouts(cfg, layouts)
    table = role_table(running, world)
    roles = {role.rank: ", ".join(f"{m} pp{role.stage(m)}" for m in role.modules) for role in table}
    stages = {role.rank: role.stage("llm") if "llm" in role.modules else None for role in table}
    # what the ranks get: the resolved container, as in training
    plan_cfg, cfg = cfg, rehearsal_config(cfg)
    jobs = cfg.rehearse.jobs or default_jobs()
    t0 = time.perf_counter()

    def said(rank, res):
        if progress:
            print(f"hcp: rehearsed rank {rank} of {world}{' (raised)' if res.error else ''}",
                  flush=True)

    classes, faults = None, []
    if cfg.rehearse.get("by_class"):
        classes = world_classes(cfg, layouts, world, jobs)
        ranks = [c.rep for c in classes]
        if progress:
            print(f"hcp: {len(classes)} rank classes of {world} ranks: rehearsing their "
                  f"representatives {_ranks_list(ranks)}", flush=True)
    results = rehearse_ranks(cfg, run_dir, ranks, world, cfg.rehearse.steps, jobs, progress=said)
    if classes is not None:
        results, faults = derive_world(results, classes, layouts, world)
    wall = time.perf_counter() - t0
    mismatches = faults + find_mismatches(results, world, cfg.cluster.device_memory_gib)
    plan_gib = plan_per_rank(plan_cfg, layouts, world, results)
    micro = micro_batch_flops(results, stages, cost_model(cfg, running["llm"], hardware(cfg)),
                             running["llm"])
    rows = role_rows(results, roles, plan_gib, micro)
    if cfg.rehearse.get("device") == "cuda":
        from hcp.preflight.rehearse.device import format_device

        print("\n".join(format_device(results, cfg.rehearse.steps)), flush=True)
    print(format_report(rows, mismatches, wall, classes), flush=True)
    job = {**job_facts(plan_cfg, resolve_modules(plan_cfg, layouts), world),
           "placement": plan_cfg.placement,
           "layouts": {m: asdict(lay) for m, lay in layouts.items()}, "ranks": ranks}
    write_json(os.path.join(run_dir, "rehearsal.json"), rows, mismatches, micro, results, wall,
               plan_gib, job, classes)
    return mismatches


def world_classes(cfg, layouts, world: int, jobs: int) -> list:
    """The world's rank classes (`hcp.preflight.rehearse.classes.rank_classes`) from every
    rank's plan slices, each computed on its own rank (`runner.plan_slices`)."""
    from hcp.config.settings import PackingSpec
    from hcp.parallel.groups import creation_order
    from hcp.preflight.rehearse.classes import rank_classes
    from hcp.preflight.rehearse.runner import plan_slices

    slices = plan_slices(cfg, world, cfg.rehearse.steps, jobs)
    dynamic = ("llm",) if PackingSpec.of(cfg).dynamic_cp else ()
    groups = {frozenset(ranks)
              for ranks, _ in creation_order(layouts, dynamic)} | {frozenset(range(world))}
    return rank_classes(layouts, world, slices, groups)


def derive_world(results: dict, classes: list, layouts, world: int) -> tuple[dict, list]:
    """Every rank's result: the representatives' (`results`) and each other member's derived
    (`hcp.preflight.rehearse.classes.derive`); and a `Mismatch` for a member whose renamed
    trace names a group no rank creates."""
    from hcp.preflight.rehearse.checks import Mismatch
    from hcp.preflight.rehearse.classes import derive, permutation

    out, faults = dict(results), []
    for c in classes:
        rep = results[c.rep]
        for t in c.members[1:]:
            try:
                out[t] = derive(rep, t, permutation(layouts, world, c.rep, t), rep.group_names)
            except ValueError as err:
                faults.append(Mismatch("class", [c.rep, t], None, None, {t: str(err)},
                                       "a class member's trace cannot be derived from its "
                                       "representative's"))
    return dict(sorted(out.items())), faults


def _ranks_list(ranks: list[int]) -> str:
    return ",".join(map(str, ranks))


def plan_per_rank(cfg, layouts, world: int, results: dict) -> dict[int, float]:
    """Plan mode's memory estimate in GiB of each rehearsed rank (`results`: rank ->
    `RankResult`) for its own heaviest step: the LLM micro-batches' worth of tokens its lane's
    step plan gave it (`RankResult.step_worth`; a small batch fills fewer than 1F1B's warm-up
    holds at full size, its last one partly; none: the whole warm-up). Each rank's own, not the
    largest of the ranks rehearsed with it, so a subset (`rehearse.ranks`) and the whole world
    give a rank the same figure."""
    from hcp.config.specs import resolve_modules
    from hcp.preflight.plan_mode import memory_per_rank, named_shapes, stage_memory

    specs = resolve_modules(cfg, layouts)
    shapes, by_worth, out = named_shapes(specs), {}, {}
    for r, res in sorted(results.items()):
        worth = max(res.step_worth, default=0) or None
        if worth not in by_worth:
            mem = stage_memory(cfg, layouts, specs, shapes, micro_batches=worth)
            by_worth[worth] = {row["rank"]: row["total"]
                               for row in memory_per_rank(cfg, layouts, world, mem)}
        out[r] = by_worth[worth][r]
    return out
