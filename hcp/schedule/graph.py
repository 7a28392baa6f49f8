"""The graph-aware 1F1B across islands (docs/design.md 4.4) as pure action-list builders.

Under `placement=non_colocated` every module of the graph (an encoder island, the LLM, ...)
is a chain of pipeline stages, and `graph.edges` connects the LAST stage of a module to the
FIRST stage of the next one. The builder numbers all stages globally (modules in the given
order, each module's stages in order) and gives every stage a 1F1B action list
(`hcp.schedule.actions.one_f_one_b_peers`) whose peers are its neighbours in that stage graph:
an encoder island acts as pipeline stages before the LLM's first stage; a join (several
modules into one) receives from all its producers in one batch, a branch (one module into
several) sends to all its consumers in one batch and its backward waits for all their
gradients. Every stage runs the micro-batches in the same order 0..m-1 (the order the LLM
consumes them), and a stage's backward of micro-batch i runs once its gradient arrived.

Warm-up depth. In a chain of p stages, stage s runs `p - s - 1` forwards before its first
backward: its distance to the end of the pipeline. Here stage s gets `depth(s)`, the longest
path (in edges) from s through the graph, computed so that every edge u -> v has
`depth(u) = depth(v) + 1`: then each edge behaves exactly like two neighbouring stages of a
plain 1F1B pipeline, which is why the lists are deadlock-free under NCCL's rendezvous rule
(`hcp.schedule.rendezvous` checks them; tests/test_graph_schedule.py). When the sinks of one
graph sit at different distances (a branch into consumers of different depths) the shallower
branch runs with a deeper warm-up than its own length: it accepts what its producer sends
ahead, and holds that many more activations.

A graph where two paths between the same two stages differ in length (a skip connection, e.g.
vision -> llm next to vision -> projector -> llm with the projector on its own stages) has no
such depth: a producer would run ahead of one consumer by more than that consumer receives,
and the lone sends would deadlock. `graph_depths` rejects it: put the modules of the shorter
path on the same stages (e.g. the projector on the encoder's last stage, the default).
"""
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
