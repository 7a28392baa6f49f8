"""The pipeline bound with the longest sequence pinned: a tighter valid bound for batches with
one very long sequence. Seconds throughout.

hcp/dcp/pipeline_bound.py lets every micro-batch shrink to the smallest sequence's time, so a
batch whose longest sequence alone outweighs the level (the average micro-batch) gets a bound
that ignores the stall that micro-batch causes in 1F1B. Here the micro-batch holding the
longest sequence L* is pinned to at least that sequence's own time.

Setting and notation as in pipeline_bound.py; R(M) is its relaxed LP (the op order of the first
and the last stage kept, `lp_model(stages=[0, p - 1])`), and
`fl_s = min_{c feasible} fwd_s(L*, L*^2, c)` (CostModel.fwd, exposed communication included).

Claim 1 (pin). A plan with M micro-batches that holds L* in micro-batch j* has simulated time
T >= R(M) with the extra constraint `x_{s j*} >= fl_s`. Proof: pipeline_bound.py's proof puts
the plan's own x and start times into R(M); x_{s j*} = max_g f_s(g) >= f_s(g*) for the group
g* that holds L*, and `fwd = mm t / c + max(attn s / c + (1 - ov) comm(t), comm(t))` does not
decrease with a group's tokens t nor its squared tokens s, so f_s(g*) >= fwd_s(L*, L*^2, c_g*)
>= fl_s.

Claim 2 (an interval of M in one LP). For M_a <= M <= M_b let R_[M_a, M_b](P) be R(M_b) whose
first F = M_b - M_a rows are free (no overheads, x >= 0) and whose row P is pinned. A plan as in
Claim 1 has T >= R_[M_a, M_b](V + j*) with V = M_b - M <= F. Proof: put V void rows (duration
0) before the plan's rows, real row r becoming V + r. (i) The real ops keep their order on
every stage: 1F1B with M_b rows runs on stage s F(0 .. w - 1), then B(t), F(t + w) for t = 0,
1, ..., then the remaining B's (w = p - s); without the void rows' ops this reads
F(V .. V + w - 1), then B(V + t), F(V + t + w), ...: the 1F1B order of M rows. So the plan's
start times meet every constraint between real ops. (ii) The void ops get times that meet
theirs: on the last stage (order F(0) B(0) F(1) B(1) ...) and for the void F's of the first
stage, time 0 (they precede every real op there); a void B(0, v) of the first stage lies
between F(0, p - 1 + v) and F(0, p + v), two consecutive warm-up forwards (real or void):
give it the end time of the op before it. Zero durations make every chain of a void row hold
(its ops on the last stage are at 0), and an op of zero duration placed at its predecessor's
end precedes its successor. (iii) Real rows among the first F keep durations >= the relaxed
ones (x >= smallest >= 0, overheads >= 0), void rows have x = 0, the work sums are unchanged,
and the last row M_b - 1 is real (T is the end of its B on the first stage). So the extended
schedule is a feasible point of R_[M_a, M_b](V + j*) with the same T. (With a middle stage's
order kept the embedding can fail: a void B on stage s must follow the void B on stage s + 1,
which may lie after the next real op of stage s; `lp_model` refuses that combination.)

Claim 3 (cover). Every plan has M >= M_min = ceil(sum L / (N m)), the staged bound S(M)
(`staged_bound`, lower_bound.py step 1-2 with M micro-batches) is valid for plans of M
micro-batches and grows with M. So for intervals I covering [M_min, M_top],
    T >= min( min_I min_P R_I(P), S(M_top + 1) ),
P ranging over every row of I's LP (V + j* can be any). The search halves the interval with
the least value until that one is a single M, adding an interval above (GROWTH times as
wide, up to where S reaches the least value) while S(M_top + 1) is the least term, until
`max_lps` LPs are spent; each intermediate minimum is already a valid bound. The result is the
larger of it and pipeline_bound.py's bound. It skips the search when pinning costs R(M) at
pipeline_bound.py's best M (next to) nothing: min over the cover <= that R, so pinning cannot
raise the bound (by more than NO_GAIN).

Cost: the positions of one interval are solved one after another by HiGHS's dual simplex from
the previous basis (highspy): thousands of LPs per batch (its time and gain over
pipeline_bound.py's bound: `benchmarks/dynamic_cp.py --lp-bound`), so it is for benchmarks, not
for the solver.
"""
from __future__ import annotations

import heapq
import time
from dataclasses import dataclass

import numpy as np

from hcp.dcp.cost_model import CostModel
from hcp.dcp.lower_bound import cp_sizes
from hcp.dcp.pipeline_bound import (PipelineBound, lp_makespan, lp_model, pipeline_bound,
                                    stage_floors, staged_bound)
from hcp.dcp.packing import check_pool, prepare_lengths, rank_tokens

GROWTH = 1.5  # the intervals of M added above grow by this factor (Claim 3)
# No search when the pin raises R(M) at the unpinned LP's best M by at most this fraction:
# the pinned minimum is at most that value, so the bound could gain no more.
NO_GAIN = 1e-4


@dataclass
class PinnedBound:
    """`bound` (s): max of pipeline_bound.py's (`unpinned`) and the pinned cover's minimum;
    `best_range` (M_a, M_b) the interval of M whose LP is least (None when the tail S(M_top +
    1) or the unpinned bound decides); `lps` solved, `intervals` evaluated, `seconds` spent."""

    bound: float
    unpinned: PipelineBound
    best_range: tuple[int, int] | None
    lps: int
    intervals: int
    seconds: float


def pin_floor(lens: np.ndarray, cost: CostModel, pool: int, m: int) -> np.ndarray:
    """fl `[p]`: the least forward seconds per stage of the longest sequence over the CP sizes
    that hold it under the cap (padding counted)."""
    longest = int(lens.max())
    cs = cp_sizes(pool)
    fwd = cost.fwd(float(longest), float(longest) ** 2, cs.astype(np.float64))  # [p, K]
    return np.where((rank_tokens(longest, cs) <= m)[None], fwd, np.inf).min(axis=1)


def _highs(A, rhs, lower):
    """A HiGHS instance holding `min T s.t. A v <= rhs, v >= lower` (T the last variable)."""
    import highspy  # optional: the `bench` and `test` extras

    n = lower.size
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = n, A.shape[0]
    cost = np.zeros(n)
    cost[-1] = 1.0
    lp.col_cost_, lp.col_lower_, lp.col_upper_ = cost, lower, np.full(n, highspy.kHighsInf)
    lp.row_lower_, lp.row_upper_ = np.full(A.shape[0], -highspy.kHighsInf), rhs
    csc = A.tocsc()
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = (csc.indptr, csc.indices,
                                                                     csc.data)
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("presolve", "off")  # re-solves start from the last basis
    h.passModel(lp)
    return h, highspy


def interval_lp(m_a: int, m_b: int, cost: CostModel, work: np.ndarray, smallest: np.ndarray,
                floor: np.ndarray) -> tuple[float, int]:
    """(min over pin rows P of R_[m_a, m_b](P) in seconds, LPs solved): Claim 2."""
    A, rhs, lower, cls = lp_model(m_b, cost, work, smallest, [0, cost.pp - 1], free=m_b - m_a)
    h, highspy = _highs(A, rhs, lower)
    C = int(cls.max()) + 1
    pin = np.array([floor[cls == c].max() for c in range(C)])
    inf = np.full(C, highspy.kHighsInf)
    best = np.inf
    for P in range(m_b):
        idx = (np.arange(C) * m_b + P).astype(np.int32)
        h.changeColsBounds(C, idx, np.maximum(lower[idx], pin), inf)
        h.run()
        if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
            raise RuntimeError(f"pinned LP [{m_a}, {m_b}] row {P}: "
                               f"{h.modelStatusToString(h.getModelStatus())}")
        best = min(best, h.getInfo().objective_function_value)
        h.changeColsBounds(C, idx, lower[idx], inf)
    return float(best), m_b


def pinned_bound(lengths, cost: CostModel, pool: int, max_tokens_per_rank: int,
                 max_lps: int = 20_000) -> PinnedBound:
    """The bound of the module docstring for lengths (tokens) that pass `prepare_lengths`; at
    pp = 1 pipeline_bound.py's (lower_bound.py's). `max_lps` caps the refinement (the bound
    stays valid, only less tight). Needs `highspy` (`pip install -e .[bench]`)."""
    start = time.perf_counter()
    pool, m = check_pool(pool, max_tokens_per_rank)
    lens = prepare_lengths(lengths, pool, m)[0]
    base = pipeline_bound(lens, cost, pool, m)
    if cost.pp == 1:
        return PinnedBound(base.bound, base, None, 0, 0, time.perf_counter() - start)
    work, smallest = stage_floors(lens, cost, pool, m)
    floor = pin_floor(lens, cost, pool, m)
    lps = intervals = 0
    if base.best_m is not None:  # the pin costs R(best M) (next to) nothing: no gain to seek
        x = lp_makespan(base.best_m, cost, work, smallest, [0, cost.pp - 1], sizes=True)[1]
        gain = not (x >= floor[:, None] * (1 - 1e-9)).all(axis=0).any()
        if gain:
            value, lps = interval_lp(base.best_m, base.best_m, cost, work, smallest, floor)
            gain, intervals = value > base.bound * (1 + NO_GAIN), 1
        if not gain:
            return PinnedBound(base.bound, base, None, lps, intervals,
                               time.perf_counter() - start)
    top = int(np.ceil(lens.sum() / (pool * m))) - 1  # intervals cover [M_min, top]
    leaves: list[tuple[float, int, int]] = []  # heap of (value, M_a, M_b)

    def add(a: int, b: int) -> None:
        nonlocal lps, intervals
        value, n = interval_lp(a, b, cost, work, smallest, floor)
        lps, intervals = lps + n, intervals + 1
        heapq.heappush(leaves, (value, a, b))

    # split the least interval down to one M (cheap, low M) before covering more M above;
    # cover only up to where S(M_top + 1) reaches the least value found
    while lps < max_lps:
        tail = staged_bound(cost, work, smallest, top + 1)
        if leaves and leaves[0][1] < leaves[0][2]:
            _, a, b = heapq.heappop(leaves)
            add(a, (a + b) // 2)
            add((a + b) // 2 + 1, b)
        elif not leaves or tail < leaves[0][0]:
            a = top + 1
            top = max(a, int(GROWTH * a) - 1)
            while leaves and top > a and staged_bound(cost, work, smallest, top) >= leaves[0][0]:
                top -= 1  # S(top + 1) already reaches the least value
            add(a, top)
        else:
            break
    tail = staged_bound(cost, work, smallest, top + 1)
    pinned = min(leaves[0][0], tail) if leaves else tail
    best_range = leaves[0][1:] if leaves and leaves[0][0] <= tail else None
    bound = max(base.bound, pinned)
    return PinnedBound(bound, base, best_range if pinned > base.bound else None, lps,
                       intervals, time.perf_counter() - start)
