"""Dynamic-CP solver: a global batch of lengths -> a plan of micro-batches with minimum
simulated iteration time under the per-rank token cap. Deterministic (numpy, heaps, HiGHS LPs);
planning time and its stall: benchmarks/dynamic_cp.py and dynamic_cp_stall.py.

1. Rank-time of a sequence at CP size c: `c * h(L, c)` (`h`: forward seconds summed over stages,
   plus its token share of the micro-batch's CP latency, `_heights`); `W` = total rank-time at
   the smallest feasible c.
2. For M micro-batches near the memory minimum `ceil(sum L / (N m))`, target height
   `tau = W / (N M)`: each sequence takes the smallest feasible c with `h(L, c) <= tau`, else the
   c where it is fastest (not the largest: across nodes a larger group can be slower).
3. Level packing over M rows of N ranks (hcp/dcp/rows.py `level_plan`): c > 1 first, largest c
   first, into the fullest group of its size under `tau` and the cap, else a new aligned block;
   then c = 1, longest first, onto the least loaded rank with room (LPT).
4. p > 1: light opening and closing rows (`ramps`) in the orders of `_orderings`, at several
   closing lengths and M (`_search_pipeline`), with "escort" rows for a sequence slower than the
   level (rows.py `ESCORT_LIFT`); 4b. rows shaped like the pipeline LP's optimal micro-batch
   sizes (hcp/dcp/pipeline_bound.py, `shaped_plan`, `LP_ROW_FACTORS`); 4c. the same LP with the
   longest sequence's row pinned (hcp/dcp/pinned_bound.py, `PIN_ROW_FACTORS`). 4b-4c are skipped
   within `EARLY_EXIT_GAP` of the staged lower bound, and for LPs above `LP_MAX_ROWS` rows.
   Every candidate, one without ramps and the packing-only baseline go through the pipeline
   simulator; the fastest wins.
5. pp = 1, at most `LOCAL_SEARCH_MAX_SEQS` sequences: local search (hcp/dcp/local_search.py:
   move, swap, resize, split; `LOCAL_SEARCH_EVALS`) on every candidate, and a truncated dive of
   the exact branch and bound (hcp/dcp/exact.py, `DIVE_NODES_PER_SEQ`).
6. `several_per_round` (pp = 1 without dp_shard): the best plans become rounds of several
   micro-batches per group (hcp/dcp/rounds.py), beside a plan packed for rounds from the start
   (hcp/dcp/rank_pack.py). Above `LOCAL_SEARCH_MAX_SEQS` sequences only greedy's plan as
   rounds and the packed one compete (`_large_rounds`), the only ones that won there.
7. p > 1, at most `PIPELINE_SEARCH_MAX_SEQS` sequences: steps 1-5 on two one-stage surrogates
   (`CostModel.one_stage`: stages summed, or each coefficient's slowest stage) add candidates.
8. Same bound: a local search timed by the 1F1B simulator (hcp/dcp/pipeline_search.py) improves
   the best plan and each baseline.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hcp.dcp.baselines import greedy, packing_only
from hcp.dcp.cost_model import CostModel
from hcp.dcp.exact import solve_exact
from hcp.dcp.local_search import improve
from hcp.dcp.rank_pack import rank_time_plan
from hcp.dcp.rounds import merge_rounds
from hcp.dcp.lower_bound import cp_sizes
from hcp.dcp.pinned_bound import pin_floor
from hcp.dcp.pipeline_search import improve_pipeline
from hcp.dcp.pipeline_bound import (lp_makespan, lp_model, stage_classes, stage_floors,
                                     staged_bound)
from hcp.dcp.packing import Packing, max_length, prepare_lengths, rank_tokens
from hcp.dcp.rows import level_plan, shaped_plan
from hcp.schedule.simulator import simulate_1f1b

OPEN_FROM = 0.05  # the opening ramp starts at this fraction of a full row
# Lengths of the closing ramp in units of k (p - 1) micro-batches (see `ramps`); each is a
# candidate. Measured on the seed-sized benchmark (seeds 0 and 1) at the memory minimum M: one
# span of 2.0 gives 1.098 / 1.101 mean time over the bound, these three 1.096 / 1.099, seven
# (1.25-3.0) no better.
CLOSING_SPANS = (1.5, 2.0, 2.5)
TARGET_OFFSETS = (-2, -1, 1)  # second pass: micro-batch counts around the memory minimum
LOCAL_SEARCH_MAX_SEQS = 128  # pp = 1 local search is O(n^2) per sweep: small batches only
# ... and evaluates at most this many moves per batch, shared by its candidates (~7 us each;
# the 32-sequence benchmark needs 14-20 thousand, 128 sequences on a pool of 64 ~900 thousand)
LOCAL_SEARCH_EVALS = 60_000
# pp > 1: the one-stage surrogates' plans and the simulator-timed local search (steps 7-8),
# small batches only (up to 0.27 s of CPU at 8 sequences, pp 8, H100 profile: 18% of that
# step, hidden by plan-ahead; tests/test_dcp_tiny.py: 1.45x the optimum without them)
PIPELINE_SEARCH_MAX_SEQS = 8
PIPELINE_SEARCH_EVALS = 2_000  # ... and at most this many timed moves (~50-100 us each)
DIVE_NODES_PER_SEQ = 2  # node budget of the branch-and-bound dive (pp = 1), per sequence
# escort rows: hcp/dcp/rows.py (ESCORT_LIFT)
ESCORT_ROW_FACTOR = 1.1  # escorted candidates only for M <= this x the memory minimum (time)
UNIMODAL_STEP = 1.45  # largest ratio between consecutive rows on the climb (see `ramps`: r)
# Step 4b: micro-batch counts (x the memory minimum) and fills (x the batch's work) of the
# candidates shaped like the pipeline LP's optimal sizes (`shaped_plan`). Measured on the
# seed-sized benchmark, seeds 0 and 1 (the only seeds used to choose them): 0.986 / 1.000 of
# the other candidates' best time at 2.5-3.0 and fills 1.0-1.02 (seed 1 keeps an escorted
# level plan); 2.0 or 1.05 add nothing, 3.5-4.0 are worse; ~0.3 s of planning CPU time.
LP_ROW_FACTORS = (2.5, 3.0)
LP_SCALES = (1.0, 1.02)
# Step 4c: micro-batch counts (x the memory minimum) of the candidates shaped like the pipeline
# LP with the longest sequence's row pinned to its own time (`_pinned_sizes`), when that
# sequence outweighs the LP's rows; its row within the first PIN_ROWS_PER_STAGE x p. Measured
# on seed 1 of the seed-sized benchmark (seed 0 has no such sequence; the only seeds used to
# choose them): at M = 40-70 the best row gives 8.157-8.206 s against 8.225 s for the other
# candidates; 1.6x (51 rows) 8.158 s, 1.5x 8.163 s, both 8.163 s for twice the plan time
# (~15 ms of CPU time per LP, ~9 LPs per count).
PIN_ROW_FACTORS = (1.6,)
PIN_ROWS_PER_STAGE = 3
# Steps 4b-4c are skipped when step 4's best plan is within this fraction of a valid lower
# bound (the staged bound at the memory minimum, hcp/dcp/pipeline_bound.py `staged_bound`):
# the LPs would cost most of the planning time for at most this gain.
EARLY_EXIT_GAP = 0.02
# ... and each LP of more than this many rows is not solved: on code lengths (seeds 0-1 of the
# seed-sized benchmark, ~175 rows at the memory minimum) HiGHS took ~2 s for the 437-row LP and
# the shaped plans gained nothing over the level plans (Wikipedia's and lognormal's LPs, 50-200
# rows, gained 0.8-3.2%).
LP_MAX_ROWS = 256
GOLDEN = (np.sqrt(5.0) - 1.0) / 2.0


@dataclass
class Solution:
    """The chosen plan, its simulated iteration time (seconds) and which candidate won."""

    plan: Packing
    time: float
    source: str


def simulate_plan(plan: Packing, lengths, cost: CostModel, record: bool = False):
    """Timeline of `plan` through 1F1B under `cost`."""
    fwd, bwd = cost.stage_times(plan, lengths)
    return simulate_1f1b(fwd, bwd, record=record)


def ramps(cost: CostModel, span: float | None) -> tuple[np.ndarray, np.ndarray]:
    """Fill fractions of the light micro-batches that open and close the pipeline, as
    (opening, closing), each ascending; none with one stage or `span=None`.

    The shapes follow the optimum of a linear program over micro-batch sizes x_j (1F1B start
    times as variables, stage times `o + a_s x_j`, total work fixed; solved with HiGHS for the
    seed-sized batches while designing this): sizes rise geometrically, stay flat, then fall
    almost linearly over many micro-batches. Opening: in 1F1B the last stage first waits for
    micro-batch j's forwards on stages 0 .. p-2 while it has run only the rows before j, so
    with `r = 1 + ((1 + k) a_L - 1) / (p - 1)` (k = backward/forward ratio, a_L = last stage's
    matmul time over the first's) row j + 1 may be r times row j without stalling it; the ramp
    starts at OPEN_FROM of a full row. Closing: the drain waits on backwards, k times the
    forwards, so the fall is long: `round(span * k * (p - 1))` rows falling linearly to 0."""
    p, k = cost.pp, cost.bwd_factor
    if p == 1 or span is None:
        return np.zeros(0), np.zeros(0)
    a_last = float(cost.mm_coef[-1] / cost.mm_coef[0])
    r = 1.0 + ((1.0 + k) * a_last - 1.0) / (p - 1)
    n_open = int(np.ceil(np.log(1.0 / OPEN_FROM) / np.log(r)))
    n_close = max(1, int(round(span * k * (p - 1))))
    return r ** -np.arange(n_open, 0, -1.0), np.arange(n_close) / n_close


def _orderings(fwd: np.ndarray, bwd: np.ndarray, opening: int, light: int) -> list[np.ndarray]:
    """Candidate micro-batch orders. Rows `[0, opening)` open ascending; every order then runs
    the body as built, or smallest at both ends ("valley"), before the closing ramp rows
    descending, or goes unimodal: from the opening ramp's top climb to the largest row with
    steps of at most UNIMODAL_STEP x (largest remaining row that fits), then all the rest
    descending (the linear program's shape when a few rows are heavier than the level)."""
    size = (fwd + bwd).sum(axis=0)
    up = np.argsort(size[:opening], kind="stable")
    down = opening + np.argsort(size[opening:light], kind="stable")[::-1]
    body = light + np.argsort(size[light:], kind="stable")
    valley = np.concatenate([body[0::2], body[1::2][::-1]])
    orders = [np.concatenate([up, b, down]) for b in (np.arange(light, size.size), valley)]
    rest = sorted(np.concatenate([body, down]).tolist(), key=lambda j: -size[j])
    climb, top = [], size[up[-1]] if up.size else 0.0
    while rest and size[rest[0]] > UNIMODAL_STEP * top:
        fits = [j for j in rest if size[j] <= UNIMODAL_STEP * top]
        if not fits:
            break
        climb.append(fits[0])
        rest.remove(fits[0])
        top = size[fits[0]]
    orders.append(np.concatenate([up, np.array(climb + rest, dtype=np.int64)]))
    return orders


def _best_order(plan: Packing, lens, cost: CostModel, opening: int = 0,
                light: int = 0) -> tuple[Packing, float]:
    fwd, bwd = cost.stage_times(plan, lens)
    best = None
    for order in _orderings(fwd, bwd, opening, light):
        t = simulate_1f1b(fwd[:, order], bwd[:, order], record=False).iteration_time
        if best is None or t < best[0] - 1e-12:
            best = (t, order)
    ordered = Packing([plan.rounds[j] for j in best[1].tolist()])
    return ordered, best[0]


def _pinned_sizes(rows: int, cost: CostModel, work, smallest, floor) -> np.ndarray | None:
    """Stage 0's row sizes `[rows]` (s) of the pipeline LP (first and last stage kept) with one
    row pinned to at least `floor` `[p]`, that row chosen by a golden-section search over the first
    `PIN_ROWS_PER_STAGE * p` rows (the LP's time is close to unimodal in it); None when the
    unpinned LP already has a row that heavy."""
    stages = [0, cost.pp - 1]
    cls, lo, _ = stage_classes(cost)
    # without an LP: every feasible point has a row j with x_0j >= Phi_0 / rows (the work
    # constraint), so x_sj >= lo_s Phi_0 / rows (the stage ratios)
    if (lo[cls] * work[0] / rows >= floor).all():
        return None
    model = lp_model(rows, cost, work, smallest, stages)  # the same LP for every pin
    x = lp_makespan(rows, cost, work, smallest, stages, sizes=True, model=model)[1]
    if (x >= floor[:, None]).all(axis=0).any():
        return None
    memo: dict[int, tuple[float, np.ndarray]] = {}

    def lp(j: int) -> float:
        if j not in memo:
            t, x = lp_makespan(rows, cost, work, smallest, stages, sizes=True, pin=(j, floor),
                               model=model)
            memo[j] = (t, x[0])
        return memo[j][0]

    lo, hi = 0, min(rows, PIN_ROWS_PER_STAGE * cost.pp) - 1
    while hi - lo > 2:  # golden section: one of the two inner rows is the last step's (memo)
        step = int(round(GOLDEN * (hi - lo)))
        a, b = hi - step, lo + step
        if lp(a) <= lp(b):
            hi = b
        else:
            lo = a
    return memo[min(range(lo, hi + 1), key=lp)][1]


def _search_pipeline(lens, heights, feasible, cost: CostModel, pool: int, m: int, m_min: int,
                     baselines: list[tuple[Packing, str]]) -> Solution:
    """Step 4 (p > 1), in two passes: each closing span at the memory minimum M, then the best
    span at `M_min + TARGET_OFFSETS` (fewer body rows raise the level `tau`)."""
    best = min((Solution(*_best_order(plan, lens, cost), src) for plan, src in baselines),
               key=lambda sol: sol.time)

    def consider(span: float | None, rows_target: int) -> bool:
        nonlocal best
        opening, closing = ramps(cost, span)
        fractions = np.concatenate([opening, closing])
        improved = False
        escorts = {0, cost.pp - 1 if rows_target <= ESCORT_ROW_FACTOR * m_min else 0}
        for escort in sorted(escorts, reverse=True):
            plan, opened, light, escorted = level_plan(
                lens, heights, feasible, rows_target, pool, m, fractions, opening.size, escort)
            plan, t = _best_order(plan, lens, cost, opened, light)
            if t < best.time - 1e-12:
                best = Solution(plan, t, f"level(M~{rows_target},span={span},escort={escort})")
                improved = True
            if not escorted:
                break
        return improved

    consider(None, m_min)  # no ramps: tiny batches, where each micro-batch's overhead dominates
    span_best = CLOSING_SPANS[0]
    for span in CLOSING_SPANS:
        if consider(span, m_min):
            span_best = span
    for offset in TARGET_OFFSETS:
        if m_min + offset >= 1:
            consider(span_best, m_min + offset)
    work, smallest = stage_floors(lens, cost, pool, m)
    if best.time <= (1.0 + EARLY_EXIT_GAP) * staged_bound(cost, work, smallest, m_min):
        return best  # within EARLY_EXIT_GAP of a valid lower bound: the LPs cannot pay
    # rows shaped like the pipeline LP's optimal micro-batch sizes (rise, then a long fall)
    excess = None  # least (shaped plan's time / its LP's value) so far
    for factor in LP_ROW_FACTORS:
        rows = max(2, int(round(factor * m_min)))
        if rows > LP_MAX_ROWS:
            continue
        if excess is not None and staged_bound(cost, work, smallest, rows) * excess >= best.time:
            continue  # predicted to lose: its LP is at least the staged bound at `rows`
        lp, x = lp_makespan(rows, cost, work, smallest, [0, cost.pp - 1], sizes=True)
        x = x[0]
        for scale in LP_SCALES:
            plan = shaped_plan(lens, heights, feasible, x, pool, m, scale)
            plan, t = _best_order(plan, lens, cost, int(np.argmax(x)), plan.num_rounds)
            excess = t / lp if excess is None else min(excess, t / lp)
            if t < best.time - 1e-12:
                best = Solution(plan, t, f"lp-shaped(M={rows},scale={scale})")
    floor = pin_floor(lens, cost, pool, m)  # 4c: the longest sequence's row pinned
    for factor in PIN_ROW_FACTORS:
        rows = max(2, int(round(factor * m_min)))
        x = _pinned_sizes(rows, cost, work, smallest, floor) if rows <= LP_MAX_ROWS else None
        for scale in LP_SCALES if x is not None else ():
            plan = shaped_plan(lens, heights, feasible, x, pool, m, scale)
            plan, t = _best_order(plan, lens, cost, int(np.argmax(x)), plan.num_rounds)
            if t < best.time - 1e-12:
                best = Solution(plan, t, f"pinned-lp-shaped(M={rows},scale={scale})")
    return best


def _heights(lens, cost: CostModel, cs, m: int) -> np.ndarray:
    """Forward seconds `[K, n]` of each sequence at each CP size `cs`, summed over stages:
    compute and exposed K/V traffic, plus its share of its micro-batch's CP latency. A
    micro-batch pays `cost.latency(c)` once per ring step, shared by its sequences; a sequence
    holding `rank_tokens(L, c)` of the cap `m` is charged that fraction (as in
    hcp/dcp/lower_bound.py step 1), not the whole latency."""
    whole = cost.fwd(lens[None, :], lens[None, :] ** 2, cs[:, None])  # latency counted once
    unshared = 1.0 - rank_tokens(lens[None, :], cs[:, None]) / m
    return (whole - cost.latency(cs[:, None]) * unshared).sum(axis=0)


def _large_rounds(lens, cost: CostModel, pool: int, m: int,
                  baselines: list[tuple[Packing, str]]) -> Solution:
    """Step 6 alone, for a batch of more than `LOCAL_SEARCH_MAX_SEQS` sequences at pp = 1 with
    `several_per_round`: the baselines, greedy's plan, greedy's plan as rounds and the plan
    packed for rounds (rank_pack.py); the fastest wins. Only these two round plans ever won at
    that size (seeds 0-9 of the peer benchmark, pool 8, Wikipedia, lognormal and code lengths,
    and lognormal at pool 64): the level plans, as rounds, cost four more `merge_rounds`."""
    plain = greedy(lens, pool, m)
    candidates = baselines + [(plain, "greedy"),
                              (merge_rounds(plain, lens, cost, m), "greedy+rounds"),
                              (rank_time_plan(lens, cost, pool, m), "rank-pack")]
    best: Solution | None = None
    for plan, source in candidates:
        t = simulate_plan(plan, lens, cost).iteration_time
        if best is None or t < best.time - 1e-12:
            best = Solution(plan, t, source)
    return best


def solve(lengths, cost: CostModel, pool: int, max_tokens_per_rank: int,
          max_len: int | None = None, several_per_round: bool = False) -> Solution:
    """Plan one global batch (see module docstring). `lengths` must already fit the pool (use
    plan.prepare_lengths); `max_len` only configures the packing-only fallback candidate.
    With `several_per_round` (pp = 1 without dp_shard: a group may run several micro-batches
    between two synchronisations of the pool, hcp/dcp/packing.py) every pp = 1 candidate is also
    turned into such rounds (hcp/dcp/rounds.py) and competes."""
    lens, _ = prepare_lengths(lengths, pool, max_tokens_per_rank)
    m = max_tokens_per_rank
    cs = cp_sizes(pool)
    feasible = rank_tokens(lens[None, :], cs[:, None]) <= m  # [K, n], padding counted
    heights = _heights(lens, cost, cs, m)  # [K, n]
    heights = np.where(feasible, heights, np.inf)
    m_min = int(np.ceil(lens.sum() / (pool * m)))
    # the baselines compete too: guards for degenerate batches (e.g. one sequence); greedy
    # (~40 ms for 2,048 sequences) only with one stage, the only setting where it has won
    # (a pool of 64; 0 of 96 runs at pools 8-64 x pp 2-8, seeds 0-7, without it)
    if max_len is not None and max_len > max_length(pool, m):  # a run's max_len need not fit
        max_len = None
    baselines = [(packing_only(lens, pool, m, max_len), "packing_only")]
    if cost.pp > 1:
        if lens.size <= PIPELINE_SEARCH_MAX_SEQS:  # step 7: the one-stage search on surrogates
            for how in ("sum", "max"):
                plan = solve(lens, cost.one_stage(how), pool, m, max_len).plan
                baselines.append((plan, f"one-stage({how})"))
        best = _search_pipeline(lens, heights, feasible, cost, pool, m, m_min, baselines)
        if lens.size <= PIPELINE_SEARCH_MAX_SEQS:  # step 8: from the best and the baselines
            starts = [(best.plan, best.source)] + [(_best_order(p, lens, cost)[0], src)
                                                   for p, src in baselines]
            for plan, source in starts:
                plan, t = improve_pipeline(plan, lens, cost, pool, m,
                                           PIPELINE_SEARCH_EVALS // len(starts))
                if t < best.time - 1e-12:
                    best = Solution(plan, t, f"{source}+pipeline-local")
        return best
    if several_per_round and lens.size > LOCAL_SEARCH_MAX_SEQS:
        return _large_rounds(lens, cost, pool, m, baselines)
    # one stage: no ramps; a row or two more than the memory minimum can pack better
    candidates = baselines + [(greedy(lens, pool, m), "greedy")]
    for rows_target in range(m_min, m_min + 3):
        plan = level_plan(lens, heights, feasible, rows_target, pool, m, np.zeros(0))[0]
        candidates.append((plan, f"level(M~{rows_target})"))
    budget = LOCAL_SEARCH_EVALS // (len(candidates) + 1)  # + 1: the dive below
    if lens.size <= LOCAL_SEARCH_MAX_SEQS:
        candidates = [(improve(p, lens, cost, pool, m, max_evals=budget), f"{src}+local")
                      for p, src in candidates]
    best: Solution | None = None
    for plan, source in candidates:
        plan, t = _best_order(plan, lens, cost)
        if best is None or t < best.time - 1e-12:
            best = Solution(plan, t, source)
    if lens.size <= LOCAL_SEARCH_MAX_SEQS:
        dive = solve_exact(lens, cost, pool, m, (best.plan,), time_limit=float("inf"), gap=0.0,
                           max_nodes=DIVE_NODES_PER_SEQ * lens.size).plan  # no clock: determinism
        plan, t = _best_order(improve(dive, lens, cost, pool, m, max_evals=budget), lens, cost)
        if t < best.time - 1e-12:
            best = Solution(plan, t, "dive+local")
        candidates.append((plan, "dive+local"))
    if several_per_round:  # the best plan, greedy's and the two fastest others become rounds
        # (greedy's groups, one size per sequence, often merge best: held-out code batches)
        timed = sorted((c for c in candidates if c[1] != "greedy"),
                       key=lambda c: simulate_plan(c[0], lens, cost).iteration_time)
        greedy_plan = [c for c in candidates if c[1] == "greedy"]
        for plan, source in [(best.plan, best.source)] + greedy_plan + timed[:2]:
            merged = merge_rounds(plan, lens, cost, m)
            t = simulate_plan(merged, lens, cost).iteration_time
            if t < best.time - 1e-12:
                best = Solution(merged, t, f"{source}+rounds")
        packed = rank_time_plan(lens, cost, pool, m)  # built for rounds (rank_pack.py)
        t = simulate_plan(packed, lens, cost).iteration_time
        if t < best.time - 1e-12:
            best = Solution(packed, t, "rank-pack")
    return best
