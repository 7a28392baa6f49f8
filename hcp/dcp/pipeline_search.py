"""Local search for small pipelined batches (`pp > 1`), each move timed by the 1F1B simulator.

With a pipeline the iteration time is not a sum over micro-batches: the first micro-batches fill
the pipeline and the last ones drain it, so a micro-batch at either end is worth running fast
even on a wide CP group that wastes rank-time (in the fill, the other ranks have nothing to
do), and the order of the micro-batches matters. The row packing (hcp/dcp/rows.py) and the
one-stage searches (hcp/dcp/local_search.py on `CostModel.one_stage` surrogates) price
rank-time and miss this on small batches, where the fill and drain are most of the step.

A plan is held as micro-batches in execution order, each a list of groups `[c, sequences]`
whose sizes sum to at most the pool (largest first they tile it with aligned blocks). Moves:
- resize a group to 2c (if the micro-batch has c idle ranks) or c / 2 (if the cap allows);
- move a sequence to another group with token room, to a new group of any feasible size in a
  micro-batch with enough idle ranks, or to a new micro-batch of its own at any position
  (an emptied micro-batch is dropped);
- swap two micro-batches in the order, or merge them into one (if their groups fit the pool);
- split a micro-batch: each of its groups becomes a micro-batch of its own at the CP size
  where it runs fastest, fastest first (the fill wants fast micro-batches, not dense ones).
Each move is timed exactly (`CostModel.fwd` per micro-batch and stage, then `simulate_1f1b`);
the first that shortens the iteration is taken, until none does or `max_evals` moves have
been timed (a deterministic budget). Seconds and tokens throughout.
"""
from __future__ import annotations

import numpy as np

from hcp.dcp.cost_model import CostModel
from hcp.dcp.lower_bound import cp_sizes
from hcp.dcp.packing import Packing, Round, rank_tokens_of, tile
from hcp.schedule.simulator import simulate_1f1b

EPS = 1e-12


def improve_pipeline(plan: Packing, lengths, cost: CostModel, pool: int, max_tokens_per_rank: int,
                     max_evals: int = 20_000) -> tuple[Packing, float]:
    """A local optimum of the moves above from `plan` (one micro-batch per group and round, in
    execution order) and its simulated time (s); never slower than `plan`."""
    lens = [int(x) for x in np.asarray(lengths)]
    m, k = max_tokens_per_rank, cost.bwd_factor
    o_f, o_b = cost.hw.micro_batch_overhead_fwd, cost.hw.micro_batch_overhead_bwd
    sizes = [int(c) for c in cp_sizes(pool)]
    mbs = [[[g.cp_size, list(g.seq_indices)] for g in r.groups if g.seq_indices]
           for r in plan.rounds]
    memo: dict[tuple, np.ndarray] = {}
    evals = 0

    def forward(mb) -> np.ndarray:  # [p] seconds: the micro-batch's slowest group per stage
        key = tuple(sorted((c, tuple(sorted(s))) for c, s in mb))
        if key not in memo:
            x = [np.array([lens[i] for i in s], dtype=np.float64) for _, s in mb]
            memo[key] = np.max([cost.fwd(v.sum(), (v * v).sum(), c) for v, (c, _) in
                                zip(x, mb)], axis=0)
        return memo[key]

    def timed(cand) -> float:
        nonlocal evals
        evals += 1
        f = np.stack([forward(mb) for mb in cand if mb], axis=1)
        return simulate_1f1b(f + o_f, k * f + o_b, record=False).iteration_time

    def fits(seqs, c) -> bool:
        return sum(rank_tokens_of(lens[i], c) for i in seqs) <= m

    def fastest(seqs) -> int:  # the CP size at which `seqs` alone run fastest (all stages)
        return min((c for c in sizes if fits(seqs, c)), key=lambda c: forward([[c, seqs]]).sum())

    def neighbours(cur):
        for j, mb in enumerate(cur):  # resize
            used = sum(c for c, _ in mb)
            for q, (c, s) in enumerate(mb):
                for c2 in (2 * c, c // 2):
                    if c2 and used - c + c2 <= pool and fits(s, c2):
                        new = list(cur)
                        new[j] = [[c2, s] if g is mb[q] else g for g in mb]
                        yield new
        for a in range(len(cur)):  # swap or merge two micro-batches
            for b in range(a + 1, len(cur)):
                new = list(cur)
                new[a], new[b] = new[b], new[a]
                yield new
                if sum(c for c, _ in cur[a] + cur[b]) <= pool:
                    yield cur[:a] + [cur[a] + cur[b]] + cur[a + 1:b] + cur[b + 1:]
        for j, mb in enumerate(cur):  # split: each group its own micro-batch, at its fastest c
            if len(mb) > 1:
                alone = sorted(([[fastest(s), s]] for _, s in mb), key=lambda x: forward(x).sum())
                yield cur[:j] + alone + cur[j + 1:]
        for j, mb in enumerate(cur):  # move one sequence
            for q, (c, s) in enumerate(mb):
                for i in s:
                    yield from _moves(cur, j, q, i, pool, sizes, fits)

    best = timed(mbs)
    improved = True
    while improved and evals < max_evals:
        improved = False
        for new in neighbours(mbs):
            new = [mb for mb in new if mb]
            t = timed(new)
            if t < best * (1 - EPS):
                mbs, best, improved = new, t, True
                break
            if evals >= max_evals:
                break
    out = Packing([Round(tile([(s, c) for c, s in mb], pool)) for mb in mbs])
    return out, best


def _moves(cur, j, q, i, pool, sizes, fits):
    """Plans with sequence i moved out of group q of
    micro-batch j: into another group, a new group, or a new micro-batch at any position."""
    def without():
        new = [[[c, list(s)] for c, s in mb] for mb in cur]
        new[j][q][1].remove(i)
        new[j] = [g for g in new[j] if g[1]]
        return new

    for j2, mb in enumerate(cur):
        for q2, (c, s) in enumerate(mb):
            if (j2, q2) != (j, q) and fits(s + [i], c):
                new = without()
                target = next(g for g in new[j2] if g[1] == s and g[0] == c)
                target[1].append(i)
                yield new
        for c in sizes:
            base = without()
            if sum(x for x, _ in base[j2]) + c <= pool and fits([i], c):
                base[j2].append([c, [i]])
                yield base
    for pos in range(len(cur) + 1):
        for c in sizes:
            if fits([i], c):
                new = without()
                new.insert(pos, [[c, [i]]])
                yield new
