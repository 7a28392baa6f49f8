"""The pattern (configuration) LP bound: a valid lower bound at pp = 1 that counts whole
micro-batches, not token shares of them. Seconds and tokens throughout.

hcp/dcp/lower_bound.py step 1 charges a sequence `rank_tokens / m` of its micro-batch's latency
and overhead, as if micro-batches were filled to the cap. Under a latency-bearing profile a
micro-batch on c ranks costs `c (o + (1 + k) lat(c))` of rank-time however full it is, and
sequences of a few hundred tokens rarely fill one exactly, so that bound sits several percent
below every plan (Wikipedia lengths, pool 8, cap 256: 0.90-0.96 of the solver's plans, whose
rank-time an exact integer program matches within 1-3%). Here the micro-batches are packed
exactly, as a bin-packing relaxation (Gilmore & Gomory, Operations Research 9, 1961).

Setting (pp = 1): N = `pool` ranks, cap m tokens per rank, lengths L_i (i = 1..n), k =
`cost.bwd_factor`, o = o_f + o_b, c ranging over the powers of two <= N. A pattern P = (c, S) is a
set S of sequences with `sum_{i in S} r_i(c) <= m` (r = `rank_tokens`, padding counted); its
rank-time is
    a(P) = c (o + (1 + k) lat(c)) + sum_{i in S} c (1 + k) phi(L_i, c)
(phi = `CostModel.fwd_floor`, lat = `CostModel.latency`).

Claim. Every valid plan takes T >= A / N, A = min over partitions of the sequences into patterns
of the sum of a(P). Proof: the groups of a round occupy disjoint blocks of c_g ranks, so the
round lasts at least `sum_g c_g t_g / N` (t_g: the group's time, idle ranks adding 0). A group
runs micro-batches q one after another, `t_g = sum_q ((1 + k) f(q) + o)` (plus selective
recompute's extra, >= 0), and `f(q) >= lat(c) + sum_{i in q} phi(L_i, c)` (lower_bound.py step
1); each micro-batch holds at most m tokens per rank, so it is a pattern and c_g times its term
is at least a(P). Summed over rounds, T >= (sum of a over the plan's micro-batches) / N >= A / N.
(Without rounds the same sum holds: each rank is busy for its micro-batches one at a time, and
the last rank ends no earlier than the average rank, as when the trainer runs rows unsynchronised.)
With one micro-batch per round (pp = 1, dp_shard) the same holds: micro-batch j lasts
`o + (1 + k) max_g f(g)` on all N ranks, at least `sum_g c_g (o + (1 + k) f(g)) / N`.

Weak duality (Lagrangian bound). For any prices pi_i, a partition's cost is
`sum_P a(P) = sum_i pi_i + sum_P (a(P) - sum_{i in P} pi_i) >= sum_i pi_i + n min(0, rho)`, with
`rho = min_P (a(P) - pi(P))` over all patterns and at most n patterns in a partition (each holds
a sequence). For each c, `rho_c = c (o + (1 + k) lat(c)) - max_S sum_{i in S}
(pi_i - c (1 + k) phi(L_i, c))` over S under the cap: a 0/1 knapsack, solved exactly by dynamic
programming over integer capacities. When m > CAPACITY_UNITS the weights are rounded down to
units of m / CAPACITY_UNITS: every pattern still fits, so the knapsack's maximum can only grow
and rho only fall (the bound stays valid, a little weaker). So
`(sum_i pi_i + n min(0, rho)) / N` is a valid bound for every pi, exact arithmetic aside.

Method: column generation. The restricted LP over the patterns found so far (covering each
sequence at least once: costs are non-negative and dropping a sequence from a pattern never
raises its cost) gives prices pi (HiGHS duals); the knapsacks give rho and a cheapest pattern
per c, added while rho < 0; at most MAX_ROUNDS rounds (a deterministic budget). The result is
the largest Lagrangian bound seen; at convergence it is the pattern LP's optimum.
"""
from __future__ import annotations

import numpy as np
from scipy.optimize import linprog

from hcp.dcp.cost_model import CostModel
from hcp.dcp.packing import cp_sizes, rank_tokens

MAX_SEQS = 128  # more sequences: no pattern bound (0); its LPs grow with n (CPU time here, seed
# batches: ~0.1 s at 32 sequences, ~0.3 s at 64, ~1.5 s at 128)
MAX_ROUNDS = 200  # column-generation rounds (seed-sized batches of 32-64 converge in 20-60)
CAPACITY_UNITS = 1024  # knapsack capacity resolution (see the module docstring)


def _knapsack(value: np.ndarray, weight: np.ndarray, cap: int) -> tuple[float, list[int]]:
    """Max of `sum value[S]` over sets S with `sum weight[S] <= cap` (0/1, exact: integer
    weights `[n]`, cap >= 0) and one such S; items with value <= 0 never help."""
    dp = np.zeros(cap + 1)
    items = [i for i in range(value.size) if value[i] > 0 and weight[i] <= cap]
    take = np.zeros((len(items), cap + 1), dtype=bool)
    for row, i in enumerate(items):
        w = int(weight[i])
        cand = dp[:cap + 1 - w] + value[i]
        take[row, w:] = cand > dp[w:]
        dp[w:] = np.maximum(dp[w:], cand)
    room, chosen = cap, []
    for row in range(len(items) - 1, -1, -1):
        if take[row, room]:
            chosen.append(items[row])
            room -= int(weight[items[row]])
    return float(dp[cap]), chosen


def pattern_bound(lens: np.ndarray, cost: CostModel, pool: int, m: int) -> float:
    """Seconds below which no valid plan of `lens` `[n]` (tokens, each fitting the pool under
    the cap `m` tokens per rank, as `prepare_lengths` ensures) can finish at pp = 1 (see the
    module docstring for the proof); 0 for more than MAX_SEQS sequences. Raises ValueError for
    pp > 1."""
    if cost.pp != 1:
        raise ValueError(f"the pattern bound is for pp=1, not {cost.pp}")
    lens = np.asarray(lens, dtype=np.int64)
    n = lens.size
    if n == 0 or n > MAX_SEQS:
        return 0.0
    cs = cp_sizes(pool).astype(np.float64)
    x = lens.astype(np.float64)[None, :]
    k1 = 1.0 + cost.bwd_factor
    o = cost.hw.micro_batch_overhead_fwd + cost.hw.micro_batch_overhead_bwd
    rt = rank_tokens(lens[None, :], cs[:, None].astype(np.int64))  # [K, n]
    feasible = rt <= m
    add = np.where(feasible, cs[:, None] * k1 * cost.fwd_floor(x, x * x, cs[:, None])[0], np.inf)
    fixed = cs * (o + k1 * cost.latency(cs)[0])  # [K]
    cap = min(m, CAPACITY_UNITS)
    weight = rt * cap // m  # rounded down: every pattern still fits
    # start: each sequence alone at its cheapest size
    cols = [(float((add[:, i] + fixed).min()), [i]) for i in range(n)]
    best = 0.0
    for _ in range(MAX_ROUNDS):
        a = np.zeros((n, len(cols)))
        for q, (_, members) in enumerate(cols):
            a[members, q] = 1.0
        res = linprog([c for c, _ in cols], A_ub=-a, b_ub=-np.ones(n), bounds=(0, None),
                      method="highs")
        if res.status != 0:
            break
        pi = np.maximum(-res.ineqlin.marginals, 0.0)
        rho, new = 0.0, []
        for j in range(cs.size):
            value, chosen = _knapsack(np.where(feasible[j], pi - add[j], -1.0), weight[j], cap)
            rc = fixed[j] - value
            rho = min(rho, rc)
            if rc < -1e-12 * max(1.0, fixed[j]) and chosen:
                new.append((float(fixed[j] + add[j, chosen].sum()), sorted(chosen)))
        best = max(best, (float(pi.sum()) + n * rho) / pool)
        if not new:
            break
        cols += new
    return best
