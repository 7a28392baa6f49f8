"""Timing model of action lists (`hcp.schedule.graph_timing`): agrees with the 1F1B simulator on
a plain pipeline, gives the known bubble of a uniform pipeline, and times a join where the
short encoder island idles."""
from __future__ import annotations

import numpy as np
import pytest

from hcp.schedule.actions import one_f_one_b
from hcp.schedule.graph import graph_one_f_one_b, stage_graph
from hcp.schedule.graph_timing import time_actions
from hcp.schedule.simulator import simulate_1f1b


@pytest.mark.parametrize("p,m", [(1, 3), (2, 5), (3, 4), (4, 9), (4, 2)])
def test_a_plain_pipeline_times_as_the_1f1b_simulator(p, m):
    rng = np.random.default_rng(p * 10 + m)
    fwd, bwd = rng.uniform(0.5, 2.0, (p, m)), rng.uniform(1.0, 3.0, (p, m))
    timeline = time_actions([one_f_one_b(s, p, m) for s in range(p)], fwd, bwd)
    assert timeline.iteration_time == pytest.approx(simulate_1f1b(fwd, bwd).iteration_time)


def test_uniform_pipeline_has_the_known_bubble():
    """p stages, m micro-batches, forward f and backward b everywhere: the step takes
    (m + p - 1)(f + b) and each stage idles (p - 1) / (m + p - 1) of it."""
    p, m, f, b = 4, 6, 1.0, 2.0
    fwd, bwd = np.full((p, m), f), np.full((p, m), b)
    timeline = time_actions([one_f_one_b(s, p, m) for s in range(p)], fwd, bwd)
    assert timeline.iteration_time == pytest.approx((m + p - 1) * (f + b))
    for s in range(p):
        assert timeline.bubble(s) == pytest.approx((p - 1) / (m + p - 1))


def test_a_join_of_a_short_and_a_long_encoder_island():
    """vision (1 stage) and audio (3 stages) into an LLM of 2 stages, all ops 1 s: the step is
    the longest chain's pipeline (5 stages), and the vision island idles as its first stage would."""
    graph = stage_graph({"vision": 1, "audio": 3, "llm": 2}, [["vision", "llm"], ["audio", "llm"]])
    m = 4
    ones = np.ones((len(graph.stages), m))
    timeline = time_actions(graph_one_f_one_b(graph, m), ones, ones)
    assert timeline.iteration_time == pytest.approx((m + 5 - 1) * 2)
    assert timeline.bubble(graph.index("vision", 0)) == pytest.approx(1 - 2 * m / 16)
    assert timeline.busy[graph.index("llm", 1)] == pytest.approx(2 * m)


def test_bad_durations_are_rejected():
    with pytest.raises(ValueError, match=r"fwd\[stage 0\]\[micro-batch 1\]"):
        time_actions([one_f_one_b(0, 1, 2)], [[1.0, -1.0]], [[1.0, 1.0]])
