"""Rank-time packing for rounds of several micro-batches per group (pp = 1 without dp_shard;
hcp/dcp/rounds.py): a candidate of the dynamic-CP solver (hcp/dcp/solver.py step 6) built for
the rounds' objective rather than for rows of the whole pool. Seconds and tokens throughout.

When a group may run several micro-batches per round, a round lasts as long as its busiest
group, and rounds re-balance their blocks' loads well (longest processing time first), so the
iteration time is close to the pool's total rank-time over the pool size:
`sum over micro-batches q of c_q ((1 + k) f(q) + o_f + o_b) / pool`, with `f` the forward
seconds of the micro-batch's group (`CostModel.fwd` at pp = 1: compute, exposed K/V traffic and
one CP latency `cp_latency * layers * (c - 1)` per micro-batch, shared by its sequences).
Row packing (hcp/dcp/rows.py) and the one-micro-batch-per-row local search instead fill the
room left on a wide group by a long sequence with short ones; under a latency-bearing profile
a short sequence costs less on a small group of its own than as a filler on c = pool, where
it pays the whole pool's compute and traffic, even though its latency share there is free.

Method (greedy, deterministic): sequences by smallest feasible CP size, then length, both
descending; each either joins an open micro-batch of a size that holds it under the cap
(marginal rank-time: c times the group's added `(1 + k) f`, its latency already paid) or opens
a new micro-batch at the feasible size where that costs least (`c ((1 + k) f + o_f + o_b)`,
whole latency), whichever adds less rank-time. The micro-batches of each size then form one
round whose `pool / c` blocks take them longest first onto the least loaded block (LPT, Graham
1969); `rounds.fill_slack` then moves sequences off each round's busiest group.
"""
from __future__ import annotations

import bisect

import numpy as np

from hcp.dcp.cost_model import CostModel
from hcp.dcp.local_search import GroupTime
from hcp.dcp.lower_bound import cp_sizes
from hcp.dcp.packing import Group, Packing, Round, rank_tokens
from hcp.dcp.rounds import fill_slack


def rank_time_plan(lens: np.ndarray, cost: CostModel, pool: int, m: int) -> Packing:
    """A plan of rounds of several micro-batches per group for `lens` `[n]` (tokens, each
    fitting the pool under the cap `m` tokens per rank, as `plan.prepare_lengths` ensures) on
    a pool of `pool` ranks at pp = 1 (see module docstring). Raises ValueError for pp > 1
    (GroupTime)."""
    f = GroupTime(cost)
    k1 = 1.0 + cost.bwd_factor
    o = cost.hw.micro_batch_overhead_fwd + cost.hw.micro_batch_overhead_bwd
    cs = [int(c) for c in cp_sizes(pool)]
    lens = np.asarray(lens, dtype=np.int64)
    rt = rank_tokens(lens[None, :], np.array(cs)[:, None])  # [K, n]
    cmin = np.argmax(rt <= m, axis=0).tolist()
    rt = rt.tolist()
    # [c, seqs, tokens, squared tokens, rank tokens, forward seconds f, index of c in cs]
    mbs: list[list] = []
    # Joining any open c = 1 micro-batch adds the same rank-time (`(1 + k)(mm n + attn n^2)`,
    # up to rounding far below the 1e-15 s tie margin), so of those only the first with room
    # can win: the c = 1 ones are kept apart; any too full for the shortest sequence is dropped
    ones: list[int] = []  # micro-batches of c = 1 (indices into mbs, in creation order)
    multi: list[int] = []  # ... of c > 1
    low = int(np.argmin(lens))  # the shortest sequence (fewest tokens per rank at every c)
    for i in np.lexsort((-lens, -np.asarray(cmin))).tolist():
        n = int(lens[i])
        sq = n * n
        best, where = np.inf, None
        first = next((q for q in ones if mbs[q][4] + n <= m), None)
        scan = multi
        if first is not None:
            scan = multi.copy()
            bisect.insort(scan, first)
        least = {}  # CP size -> the least rank-time joining one of its micro-batches adds
        for q in scan:
            c, _, t, s, used, ft, kc = mbs[q]
            if c > 1:
                if c not in least:
                    least[c] = c * k1 * f.least_growth(n, sq, c)
                if best <= least[c] + 5e-16:  # none of size c can be 1e-15 s below the best
                    continue  # (5e-16: above the rounding of the adds, below the margin)
                if used + rt[kc][i] > m:
                    continue  # does not fit
            add = c * k1 * (f(t + n, s + sq, c) - ft)
            if add < best - 1e-15:
                best, where = add, q
        for kc in range(cmin[i], len(cs)):
            c = cs[kc]
            add = c * (k1 * f(n, sq, c) + o)
            if add < best - 1e-15:
                best, where = add, -1 - kc
        if where < 0:
            mbs.append([cs[-1 - where], [], 0, 0, 0, 0.0, -1 - where])
            where = len(mbs) - 1
            (ones if mbs[where][0] == 1 else multi).append(where)
        mb = mbs[where]
        mb[1].append(i)
        mb[2] += n
        mb[3] += sq
        mb[4] += rt[mb[6]][i]
        mb[5] = f(mb[2], mb[3], mb[0])
        if mb[4] + rt[mb[6]][low] > m:  # too full for any sequence: never a candidate again
            (ones if mb[0] == 1 else multi).remove(where)
    plan = Packing()
    for c in cs:
        own = sorted((mb for mb in mbs if mb[0] == c),
                     key=lambda mb: -(k1 * f(mb[2], mb[3], c) + o))
        if not own:
            continue
        load = [0.0] * (pool // c)
        blocks: list[list[list[int]]] = [[] for _ in load]
        for mb in own:
            b = min(range(len(load)), key=load.__getitem__)
            load[b] += k1 * f(mb[2], mb[3], c) + o
            blocks[b].append(mb[1])
        plan.rounds.append(Round([Group([i for q in qs for i in q], c, b * c, [len(q) for q in qs])
                                  for b, qs in enumerate(blocks)]))
    return fill_slack(plan, lens, cost, m)
