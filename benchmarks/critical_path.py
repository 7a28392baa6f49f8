"""The critical path of a dynamic-CP step from per-rank micro-batch times, measured
(`critical_path`, benchmarks/dynamic_cp_train.py's measurement) or under the cost model
(`predicted_path`, its prediction): one rule for both, so they compare like with like; and the
cost model's error per micro-batch (`micro_batch_errors`) ranked by kind (`error_table`).
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


def group_time(g, lens, cost) -> float:
    """Seconds one rank of group `g` (a `hcp.dcp.rows` group: seq_indices, cp_size) spends on
    its micro-batch under the cost model: `(1 + k) f + o_f + o_b`, 0 when it holds no document."""
    x = np.asarray(lens, dtype=np.float64)[g.seq_indices]
    if not x.size:
        return 0.0
    o = cost.hw.micro_batch_overhead_fwd + cost.hw.micro_batch_overhead_bwd
    return (1.0 + cost.bwd_factor) * float(cost.fwd(x.sum(), (x * x).sum(), g.cp_size).sum()) + o


def predicted_path(plan, lens, cost) -> float:
    """Seconds: `critical_path` of `plan` (rows of one micro-batch per group, as the policy
    returns it) under the cost model: micro-batch j of a group lasts `group_time` on each of its
    ranks, and starts when they are all free. The trainer runs rows so (no synchronisation of
    the pool per row, `hcp.dcp.policy`), and the measurement counts them so; `simulate_plan`
    would wait for every row's slowest group."""
    world = max(g.rank_offset + g.cp_size for r in plan.rounds for g in r.groups)
    busy = [[0.0] * plan.num_rounds for _ in range(world)]
    groups = [[(1, r)] * plan.num_rounds for r in range(world)]  # a rank no group holds: idle
    for j, row in enumerate(plan.rounds):
        for g in row.groups:
            t = group_time(g, lens, cost)
            for r in range(g.rank_offset, g.rank_offset + g.cp_size):
                busy[r][j], groups[r][j] = t, (g.cp_size, g.rank_offset)
    return critical_path(busy, groups)


def micro_batch_errors(plan, lens, cost, busy_reps) -> list[dict]:
    """Per micro-batch of `plan` that holds documents: its CP size, documents, tokens, longest
    document, measured seconds (its slowest rank's `busy_reps[k][r][j]`, the median over reps k)
    and `group_time`'s prediction, for ranking the cost model's errors by micro-batch kind."""
    out = []
    for j, row in enumerate(plan.rounds):
        for g in row.groups:
            if not len(g.seq_indices):
                continue
            ranks = range(g.rank_offset, g.rank_offset + g.cp_size)
            meas = float(np.median([max(rep[r][j] for r in ranks) for rep in busy_reps]))
            x = np.asarray(lens)[g.seq_indices]
            out.append({"cp": int(g.cp_size), "docs": int(x.size), "tokens": int(x.sum()),
                        "longest": int(x.max()), "measured_s": meas,
                        "predicted_s": group_time(g, lens, cost)})
    return out


def error_table(runs, methods) -> list[str]:
    """The cost model's errors inside the trainer's step, by micro-batch kind (method, CP size,
    one document or several), then by the micro-batch's longest document (tokens, up to a power
    of two), each largest mean |error| first: lines to print. Error = predicted / measured - 1 of
    a micro-batch's slowest rank (`micro_batch_errors`): `runs[i][method]` of each of `methods`
    holds its records under "micro_batch_errors"."""
    kinds: dict = {}
    longest: dict = {}
    for r in runs:
        for m in methods:
            for mb in r[m]["micro_batch_errors"]:
                err = mb["predicted_s"] / mb["measured_s"] - 1.0
                kinds.setdefault((m, mb["cp"], "1 doc" if mb["docs"] == 1 else "packed"), []).append(err)
                longest.setdefault(1 << (int(mb["longest"]) - 1).bit_length(), []).append(err)

    def stats(e):
        return f"{len(e):>6} {100 * np.mean(e):+8.1f}% {100 * np.mean(np.abs(e)):9.1f}%"

    def worst(d):
        return sorted(d.items(), key=lambda kv: -np.mean(np.abs(kv[1])))

    head = f"{'count':>6} {'mean err':>9} {'mean |err|':>10}"
    return (["cost model inside the step, by micro-batch kind (error = predicted / measured - 1):",
             f"{'method':>8} {'cp':>3} {'kind':>6} {head}"]
            + [f"{m:>8} {c:>3} {kind:>6} {stats(e)}" for (m, c, kind), e in worst(kinds)]
            + ["... and by its longest document:", f"{'tokens <=':>19} {head}"]
            + [f"{n:>19} {stats(e)}" for n, e in worst(longest)])
