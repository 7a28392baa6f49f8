"""Local search for one pipeline stage (`pp = 1`), where the iteration time is a sum over
micro-batches: `T = sum_j ((1 + k) H_j + o_f + o_b)`, `H_j` the slowest group's forward
(hcp/schedule/simulator.py with p = 1). Seconds throughout.

A plan is held as micro-batches of groups `(sequences, CP size c)` whose sizes sum to at most
the pool (largest first they tile it with aligned blocks). Moves, each evaluated exactly with
the cost model in O(1) from the groups' token and squared-token sums:
- move one sequence to another group, or to a new group of any feasible size in a micro-batch
  with enough idle ranks (this mixes CP sizes and empties micro-batches: an emptied one is
  dropped and its overhead saved);
- swap two sequences of different groups;
- resize a group to 2c (if idle ranks allow) or c/2 (if the cap allows);
(the cap counts each group's tokens per rank with head-tail padding, `plan.rank_tokens`)
- split a group of c ranks into two of c/2, its sequences halved by tokens (longest first):
  short sequences stop paying CP communication (a coordinated move that single moves miss).
A move is taken when it lowers T, or keeps T and lowers the sum of squared group times (which
balances groups below the slowest, so that the next move can lower it). Best improvement per
sequence, sweeps until none improves: deterministic, a local optimum of these moves.
"""
from __future__ import annotations

import numpy as np

from hcp.dcp.cost_model import CostModel
from hcp.dcp.packing import Group, Round, Packing, fill_idle, rank_tokens_of

EPS = 1e-12


class GroupTime:
    """Scalar forward seconds of a group at pp = 1, equal to `CostModel.fwd` (no overhead)."""

    def __init__(self, cost: CostModel):
        if cost.pp != 1:
            raise ValueError("local search is for pp=1")
        self.mm, self.attn = float(cost.mm_coef[0]), float(cost.attn_coef[0])
        self.comm, self.ov = float(cost.comm_coef[0]), cost.hw.comm_overlap
        self.cost = cost
        # per CP size: attention scale, bandwidth (bytes/s), latency (s, once per micro-batch)
        self.per_c: dict[int, tuple[float, float, float]] = {}

    def _constants(self, c: int) -> tuple[float, float, float]:
        cost = self.cost
        out = self.per_c[c] = (float(cost.attn_scale(c)), float(cost.bandwidth(c)),
                               float(cost.latency(c)[0]))
        return out

    def least_growth(self, n: int, sq: int, c: int) -> float:
        """Seconds: a lower bound on `self(t + n, s + sq, c) - self(t, s, c)` over every group
        (t > 0) of c ranks: the matmuls' `mm n / c` plus the smaller growth of the two branches
        of the exposed-traffic max (attention with the unhidden traffic, or the traffic)."""
        scale, bw, _ = self.per_c.get(c) or self._constants(c)
        comm = self.comm * n * (c - 1) / c / bw
        return self.mm * n / c + min(self.attn * scale * sq / c + (1.0 - self.ov) * comm, comm)

    def __call__(self, t: float, s: float, c: int) -> float:
        if t <= 0:
            return 0.0
        scale, bw, lat = self.per_c.get(c) or self._constants(c)
        attn = self.attn * scale * s / c
        comm = self.comm * t * (c - 1) / c / bw
        exposed = max((1.0 - self.ov) * comm, comm - attn)
        return self.mm * t / c + attn + exposed + lat


def _split(seqs: list[int], lens: list[int]) -> tuple[list[int], list[int]]:
    """Two halves of `seqs` (longest first) balanced by tokens, greedily."""
    a, b, ta, tb = [], [], 0, 0
    for i in seqs:
        if ta <= tb:
            a.append(i)
            ta += lens[i]
        else:
            b.append(i)
            tb += lens[i]
    return a, b


def improve(plan: Packing, lengths, cost: CostModel, pool: int, max_tokens_per_rank: int,
            max_sweeps: int = 50, max_evals: int | None = None) -> Packing:
    """A local optimum of the moves above, starting from `plan` (never slower than it). With
    `max_evals`, the search stops after the sequence at which that many moves have been
    evaluated (a deterministic budget: the same input gives the same plan)."""
    f = GroupTime(cost)
    lens = [int(x) for x in np.asarray(lengths)]
    m, k1 = max_tokens_per_rank, 1.0 + cost.bwd_factor
    # groups: [mb, c, set of seqs, tokens, sq, forward seconds, tokens per rank (padding
    # counted)]; where[i] = group of sequence i
    groups: list[list] = []
    rt = rank_tokens_of  # tokens per rank of one document at c
    # ... of every sequence at every CP size, as lists (the inner loops read it per move)
    tab = {c: [rt(x, c) for x in lens] for c in (1 << e for e in range(int(pool).bit_length()))}

    def refresh(g):  # after any change of the group's c, members, tokens or sq
        g[5] = f(g[3], g[4], g[1])
        g[6] = sum(rt(lens[i], g[1]) for i in g[2])

    for j, mb in enumerate(plan.rounds):
        for g in mb.groups:
            if g.seq_indices:
                groups.append([j, g.cp_size, set(g.seq_indices),
                               sum(lens[i] for i in g.seq_indices),
                               sum(lens[i] ** 2 for i in g.seq_indices), 0.0, 0])
                refresh(groups[-1])
    where = {i: g for g in groups for i in g[2]}
    nmb = plan.num_rounds
    sizes = [1 << e for e in range(int(pool).bit_length())]
    # every group ever made, per micro-batch in creation order (emptied ones stay, skipped),
    # and by id: the deltas below touch one or two micro-batches, not every group
    in_mb: list[list[list]] = [[] for _ in range(nmb)]
    for g in groups:
        in_mb[g[0]].append(g)
    by_id = {id(g): g for g in groups}

    def add_group(g):
        groups.append(g)
        in_mb[g[0]].append(g)
        by_id[id(g)] = g

    def members(j):
        return [g for g in in_mb[j] if g[2]]

    o = cost.hw.micro_batch_overhead_fwd + cost.hw.micro_batch_overhead_bwd

    def used(j):  # ranks busy in micro-batch j (kept in mb_used by sync)
        return mb_used[j]

    evals = [0]  # moves evaluated
    mb_max = [0.0] * nmb  # slowest group's forward seconds per micro-batch (0 if empty)
    mb_count = [0] * nmb  # non-empty groups per micro-batch
    mb_used = [0] * nmb  # ranks of its non-empty groups

    def sync(*js):  # after a move is applied in these micro-batches
        for j in js:
            live = [g for g in in_mb[j] if g[2]]
            mb_max[j], mb_count[j] = max((g[5] for g in live), default=0.0), len(live)
            mb_used[j] = sum(g[1] for g in live)

    sync(*range(nmb))

    def delta(changes: dict, *new: tuple):
        """(dT, d sum f^2) of giving the groups in `changes` {id: (tokens, sq, c)} new sums
        and adding each of `new` = (micro-batch, tokens, sq, c) as a group. Only the changed
        groups are costed: the others' slowest is `mb_max` unless a changed group was it."""
        evals[0] += 1
        per: dict[int, list] = {x[0]: [] for x in new}
        for k, v in changes.items():
            g = by_id[k]
            per.setdefault(g[0], []).append((g, *v))
        dt = dq = 0.0
        for j in sorted(per):
            before, ch = mb_max[j], per[j]
            if any(g[5] >= before for g, *_ in ch):  # the slowest changes: scan the others
                after = max((g[5] for g in in_mb[j] if g[2] and id(g) not in changes),
                            default=0.0)
            else:
                after = before
            has = mb_count[j] > len(ch)
            for g, t, sq, c in ch:
                fa = f(t, sq, c)
                dq += fa * fa - g[5] * g[5]
                if t > 0:
                    after, has = max(after, fa), True
            for x in new:
                if x[0] == j:
                    fa = f(*x[1:])
                    dq += fa * fa
                    after, has = max(after, fa), True
            dt += k1 * (after - before) + o * (has - (mb_count[j] > 0))
        return dt, dq

    def better(d, best):
        return d[0] < best[0] - EPS or (d[0] <= best[0] + EPS and d[1] < best[1] - EPS)

    for _ in range(max_sweeps):
        improved = False
        for i in sorted(range(len(lens)), key=lambda i: -lens[i]):
            if max_evals is not None and evals[0] >= max_evals:
                break
            g0, n = where[i], lens[i]
            out = (g0[3] - n, g0[4] - n * n, g0[1])
            best, act = (0.0, 0.0), None
            for g in groups:  # move to an existing group
                if g is g0 or not g[2] or g[6] + tab[g[1]][i] > m:
                    continue
                d = delta({id(g0): out, id(g): (g[3] + n, g[4] + n * n, g[1])})
                if better(d, best):
                    best, act = d, ("move", g)
            for j in range(nmb):  # move to a new group
                idle = pool - used(j) + (g0[1] if g0[0] == j and len(g0[2]) == 1 else 0)
                for c in sizes:
                    if c <= idle and tab[c][i] <= m:
                        d = delta({id(g0): out}, (j, n, n * n, c))
                        if better(d, best):
                            best, act = d, ("new", j, c)
            n_rt, mine = tab[g0[1]][i], tab[g0[1]]
            for q in range(len(lens)):  # swap
                g = where[q]
                if g is g0 or lens[q] == n:
                    continue
                dn = lens[q] - n
                if (g0[6] - n_rt + mine[q] > m
                        or g[6] - tab[g[1]][q] + tab[g[1]][i] > m):
                    continue
                ch = {id(g0): (g0[3] + dn, g0[4] - n * n + lens[q] ** 2, g0[1]),
                      id(g): (g[3] - dn, g[4] - lens[q] ** 2 + n * n, g[1])}
                d = delta(ch)
                if better(d, best):
                    best, act = d, ("swap", q)
            if act is None:
                continue
            improved = True
            g0[2].discard(i)
            g0[3], g0[4] = out[0], out[1]
            refresh(g0)
            if act[0] == "move":
                g = act[1]
            elif act[0] == "new":
                g = [act[1], act[2], set(), 0, 0, 0.0, 0]
                add_group(g)
            else:
                q = act[1]
                g = where[q]
                g[2].discard(q)
                g[3], g[4] = g[3] - lens[q], g[4] - lens[q] ** 2
                g0[2].add(q)
                g0[3], g0[4] = g0[3] + lens[q], g0[4] + lens[q] ** 2
                refresh(g0)
                where[q] = g0
            g[2].add(i)
            g[3], g[4] = g[3] + n, g[4] + n * n
            refresh(g)
            where[i] = g
            sync(g0[0], g[0])
            groups[:] = [g for g in groups if g[2]]
        for g in list(groups):  # resize
            j = g[0]
            for c in (2 * g[1], g[1] // 2):
                if (c < 1 or c > pool or sum(rt(lens[i], c) for i in g[2]) > m
                        or (c > g[1] and used(j) + g[1] > pool)):
                    continue
                d = delta({id(g): (g[3], g[4], c)})
                if better(d, (0.0, 0.0)):
                    g[1], improved = c, True
                    refresh(g)
                    sync(j)
                    break
            halves = _split(sorted(g[2], key=lambda i: -lens[i]), lens)
            c = g[1] // 2
            if c and all(sum(rt(lens[i], c) for i in h) <= m for h in halves):
                sums = [(j, sum(lens[i] for i in h), sum(lens[i] ** 2 for i in h), c)
                        for h in halves]
                if better(delta({id(g): (0, 0, g[1])}, *sums), (0.0, 0.0)):
                    g[1], g[2], g[3], g[4] = c, set(halves[0]), sums[0][1], sums[0][2]
                    refresh(g)
                    h = [j, c, set(halves[1]), sums[1][1], sums[1][2], 0.0, 0]
                    refresh(h)
                    add_group(h)
                    where.update({i: h for i in h[2]})
                    sync(j)
                    improved = True
        if not improved or (max_evals is not None and evals[0] >= max_evals):
            break
    out_plan = Packing()
    for j in range(nmb):
        gs = sorted(members(j), key=lambda g: (-g[1], min(g[2])))
        blocks, off = [], 0
        for g in gs:
            blocks.append(Group(sorted(g[2]), g[1], off))
            off += g[1]
        if blocks:
            out_plan.rounds.append(Round(fill_idle(blocks, pool)))
    return out_plan
