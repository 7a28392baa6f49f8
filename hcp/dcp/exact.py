"""Exact dynamic-CP plans for small instances: a mixed-integer program solved by scipy's HiGHS.

Only for one pipeline stage (`pp = 1`), where the simulated time is order-free:
`T = sum_j (F_j + B_j) = sum_j ((1 + k) H_j + o_f + o_b)`, `H_j` the slowest group's forward.
Variables (J micro-batches, B aligned power-of-two blocks of the pool, n sequences):
    x[i, j, b] in {0, 1}  sequence i runs in block b of micro-batch j (only if L_i <= c_b m)
    y[j, b]    in {0, 1}  block b is a group of micro-batch j
    u[j]       in {0, 1}  micro-batch j is used;   H[j] >= 0 seconds
Constraints: each sequence placed once; x <= y; per micro-batch and rank, the blocks holding the
rank sum to <= u[j] (disjoint blocks; uncovered ranks idle); tokens of a block <= c_b m; and
`H[j] >= compute + (1 - overlap) comm` and `H[j] >= compute + comm - attention` summed over the
block's sequences (the two linear pieces of the cost model's exposed communication, so `H[j]`
is exactly the slowest group); an area cut `pool * H[j] >= sum_b c_b * (block b's piece 1)`
tightens the relaxation. Symmetry: `u` and `H` non-increasing in j.
Minimize `(1 + k) sum H + (o_f + o_b) sum u`. J is an upper bound on micro-batches given by
the caller (the optimum is over plans with at most J micro-batches).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from hcp.dcp.cost_model import CostModel
from hcp.dcp.plan import Group, MicroBatch, Plan, fill_idle


@dataclass
class ExactResult:
    """The best plan found (None if HiGHS found none better than `upper_bound`), its objective
    and HiGHS's proven lower bound on the optimum (seconds), and whether the relative gap
    between them is within the tolerance (the plan is then called optimal)."""

    plan: Plan | None
    time: float
    dual_bound: float
    optimal: bool


def _blocks(pool: int) -> list[tuple[int, int]]:
    return [(o, c) for c in (1 << np.arange(int(pool).bit_length())).tolist()
            for o in range(0, pool, c)]


def solve_exact(lengths, cost: CostModel, pool: int, max_tokens_per_rank: int, max_micro_batches: int,
                time_limit: float = 20.0, gap: float = 0.01,
                upper_bound: float | None = None) -> ExactResult:
    """Optimal plan within `gap` (relative) if HiGHS proves it inside `time_limit` seconds.
    `upper_bound` (seconds, e.g. a heuristic plan's time) prunes the search: plans slower than
    it are cut off (the optimum is never slower than a known plan)."""
    if cost.pp != 1:
        raise ValueError(f"exact plans need pp=1 (got {cost.pp}): with a pipeline the order of "
                         "micro-batches matters and the program would not be linear")
    lens = np.asarray(lengths, dtype=np.float64)
    n, J, m = lens.size, int(max_micro_batches), max_tokens_per_rank
    blocks = _blocks(pool)
    cs = np.array([c for _, c in blocks], dtype=np.float64)
    compute, attn, comm = cost._parts(lens[:, None], lens[:, None] ** 2, cs[None, :])  # [1, n, B]
    piece1 = (compute + (1 - cost.hw.comm_overlap) * comm)[0]
    piece2 = (compute + comm - attn)[0]
    ok = lens[:, None] <= cs[None, :] * m
    xs = [(i, j, b) for j in range(J) for i, b in zip(*np.nonzero(ok))]
    nx, nb = len(xs), len(blocks)
    y0, u0, h0 = nx, nx + J * nb, nx + J * nb + J
    nvar = h0 + J
    rows, cols, vals, lo, hi = [], [], [], [], []

    def add(entries, lower, upper):
        r = len(lo)
        for col, val in entries:
            rows.append(r)
            cols.append(col)
            vals.append(val)
        lo.append(lower)
        hi.append(upper)

    by_seq = [[] for _ in range(n)]
    by_jb: dict[tuple[int, int], list[int]] = {}
    for col, (i, j, b) in enumerate(xs):
        by_seq[i].append(col)
        by_jb.setdefault((j, b), []).append(col)
        add([(col, 1.0), (y0 + j * nb + b, -1.0)], -np.inf, 0.0)
    for i in range(n):
        add([(col, 1.0) for col in by_seq[i]], 1.0, 1.0)
    for j in range(J):
        for r in range(pool):
            add([(y0 + j * nb + b, 1.0) for b, (o, c) in enumerate(blocks) if o <= r < o + c]
                + [(u0 + j, -1.0)], -np.inf, 0.0)
        for b in range(nb):
            members = by_jb.get((j, b), [])
            add([(col, lens[xs[col][0]]) for col in members], -np.inf, cs[b] * m)
            for piece in (piece1, piece2):
                add([(col, piece[xs[col][0], b]) for col in members] + [(h0 + j, -1.0)], -np.inf, 0.0)
        # Area cut (valid, tightens the relaxation): the blocks are disjoint, so
        # pool * H[j] >= sum over blocks of c_b * (their slowest piece) >= sum c_b * piece1.
        add([(col, cs[xs[col][2]] * piece1[xs[col][0], xs[col][2]])
             for b in range(nb) for col in by_jb.get((j, b), [])] + [(h0 + j, -float(pool))],
            -np.inf, 0.0)
        if j + 1 < J:
            add([(u0 + j, 1.0), (u0 + j + 1, -1.0)], 0.0, np.inf)
            add([(h0 + j, 1.0), (h0 + j + 1, -1.0)], 0.0, np.inf)
    a = coo_matrix((vals, (rows, cols)), shape=(len(lo), nvar)).tocsr()
    obj = np.zeros(nvar)
    obj[h0:] = 1.0 + cost.bwd_factor
    obj[u0:u0 + J] = cost.hw.micro_batch_overhead_fwd + cost.hw.micro_batch_overhead_bwd
    integrality = np.r_[np.ones(h0), np.zeros(J)]
    upper = np.r_[np.ones(h0), np.full(J, np.inf)]
    constraints = [LinearConstraint(a, lo, hi)]
    if upper_bound is not None:
        constraints.append(LinearConstraint(obj[None, :], -np.inf, upper_bound * (1 + 1e-9)))
    res = milp(obj, constraints=constraints, integrality=integrality,
               bounds=Bounds(np.zeros(nvar), upper),
               options={"time_limit": time_limit, "mip_rel_gap": gap, "disp": False})
    dual = float(getattr(res, "mip_dual_bound", 0.0) or 0.0)
    if res.x is None:
        if res.status == 2 and upper_bound is not None:  # infeasible: nothing beats the bound
            return ExactResult(None, upper_bound, upper_bound, True)
        return ExactResult(None, np.inf, dual, False)
    x = res.x
    plan = Plan()
    for j in range(J):
        groups = []
        for b, (o, c) in enumerate(blocks):
            seqs = [xs[col][0] for col in by_jb.get((j, b), []) if x[col] > 0.5]
            if seqs:
                groups.append(Group(sorted(seqs), c, o))
        if groups:
            plan.micro_batches.append(MicroBatch(fill_idle(groups, pool)))
    rel_gap = (res.fun - dual) / max(res.fun, 1e-30)
    return ExactResult(plan, float(res.fun), dual, rel_gap <= gap + 1e-9)
