"""Plan mode: check and show a layout for the configured cluster in one process, no process group.

    python train.py +recipe=llava_hetero mode=plan
    python train.py +recipe=llama13b_dynamic_cp mode=plan llm.layout.cp=4 llm.layout.dp=2

For the world training would get (`launcher.nnodes x nproc_per_node`; `auto`: this machine's
local ranks on one node, `cluster.gpus_per_node` on several) it prints, per module, the layout,
island ranks, parameter count (from the model built on the meta device, as 1.2M / 13.0B) and
the groups the registry would create (and how it runs CP: encoder CP, dynamic CP's pool and
sizes, `cp_notes`, also written on the picture's rows); a rank map compressed into runs of ranks
with the same role; the per-rank memory estimate of `hcp.preflight.memory` against
`cluster.device_memory_gib`; the estimated step time, TFLOPS/GPU and bubble, priced as `layout=auto`
prices a layout (`hcp.preflight.auto_cost.price_step`: the run's own first global batch, the
encoders, the islands, `packing_profile`; one set of figures for one layout); and warnings for TP
(and dynamic-CP) groups that cross a node boundary. It writes `plan.json` and `plan.png` to
`out_dir`, then raises ConfigError naming the knob to turn when a rank does not fit. A `-m`
sweep of plans ends with one comparison table (`hcp.preflight.plan_table`).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from hcp.config.errors import ConfigError
from hcp.config.layouts import check_layouts, world_size_of
from hcp.config.specs import resolve_modules
from hcp.config.modules import kind
from hcp.config.precision import Precision
from hcp.parallel.grid import KINDS, Grid
from hcp.parallel.roles import logging_rank, role_table
from hcp.launch.launch import cluster_fix, machine_memory_gib, resolve_nproc
from hcp.preflight.auto_cost import Scorer, price_step, priced_on
from hcp.preflight.memory import GIB, module_memory, rank_activations
from hcp.preflight.plan_figure import draw_plan
from hcp.preflight.running import named_shapes, running_layouts


def group_counts(cfg, layouts) -> dict[str, dict[str, list[int]]]:
    """module -> kind -> [number of groups, ranks per group] (dynamic CP: `dynamic_cp_<size>`)."""
    counts = {}
    for m, lay in layouts.items():
        grid = Grid.of(lay)
        counts[m] = {k: list(grid.groups(k).shape) for k in KINDS}
        if m == "llm" and cfg.packing == "dynamic_cp":
            counts[m] |= {f"dynamic_cp_{s}": [grid.size // s, s] for s in grid.dynamic_cp_sizes()}
    return counts


def cp_notes(cfg, layouts) -> dict[str, str]:
    """module -> how it runs context parallelism, for the table and the picture: the LLM under
    `packing=dynamic_cp` (its CP pool and the CP sizes a micro-batch may take), an encoder-side
    encoder with `layout.cp` > 1 (encoder CP: every input's tokens split over its CP ranks)."""
    notes = {}
    for m, lay in layouts.items():
        if m == "llm" and cfg.packing == "dynamic_cp":
            sizes = Grid.of(lay).dynamic_cp_sizes()
            notes[m] = (f"dynamic CP: pool dp*cp = {lay.cp_pool} ranks per stage, CP "
                        f"{'/'.join(map(str, sizes))} chosen per micro-batch")
        elif m != "llm" and lay.cp > 1 and kind(cfg, m) == "encoder":
            notes[m] = f"encoder CP {lay.cp}: every input's tokens split over {lay.cp} ranks"
    return notes


def rank_runs(roles) -> list[dict]:
    """Consecutive ranks with the same modules and PP stages, as [{first, last, role}]."""
    runs = []
    for role in roles:
        tag = ", ".join(f"{m} pp{role.stage(m)}" for m in role.modules)
        if runs and runs[-1]["role"] == tag:
            runs[-1]["last"] = role.rank
        else:
            runs.append({"first": role.rank, "last": role.rank, "role": tag})
    return runs


def _fix_for(cfg, layout, stage_mem) -> tuple[str, object, str]:
    """(field, value, fix) of the knob that helps a rank that does not fit most."""
    m = layout.module
    if stage_mem.activations > stage_mem.total - stage_mem.activations:
        if layout.recompute != "full":
            return f"{m}.layout.recompute", layout.recompute, "use `selective` or `full` recompute"
        return "trainer.micro_batch_tokens", cfg.trainer.micro_batch_tokens, "lower it or raise cp"
    if not layout.dp_shard and layout.dp * layout.cp > 1:
        return (f"{m}.layout.dp_shard", False,
                "shard the model state over dp*cp (dp_shard=true) or raise tp/pp")
    return f"{m}.layout.pp", layout.pp, "raise pp or tp"


def stage_memory(cfg, layouts, specs=None, shapes=None, micro_batches=None) -> dict:
    """{module: [StageMemory of one rank of each PP stage]} (`hcp.preflight.memory.module_memory`,
    `micro_batches` its) under the layouts the modules run with (`running_layouts`); `specs`
    (`resolve_modules`') and `shapes` (`named_shapes`') are resolved here when not given."""
    specs = specs or resolve_modules(cfg, layouts)
    shapes = shapes or named_shapes(specs)
    running = running_layouts(cfg, layouts)
    return {m: module_memory(cfg, specs, lay, shapes[m], running, micro_batches=micro_batches)
            for m, lay in running.items()}


def memory_per_rank(cfg, layouts, world: int, stage_mem=None, micro_batches=None) -> list[dict]:
    """Each rank's estimated memory in GiB, `[{rank, weights, grads, optimizer, activations,
    total}]` (`hcp.preflight.memory`): the modules and PP stages of the rank's role only (under
    `non_colocated` its island's); `stage_mem` (`stage_memory`'s result) if known, else computed
    with `micro_batches` (`hcp.preflight.memory.module_memory`'s)."""
    if stage_mem is None:
        stage_mem = stage_memory(cfg, layouts, micro_batches=micro_batches)
    per_rank = []
    for role in role_table(running_layouts(cfg, layouts), world):
        parts = [stage_mem[m][role.stage(m)] for m in role.modules]
        row = {k: sum(getattr(p, k) for p in parts) / GIB
               for k in ("weights", "grads", "optimizer")}
        row["activations"] = rank_activations(parts) / GIB
        per_rank.append({"rank": role.rank, **row, "total": sum(row.values())})
    return per_rank


def readable_count(n: float) -> str:
    """A count with one decimal and a unit: 950, 12.3K, 1.2M, 13.0B, 1.1T."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:g}"


def _ranks_text(ranks) -> str:
    ranks = [int(r) for r in ranks]
    if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")


def _crossing(groups, per_node: int) -> list:
    nodes = groups // per_node
    return [row for row, n in zip(groups, nodes) if n.min() != n.max()]


def node_warnings(cfg, layouts) -> list[str]:
    """Warnings for TP groups (every module) and, under `packing=dynamic_cp`, the LLM's dynamic
    CP groups that cross a node boundary (`cluster.gpus_per_node` ranks per node), naming the
    ranks of the first such group: their traffic leaves NVLink for the inter-node network."""
    per_node, out = int(cfg.cluster.gpus_per_node), []
    for m, lay in layouts.items():
        grid = Grid.of(lay)
        tp = grid.groups("tp")
        bad = _crossing(tp, per_node)
        if lay.tp > 1 and bad:
            out.append(f"warning: {m}: {len(bad)} of {len(tp)} TP groups cross a node boundary "
                       f"(cluster.gpus_per_node={per_node}), e.g. ranks {_ranks_text(bad[0])} on "
                       f"nodes {bad[0].min() // per_node}-{bad[0].max() // per_node}; TP "
                       f"all-reduces every layer: use a tp that divides {per_node} (and islands "
                       f"aligned to nodes)")
        if m == "llm" and cfg.packing == "dynamic_cp":
            for size in grid.dynamic_cp_sizes()[1:]:
                groups = grid.dynamic_cp_groups(size)
                bad = _crossing(groups, per_node)
                if bad:
                    out.append(f"warning: llm: {len(bad)} of {len(groups)} dynamic-CP groups of "
                               f"size {size} cross a node boundary, e.g. ranks "
                               f"{_ranks_text(bad[0])}: their K/V exchange runs over the "
                               f"inter-node network")
    return out


def memory_by_role(runs, per_rank) -> list[dict]:
    """The largest per-rank memory (GiB) of each role of the rank map (`rank_runs`), as
    [{role, ranks, max_gib}] in first-rank order: under `non_colocated` one row per island stage."""
    out: dict[str, dict] = {}
    for run in runs:
        row = out.setdefault(run["role"], {"role": run["role"], "ranks": 0, "max_gib": 0.0})
        row["ranks"] += run["last"] - run["first"] + 1
        row["max_gib"] = max([row["max_gib"]]
                             + [r["total"] for r in per_rank[run["first"]:run["last"] + 1]])
    return list(out.values())


def encoder_recompute_warnings(cfg, layouts) -> list[str]:
    """Under `non_colocated`, an encoder-side module with `selective` recompute: the memory
    estimate charges it, which the ViT does not implement (`full` runs per block on an island,
    as estimated)."""
    if cfg.placement != "non_colocated":
        return []
    return [f"warning: {m}.layout.recompute={lay.recompute} on an island: the memory above assumes "
            "it, which the encoder does not implement (use full or none)"
            for m, lay in layouts.items() if m != "llm" and lay.recompute not in ("none", "full")]


def trainable_warnings(cfg, specs) -> list[str]:
    """A layout that plan mode accepts but `python train.py` refuses today
    (`hcp.train.support.check_trainable`): one warning with training's own error."""
    from hcp.train.support import check_trainable

    try:
        check_trainable(cfg, specs)
    except ConfigError as e:
        return [f"warning: training refuses this layout today: {e}"]
    return []


def run_plan(cfg, out_dir) -> dict:
    """Plan the configured layout; print it, write `plan.json` and `plan.png`, return the plan.

    The world is what training would get (`world_size_of` with this machine's local rank count
    under `nproc_per_node=auto` on one node). Raises ConfigError for every layout rule
    (`hcp.config.layouts.check_layouts`), a world larger than `cluster` holds, or a rank whose
    estimated memory exceeds `cluster.device_memory_gib` (after writing the plan).
    """
    world = world_size_of(cfg, resolve_nproc("auto"))
    capacity = cfg.cluster.num_nodes * cfg.cluster.gpus_per_node
    if world > capacity:
        raise ConfigError("launcher.nnodes", cfg.launcher.nnodes,
                          f"{world} ranks exceed the cluster's {capacity} GPUs",
                          "match cluster.* to the launcher")
    layouts = check_layouts(cfg, world)
    specs = resolve_modules(cfg, layouts)  # once: the plan's modules
    shapes = named_shapes(specs)
    stage_mem = stage_memory(cfg, layouts, specs, shapes)
    roles = role_table(running_layouts(cfg, layouts), world)
    per_rank = memory_per_rank(cfg, layouts, world, stage_mem)
    notes = cp_notes(cfg, layouts)
    plan = {
        "world_size": world,
        "placement": cfg.placement,
        "precision": cfg.precision,
        "bytes_per_trained_param": sum(Precision.of(cfg.precision).state_bytes.values()),
        "device_memory_gib": cfg.cluster.device_memory_gib,
        "logging_rank": logging_rank(layouts),
        "modules": {m: {"layout": {k: getattr(lay, k) for k in ("tp", "cp", "pp", "dp")} |
                        {"pp_layers": list(lay.pp_layers), "recompute": lay.recompute},
                        "island": [lay.rank_offset, lay.rank_offset + lay.num_ranks - 1],
                        "num_params": sum(math.prod(s) for _, s in shapes[m]),
                        "groups": counts} | ({"cp": notes[m]} if m in notes else {})
                    for (m, lay), counts in zip(layouts.items(),
                                                group_counts(cfg, layouts).values())},
        "rank_map": rank_runs(roles),
        "memory_gib": per_rank,
        "memory_by_role": memory_by_role(rank_runs(roles), per_rank),
        "warnings": (node_warnings(cfg, layouts) + encoder_recompute_warnings(cfg, layouts)
                     + trainable_warnings(cfg, specs)),
    }
    worst = max(per_rank, key=lambda r: r["total"])
    scorer = Scorer(cfg, world, cfg.packing_profile)
    score = price_step(cfg, layouts, world, scorer)  # layout=auto prices a layout the same way
    plan["estimate"] = {"step_time_s": score.step_time_s, "tflops_per_gpu": score.tflops_per_gpu,
                        "bubble_fraction": score.bubble_fraction, "grad_sync_s": score.grad_sync_s,
                        "critical": score.critical, "why": score.why,
                        "max_memory_gib": worst["total"],
                        "fits": worst["total"] <= cfg.cluster.device_memory_gib,
                        "priced_on": priced_on(scorer, cfg)}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(json.dumps(plan, indent=1))
    draw_plan(layouts, world, out / "plan.png", cfg.cluster.gpus_per_node,
              [r["total"] for r in per_rank], cfg.cluster.device_memory_gib, notes)
    print(format_plan(plan))
    if worst["total"] > cfg.cluster.device_memory_gib:
        role = roles[worst["rank"]]
        m = max(role.modules, key=lambda k: stage_mem[k][role.stage(k)].total)
        field, value, fix = _fix_for(cfg, layouts[m], stage_mem[m][role.stage(m)])
        raise ConfigError(field, value,
                          f"rank {worst['rank']} needs an estimated {worst['total']:.1f} GiB "
                          f"(weights {worst['weights']:.1f}, grads {worst['grads']:.1f}, optimizer "
                          f"{worst['optimizer']:.1f}, activations {worst['activations']:.1f}), "
                          f"more than cluster.device_memory_gib={cfg.cluster.device_memory_gib}",
                          fix)
    return plan


def format_plan(plan: dict) -> str:
    """The console summary of a plan."""
    lines = [f"plan: {plan['world_size']} ranks, placement={plan['placement']}, "
             f"precision={plan['precision']} ({plan['bytes_per_trained_param']} B per trained "
             f"parameter; embedding on the first PP stage, final norm and output layer on the "
             f"last), logging rank {plan['logging_rank']}"]
    for m, info in plan["modules"].items():
        lay, (lo, hi) = info["layout"], info["island"]
        groups = " ".join(f"{k}:{n}x{s}" for k, (n, s) in info["groups"].items())
        lines.append(f"  {m:<9} ranks {lo}-{hi}  tp{lay['tp']} cp{lay['cp']} dp{lay['dp']} "
                     f"pp{lay['pp']} layers/stage {lay['pp_layers']} recompute={lay['recompute']}  "
                     f"{readable_count(info['num_params'])} params")
        lines.append(f"            groups (count x size): {groups}")
        if "cp" in info:
            lines.append(f"            {info['cp']}")
    lines.append("  rank map:")
    lines += [f"    {r['first']}-{r['last']}: {r['role']}" for r in plan["rank_map"]]
    worst = max(plan["memory_gib"], key=lambda r: r["total"])
    lines.append(f"  memory: max {worst['total']:.2f} GiB on rank {worst['rank']} (weights "
                 f"{worst['weights']:.2f}, grads {worst['grads']:.2f}, optimizer "
                 f"{worst['optimizer']:.2f}, activations {worst['activations']:.2f}) of "
                 f"{plan['device_memory_gib']} GiB")
    if len(plan.get("memory_by_role", [])) > 1:
        lines.append("  memory by role: " + "; ".join(
            f"{r['role']} ({r['ranks']} rank{'s' * (r['ranks'] != 1)}) {r['max_gib']:.2f}"
            for r in plan["memory_by_role"]) + " GiB")
    est = plan["estimate"]
    lines.append(f"  estimate: step {est['step_time_s']:.3g} s, {est['tflops_per_gpu']:.0f} "
                 f"TFLOPS/GPU, bubble {est['bubble_fraction']:.1%}, gradient sync "
                 f"{est['grad_sync_s']:.3g} s; {est['critical']} is the critical path "
                 f"({est['why']})")
    lines.append("  priced as layout=auto prices a layout (hcp/preflight/auto_cost.py); "
                 + est["priced_on"])
    lines += [f"  {w}" for w in plan["warnings"]]
    return "\n".join(lines)


def check_fits_here(cfg, layouts: dict, world: int, overrides=(), memory=None) -> None:
    """Before local ranks start: the estimated memory of the run (plan mode's per-rank estimate,
    `hcp.preflight.memory`) must fit this machine, else one error that offers plan mode and the
    cluster launch. `memory` overrides `machine_memory_gib()` (tests).

    Raises:
        ConfigError: the local ranks would need more memory than this machine has.
    """
    gib, what, shared = memory or machine_memory_gib()
    per_rank = [r["total"] for r in memory_per_rank(cfg, layouts, world)]
    need = sum(per_rank) if shared else max(per_rank)
    if need <= gib:
        return
    c = cfg.cluster
    raise ConfigError("launcher.nproc_per_node", cfg.launcher.nproc_per_node,
                      f"{world} local ranks need an estimated {need:.1f} GiB "
                      f"({'in all' if shared else 'on the largest rank'}), more than this "
                      f"machine's {gib:.1f} GiB of {what}: this config is sized for a cluster "
                      f"(cluster.* {c.num_nodes} x {c.gpus_per_node} GPUs of "
                      f"{c.device_memory_gib:g} GiB)",
                      cluster_fix(cfg, overrides))
