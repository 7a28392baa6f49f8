"""A tighter lower bound for pipelines (p > 1): the minimum over micro-batch counts M of a 1F1B
linear program. Seconds throughout.

hcp/dcp/lower_bound.py charges the pipeline fill and drain only for the smallest micro-batch
conceivable, so its bound ignores that 1F1B couples the stages: stage s may start the forward
of micro-batch j only after its backward of j - (p - s) (the warm-up depth), which waits on
the later stages. Light micro-batches at both ends shorten the fill and drain, but every extra
micro-batch pays the fixed overheads on every stage, and light rows at the end must still wait
for the backward of heavier ones before them. This bound prices that trade-off exactly for a
relaxation of the plans.

Setting as in lower_bound.py: N = `pool` ranks per stage, p stages, cap m, `f_s(g)` the
forward seconds of group g on stage s (CostModel.fwd), k = 2 + recompute, overheads o_f, o_b.
Under PP a plan's micro-batch j (a round) runs on stage s for `F_sj = o_f + x_sj` forward and
`B_sj = o_b + k x_sj` backward, `x_sj = max_g f_s(g)` over its groups; micro-batches run in
the plan's order (hcp/schedule/simulator.py).

Claim: for every valid plan with M micro-batches, simulated time T >= LP(M), where LP(M)
minimises the 1F1B makespan over start times AND durations x_sj >= 0 subject to
  (a) work: `sum_j x_sj >= Phi_s = (1 / N) sum_i min_{c feasible} c * phi_s(L_i, c)`;
  (b) stage ratios: `lo_s x_0j <= x_sj <= hi_s x_0j`;
  (c) a micro-batch holds a sequence: `x_sj >= min_i min_c phi_s(L_i, c)`;
  (d) precedence: each stage runs its 1F1B order one op at a time (`stage_order`), F(s, j)
      after F(s - 1, j) ends, B(s, j) after B(s + 1, j) ends (on the last stage after its
      F(p - 1, j)), all from time 0, and T after the end of B(0, M - 1).
Proof. Take the plan's own x_sj and the simulator's start times. The simulator starts every op
as soon as its stage is free and its predecessor has ended, so its times satisfy (d) and its
T is the end of the last op, B(0, M - 1) (every op of the last micro-batch precedes it). (a):
the groups of micro-batch j tile the N ranks, so `N x_sj >= sum_g c_g f_s(g) >=
sum_{i in j} c_i phi_s(L_i, c_i)` (lower_bound.py step 1); sum over j. (c): f_s(g) >=
phi_s(L_i, c_g) for any member i (both parts of fwd_floor grow with the group's tokens and
squared tokens). (b): in CostModel, stage s's matmul coefficient is `mm_s`, its attention and
K/V coefficients are `n_s` times per-layer constants (n_s layers), so every group's forward
is `f_s(g) = mm_s X(g) + n_s Y(g)` with X, Y >= 0 independent of s (X = tokens / c, Y the
attention plus the exposed communication per layer; `max((1 - ov) C, C - A)` scales with n_s
when C and A both do). Hence `f_s(g) / f_0(g)` lies between `min(mm_s / mm_0, n_s / n_0)` =
lo_s and the max = hi_s, and so does the ratio of the maxima over groups. So the plan is a
feasible point and T >= LP(M). Every plan has some M >= M_min = ceil(sum L / (N m)), so
T >= min_{M >= M_min} LP(M). The minimum is taken over finitely many M: lower_bound.py's
staged bound with M in place of M_min, S(M), is a valid bound for plans of M micro-batches
that grows with M (each micro-batch adds its overheads to every stage), so once S(M) reaches
the least LP(M') found so far, no larger M can go below it; the search stops there (or
after `max_micro_batches`, returning min(least LP, S(next M)): still a bound).

Relaxation used by default: keep the op order (d) of the first and the last stage only, and
for the stages in between keep only what their ops add to the chains that cross them:
`F(0, j)` ends + `sum_{0<s<p-1} F_sj` <= `F(p - 1, j)` starts, `B(p - 1, j)` ends +
`sum_{0<s<p-1} B_sj` <= `B(0, j)` starts. Both follow from (d) (each skipped stage runs
F(s, j) after F(s - 1, j) and before F(s + 1, j) starts, and B likewise), so every point of
LP(M) gives one of the relaxation with the same T: it is a lower bound on LP(M), and the proof
above carries over. It keeps the loop that makes 1F1B pay: the first stage runs F(0, j) only
after its backward of j - p, which waits for the last stage.

Cost: one HiGHS LP (scipy.optimize.linprog) per M, ~4M start times (all stages: ~2pM) and
~6M rows (stages with equal coefficients share their x), about 100 LPs for a seed-sized batch:
for benchmarks (`benchmarks/dynamic_cp.py --lp-bound`), not for the solver.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sparse
from scipy.optimize import linprog

from hcp.dcp.cost_model import CostModel
from hcp.dcp.lower_bound import cp_sizes, lower_bound
from hcp.dcp.packing import check_pool, prepare_lengths, rank_tokens
from hcp.schedule.simulator import stage_order


@dataclass
class PipelineBound:
    """`bound` (s): max of lower_bound.py's and min over M of LP(M); `best_m` the M where
    LP(M) is least (None when the simple bound is larger); `lps` solved; `seconds` spent."""

    bound: float
    simple: float
    best_m: int | None
    lps: int
    seconds: float


def stage_floors(lens: np.ndarray, cost: CostModel, pool: int, m: int):
    """phi `[p, K, n]` (inf where infeasible), Phi `[p]` and the smallest phi `[p]`."""
    cs = cp_sizes(pool).astype(np.float64)[:, None]
    x = lens.astype(np.float64)[None, :]
    phi = cost.fwd_floor(x, x ** 2, cs)
    phi = np.where((rank_tokens(lens[None, :], cs.astype(np.int64)) <= m)[None], phi, np.inf)
    work = (cs[None] * phi).min(axis=1).sum(axis=1) / pool
    return work, phi.min(axis=(1, 2))


def staged_bound(cost: CostModel, work, smallest, M: int) -> float:
    """lower_bound.py's staged bound with `M` micro-batches (work per stage `Phi_s`)."""
    k, o = cost.bwd_factor, cost.hw.micro_batch_overhead_fwd + cost.hw.micro_batch_overhead_bwd
    w = (1 + k) * work + M * o
    ends = np.concatenate([[0.0], np.cumsum((1 + k) * smallest + o)[:-1]])
    return float((ends + w).max())


def stage_classes(cost: CostModel) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(class of each stage `[p]`, lo `[C]`, hi `[C]`): stages with equal coefficients share a
    class; lo/hi bound a class's forward over class 0's (stage 0's), proof (b)."""
    keys = [(float(a), float(b), float(c)) for a, b, c in
            zip(cost.mm_coef, cost.attn_coef, cost.comm_coef)]
    uniq = list(dict.fromkeys(keys))
    cls = np.array([uniq.index(key) for key in keys])
    mm = np.array([u[0] for u in uniq]) / uniq[0][0]
    n = np.array([u[1] for u in uniq]) / uniq[0][1]
    n_comm = np.array([u[2] for u in uniq]) / uniq[0][2]
    if not np.allclose(n, n_comm, rtol=1e-9):
        raise ValueError("attention and K/V coefficients must scale together across stages")
    return cls, np.minimum(mm, n), np.maximum(mm, n)


def lp_model(M: int, cost: CostModel, work: np.ndarray, smallest: np.ndarray, stages=None,
             free: int = 0):
    """The LP of `lp_makespan` as `(A [rows, n] csr, b [rows], lower [n], cls [p])`: minimise the
    last variable (T) s.t. `A v <= b`, `v >= lower`. Variables: x[c, j] at `c * M + j` (C
    stage classes), then the start times, then T. The first `free` rows are "maybe void":
    no overheads and `x >= 0` (hcp/dcp/pinned_bound.py; first and last stage kept only)."""
    p, k = cost.pp, cost.bwd_factor
    kept = list(range(p)) if stages is None else sorted(set(stages))
    if kept[0] != 0 or kept[-1] != p - 1:
        raise ValueError(f"stages {stages} must include 0 and {p - 1}")
    if free and len(kept) > 2:
        raise ValueError(f"free={free} rows need the first and last stage's order only "
                         f"(stages [0, {p - 1}]), not {kept}: pinned_bound's proof")
    o_f, o_b = cost.hw.micro_batch_overhead_fwd, cost.hw.micro_batch_overhead_bwd
    of_j = np.where(np.arange(M) < free, 0.0, o_f)  # overheads per row [M]
    ob_j = np.where(np.arange(M) < free, 0.0, o_b)
    cls, lo, hi = stage_classes(cost)
    C = lo.size
    nx = C * M  # x[c, j] at c * M + j; then start of F(s, j), of B(s, j); then T
    q = len(kept)
    pos = {s: i for i, s in enumerate(kept)}  # start times of kept stages only
    f0, b0, tv = nx, nx + q * M, nx + 2 * q * M
    rows, cols, vals, rhs = [], [], [], []

    def chain(a_start, d_var, d_coef, d_const, b_start):
        """start(a) + d_coef * x[d_var] + d_const <= start(b), vectorised."""
        n = len(a_start)
        r = len(rhs) + np.arange(n)
        rows.extend([r, r, r])
        cols.extend([a_start, d_var, b_start])
        vals.extend([np.ones(n), d_coef, -np.ones(n)])
        rhs.extend((-np.asarray(d_const, dtype=np.float64)).tolist())

    for s in kept:
        order = stage_order(s, p, M)
        kind = np.array([o[0] == "F" for o in order])
        j = np.array([o[1] for o in order])
        start = np.where(kind, f0, b0) + pos[s] * M + j
        dvar = cls[s] * M + j
        coef = np.where(kind, 1.0, k)
        const = np.where(kind, of_j[j], ob_j[j])
        chain(start[:-1], dvar[:-1], coef[:-1], const[:-1], start[1:])
    j = np.arange(M)
    for a, b in zip(kept[:-1], kept[1:]):  # F(a, j) -> F(b, j); B(b, j) -> B(a, j)
        for src, dst, stages_between, coef, const in (
                (f0 + pos[a] * M + j, f0 + pos[b] * M + j, range(a, b), 1.0, of_j),
                (b0 + pos[b] * M + j, b0 + pos[a] * M + j, range(a + 1, b + 1), k, ob_j)):
            n = len(stages_between)  # the durations of these stages (sums over classes)
            r = len(rhs) + np.arange(M)
            rows.extend([r, r] + [r] * n)
            cols.extend([src, dst] + [cls[s] * M + j for s in stages_between])
            vals.extend([np.ones(M), -np.ones(M)] + [np.full(M, coef)] * n)
            rhs.extend((-n * const).tolist())
    chain(np.array([b0 + M - 1]), np.array([cls[0] * M + M - 1]), np.array([k]),
          np.array([ob_j[M - 1]]), np.array([tv]))
    for c in range(C):  # work: -sum_j x[c, j] <= -Phi (the largest Phi of the class)
        r = len(rhs)
        rows.append(np.full(M, r))
        cols.append(c * M + j)
        vals.append(-np.ones(M))
        rhs.append(-float(work[cls == c].max()))
        if c:  # lo x[0, j] <= x[c, j] <= hi x[0, j]
            for sign, ratio in ((1.0, hi[c]), (-1.0, lo[c])):
                r = len(rhs) + np.arange(M)
                rows.extend([r, r])
                cols.extend([c * M + j, j])
                vals.extend([np.full(M, sign), np.full(M, -sign * ratio)])
                rhs.extend([0.0] * M)
    A = sparse.csr_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
                          shape=(len(rhs), tv + 1))
    lower = np.zeros(tv + 1)
    for c in range(C):
        lower[c * M + free:(c + 1) * M] = float(smallest[cls == c].max())
    return A, np.asarray(rhs), lower, cls


def lp_makespan(M: int, cost: CostModel, work: np.ndarray, smallest: np.ndarray,
                stages=None, sizes: bool = False, pin: tuple[int, np.ndarray] | None = None,
                model: tuple | None = None):
    """LP(M) of the module docstring (seconds); `work`, `smallest`: Phi_s and the least phi_s
    per stage `[p]`. `stages` (sorted, with 0 and p - 1; default all) keeps the op order of
    those stages only; between kept stages a < b the skipped ones contribute their durations:
    F(a, j) ends + sum_{a<s<b} F_sj <= F(b, j) starts, and likewise for B from b to a (implied
    by (d), so this is a relaxation: a lower bound on LP(M)). With `sizes`, returns
    `(LP(M), x)`, x `[p, M]` the optimal forward seconds of each stage and micro-batch. With
    `pin = (j, floor [p])`, row j's x is at least `floor` (hcp/dcp/pinned_bound.py, Claim 1).
    `model`: `lp_model(M, cost, work, smallest, stages)` built once for several pins (unchanged)."""
    A, rhs, lower, cls = model if model is not None else lp_model(M, cost, work, smallest, stages)
    if pin is not None:
        lower = lower.copy()
        for c in range(int(cls.max()) + 1):
            lower[c * M + pin[0]] = max(lower[c * M + pin[0]], float(pin[1][cls == c].max()))
    n = lower.size
    objective = np.zeros(n)
    objective[-1] = 1.0
    res = linprog(objective, A_ub=A, b_ub=rhs, method="highs",
                  bounds=np.stack([lower, np.full(n, np.inf)], axis=1))
    if res.status != 0:
        raise RuntimeError(f"pipeline LP at M={M} failed: {res.message}")
    if sizes:
        C = int(cls.max()) + 1
        return float(res.fun), res.x[:C * M].reshape(C, M)[cls]
    return float(res.fun)


def pipeline_bound(lengths, cost: CostModel, pool: int, max_tokens_per_rank: int,
                   max_micro_batches: int | None = None, full: bool = False) -> PipelineBound:
    """The bound of the module docstring for lengths (tokens) that pass `prepare_lengths`; at
    pp = 1 it is lower_bound.py's (no pipeline to fill). By default each LP keeps the op order
    of the first and the last stage only (`lp_makespan(stages=[0, p - 1])`, a relaxation
    that is much faster and loosens the bound a little); `full=True` keeps every stage's."""
    start = time.perf_counter()
    pool, m = check_pool(pool, max_tokens_per_rank)
    lens = prepare_lengths(lengths, pool, m)[0]
    simple = lower_bound(lens, cost, pool, m)
    if cost.pp == 1:
        return PipelineBound(simple, simple, None, 0, time.perf_counter() - start)
    work, smallest = stage_floors(lens, cost, pool, m)
    stages = None if full else [0, cost.pp - 1]
    M = int(np.ceil(lens.sum() / (pool * m)))
    best, best_m, lps = np.inf, None, 0
    while staged_bound(cost, work, smallest, M) < best:
        if max_micro_batches is not None and M > max_micro_batches:
            best, best_m = staged_bound(cost, work, smallest, M), None  # < best: loop condition
            break
        t = lp_makespan(M, cost, work, smallest, stages)
        lps += 1
        if t < best:
            best, best_m = t, M
        M += 1
    bound = max(simple, best)
    return PipelineBound(bound, simple, best_m if best > simple else None, lps,
                         time.perf_counter() - start)
