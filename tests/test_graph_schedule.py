"""The graph-aware 1F1B (docs/design.md 4.4) as action lists: deadlock-free under NCCL's rendezvous
semantics (`hcp.schedule.rendezvous`) for an encoder island before the LLM, joins, branches and
PP depths 1-4 on each side, 1..9 micro-batches; warm-up depths follow the longest path."""
from __future__ import annotations

import itertools

import pytest

from hcp.schedule.actions import Compute, Exchange, one_f_one_b, one_f_one_b_peers
from hcp.schedule.graph import graph_one_f_one_b, stage_graph
from hcp.schedule.rendezvous import ScheduleDeadlock, run_rendezvous

DEPTHS = (1, 2, 3, 4)
MICRO = range(1, 10)


def _check(graph, m):
    programs = graph_one_f_one_b(graph, m)
    log = run_rendezvous(programs)
    assert len(log) == sum(map(len, programs))
    for g, prog in enumerate(programs):
        computes = [a for a in prog if isinstance(a, Compute)]
        # every stage runs every micro-batch's forward and backward, in the LLM's order
        assert [a.micro for a in computes if a.kind == "F"] == list(range(m))
        assert [a.micro for a in computes if a.kind == "B"] == list(range(m))
        alive = peak = 0
        for a in computes:
            alive += 1 if a.kind == "F" else -1
            peak = max(peak, alive)
        assert peak == min(graph.depth[g] + 1, m)
        # a branch's or join's ops with all its peers on one side share one batch
        for a in prog:
            if isinstance(a, Exchange) and any(op.kind == "RECV_B" for op in a.ops):
                assert {op.peer for op in a.ops if op.kind == "RECV_B"} == set(graph.next[g])
            if isinstance(a, Exchange) and any(op.kind == "RECV_F" for op in a.ops):
                assert {op.peer for op in a.ops if op.kind == "RECV_F"} == set(graph.prev[g])


@pytest.mark.parametrize("pe,pl", itertools.product(DEPTHS, DEPTHS))
def test_encoder_island_before_the_llm(pe, pl):
    graph = stage_graph({"vision": pe, "llm": pl}, [["vision", "llm"]])
    # the encoder island's stages act as stages before the LLM's first one
    assert graph.depth == tuple(range(pe + pl - 1, -1, -1))
    for m in MICRO:
        _check(graph, m)
        # ... and the lists equal a plain pipeline of pe + pl stages
        assert graph_one_f_one_b(graph, m) == [one_f_one_b(s, pe + pl, m) for s in range(pe + pl)]


@pytest.mark.parametrize("pa,pb", itertools.product(DEPTHS, DEPTHS))
def test_join_of_two_encoders(pa, pb):
    for pl in DEPTHS:
        graph = stage_graph({"vision": pa, "audio": pb, "llm": pl},
                            [["vision", "llm"], ["audio", "llm"]])
        # warm-up from the longest path: each encoder's first stage is its path length away
        assert graph.depth[graph.index("vision", 0)] == pa + pl - 1
        assert graph.depth[graph.index("audio", 0)] == pb + pl - 1
        for m in MICRO:
            _check(graph, m)


@pytest.mark.parametrize("pa,pb,pc", [(1, 1, 1), (1, 2, 4), (4, 3, 1), (2, 4, 2)])
def test_join_of_three_encoder_islands(pa, pb, pc):
    """Three islands (e.g. two vision towers and an audio encoder) into one LLM of 1-4 stages;
    a branch on an island is one edge here (its projectors share the island's last stage)."""
    for pl in DEPTHS:
        graph = stage_graph({"vision": pa, "vision2": pb, "audio": pc, "llm": pl},
                            [["vision", "llm"], ["vision2", "llm"], ["audio", "llm"]])
        assert graph.prev[graph.index("llm", 0)] == tuple(
            graph.index(m, p - 1) for m, p in (("vision", pa), ("vision2", pb), ("audio", pc)))
        for m in MICRO:
            _check(graph, m)


@pytest.mark.parametrize("pp,pa,pb", [(p, a, b) for p in DEPTHS for a in DEPTHS for b in (1, 4)])
def test_branch_into_two_consumers(pp, pa, pb):
    graph = stage_graph({"vision": pp, "llm": pa, "head": pb}, [["vision", "llm"], ["vision", "head"]])
    last = graph.index("vision", pp - 1)
    assert graph.next[last] == (graph.index("llm", 0), graph.index("head", 0))
    for m in MICRO:
        _check(graph, m)


def test_diamond_with_equal_arms_and_a_chain_of_three_modules():
    graph = stage_graph({"vision": 2, "proj_a": 1, "proj_b": 1, "llm": 3},
                        [["vision", "proj_a"], ["vision", "proj_b"], ["proj_a", "llm"],
                         ["proj_b", "llm"]])
    for m in MICRO:
        _check(graph, m)
    chain = stage_graph({"vision": 2, "projector": 1, "llm": 2},
                        [["vision", "projector"], ["projector", "llm"]])
    assert graph_one_f_one_b(chain, 5) == [one_f_one_b(s, 5, 5) for s in range(5)]


def test_warm_up_from_each_stage_own_distance_to_its_sink_deadlocks_a_branch():
    """Why the depths are potentials: a branch into a 1-stage head and a 3-stage LLM. With each
    stage's own distance to its sink the head (warm-up 0) refuses what the vision stage (warm-up
    3) sends ahead; the graph-aware depths give the head warm-up 2 and finish."""
    graph = stage_graph({"vision": 1, "llm": 3, "head": 1}, [["vision", "llm"], ["vision", "head"]])
    own = {("vision", 0): 3, ("llm", 0): 2, ("llm", 1): 1, ("llm", 2): 0, ("head", 0): 0}
    naive = [one_f_one_b_peers(list(graph.prev[g]), list(graph.next[g]), own[st], 4)
             for g, st in enumerate(graph.stages)]
    with pytest.raises(ScheduleDeadlock):
        run_rendezvous(naive)
    assert graph.depth[graph.index("head", 0)] == 2
    run_rendezvous(graph_one_f_one_b(graph, 4))


def test_bad_graphs_are_rejected_with_the_field():
    with pytest.raises(ValueError, match="skip connection"):
        stage_graph({"vision": 1, "projector": 1, "llm": 2},
                    [["vision", "projector"], ["projector", "llm"], ["vision", "llm"]])
    with pytest.raises(ValueError, match="cycle"):
        stage_graph({"a": 1, "b": 1}, [["a", "b"], ["b", "a"]])
    with pytest.raises(ValueError, match="graph.edges"):
        stage_graph({"vision": 1}, [["vision", "llm"]])
    with pytest.raises(ValueError, match="pipeline depth 0"):
        stage_graph({"vision": 0}, [])
    with pytest.raises(ValueError, match="twice"):
        stage_graph({"a": 1, "b": 1}, [["a", "b"], ["a", "b"]])
