"""The graph-aware 1F1B across islands (docs/design.md 4.4) as pure action-list builders.

Under `placement=non_colocated` every module of the graph is a chain of pipeline stages and
`graph.edges` connects a module's LAST stage to the next one's FIRST. Stages are numbered
globally (modules in order, then their stages) and each gets a 1F1B action list
(`hcp.schedule.actions.one_f_one_b_peers`) over its neighbours: a join receives from all its
producers in one batch, a branch sends to all its consumers in one batch. Every stage runs
micro-batches 0..m-1 in the LLM's order. Stage s warms up `depth(s)` forwards, the longest path
from s, so each edge behaves like two neighbouring stages of a plain 1F1B (deadlock-free under
NCCL's rendezvous rule: `hcp.schedule.rendezvous`). `graph_depths` raises ValueError for two
paths of different lengths between the same stages (a skip connection), which would deadlock."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Sequence

from hcp.schedule.actions import Action, one_f_one_b_peers


@dataclass(frozen=True)
class StageGraph:
    """All pipeline stages of a module graph.

    stages: (module, stage index within the module) of every global stage, in global order;
    prev[g] / next[g]: global stages that feed / are fed by global stage g, ascending;
    depth[g]: its warm-up depth (module docstring).
    """

    stages: tuple[tuple[str, int], ...]
    prev: tuple[tuple[int, ...], ...]
    next: tuple[tuple[int, ...], ...]
    depth: tuple[int, ...]

    def index(self, module: str, stage: int) -> int:
        """Global index of `module`'s stage `stage`. Raises ValueError when there is none."""
        try:
            return self.stages.index((module, stage))
        except ValueError:
            raise ValueError(f"module {module!r} has no stage {stage}") from None


def stage_graph(depths: dict[str, int], edges: Sequence[Sequence[str]]) -> StageGraph:
    """The stage graph of modules with `depths[module]` pipeline stages each (PP size) joined by
    `edges` ([src, dst] pairs, as `graph.edges`).

    Raises:
        ValueError: a PP size < 1, an edge naming an unknown module or a module twice, a
            repeated edge, a cycle, or two paths of different lengths between two stages (the
            message names the edge and the fix).
    """
    for module, pp in depths.items():
        if int(pp) < 1:
            raise ValueError(f"module {module!r}: pipeline depth {pp} must be >= 1")
    pairs = [tuple(e) for e in edges]
    for e in pairs:
        if len(e) != 2 or e[0] not in depths or e[1] not in depths or e[0] == e[1]:
            raise ValueError(f"graph.edges: {list(e)} must name two different modules of "
                             f"{sorted(depths)}")
    if len(set(pairs)) != len(pairs):
        raise ValueError(f"graph.edges: an edge appears twice in {[list(e) for e in pairs]}")
    stages = tuple((m, s) for m, pp in depths.items() for s in range(int(pp)))
    gid = {st: g for g, st in enumerate(stages)}
    prev: list[set] = [set() for _ in stages]
    nxt: list[set] = [set() for _ in stages]
    links = [(gid[m, s], gid[m, s + 1]) for m, pp in depths.items() for s in range(int(pp) - 1)]
    links += [(gid[a, int(depths[a]) - 1], gid[b, 0]) for a, b in pairs]
    for u, v in links:
        nxt[u].add(v)
        prev[v].add(u)
    _check_acyclic(pairs, depths)
    depth = _depths(len(stages), links, stages)
    return StageGraph(stages, tuple(tuple(sorted(p)) for p in prev),
                      tuple(tuple(sorted(n)) for n in nxt), tuple(depth))


def _check_acyclic(pairs, depths) -> None:
    indeg = {m: 0 for m in depths}
    for _, b in pairs:
        indeg[b] += 1
    ready = deque(m for m, d in indeg.items() if d == 0)
    seen = 0
    while ready:
        m = ready.popleft()
        seen += 1
        for a, b in pairs:
            if a == m:
                indeg[b] -= 1
                if indeg[b] == 0:
                    ready.append(b)
    if seen < len(depths):
        cyc = sorted(m for m, d in indeg.items() if d > 0)
        raise ValueError(f"graph.edges: the modules {cyc} form a cycle; the module graph must be "
                         "acyclic")


def _depths(n: int, links, stages) -> list[int]:
    """Potentials with depth(u) = depth(v) + 1 on every link, the smallest of each connected
    part 0 (a breadth-first walk over the undirected stage graph)."""
    adj: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    for u, v in links:
        adj[u].append((v, -1))
        adj[v].append((u, +1))
    depth: list[int | None] = [None] * n
    for root in range(n):
        if depth[root] is not None:
            continue
        depth[root], part, todo = 0, [root], deque([root])
        while todo:
            u = todo.popleft()
            for v, step in adj[u]:
                want = depth[u] + step
                if depth[v] is None:
                    depth[v] = want
                    part.append(v)
                    todo.append(v)
                elif depth[v] != want:
                    raise ValueError(
                        f"graph.edges: stage {stages[v]} is reached from stage {stages[u]} by "
                        "paths of different lengths (a skip connection); the graph-aware 1F1B "
                        "needs equal lengths: put the modules of the shorter path on shared "
                        "stages (e.g. the projector on the encoder's last stage) or make the "
                        "pipeline depths match")
        low = min(depth[g] for g in part)
        for g in part:
            depth[g] -= low
    return depth  # type: ignore[return-value]


def graph_one_f_one_b(graph: StageGraph, num_micro: int) -> list[list[Action]]:
    """Every global stage's 1F1B action list over `num_micro` micro-batches (peers are global
    stage indices). A single module of p stages gives exactly `actions.one_f_one_b`'s lists.
    Raises ValueError for num_micro < 0."""
    return [one_f_one_b_peers(list(graph.prev[g]), list(graph.next[g]), graph.depth[g], num_micro)
            for g in range(len(graph.stages))]
