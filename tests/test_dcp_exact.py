"""Exact pp = 1 plans (branch and bound) against an independent exhaustive search."""
from functools import lru_cache

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from hcp.dcp.baselines import greedy
from hcp.dcp.cost_model import load_cost, recipe_llm
from hcp.dcp.exact import best_weights, solve_exact
from hcp.dcp.lower_bound import lower_bound
from hcp.dcp.packing import validate_plan
from hcp.dcp.solver import simulate_plan

COST = load_cost(recipe_llm(), pp=1)


def set_partitions(items):
    """Every partition of the tuple `items` into non-empty blocks."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in set_partitions(rest):
        for k in range(len(part)):
            yield part[:k] + [(first,) + part[k]] + part[k + 1:]
        yield [(first,)] + part


def brute_force(lens, pool, cap):
    """Minimum pp = 1 time over every plan: partition the sequences into micro-batches, each
    micro-batch into groups, each group at every feasible CP size whose sizes fit the pool."""
    o = COST.hw.micro_batch_overhead_fwd + COST.hw.micro_batch_overhead_bwd
    sizes = [c for c in (1, 2, 4, 8) if c <= pool]

    @lru_cache(maxsize=None)
    def micro_batch(seqs):  # fastest way to run these sequences as one micro-batch
        best = np.inf
        for groups in set_partitions(seqs):
            def assign(k, used, worst):
                if k == len(groups):
                    return worst
                x = lens[list(groups[k])]
                out = np.inf
                for c in sizes:
                    if used + c <= pool and x.sum() <= c * cap:
                        f = float(COST.fwd(x.sum(), (x * x).sum(), c)[0])
                        out = min(out, assign(k + 1, used + c, max(worst, f)))
                return out
            best = min(best, assign(0, 0, 0.0))
        return (1 + COST.bwd_factor) * best + o

    return min(sum(micro_batch(b) for b in part)
               for part in set_partitions(tuple(range(lens.size))))


@settings(max_examples=12, derandomize=True, deadline=None)
@given(st.lists(st.integers(1, 4096), min_size=1, max_size=5), st.sampled_from([2, 4]))
def test_exact_equals_exhaustive_search_on_tiny_instances(raw, pool):
    lens, cap = np.array(raw), 1024
    lens = np.minimum(lens, pool * cap)
    res = solve_exact(lens, COST, pool, cap, (greedy(lens, pool, cap),), gap=0.0)
    validate_plan(res.plan, lens, pool, cap)
    assert res.optimal
    assert res.time == pytest.approx(brute_force(lens, pool, cap), rel=1e-9)
    assert res.time == pytest.approx(simulate_plan(res.plan, lens, COST).iteration_time, rel=1e-9)


@pytest.mark.parametrize("seed", [0, 1])
def test_root_bound_is_at_least_the_area_bound(seed):
    lens = np.random.default_rng(seed).integers(16, 6000, 24)
    res = solve_exact(lens, COST, 8, 2048, (greedy(lens, 8, 2048),), time_limit=0.5)
    assert lower_bound(lens, COST, 8, 2048) <= res.dual_bound * (1 + 1e-12) <= res.time * (1 + 1e-9)
    assert best_weights(lens, COST, 8, 2048)[0] == 1.0


def test_exact_with_a_pipeline_only_for_tiny_batches():
    """With a pipeline the exact plan is an exhaustive search: at most PIPELINE_MAX_SEQS
    sequences, a clear error above."""
    cost = load_cost(recipe_llm(), pp=2)
    assert solve_exact([10], cost, 4, 1024).optimal
    with pytest.raises(ValueError, match="at most 6 sequences, not 7"):
        solve_exact([10] * 7, cost, 4, 1024, ())
