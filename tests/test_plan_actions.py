"""Each rank's action list comes from the step plan (`RankPlan.actions`, `hcp.plan.actions`):
the colocated three-phase step around the LLM's 1F1B, the graph 1F1B across islands; the
rendezvous check and the timing model replay the same lists (routes as collectives of all
ranks). Pure: no process group (well under a second)."""
import numpy as np
import pytest

from hcp.parallel.grid import Grid
from hcp.plan.step import plan_step
from hcp.schedule import actions as A
from hcp.schedule.graph import graph_one_f_one_b
from hcp.schedule.graph_timing import time_actions
from hcp.schedule.rendezvous import ScheduleDeadlock, run_rendezvous
from test_island_plan import island_layouts
from test_step_plan import EDGES, layouts, random_sizes


def test_colocated_plan_emits_the_three_phase_step_around_each_stage_1f1b():
    sizes = random_sizes(np.random.default_rng(0), 8)
    lays = layouts(1, 8, 2, 2, 1, pp=2)  # encoder dp8; LLM tp2 x cp2 x pp2
    plan = plan_step(sizes, lays, "first_fit", 64, EDGES)
    llm = Grid.of(lays["llm"])
    lists = [plan.rank(r).actions for r in range(8)]
    for r, got in enumerate(lists):
        stage = llm.coords(r)["pp"]
        llm_list = A.with_grad_sync(A.one_f_one_b(stage, 2, plan.num_micro_batches))
        assert got == [A.EncoderCompute("F"), A.Route("F", "projector"), *llm_list,
                       A.Route("B", "projector"), A.EncoderCompute("B")]
    # the stage lists of one pipeline (ranks 0 and its pp peer) finish under NCCL's rules,
    # every route a collective of both
    peer = next(r for r in range(8) if llm.coords(r)["pp"] == 1 and llm.coords(r)["dp"] == llm.coords(0)["dp"]
                and llm.coords(r)["tp"] == 0 and llm.coords(r)["cp"] == 0)
    done = run_rendezvous([lists[0], lists[peer]])
    assert [a for s, a in done if s == 0] == lists[0]


def test_text_only_plan_is_plain_1f1b_and_no_overlap_leaves_out_the_marker():
    sizes = random_sizes(np.random.default_rng(1), 4, max_images=0)
    lays = {"llm": layouts(1, 2, 1, 1, 2)["llm"]}
    plan = plan_step(sizes, lays, "first_fit", 64, ())
    assert plan.rank(1).actions == A.with_grad_sync(A.one_f_one_b(0, 1, len(plan.rank(1).micro_batches)))
    plan.overlap_grad_sync = False
    assert not any(isinstance(a, A.SyncGrads) for a in plan.rank(1).actions)


def test_island_plan_emits_each_stage_of_the_graph_1f1b():
    sizes = random_sizes(np.random.default_rng(2), 8)
    lays = island_layouts((1, 2, 2), (1, 2, 1, 2))  # vision dp2 x pp2 on 0-3, LLM cp2 x pp2 on 4-7
    plan = plan_step(sizes, lays, "first_fit", 64, EDGES)
    from hcp.plan.actions import island_stage_graph

    graph = island_stage_graph(lays, EDGES)
    programs = [A.with_grad_sync(p) for p in graph_one_f_one_b(graph, plan.num_micro_batches)]
    for r in range(8):
        head = "vision" if r < 4 else "llm"
        g = graph.index(head, Grid.of(lays[head]).coords(r)["pp"])
        assert plan.rank(r).actions == programs[g]


def test_routes_are_collectives_in_the_replays():
    a = A.colocated(A.one_f_one_b(0, 1, 2), ["p"])
    b = A.colocated(A.one_f_one_b(0, 1, 2), ["q"])
    with pytest.raises(ValueError, match="different"):
        run_rendezvous([a, b])
    with pytest.raises(ScheduleDeadlock):  # one rank never reaches the route
        run_rendezvous([a, A.one_f_one_b(0, 1, 2)])
    # a slow encoder forward on rank 0 holds rank 1 at the forward route
    t = time_actions([a, a], [[1.0, 1.0]] * 2, [[2.0, 2.0]] * 2, encoder=[(5.0, 1.0), (0.0, 0.0)])
    assert t.starts[1][0] == 5.0 and t.busy == [12.0, 6.0]
    assert t.iteration_time == 12.0  # rank 0: 5 + 6 of the LLM + 1 encoder backward


F0, F1, B0, B1 = A.Compute("F", 0), A.Compute("F", 1), A.Compute("B", 0), A.Compute("B", 1)
SYNC = A.SyncGrads()


def X(*ops):
    """One batch of P2P ops, each (kind, micro, peer)."""
    return A.Exchange(tuple(A.P2P(*op) for op in ops))


def test_the_colocated_plan_is_the_hand_written_1f1b_with_the_sync_before_the_last_backward():
    """Written out by hand (not by the functions under test): LLM pp 2, two micro-batches;
    `SyncGrads` goes right before the last backward (after its receive), so the DP reduction
    starts with it and overlaps it."""
    plan = plan_step(random_sizes(np.random.default_rng(0), 8), layouts(1, 8, 2, 2, 1, pp=2),
                     "first_fit", 64, EDGES)
    assert plan.num_micro_batches == 2
    enc_f, enc_b = [A.EncoderCompute("F"), A.Route("F", "projector")], [A.Route("B", "projector"),
                                                                         A.EncoderCompute("B")]
    stage0 = [F0, X(("SEND_F", 0, 1)), F1, X(("SEND_F", 1, 1), ("RECV_B", 0, 1)), B0,
              X(("RECV_B", 1, 1)), SYNC, B1]
    stage1 = [X(("RECV_F", 0, 0)), F0, B0, X(("SEND_B", 0, 0), ("RECV_F", 1, 0)), F1, SYNC, B1,
              X(("SEND_B", 1, 0))]
    llm = Grid.of(plan.layouts["llm"])
    for r in range(8):
        expected = stage0 if llm.coords(r)["pp"] == 0 else stage1
        assert plan.rank(r).actions == [*enc_f, *expected, *enc_b], r


def test_a_text_only_plan_is_hand_written_accumulation_with_the_sync_before_the_last_backward():
    plan = plan_step(random_sizes(np.random.default_rng(1), 4, max_images=0),
                     {"llm": layouts(1, 2, 1, 1, 2)["llm"]}, "first_fit", 64, ())
    assert plan.rank(1).actions == [F0, B0, F1, SYNC, B1]


def test_the_island_plan_is_the_hand_written_graph_1f1b():
    """Vision pp 2 on ranks 0-3 then the LLM's pp 2 on 4-7: a chain of graph stages 0-3, two
    micro-batches; the first stage runs both forwards before its backwards, the last stage
    alternates; `SyncGrads` right before each stage's last backward."""
    plan = plan_step(random_sizes(np.random.default_rng(2), 8),
                     island_layouts((1, 2, 2), (1, 2, 1, 2)), "first_fit", 64, EDGES)
    assert plan.num_micro_batches == 2
    first = [F0, X(("SEND_F", 0, 1)), F1, X(("SEND_F", 1, 1)), X(("RECV_B", 0, 1)), B0,
             X(("RECV_B", 1, 1)), SYNC, B1]
    last = [X(("RECV_F", 0, 2)), F0, B0, X(("SEND_B", 0, 2), ("RECV_F", 1, 2)), F1, SYNC, B1,
            X(("SEND_B", 1, 2))]
    assert plan.rank(0).actions == first
    assert plan.rank(7).actions == last


def test_with_grad_sync_puts_one_sync_right_before_the_last_backward_only():
    assert A.with_grad_sync([F0, B0, F1, B1]) == [F0, B0, F1, SYNC, B1]
    assert A.with_grad_sync([F0, F1, X(("RECV_B", 1, 1)), B1, B0, X(("SEND_B", 0, 0))]) == [
        F0, F1, X(("RECV_B", 1, 1)), B1, SYNC, B0, X(("SEND_B", 0, 0))]
    assert A.with_grad_sync([F0, F1]) == [F0, F1]  # no backward (evaluation): no sync
