"""The critical path of a dynamic-CP step from per-rank micro-batch times, measured
(`critical_path`, benchmarks/dynamic_cp_train.py's measurement) or under the cost model
(`predicted_path`, its prediction): one rule for both, so they compare like with like.
Seconds throughout."""
from __future__ import annotations

import numpy as np


def critical_path(busy, groups) -> float:
    """Seconds: micro-batch j of a group starts when all its ranks are free and lasts as long
    as its slowest rank (busy[r][j]); the end of the last rank. `groups[r][j]` = (c, block)."""
    world = len(busy)
    free = np.zeros(world)
    for j in range(len(busy[0])):
        seen = set()
        for r in range(world):
            c, block = groups[r][j]
            if (c, block) in seen:
                continue
            seen.add((c, block))
            members = [q for q in range(world) if tuple(groups[q][j]) == (c, block)]
            start = free[members].max()
            free[members] = start + max(busy[q][j] for q in members)
    return float(free.max())


def predicted_path(plan, lens, cost) -> float:
    """Seconds: `critical_path` of `plan` (rows of one micro-batch per group, as the policy
    returns it) under the cost model: micro-batch j of a group lasts `(1 + k) f + o_f + o_b` on
    each of its ranks (0 when empty), and starts when they are all free. The trainer runs rows
    so (no synchronisation of the pool per row, `hcp.dcp.policy`), and the measurement counts
    them so; `simulate_plan` would wait for every row's slowest group."""
    k1 = 1.0 + cost.bwd_factor
    o = cost.hw.micro_batch_overhead_fwd + cost.hw.micro_batch_overhead_bwd
    world = max(g.rank_offset + g.cp_size for r in plan.rounds for g in r.groups)
    busy = [[0.0] * plan.num_rounds for _ in range(world)]
    groups = [[(1, r)] * plan.num_rounds for r in range(world)]  # a rank no group holds: idle
    for j, row in enumerate(plan.rounds):
        for g in row.groups:
            x = np.asarray(lens, dtype=np.float64)[g.seq_indices]
            t = k1 * float(cost.fwd(x.sum(), (x * x).sum(), g.cp_size).sum()) + o if x.size else 0.0
            for r in range(g.rank_offset, g.rank_offset + g.cp_size):
                busy[r][j], groups[r][j] = t, (g.cp_size, g.rank_offset)
    return critical_path(busy, groups)
