"""The pinned pipeline bound (hcp/dcp/pinned_bound.py): never above the exhaustive optimum on
tiny instances nor above any planner's plan in any order, its intervals of M (void rows in
front, Claim 2) never above a plan of any M they cover, and tighter than the unpinned bound
when one sequence outweighs the level."""
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from hcp.dcp.baselines import greedy, packing_only
from hcp.dcp.pinned_bound import interval_lp, pin_floor, pinned_bound
from hcp.dcp.pipeline_bound import lp_model, pipeline_bound, stage_floors
from hcp.dcp.packing import Packing, validate_plan
from hcp.dcp.solver import simulate_plan, solve
from test_dcp_pipeline_bound import COSTS, best_time

SAMPLE = Path(__file__).resolve().parents[1] / "hcp/data/lengths/wikipedia_sample.txt"


@settings(max_examples=12, derandomize=True, deadline=None)
@given(st.lists(st.integers(1, 2048), min_size=2, max_size=4), st.sampled_from([2, 3]))
def test_pinned_bound_is_never_above_the_exhaustive_optimum(raw, pp):
    lens, pool, cap, cost = np.array(raw), 2, 1024, COSTS[pp]
    res = pinned_bound(lens, cost, pool, cap)
    assert res.bound >= res.unpinned.bound
    assert res.bound <= best_time(lens, cost, pool, cap) * (1 + 1e-9)


def _long_tail_batch(n, seed, longest, others_max=8192):
    """`n - 1` Wikipedia lengths <= `others_max` and one of `longest` tokens."""
    rng = np.random.default_rng(seed)
    sample = np.loadtxt(SAMPLE, dtype=np.int64)
    return np.append(rng.choice(sample[sample <= others_max], n - 1, replace=False), longest)


@pytest.mark.slow
@settings(max_examples=4, derandomize=True, deadline=None)
@given(st.integers(0, 2**16), st.sampled_from([2, 4]), st.integers(4096, 16384))
def test_every_planners_plan_in_any_order_is_above_every_interval_covering_its_m(seed, pp,
                                                                                 longest):
    """Claim 2 on real plans: a plan of M micro-batches, its rows in random orders, is never
    faster than the pinned LP of any interval [a, b] with a <= M <= b."""
    lens, pool, cap, cost = _long_tail_batch(48, seed, longest), 4, 4096, COSTS[pp]
    work, smallest = stage_floors(lens, cost, pool, cap)
    floor = pin_floor(lens, cost, pool, cap)
    rng = np.random.default_rng(seed)
    for plan in (solve(lens, cost, pool, cap).plan, greedy(lens, pool, cap),
                 packing_only(lens, pool, cap)):
        validate_plan(plan, lens, pool, cap)
        M = plan.num_rounds
        fastest = min(simulate_plan(Packing([plan.rounds[j] for j in rng.permutation(M)]), lens,
                                    cost).iteration_time for _ in range(4))
        for a, b in ((M, M), (max(1, M - 3), M), (M, M + 4), (max(1, M - 5), M + 5)):
            assert fastest >= interval_lp(a, b, cost, work, smallest, floor)[0] * (1 - 1e-9)
    assert pinned_bound(lens, cost, pool, cap).bound <= fastest * (1 + 1e-9)


@pytest.mark.slow
def test_one_long_sequence_tightens_the_bound_and_the_solver_stays_above_it():
    """128 Wikipedia-like lengths and one of 24K tokens (3 of the pool's 4 ranks at cap 8192),
    PP 2: its micro-batch stalls 1F1B, which the unpinned bound ignores (1.096x it)."""
    lens, cost = _long_tail_batch(128, 7, 24000), COSTS[2]
    res = pinned_bound(lens, cost, 4, 8192)
    assert res.bound > 1.05 * res.unpinned.bound and res.best_range is not None
    assert solve(lens, cost, 4, 8192).time >= res.bound * (1 - 1e-9)
    capped = pinned_bound(lens, cost, 4, 8192, max_lps=20)  # stops early: still a bound
    assert res.unpinned.bound <= capped.bound <= res.bound and capped.lps < res.lps
    # no long sequence: the unpinned LP already has a row as heavy as the longest sequence
    short = _long_tail_batch(128, 7, 1000, others_max=1000)
    res = pinned_bound(short, cost, 4, 8192)
    assert res.bound == pipeline_bound(short, cost, 4, 8192).bound and res.lps == 0


def test_free_rows_need_the_first_and_last_stage_only():
    work, smallest = np.ones(3), np.full(3, 1e-3)
    lp_model(6, COSTS[3], work, smallest, [0, 2], free=2)  # fine
    with pytest.raises(ValueError, match="free=2 rows need the first and last stage"):
        lp_model(6, COSTS[3], work, smallest, [0, 1, 2], free=2)
