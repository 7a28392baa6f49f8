"""The dynamic-CP solver's work, counted rather than timed (the machine's speed must not matter):
cost evaluations on the peer benchmark's batch size, the LPs it solves at seed size, and the
same plan however fast the clock runs."""
import time
from pathlib import Path

import numpy as np
import pytest

import hcp.dcp.solver as solver
from hcp.dcp.cost_model import load_cost, recipe_llm
from hcp.dcp.local_search import GroupTime
from hcp.dcp.packing import validate_plan

SAMPLE = Path(__file__).resolve().parents[1] / "hcp/data/lengths/wikipedia_sample.txt"


def peer_batch(seed=100, size=256, max_len=8192):
    """A batch as benchmarks/dynamic_cp.py draws it (Wikipedia lengths <= max_len)."""
    lens = np.loadtxt(SAMPLE, dtype=np.int64)
    return np.random.default_rng(seed).choice(lens[lens <= max_len], size, replace=False)


def shape(plan):
    return [[(list(map(int, g.seq_indices)), g.cp_size, g.rank_offset, g.micro_batch_sizes)
             for g in r.groups] for r in plan.rounds]


def test_peer_batch_costs_few_evaluations(monkeypatch):
    """The peer benchmark's setting (GBS 256, pool 8, cap 2048, pp 1, several micro-batches per
    round), seed 100: the solver costed 67,431 groups before the placement caches and pruning
    of `rounds.fill_slack`, the two-candidate race above 128 sequences (`_large_rounds`) and
    rank-pack's candidate pruning; 8,153 with them, for the same plan (4.474 s, rank-pack)."""
    calls = [0]
    plain = GroupTime.__call__

    def counted(self, t, s, c):
        calls[0] += 1
        return plain(self, t, s, c)

    monkeypatch.setattr(GroupTime, "__call__", counted)
    lens = peer_batch()
    sol = solver.solve(lens, load_cost(recipe_llm(), pp=1), 8, 2048, 8192, several_per_round=True)
    validate_plan(sol.plan, lens, 8, 2048, several_per_round=True)
    assert calls[0] < 16_000
    assert sol.time == pytest.approx(4.474272538498122, rel=1e-12)


def test_no_lp_above_the_row_limit(monkeypatch):
    """A seed-sized pipeline batch of long documents (~190 rows at the memory minimum): the
    LP-shaped candidates would need LPs of 1.6-3 x that many rows (HiGHS: seconds each); none
    above `LP_MAX_ROWS` is solved."""
    sizes = []
    lp = solver.lp_makespan

    def recorded(rows, *args, **kwargs):
        sizes.append(rows)
        return lp(rows, *args, **kwargs)

    monkeypatch.setattr(solver, "lp_makespan", recorded)
    monkeypatch.setattr(solver, "EARLY_EXIT_GAP", -1.0)  # never skip the LP stage for the gap
    lens = np.random.default_rng(0).integers(4000, 8000, 2048)
    cost = load_cost(recipe_llm(), pp=8)
    assert np.ceil(lens.sum() / (8 * 8192)) * min(solver.PIN_ROW_FACTORS) > solver.LP_MAX_ROWS
    sol = solver.solve(lens, cost, 8, 8192, 65536)
    validate_plan(sol.plan, lens, 8, 8192)
    assert sizes == []


def test_same_plan_whatever_the_clock(monkeypatch):
    """Deterministic: no wall-clock budget anywhere in the search, so a clock that jumps 10 s
    at every reading (a machine 'too slow' for any budget) gives the same plans, at pp 1 with
    local search and the branch-and-bound dive (64 sequences) and at pp 4 with the LP-shaped
    candidates."""
    cases = [(peer_batch(7, 64, 2048), load_cost(recipe_llm(), pp=1), 256, True),
             (peer_batch(8, 300, 8192), load_cost(recipe_llm(), pp=4), 2048, False)]
    plain = [shape(solver.solve(l, c, 8, m, several_per_round=r).plan) for l, c, m, r in cases]
    again = [shape(solver.solve(l, c, 8, m, several_per_round=r).plan) for l, c, m, r in cases]
    assert again == plain
    ticks = [0.0]

    def slow_clock():
        ticks[0] += 10.0
        return ticks[0]

    for name in ("perf_counter", "monotonic", "time", "process_time", "thread_time"):
        monkeypatch.setattr(time, name, slow_clock)
    slow = [shape(solver.solve(l, c, 8, m, several_per_round=r).plan) for l, c, m, r in cases]
    assert slow == plain


def test_fill_slack_tests_few_pairs(monkeypatch):
    """`rounds.fill_slack` on greedy's plan as rounds (the peer benchmark's batch, seed 100):
    every (sequence, group) pair whose sequence could gain was tested one by one before the
    bounds over all groups at once (8,923 pairs, 447 with them); now only those of sequences
    some group may take, for the same moves and plan. Micro-batches were costed 2,511 times (each removal
    costed, each micro-batch costed again at every move), 1,363 times now."""
    from hcp.dcp import rounds
    from hcp.dcp.baselines import greedy

    lens = peer_batch()
    cost = load_cost(recipe_llm(), pp=1)
    real, kept = rounds.fill_slack, []
    monkeypatch.setattr(rounds, "fill_slack", lambda plan, *a, **k: kept.append(plan)
                        or real(plan, *a, **k))
    out = rounds.merge_rounds(greedy(lens, 8, 2048), lens, cost, 2048)
    counter, calls, plain = [], [0], GroupTime.__call__

    def counted(self, t, s, c):
        calls[0] += 1
        return plain(self, t, s, c)

    monkeypatch.setattr(GroupTime, "__call__", counted)
    again = real(kept[0], lens, cost, 2048, counter=counter)
    assert shape(again) == shape(out)
    assert counter[1] < 1_000
    assert calls[0] < 1_800
