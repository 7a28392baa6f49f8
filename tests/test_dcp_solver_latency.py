"""The dynamic-CP solver under a latency-bearing profile (each micro-batch pays `cp_latency` per
ring step and layer, hcp/dcp/cost_model.py): the profile `mode=calibrate` fitted for llama_tiny
on 8 gloo CPU ranks (benchmarks/dynamic_cp_train.py, Wikipedia lengths, seed 100), numbers
copied here so the test needs no calibration run."""
from pathlib import Path

import numpy as np
import pytest

from hcp.dcp import pattern_bound
from hcp.dcp.cost_model import CostModel, recipe_llm
from hcp.dcp.hardware import HardwareProfile
from hcp.dcp.lower_bound import lower_bound
from hcp.dcp.packing import validate_plan
from hcp.dcp.rank_pack import rank_time_plan
from hcp.dcp.solver import simulate_plan, solve

SAMPLE = Path(__file__).resolve().parents[1] / "hcp/data/lengths/wikipedia_sample.txt"
GLOO = HardwareProfile(peak_flops=7.095e10, matmul_efficiency=1.0, attention_efficiency=0.09595,
                       nvlink_bandwidth=2.2625e8, ib_bandwidth=2.2625e8, ranks_per_node=8,
                       comm_overlap=0.0, micro_batch_overhead_fwd=0.0017,
                       micro_batch_overhead_bwd=0.0034, bytes_per_element=4,
                       cp_latency=0.001389)
POOL, CAP = 8, 256


def gloo_cost() -> CostModel:
    return CostModel(recipe_llm("llama_tiny"), GLOO, pp=1, tp=1, recompute="none")


def test_latency_bearing_plan_near_the_bound():
    """The benchmark's second Wikipedia batch of seed 100 (64 documents <= 2048 tokens, pool 8,
    cap 256, rounds of several micro-batches): 1.155x the share-only bound before the rank-time
    candidate (hcp/dcp/rank_pack.py), 1.130x with it. The bound's step 5 (the whole pool's
    latency: a document over 1024 tokens needs the whole pool for itself) puts it at 1.051x
    when written (seed 100-103's eight batches: 1.020-1.072x), step 6 (whole micro-batches,
    hcp/dcp/pattern_bound.py) at 1.015x; cap 1.03."""
    lens = np.loadtxt(SAMPLE, dtype=np.int64)
    rng = np.random.default_rng(100)
    batch = [rng.choice(np.sort(lens[lens <= POOL * CAP]), 64, replace=False) for _ in range(2)][1]
    cost = gloo_cost()
    sol = solve(batch, cost, POOL, CAP, several_per_round=True)
    validate_plan(sol.plan, batch, POOL, CAP, several_per_round=True)
    assert abs(simulate_plan(sol.plan, batch, cost).iteration_time - sol.time) < 1e-9
    assert sol.time <= 1.03 * lower_bound(batch, cost, POOL, CAP, several_per_round=True)


def test_bound_charges_whole_pool_micro_batches_their_full_latency(monkeypatch):
    """Three 1100-token documents need the whole pool (c = 4 holds 2 * ceil(1100 / 8) = 276 >
    256 tokens per rank) and each holds 138 > 128 tokens per rank at c = 8, so no two share a
    micro-batch: three micro-batches pay the pool's latency on all 8 ranks (lower_bound.py step
    5), where step 1 charged each only 138 / 256 of it. Without step 6 the bound is that work,
    by hand; step 6 (hcp/dcp/pattern_bound.py) also charges each micro-batch its whole
    overhead, and the plan that runs them one after another meets it."""
    cost = gloo_cost()
    lens = np.array([1100, 1100, 1100])
    k, o = cost.bwd_factor, GLOO.micro_batch_overhead_fwd + GLOO.micro_batch_overhead_bwd
    phi = cost.fwd_floor(1100.0, 1100.0**2, 8)[0]
    lat = cost.latency(8)[0]
    hand = (1 + k) * 3 * (phi + lat) + o * 3 * 1100 / (POOL * CAP)
    share_only = (1 + k) * 3 * (phi + lat * 138 / CAP) + o * 3 * 1100 / (POOL * CAP)
    whole = (1 + k) * 3 * (phi + lat) + 3 * o
    with monkeypatch.context() as patch:
        patch.setattr(pattern_bound, "MAX_SEQS", 0)  # step 6 off
        bound = lower_bound(lens, cost, POOL, CAP, several_per_round=True)
    assert bound == pytest.approx(hand, rel=1e-12) and bound > 1.1 * share_only
    assert lower_bound(lens, cost, POOL, CAP, several_per_round=True) == pytest.approx(
        whole, rel=1e-9)
    sol = solve(lens, cost, POOL, CAP, several_per_round=True)
    assert sol.time == pytest.approx(whole, rel=1e-9)


def test_rank_pack_keeps_short_documents_off_the_whole_pool():
    """One 1100-token document needs all 8 ranks (552 tokens per rank at c = 4 > cap 256) and
    leaves 118 tokens per rank of room; sixteen 250-token documents cost less on one rank each
    (c = 1: no latency, no traffic) than as fillers at c = 8, where each pays 8 ranks' compute
    and traffic although its share of the latency is free. Rank-time packing keeps them at
    c = 1, two rounds: the long document's and one of 8 single-rank groups with 2 each."""
    lens = np.array([1100] + [250] * 16)
    cost = gloo_cost()
    plan = rank_time_plan(lens, cost, POOL, CAP)
    validate_plan(plan, lens, POOL, CAP, several_per_round=True)
    where = {i: g.cp_size for r in plan.rounds for g in r.groups for i in g.seq_indices}
    assert where[0] == 8 and all(where[i] == 1 for i in range(1, 17))
    assert sorted(len(g.seq_indices) for r in plan.rounds for g in r.groups if g.cp_size == 1) \
        == [2] * 8
    sol = solve(lens, cost, POOL, CAP, several_per_round=True)
    assert sol.time <= simulate_plan(plan, lens, cost).iteration_time + 1e-12
