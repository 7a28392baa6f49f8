"""A provable lower bound on the simulated iteration time of any valid plan.

Setting: N = `pool` ranks per stage, p stages, cap m tokens per rank, lengths L_i; `f_s(g)` the
forward seconds of group g on stage s (cost_model.CostModel.fwd), `k = 2 + recompute` so a
group's backward is `k * f_s(g)`, overheads o_f, o_b per micro-batch and stage. A plan's
micro-batch j takes `F_sj = o_f + max_g f_s(g)` and `B_sj = o_b + k max_g f_s(g)` on stage s.

1. Work. The groups of micro-batch j tile the N ranks, so `max_g f_s(g) >= sum_g (c_g / N) f_s(g)`
   and `f_s(g) >= sum_{i in g} (phi_s(L_i, c_g) + lat_s(c_g) rank_tokens(L_i, c_g) / m)` with
   `phi_s` the additive floor (CostModel.fwd_floor) and `lat_s(c)` the CP latency that f_s(g)
   pays once (CostModel.latency), shared by the members' rank tokens, which sum to at most m.
   Writing phi'_s(L, c) for that sum's term, stage s is busy at least
       W_s = (1 + k) / N * sum_i min_{c feasible} c * phi'_s(L_i, c) + M_min (o_f + o_b),
   c ranging over powers of two <= N that hold L_i under the cap (`rank_tokens`, padding
   counted), and `M >= M_min = ceil(sum L / (N m))`
   because a micro-batch holds at most N m tokens.
2. Fill and drain. In 1F1B stage s starts with F(s, 0), which waits for F(s', 0) on every
   s' < s, and ends with B(s, M - 1), after which B(s', M - 1) still runs on every s' < s. A
   micro-batch holds at least one sequence, so
   `F_s'j >= o_f + min_i min_c phi_s'(L_i, c)` =: Fmin_s' and
   `B_s'j >= o_b + k (Fmin_s' - o_f)`. So T >= sum_{s' < s} (Fmin_s' + Bmin_s') + W_s for
   every s. (The often quoted `(p - 1) * max_j t_j` is not a bound: a plan may put its smallest
   micro-batches first and last.)
3. Critical path. Each sequence's micro-batch passes forward through all stages and back, so
   T >= max_i min_c sum_s (1 + k) phi_s(L_i, c) + p (o_f + o_b).
4. Several micro-batches per round (pp = 1 without dp_shard, hcp/dcp/packing.py). Rounds no longer
   tile the pool per micro-batch, so replace M_min in 1: each micro-batch of a group of c ranks
   puts at most m tokens on each of its ranks, so the groups' micro-batches occupy at least
   `sum L / m` rank-micro-batches in all, each paying o_f + o_b on each of its ranks; the
   busiest rank works at least the average, so
       T >= (1 + k) / N * sum_i min_c c * phi'(L_i, c) + (o_f + o_b) * sum L / (N m)
   (each micro-batch pays its latency once, shared as in 1).
   Term 3 holds as it stands (a group runs each of its sequences' micro-batches through the
   stage); term 2 is void at p = 1.
5. The whole pool's latency. Step 1 charges a sequence only its token share of its
   micro-batch's latency, so a micro-batch that one long document fills halfway looks half as
   dear as it is. Let F be the sequences that only the whole pool holds under the cap (no
   c < N feasible). Each runs in a micro-batch of one group of all N ranks, which holds at most
   m rank tokens per rank, so there are at least
       K = max(ceil(sum_{i in F} r_i / m), #{i in F : r_i > m / 2})
   such micro-batches (r_i = rank_tokens(L_i, N); two sequences over m / 2 never share one),
   each paying lat_s(N) on all N ranks. Any other sequence runs either on c < N ranks, costing
   at least c phi'_s(L, c) as in step 1, or on the whole pool, costing at least N phi_s(L, N)
   (it may fill the room those K micro-batches leave, latency already paid). So in step 1 (and
   step 4) the rank-time sum may be replaced by
       sum_{i in F} N phi_s(L_i, N) + K N lat_s(N)
       + sum_{i not in F} min(min_{c < N} c phi'_s(L_i, c), N phi_s(L_i, N)),
   and the larger of the two work terms holds. Term 3 also counts the latency a sequence's own
   micro-batch pays once at its c: `phi_s(L, c) + lat_s(c)`.
6. Whole micro-batches (pp = 1, computed for `several_per_round`): steps 1 and 4 charge a
   sequence its token share of a micro-batch's latency and overhead, as if every micro-batch
   were full; hcp/dcp/pattern_bound.py packs the micro-batches exactly instead (a pattern LP
   over sets of sequences that fit one micro-batch; its proof there).
The bound is the largest of these. Seconds throughout.
"""
from __future__ import annotations

import numpy as np

from hcp.dcp.cost_model import CostModel
from hcp.dcp.packing import check_pool, cp_sizes, prepare_lengths, rank_tokens
from hcp.dcp.pattern_bound import pattern_bound


def lower_bound(lengths, cost: CostModel, pool: int, max_tokens_per_rank: int,
                several_per_round: bool = False) -> float:
    """Seconds below which no valid plan of these lengths (tokens) can finish an iteration (see
    module docstring for the proof); `several_per_round` for plans whose groups may run
    several micro-batches per round (pp = 1 without dp_shard; proof steps 4 and 6). The inputs must
    pass `prepare_lengths` as they are (so each
    length fits the pool, `plan.max_length`); its errors are raised otherwise."""
    pool, max_tokens_per_rank = check_pool(pool, max_tokens_per_rank)  # Python ints: no overflow
    lens = prepare_lengths(lengths, pool, max_tokens_per_rank)[0].astype(np.float64)
    cs = cp_sizes(pool).astype(np.float64)[:, None]  # [K, 1]
    phi = cost.fwd_floor(lens[None, :], lens[None, :] ** 2, cs)  # [p, K, n]
    feasible = rank_tokens(lens[None, :], cs) <= max_tokens_per_rank  # [K, n]
    phi = np.where(feasible[None], phi, np.inf)
    # each sequence's share of its micro-batch's CP latency (proof step 1)
    share = phi + cost.latency(cs) * rank_tokens(lens[None, :], cs) / max_tokens_per_rank
    k = cost.bwd_factor
    o_f, o_b = cost.hw.micro_batch_overhead_fwd, cost.hw.micro_batch_overhead_bwd
    m_min = lens.sum() / (pool * max_tokens_per_rank)
    if not several_per_round:
        m_min = np.ceil(m_min)
    rank_time = (cs[None] * share).min(axis=1).sum(axis=1)  # [p]
    work = (1 + k) / pool * np.maximum(rank_time, _whole_pool(lens, cost, phi, share, pool,
                                                               max_tokens_per_rank))
    work = work + m_min * (o_f + o_b)  # [p]
    smallest = phi.min(axis=(1, 2))  # [p]
    ends = np.concatenate([[0.0], np.cumsum((1 + k) * smallest + o_f + o_b)[:-1]])
    staged = float((ends + work).max())
    own = phi + cost.latency(cs)  # [p, K, n]: its micro-batch's latency, once
    path = float(((1 + k) * own.sum(axis=0)).min(axis=0).max()) + cost.pp * (o_f + o_b)
    if several_per_round and cost.pp == 1:
        return max(staged, path, pattern_bound(lens.astype(np.int64), cost, pool,
                                               max_tokens_per_rank))
    return max(staged, path)


def _whole_pool(lens: np.ndarray, cost: CostModel, phi: np.ndarray, share: np.ndarray,
                pool: int, m: int) -> np.ndarray:
    """Proof step 5's rank-time sum `[p]` (seconds over all ranks of a stage); 0 when no
    sequence needs the whole pool. `phi`, `share`: `[p, K, n]` as in `lower_bound` (inf where
    infeasible), lengths `[n]` tokens."""
    if pool == 1:
        return np.zeros(cost.pp)
    forced = ~np.isfinite(phi[0, :-1]).any(axis=0)  # [n]: no c < pool holds it
    if not forced.any():
        return np.zeros(cost.pp)
    r = rank_tokens(lens[forced], pool)
    k_min = max(np.ceil(r.sum() / m), float((2 * r > m).sum()))  # whole-pool micro-batches
    whole = pool * phi[:, -1, :]  # [p, n]: on the whole pool, no latency share
    cs = cp_sizes(pool)[:-1].astype(np.float64)[None, :, None]
    below_cost = (cs * share[:, :-1, :]).min(axis=1)  # [p, n], inf where no c < pool holds it
    charge = np.where(forced[None], whole, np.minimum(below_cost, whole))
    return charge.sum(axis=1) + k_min * pool * cost.latency(pool)
