"""Each rank's action list of a step (`RankPlan.actions`): what the one executor runs
(`hcp.schedule.executor`) and the simulators replay (`hcp.schedule.graph_timing`).

- colocated: the LLM's 1F1B on the rank's pipeline stage (`hcp.schedule.actions.one_f_one_b`),
  inside the three-phase step (`actions.colocated`: encoder forward, each stream's route, ...,
  encoder backward) when edges route rows into the LLM;
- non_colocated: the rank's stage of the graph-aware 1F1B across the islands
  (`hcp.schedule.graph.graph_one_f_one_b` over `island_stage_graph`).
`SyncGrads` sits before the last backward where the gradient reduction overlaps it
(`StepPlan.overlap_grad_sync`, or FSDP on the rank's module: its reduce-scatter runs there).
"""
from __future__ import annotations

from hcp.parallel.grid import Grid
from hcp.plan.island_routes import island_head
from hcp.schedule.actions import Action, colocated, one_f_one_b, with_grad_sync
from hcp.schedule.graph import StageGraph, graph_one_f_one_b, stage_graph


def island_heads(layouts: dict, edges) -> tuple[str, ...]:
    """Every encoder island's head module (`island_head`), in layout order."""
    return tuple(dict.fromkeys(island_head(layouts, edges, m) for m in layouts if m != "llm"))


def island_stage_graph(layouts: dict, edges) -> StageGraph:
    """The stage graph of the islands: every island head's stages, then the LLM's."""
    depths = {m: layouts[m].pp for m in (*island_heads(layouts, edges), "llm")}
    heads = [(island_head(layouts, edges, a), island_head(layouts, edges, b)) for a, b in edges]
    return stage_graph(depths, list(dict.fromkeys(e for e in heads if e[0] != e[1])))


def rank_actions(plan, rank: int, num_micro: int) -> list[Action]:
    """Global rank `rank`'s action list of the `StepPlan` `plan` (module docstring), running
    `num_micro` LLM micro-batches (colocated; every island runs all of the plan's); [] on a
    rank that runs no module."""
    layouts, heads = (plan.layouts,
                      island_heads(plan.layouts, plan.edges) if plan.island_tables else ())
    head = next((h for h in heads if Grid.of(layouts[h]).contains(rank)), "llm")
    grid = Grid.of(layouts[head])
    if not grid.contains(rank):
        return []
    if plan.island_tables:
        graph = island_stage_graph(layouts, plan.edges)
        actions = graph_one_f_one_b(graph,
                                    plan.num_micro_batches)[graph.index(head,
                                                                        grid.coords(rank)["pp"])]
    else:
        actions = one_f_one_b(grid.coords(rank)["pp"], layouts["llm"].pp, num_micro)
        if plan.tables:
            actions = colocated(actions, [src for src, _ in plan.tables])
    return with_grad_sync(actions) if plan.overlap_grad_sync or layouts[head].dp_shard else actions
