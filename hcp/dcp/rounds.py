"""Rounds of several micro-batches per group (pp = 1 without dp_shard; hcp/dcp/plan.py).

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
"""
from __future__ import annotations

import numpy as np

from hcp.dcp.cost_model import CostModel
from hcp.dcp.plan import Group, Plan, Round, rank_tokens


def _key(r: Round) -> tuple:
    return tuple(sorted((g.rank_offset, g.cp_size) for g in r.groups))


def _round_time(r: Round, lens, cost: CostModel) -> float:
    fwd, bwd = cost.stage_times(Plan([r]), lens)
    return float(fwd.sum() + bwd.sum())


def _pack(seqs: list[int], lens: np.ndarray, c: int, m: int) -> tuple[list[int], list[int]]:
    """First-fit decreasing of `seqs` into micro-batches of at most m tokens per rank at CP
    size c; returns (sequences in micro-batch order, sequences per micro-batch)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(seqs, key=lambda i: -lens[i]):
        n = int(rank_tokens(lens[i], c))
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
    load = np.zeros(len(blocks))
    members: list[list[int]] = [[] for _ in blocks]
    for q in np.argsort(-est.min(axis=0), kind="stable"):
        b = int(np.argmin(load + est[:, q]))
        load[b] += est[b, q]
        members[b].append(seqs[q])
    groups = []
    for (off, c), mem in zip(blocks, members):
        order, counts = _pack(mem, lens, c, m) if mem else ([], None)
        groups.append(Group(order, c, off, counts))
    return Round(groups)


def merge_rounds(plan: Plan, lengths, cost: CostModel, max_tokens_per_rank: int) -> Plan:
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
    out = Plan()
    for r in merged.values():
        best, t = r, _round_time(r, lens, cost)
        new = _rebalance(r, lens, cost, max_tokens_per_rank)
        if _round_time(new, lens, cost) < t:
            best = new
        out.rounds.append(best)
    return out
