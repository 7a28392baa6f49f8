"""pp = 1 local search: valid plans under the cap, never slower than the start, deterministic,
and its scalar group time equals the cost model's."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from hcp.dcp.baselines import greedy, packing_only
from hcp.dcp.cost_model import load_cost, recipe_llm
from hcp.dcp.local_search import GroupTime, improve
from hcp.dcp.packing import prepare_lengths, validate_plan
from hcp.dcp.solver import simulate_plan

COST = load_cost(recipe_llm(), pp=1)


@settings(max_examples=25, derandomize=True, deadline=None)
@given(st.lists(st.integers(1, 4096), min_size=1, max_size=40), st.sampled_from([2, 4, 8]),
       st.sampled_from([512, 1024]))
def test_improve_gives_valid_plans_never_slower_and_deterministic(raw, pool, cap):
    lens, _ = prepare_lengths(raw, pool, cap, on_overlong="truncate")
    for start in (greedy(lens, pool, cap), packing_only(lens, pool, cap)):
        plan = improve(start, lens, COST, pool, cap)
        validate_plan(plan, lens, pool, cap)  # once each, aligned tiling, tokens <= cap
        t0 = simulate_plan(start, lens, COST).iteration_time
        assert simulate_plan(plan, lens, COST).iteration_time <= t0 * (1 + 1e-12)
        assert improve(start, lens, COST, pool, cap) == plan


def test_move_budget_stops_early_and_stays_valid():
    lens = np.random.default_rng(0).integers(100, 2048, 48)
    start = packing_only(lens, 8, 2048)
    full, capped = improve(start, lens, COST, 8, 2048), improve(start, lens, COST, 8, 2048,
                                                                 max_evals=50)
    validate_plan(capped, lens, 8, 2048)
    times = [simulate_plan(p, lens, COST).iteration_time for p in (start, capped, full)]
    assert times[0] > times[1] > times[2]  # some progress, less than without the budget
    assert improve(start, lens, COST, 8, 2048, max_evals=50) == capped


def test_split_mixes_cp_sizes():
    # packing-only puts everything at c = 4; splitting runs the short ones at c = 2, beside it
    lens = np.array([3000] + [300] * 12)
    start = packing_only(lens, 4, 1024)
    plan = improve(start, lens, COST, 4, 1024)
    sizes = [sorted(g.cp_size for g in mb.groups if g.seq_indices) for mb in plan.rounds]
    assert [4] in sizes and [2, 2] in sizes
    assert (simulate_plan(plan, lens, COST).iteration_time
            < simulate_plan(start, lens, COST).iteration_time)


@pytest.mark.parametrize("c", [1, 2, 8, 16])
def test_scalar_time_matches_cost_model(c):
    x = np.array([700.0, 3000.0, 20.0])
    assert GroupTime(COST)(x.sum(), (x * x).sum(), c) == pytest.approx(
        float(COST.fwd(x.sum(), (x * x).sum(), c)[0]), rel=1e-12)
