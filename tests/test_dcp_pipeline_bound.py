"""The pipeline LP bound (hcp/dcp/pipeline_bound.py): never above the simulated time of any
valid plan (exhaustive search on tiny instances, every planner's plans in many orders on larger
ones), and tighter than the simple bound where the pipeline's fill and drain matter."""
import itertools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from hcp.dcp.baselines import greedy, packing_only
from hcp.dcp.cost_model import load_cost, recipe_llm
from hcp.dcp.lower_bound import lower_bound
from hcp.dcp.pipeline_bound import lp_makespan, pipeline_bound, stage_classes, stage_floors
from hcp.dcp.packing import Group, Packing, Round, fill_idle, rank_tokens, validate_plan
from hcp.dcp.solver import simulate_plan, solve
from test_dcp_exact import set_partitions

COSTS = {pp: load_cost(recipe_llm(), pp=pp) for pp in (2, 3, 4)}



def rounds_of(seqs, lens, pool, cap):
    """Every way to run `seqs` as one round: groups with CP sizes whose sum fits the pool."""
    out = []
    for groups in set_partitions(seqs):
        for cs in itertools.product(*[[c for c in (1, 2, 4) if c <= pool] for _ in groups]):
            if sum(cs) > pool or any(rank_tokens(lens[list(g)], c).sum() > cap
                                     for g, c in zip(groups, cs)):
                continue
            blocks, off = [], 0
            for g, c in sorted(zip(groups, cs), key=lambda x: -x[1]):
                blocks.append(Group(sorted(g), c, off))
                off += c
            out.append(Round(fill_idle(blocks, pool)))
    return out


def best_time(lens, cost, pool, cap):
    """Minimum simulated 1F1B time over every valid plan (partition into rounds, groupings and
    CP sizes, every order of the rounds)."""
    best = np.inf
    for part in set_partitions(tuple(range(lens.size))):
        options = [rounds_of(seqs, lens, pool, cap) for seqs in part]
        for choice in itertools.product(*options):
            for order in itertools.permutations(choice):
                plan = Packing(list(order))
                best = min(best, simulate_plan(plan, lens, cost).iteration_time)
    return best


@settings(max_examples=12, derandomize=True, deadline=None)
@given(st.lists(st.integers(1, 2048), min_size=2, max_size=4), st.sampled_from([2, 3]))
def test_bound_is_never_above_the_exhaustive_optimum(raw, pp):
    lens, pool, cap = np.array(raw), 2, 1024
    cost = COSTS[pp]  # pp = 3 splits 40 layers 14/13/13: stage classes with ratio bounds
    res = pipeline_bound(lens, cost, pool, cap)  # first and last stage's order kept
    full = pipeline_bound(lens, cost, pool, cap, full=True)  # every stage's
    assert res.simple <= res.bound <= full.bound * (1 + 1e-9)
    assert full.bound <= best_time(lens, cost, pool, cap) * (1 + 1e-9)


@settings(max_examples=8, derandomize=True, deadline=None)
@given(st.lists(st.integers(1, 16384), min_size=8, max_size=48), st.sampled_from([2, 4]),
       st.integers(0, 2**16))
def test_bound_is_never_above_any_planners_plan_in_any_order(raw, pp, seed):
    lens, pool, cap = np.array(raw), 4, 4096
    cost = COSTS[pp]
    bound = pipeline_bound(lens, cost, pool, cap).bound
    rng = np.random.default_rng(seed)
    for plan in (solve(lens, cost, pool, cap).plan, greedy(lens, pool, cap),
                 packing_only(lens, pool, cap)):
        validate_plan(plan, lens, pool, cap)
        for _ in range(5):
            order = rng.permutation(plan.num_rounds)
            shuffled = Packing([plan.rounds[j] for j in order])
            assert simulate_plan(shuffled, lens, cost).iteration_time >= bound * (1 - 1e-9)


def test_lp_of_fixed_sizes_is_the_simulated_time():
    """With the work of one micro-batch (M = 1, a single sequence) the LP has one feasible
    duration per stage class and must reproduce the simulator's time exactly."""
    cost = COSTS[3]
    lens = np.array([3000])
    work, smallest = stage_floors(lens, cost, 1, 4096)
    plan = Packing([Round([Group([0], 1, 0)])])
    # fwd_floor = fwd at c = 1 (no communication), so the floors are the plan's durations
    assert lp_makespan(1, cost, work, smallest) == pytest.approx(
        simulate_plan(plan, lens, cost).iteration_time, rel=1e-9)
    cls, lo, hi = stage_classes(cost)
    assert cls.tolist() == [0, 1, 2]  # 14, 13, 13 layers, the LM head on the last
    assert lo[1] == hi[1] == pytest.approx(13 / 14)
    assert lo[2] == pytest.approx(13 / 14) and hi[2] == pytest.approx(cost.mm_coef[2] / cost.mm_coef[0])


def test_bound_is_tighter_than_the_simple_bound_on_wikipedia_lengths():
    """A pipeline where the fill and drain matter: 256 Wikipedia-like lengths, pool 4, PP 4.
    The solver's plan stays above the bound; the bound exceeds the simple one by > 1%."""
    from pathlib import Path
    sample = np.loadtxt(Path(__file__).resolve().parents[1] / "hcp/data/lengths/wikipedia_sample.txt",
                        dtype=np.int64)
    rng = np.random.default_rng(7)
    lens = rng.choice(sample[sample <= 32768], 256, replace=False)
    cost = COSTS[4]
    res = pipeline_bound(lens, cost, 4, 8192)
    t = solve(lens, cost, 4, 8192).time
    assert res.simple == pytest.approx(lower_bound(lens, cost, 4, 8192))
    assert res.bound > 1.01 * res.simple and t >= res.bound * (1 - 1e-9)


def test_on_a_tiny_case_the_bound_lies_strictly_between_the_simple_bound_and_the_optimum():
    lens, cost = np.array([1318, 1126, 176, 57]), COSTS[2]
    res = pipeline_bound(lens, cost, 2, 1024)
    opt = best_time(lens, cost, 2, 1024)
    assert 1.1 * res.simple < res.bound <= opt  # 1.127x the simple bound, 0.83x the optimum
    capped = pipeline_bound(lens, cost, 2, 1024, max_micro_batches=res.best_m - 1)
    assert res.simple < capped.bound < res.bound and capped.lps < res.lps and capped.best_m is None
    # with three stages the relaxation drops stage 1's order: lower than all stages' LP,
    # still above the simple bound (1.0747x and 1.0774x it)
    lens, cost3 = np.array([372, 1641, 1780, 1192]), COSTS[3]
    relaxed, full = (pipeline_bound(lens, cost3, 2, 1024, full=f) for f in (False, True))
    assert 1.07 * relaxed.simple < relaxed.bound < full.bound <= best_time(lens, cost3, 2, 1024)
