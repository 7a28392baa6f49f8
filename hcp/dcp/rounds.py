"""Rounds of several micro-batches per group (pp = 1 without dp_shard; hcp/dcp/packing.py).

With one pipeline stage a group need not synchronise with the pool after every micro-batch:
between two synchronisations (a round) it may run several micro-batches one after another, so
a round lasts as long as its busiest group, not as the sum of the slowest group of every
micro-batch. `merge_rounds` turns a plan of one micro-batch per group into such rounds:
1. Rounds with the same grouping of the pool (the same blocks) merge into one; each group runs
   the micro-batches it ran in each of them. Never slower: a max of sums is at most the sum
   of maxes.
2. Each round's sequences are then re-balanced over its blocks (idle blocks included): longest
   processing time first (LPT, Graham 1969) by the additive estimate
   `(1 + k) fwd_floor(L, c) + (o_f + o_b) rank_tokens(L, c) / m` (seconds, cost_model), each
   sequence only on blocks whose size holds it under the cap; each group's sequences are then
   packed into micro-batches first-fit decreasing under the cap (padding counted). The
   re-balanced round is kept only when the cost model says it is faster.
3. `fill_slack` then moves sequences across rounds, off a round's busiest group onto groups
   that finish early.
"""
from __future__ import annotations

import numpy as np

from hcp.dcp.cost_model import CostModel
from hcp.dcp.packing import Group, Packing, Round, rank_tokens, rank_tokens_of


def _key(r: Round) -> tuple:
    return tuple(sorted((g.rank_offset, g.cp_size) for g in r.groups))


def _round_time(r: Round, lens, cost: CostModel) -> float:
    fwd, bwd = cost.stage_times(Packing([r]), lens)
    return float(fwd.sum() + bwd.sum())


def _pack(seqs: list[int], lens: np.ndarray, c: int, m: int) -> tuple[list[int], list[int]]:
    """First-fit decreasing of `seqs` into micro-batches of at most m tokens per rank at CP
    size c; returns (sequences in micro-batch order, sequences per micro-batch)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(seqs, key=lambda i: -lens[i]):
        n = rank_tokens_of(int(lens[i]), c)
        k = next((k for k, free in enumerate(room) if free >= n), -1)
        if k < 0:
            bins.append([])
            room.append(m)
            k = len(bins) - 1
        bins[k].append(i)
        room[k] -= n
    return [i for b in bins for i in b], [len(b) for b in bins]


def _rebalance(r: Round, lens: np.ndarray, cost: CostModel, m: int) -> Round:
    seqs = [i for g in r.groups for i in g.seq_indices]
    blocks = [(g.rank_offset, g.cp_size) for g in r.groups]
    o = cost.hw.micro_batch_overhead_fwd + cost.hw.micro_batch_overhead_bwd
    k1 = 1.0 + cost.bwd_factor
    sizes = np.array([c for _, c in blocks])
    x = lens[seqs].astype(np.float64)
    est = (k1 * cost.fwd_floor(x[None, :], x[None, :] ** 2, sizes[:, None]).sum(axis=0)
           + o * rank_tokens(x[None, :].astype(np.int64), sizes[:, None]) / m)  # [B, n]
    fits = rank_tokens(lens[seqs][None, :], sizes[:, None]) <= m
    est = np.where(fits, est, np.inf)
    load = [0.0] * len(blocks)
    members: list[list[int]] = [[] for _ in blocks]
    est_q = est.T.tolist()  # [n][B]
    for q in np.argsort(-est.min(axis=0), kind="stable").tolist():
        row = est_q[q]
        b = min(range(len(load)), key=lambda b: load[b] + row[b])  # the first least, as argmin
        load[b] += row[b]
        members[b].append(seqs[q])
    groups = []
    for (off, c), mem in zip(blocks, members):
        order, counts = _pack(mem, lens, c, m) if mem else ([], None)
        groups.append(Group(order, c, off, counts))
    return Round(groups)


def merge_rounds(plan: Packing, lengths, cost: CostModel, max_tokens_per_rank: int) -> Packing:
    """Rounds of several micro-batches per group from `plan` (see module docstring); pp = 1."""
    if cost.pp != 1:
        raise ValueError(f"several micro-batches per round need pp=1, not {cost.pp}")
    lens = np.asarray(lengths, dtype=np.int64)
    merged: dict[tuple, Round] = {}
    for r in plan.rounds:
        key = _key(r)
        if key not in merged:
            merged[key] = Round([Group([], g.cp_size, g.rank_offset, []) for g in
                                 sorted(r.groups, key=lambda g: g.rank_offset)])
        for g, h in zip(merged[key].groups, sorted(r.groups, key=lambda g: g.rank_offset)):
            for mb in h.micro_batches:
                g.seq_indices += mb
                g.micro_batch_sizes.append(len(mb))
    out = Packing()
    for r in merged.values():
        best, t = r, _round_time(r, lens, cost)
        new = _rebalance(r, lens, cost, max_tokens_per_rank)
        if _round_time(new, lens, cost) < t:
            best = new
        out.rounds.append(best)
    return fill_slack(out, lens, cost, max_tokens_per_rank)


FILL_SLACK_EVALS = 200_000  # candidate placements costed per fill_slack call (deterministic)


def fill_slack(plan: Packing, lengths, cost: CostModel, max_tokens_per_rank: int,
               max_moves: int = 2000, max_evals: int = FILL_SLACK_EVALS,
               counter: list | None = None) -> Packing:
    """Move sequences off the busiest group of a round onto groups (of any round, idle blocks
    included) that finish early, while a move shortens the iteration: the time of a round is
    its busiest group's, so taking a sequence off a round's unique busiest group saves
    `max - max(its new time, the round's second busiest)`, and adding it to a group costs only
    what that group then runs past its own round's maximum. Times are exact (cost model at
    pp = 1: each micro-batch `(1 + k) f + o_f + o_b`); a moved sequence joins the group's
    micro-batch with the most room that holds it (padding counted), else a new micro-batch.
    Best move per pass (the first best in a fixed order), at most `max_moves` moves and
    `max_evals` costed placements (a deterministic budget, no clock); the result is never
    slower. `counter`, if given, gets the number of costed placements and of (sequence, group)
    pairs tested one by one appended.

    Work saved without changing the move taken: a group's placements are cached until the group
    changes; a group is skipped when even the least its time can grow (the matmuls of the
    sequence, `(1 + k) mm n / c`) leaves no gain over the best move so far; the scan for a
    sequence stops at the first group that takes it at no loss (no later one can beat it); a
    round is skipped when its gap to its second busiest group is no gain over the best; a
    sequence's removal is not costed when even its micro-batch alone (the most taking it off
    can save: the forward time is subadditive) is no gain over the best; a
    sequence (or a whole busiest group, by its shortest sequence) is skipped when no CP size's
    most idle group, in any round, leaves a gain at that least growth (the per-group test,
    bounded over the groups at once)."""
    from hcp.dcp.local_search import GroupTime

    if cost.pp != 1:
        raise ValueError(f"rounds of several micro-batches need pp=1, not {cost.pp}")
    f, m = GroupTime(cost), max_tokens_per_rank
    k1 = 1.0 + cost.bwd_factor
    o = cost.hw.micro_batch_overhead_fwd + cost.hw.micro_batch_overhead_bwd
    grow = k1 * f.mm * (1.0 - 1e-9)  # least growth per token and rank, rounding kept safe
    inf = float("inf")
    lens = [int(x) for x in np.asarray(lengths)]

    rt = rank_tokens_of

    def mb_time(mb, c):  # mb = [seqs, tokens, sq, rank tokens]
        return k1 * f(mb[1], mb[2], c) + o if mb[0] else 0.0

    def timed(mb, c):  # mb with its time appended (mb[4], seconds): costed once
        mb.append(mb_time(mb, c))
        return mb

    # rounds -> groups [c, offset, [micro-batches, each timed], time, {seq: cached addition},
    # {seq: cached removal}]
    rounds = []
    for r in plan.rounds:
        groups = []
        for g in r.groups:
            mbs = [timed([list(q), sum(lens[i] for i in q), sum(lens[i] ** 2 for i in q),
                          sum(rt(lens[i], g.cp_size) for i in q)], g.cp_size)
                   for q in g.micro_batches]
            groups.append([g.cp_size, g.rank_offset, mbs, sum(mb[4] for mb in mbs), {}, {}])
        rounds.append(groups)

    def removal(g, i):  # new time of g without sequence i, and (mb index, new mb)
        c = g[0]
        for q, mb in enumerate(g[2]):
            if i in mb[0]:
                n = lens[i]
                new = timed([[x for x in mb[0] if x != i], mb[1] - n, mb[2] - n * n,
                             mb[3] - rt(n, c)], c)
                return g[3] - mb[4] + new[4], q, new
        raise AssertionError(i)

    def addition(g, i):  # best new time of g with sequence i, and (mb index or -1, new mb)
        c, n = g[0], lens[i]
        need = rt(n, c)
        if need > m:
            return None
        x = k1 * f(n, n * n, c)
        best = (g[3] + x + o, -1, [[i], n, n * n, need, x + o])  # in a micro-batch of its own
        for q, mb in enumerate(g[2]):
            if mb[3] + need <= m:
                new = timed([mb[0] + [i], mb[1] + n, mb[2] + n * n, mb[3] + need], c)
                t = g[3] - mb[4] + new[4]
                if t < best[0]:
                    best = (t, q, new)
        return best

    def apply(g, q, new):
        if q < 0:
            g[2].append(new)
        elif new[0]:
            g[2][q] = new
        else:
            g[2].pop(q)
        g[3] = sum(mb[4] for mb in g[2])
        g[4].clear()
        g[5].clear()

    evals = pairs = 0  # costed placements; (sequence, group) pairs tested one by one
    alone: dict[tuple[int, int], float] = {}  # (seq, c) -> its micro-batch alone (seconds)
    for _ in range(max_moves):
        if evals >= max_evals:
            break
        tops = [max(g[3] for g in r) for r in rounds]
        # per round and CP size c, the most time one of its groups of c ranks can take before
        # it runs past the round: {c: seconds}
        room = [{} for _ in rounds]
        for t, r, out in zip(tops, rounds, room):
            for g in r:
                out[g[0]] = max(out.get(g[0], -inf), t - g[3])
        best = (1e-12, None)
        for a, ra in enumerate(rounds):
            order = sorted(ra, key=lambda g: -g[3])
            ga = order[0]
            second = order[1][3] if len(order) > 1 else 0.0
            if tops[a] - second <= best[0]:
                continue  # no removal gains more (a tie at the top: none shortens the round)
            # ... of the other rounds, and of round a less ga less its top: [(c, s, s)]
            bounds = {}
            for b, x in enumerate(room):
                for c, t in x.items():
                    if b != a and t > bounds.get(c, (-inf, -inf))[0]:
                        bounds[c] = (t, -inf)
            for g in order[1:]:
                t, u = bounds.get(g[0], (-inf, -inf))
                bounds[g[0]] = (t, max(u, -g[3]))
            bounds = [(c * 1.0, t, u) for c, (t, u) in bounds.items()]
            if not bounds:
                continue  # no group to move to
            n = min(lens[i] for mb in ga[2] for i in mb[0])  # the least growth: the shortest
            if max(max(tops[a] - second + t, tops[a] + u) - grow * n / c
                   for c, t, u in bounds) <= best[0] - 1e-12:
                continue  # the test below for every sequence of ga, bounded
            gone, ca = ga[5], ga[0]
            for i in {i for mb in ga[2] for i in mb[0]}:
                if i not in gone:
                    # f is subadditive, so taking i off saves at most its micro-batch of its own
                    if (i, ca) not in alone:
                        alone[i, ca] = k1 * f(lens[i], lens[i] ** 2, ca) + o
                    if tops[a] - max(ga[3] - alone[i, ca], second) <= best[0] - 1e-12:
                        continue  # the gain below, bounded without costing the removal
                    gone[i] = removal(ga, i)
                t_a, qa, new_a = gone[i]
                gain = tops[a] - max(t_a, second)
                if gain <= best[0]:
                    continue
                n = lens[i]
                top_a = max(t_a, second)
                if max(max(t, top_a + u) - grow * n / c
                       for c, t, u in bounds) <= best[0] - gain - 1e-12:
                    continue  # no group of any round has room for it (the test below, bounded)
                for b, rb in enumerate(rounds):
                    top_b = max(t_a, second) if b == a else tops[b]
                    pairs += len(rb)
                    for gb in rb:
                        if gb is ga or gain - (gb[3] + grow * n / gb[0] - top_b) <= best[0]:
                            continue  # no gain left even at the least growth
                        cache = gb[4]
                        if i in cache:
                            add = cache[i]
                        else:
                            add = cache[i] = addition(gb, i)
                            evals += 1
                        if add is None:
                            continue
                        loss = max(0.0, add[0] - top_b)
                        if gain - loss > best[0]:
                            best = (gain - loss, (ga, qa, new_a, gb, add[1], add[2]))
                            if loss == 0.0:
                                break  # no later group of any round beats it for this i
                    else:
                        continue
                    break
        if best[1] is None:
            break
        ga, qa, new_a, gb, qb, new_b = best[1]
        apply(ga, qa, new_a)
        apply(gb, qb, new_b)
    if counter is not None:
        counter += [evals, pairs]
    out = Packing()
    for r in rounds:
        groups = []
        for c, off, mbs, *_ in r:
            seqs = [i for mb in mbs for i in mb[0]]
            groups.append(Group(seqs, c, off, [len(mb[0]) for mb in mbs] if mbs else None))
        if any(g.seq_indices for g in groups):
            out.rounds.append(Round(groups))
    return out
