"""Exact dynamic-CP plans for small instances: depth-first branch and bound at `pp = 1`; with a
pipeline, an exhaustive search over every plan of at most `PIPELINE_MAX_SEQS` sequences
(`exhaustive`, the reference for the solver on tiny instances).

With one pipeline stage the simulated time is order-free (hcp/schedule/simulator.py, p = 1):
    T = sum_j ((1 + k) H_j + o),   H_j = max_{g in j} f(g),  o = o_f + o_b,
a bin-packing-like problem: micro-batches j of groups g (sequences, CP size c_g) with
`sum_g c_g <= N` (any multiset of power-of-two sizes summing to <= N tiles the pool with aligned
blocks, largest first) and tokens per rank, head-tail padding counted, `<= m`.
f(g) = compute_g + max((1 - overlap) comm_g,
comm_g - attn_g) (cost_model.fwd) is the larger of two pieces P1, P2 that are sums over the
group's sequences: p1_i(c) = compute + (1 - overlap) comm, p2_i(c) = compute + comm - attn
(= compute at c = 1, where nothing is communicated).

Bound (seconds). For weights lam_c in [0, 1] (one per CP size), every group has
`f(g) >= lam P1_g + (1 - lam) P2_g`, additive over its sequences, and the groups of micro-batch j
tile at most N ranks, so `N H_j >= sum_g c_g f(g) >= A_j + sum_{i added later to j} a_i` with
A_j the lam-area of j's current groups and `a_i = min_c c (lam_c p1_i + (1 - lam_c) p2_i)`
over feasible c (the sequence may still open a new group). Micro-batch j takes at most
`N m - tokens_j` more (real) tokens, so the a-mass it can absorb below its level is at most
`K(N m - tokens_j)`, K the fractional knapsack of the remaining sequences (weights L_i, values
a_i: the best a per token first). Hence, for a partial plan with micro-batch levels H_j and
remaining sequences R (the mass not absorbed raises some level, at rate 1 / N),
    T >= (1 + k) [sum_j H_j + max(0, sum_R a_i - sum_j min(N H_j - A_j, K(N m - tokens_j))) / N]
         + o max(M, M_min),
M_min = ceil(sum L / (N m)). At the root (no micro-batch) this is the area bound of
hcp/dcp/lower_bound.py made stronger by lam (best_weights; lam = 1 there).

Search: sequences by decreasing `a_i`; each goes into an existing group with token room, a new
group of each feasible size in a micro-batch with idle ranks, or a new micro-batch (one branch:
empty micro-batches are interchangeable); children in order of their bound; a node is cut when
its bound reaches `UB / (1 + gap)`, so the final plan is optimal within `gap` if the search
ends; stopped earlier (time or node budget), the proven bound is the least bound of the nodes
left open or cut, each subtree reporting the least over its children. The incumbent starts
from the given plans (e.g. the solver's). Classical depth-first branch and bound for bin
packing (Martello & Toth, Knapsack Problems, Wiley 1990, ch. 8).
"""
from __future__ import annotations

import bisect
import time as _time
from dataclasses import dataclass
from itertools import permutations, product

import numpy as np

from hcp.dcp.cost_model import CostModel
from hcp.dcp.local_search import GroupTime
from hcp.dcp.lower_bound import cp_sizes, lower_bound
from hcp.dcp.packing import Round, Packing, rank_tokens, tile
from hcp.schedule.simulator import simulate_1f1b


@dataclass
class ExactResult:
    """The best plan found, its time, the proven lower bound on the optimum (seconds), whether
    their relative gap is within the tolerance (the plan is then called optimal), and the
    number of search nodes."""

    plan: Packing
    time: float
    dual_bound: float
    optimal: bool
    nodes: int = 0


def plan_time(plan: Packing, lens, cost: CostModel) -> float:
    """T of a plan at pp = 1 (seconds), as the simulator computes it."""
    fwd, bwd = cost.stage_times(plan, lens)
    return float(fwd.sum() + bwd.sum())


def _pieces(lens: np.ndarray, cost: CostModel, pool: int):
    """p1, p2 `[K, n]` seconds per CP size (rows 1, 2, ..., pool) and sequence."""
    cs = cp_sizes(pool).astype(np.float64)[:, None]
    compute, attn, comm = (x[0] for x in cost._parts(lens[None, :], lens[None, :] ** 2, cs))
    p1 = compute + (1 - cost.hw.comm_overlap) * comm
    p2 = np.where(cs > 1, compute + comm - attn, compute)
    return p1, p2


def best_weights(lens, cost: CostModel, pool: int, m: int, steps: int = 11,
                 rounds: int = 2) -> np.ndarray:
    """lam per CP size (lam = 1 at c = 1) raising `sum_i a_i`: coordinate ascent over a grid of
    `steps` values per size, `rounds` passes (any lam gives a valid bound)."""
    p1, p2 = _pieces(lens, cost, pool)
    cs = cp_sizes(pool).astype(np.float64)[:, None]
    feasible = rank_tokens(lens[None, :], cs) <= m
    lam = np.ones(cs.size)

    def total(w):
        mixed = cs * (w[:, None] * p1 + (1 - w[:, None]) * p2)
        return np.where(feasible, mixed, np.inf).min(0).sum()

    for _ in range(rounds):
        for e in range(1, cs.size):
            trials = [np.r_[lam[:e], x, lam[e + 1:]] for x in np.linspace(0, 1, steps)]
            lam = max(trials, key=total)
    return lam


def solve_exact(lengths, cost: CostModel, pool: int, max_tokens_per_rank: int,
                plans: tuple[Packing, ...] = (), time_limit: float = 20.0,
                gap: float = 0.01, max_nodes: int | None = None) -> ExactResult:
    """Branch and bound (module docstring) within `time_limit` seconds and `max_nodes` search
    nodes, starting from the best of `plans` (at least one). The returned plan is never slower
    than it. With a node budget it is a deterministic heuristic: the first dives of the search
    follow the children with the lowest bound."""
    if cost.pp != 1:
        if len(lengths) > PIPELINE_MAX_SEQS:
            raise ValueError(f"exact plans with a pipeline (pp={cost.pp}) search every plan: at "
                             f"most {PIPELINE_MAX_SEQS} sequences, not {len(lengths)}; use pp=1 "
                             f"(branch and bound) or the solver (hcp/dcp/solver.py)")
        return exhaustive(lengths, cost, pool, max_tokens_per_rank)
    start = _time.perf_counter()
    lens = np.asarray(lengths, dtype=np.float64)
    n, m, N = lens.size, max_tokens_per_rank, pool
    k1 = 1.0 + cost.bwd_factor
    o = cost.hw.micro_batch_overhead_fwd + cost.hw.micro_batch_overhead_bwd
    f = GroupTime(cost)
    lam = best_weights(lens, cost, pool, m)
    p1, p2 = _pieces(lens, cost, pool)
    sizes = cp_sizes(pool).tolist()
    lam_area = [c * (lam[e] * p1[e] + (1 - lam[e]) * p2[e]) for e, c in enumerate(sizes)]
    fits = rank_tokens(lens[None, :], cp_sizes(pool)[:, None]) <= m  # [K, n]
    a = np.where(fits, np.array(lam_area), np.inf).min(0)
    order = np.argsort(-a, kind="stable").tolist()
    tail = np.r_[np.cumsum(a[order][::-1])[::-1], 0.0]  # tail[d]: sum of a over order[d:]
    knap = [_knapsack_table(lens[order[d:]], a[order[d:]]) for d in range(n + 1)]
    m_min = int(np.ceil(lens.sum() / (N * m)))
    L = lens.tolist()
    best_plan = min(plans, key=lambda p: plan_time(p, lens, cost))
    state = {"ub": plan_time(best_plan, lens, cost), "plan": best_plan, "nodes": 0,
             "stopped": False}
    # micro-batch: [H, lam-area, used ranks, groups, tokens]; group: [c, tokens, sq, seqs,
    # tokens per rank with padding]
    rt = rank_tokens(lens[None, :], cp_sizes(pool)[:, None]).tolist()  # [K][n]
    mbs: list[list] = []

    def bound(depth: int) -> float:
        h = sum(mb[0] for mb in mbs)
        tokens, mass = knap[depth]
        slack = sum(min(N * mb[0] - mb[1], _absorb(tokens, mass, N * m - mb[4])) for mb in mbs)
        return k1 * (h + max(0.0, tail[depth] - slack) / N) + o * max(len(mbs), m_min)

    def dfs(depth: int, node_lb: float) -> float:
        """Search the subtree; return a proven lower bound on its best plan (seconds)."""
        state["nodes"] += 1
        if (max_nodes is not None and state["nodes"] >= max_nodes) or (
                state["nodes"] % 256 == 0 and _time.perf_counter() - start > time_limit):
            state["stopped"] = True
        if state["stopped"]:
            return node_lb
        if depth == n:
            t = k1 * sum(mb[0] for mb in mbs) + o * len(mbs)
            if t < state["ub"] * (1 - 1e-12):
                state["ub"] = t
                state["plan"] = Packing([Round(tile([(list(g[3]), g[0]) for g in mb[3]], N))
                                      for mb in mbs])
            return t
        i = order[depth]
        n_i = L[i]
        children = []
        for j, mb in enumerate(mbs):
            for g in mb[3]:
                if g[4] + rt[g[0].bit_length() - 1][i] <= m:
                    children.append((j, g, g[0]))
            for c in sizes:
                if c <= N - mb[2] and rt[c.bit_length() - 1][i] <= m:
                    children.append((j, None, c))
        children += [(len(mbs), None, c) for c in sizes if rt[c.bit_length() - 1][i] <= m]
        scored = []
        for j, g, c in children:
            e = c.bit_length() - 1
            if j == len(mbs):
                mbs.append([0.0, 0.0, 0, [], 0])
            mb = mbs[j]
            t, s = (g[1], g[2]) if g else (0, 0)
            new_f = f(t + n_i, s + n_i * n_i, c)
            saved = (mb[0], mb[1], mb[4])
            mb[0] = max(mb[0], new_f)
            mb[1] += lam_area[e][i]
            mb[4] += n_i
            lb = bound(depth + 1)
            mb[0], mb[1], mb[4] = saved
            if j == len(mbs) - 1 and not mb[3]:
                mbs.pop()
            scored.append((max(lb, node_lb), j, g, c))
        sub = np.inf  # lower bound over the children: searched, cut or left when stopped
        for lb, j, g, c in sorted(scored, key=lambda x: x[0]):
            if lb >= state["ub"] / (1 + gap) or state["stopped"]:
                sub = min(sub, lb)
                break
            if j == len(mbs):
                mbs.append([0.0, 0.0, 0, [], 0])
            mb = mbs[j]
            e = c.bit_length() - 1
            saved = (mb[0], mb[1], mb[2], mb[4])
            mb[4] += n_i
            if g is None:
                g_new = [c, 0, 0, [], 0]
                mb[3].append(g_new)
                mb[2] += c
            else:
                g_new = g
            g_new[1] += n_i
            g_new[2] += n_i * n_i
            g_new[3].append(i)
            g_new[4] += rt[e][i]
            mb[0] = max(mb[0], f(g_new[1], g_new[2], c))
            mb[1] += lam_area[e][i]
            sub = min(sub, dfs(depth + 1, lb))
            g_new[1] -= n_i
            g_new[2] -= n_i * n_i
            g_new[3].pop()
            g_new[4] -= rt[e][i]
            mb[0], mb[1], mb[2], mb[4] = saved
            if g is None:
                mb[3].pop()
            if not mb[3]:
                mbs.pop()
        return sub

    root = max(bound(0), lower_bound(lens, cost, pool, m))  # the latter: critical path too
    low = min(dfs(0, root), state["ub"])
    return ExactResult(state["plan"], state["ub"], low, state["ub"] <= low * (1 + gap) + 1e-15,
                       state["nodes"])


PIPELINE_MAX_SEQS = 6  # exhaustive search with a pipeline: Bell(6) = 203 partitions x 6! orders


def _partitions(items: tuple) -> list[list[tuple]]:
    """Every partition of `items` into non-empty blocks."""
    if not items:
        return [[]]
    out = []
    for part in _partitions(items[1:]):
        for k in range(len(part)):
            out.append(part[:k] + [(items[0],) + part[k]] + part[k + 1:])
        out.append([(items[0],)] + part)
    return out


def _micro_batch_options(seqs: tuple, lens: np.ndarray, cost: CostModel, pool: int, m: int):
    """The ways to run `seqs` as one micro-batch that no other way beats on every stage: a list
    of (stage seconds `[p]` of its slowest group's forward, groups `[(seqs, c)]`)."""
    sizes = cp_sizes(pool).tolist()
    found = []
    for groups in _partitions(seqs):
        def assign(k, used, chosen):
            if k == len(groups):
                x = [lens[list(g)] for g in groups]
                f = np.max([cost.fwd(v.sum(), (v * v).sum(), c) for v, (_, c) in
                            zip(x, chosen)], axis=0)
                found.append((f, list(chosen)))
                return
            for c in sizes:
                if used + c <= pool and rank_tokens(lens[list(groups[k])], c).sum() <= m:
                    assign(k + 1, used + c, chosen + [(groups[k], c)])
        assign(0, 0, [])
    return [(f, g) for f, g in found
            if not any((h <= f).all() and (h < f).any() for h, _ in found)]


def exhaustive(lengths, cost: CostModel, pool: int, max_tokens_per_rank: int) -> ExactResult:
    """The optimum over every plan of at most PIPELINE_MAX_SEQS sequences, any pp: every
    partition into micro-batches, every way to run each (its groups and their CP sizes, only
    those no other way beats on every stage: a micro-batch's stage times grow with its groups'
    forwards), every order of the micro-batches through the 1F1B simulator. Seconds; a
    deterministic reference for the solver on tiny instances."""
    lens = np.asarray(lengths, dtype=np.int64)
    k, hw = cost.bwd_factor, cost.hw
    o_f, o_b = hw.micro_batch_overhead_fwd, hw.micro_batch_overhead_bwd
    options = {}
    best = (np.inf, None)
    for part in _partitions(tuple(range(lens.size))):
        for b in part:
            if b not in options:
                options[b] = _micro_batch_options(b, lens, cost, pool, max_tokens_per_rank)
        for choice in product(*(options[b] for b in part)):
            fwd = np.stack([f for f, _ in choice], axis=1)  # [p, M]
            for order in permutations(range(len(part))):
                t = simulate_1f1b(fwd[:, order] + o_f, k * fwd[:, order] + o_b,
                                  record=False).iteration_time
                if t < best[0]:
                    best = (t, [choice[j][1] for j in order])
    plan = Packing([Round(tile([(list(s), c) for s, c in groups], pool)) for groups in best[1]])
    return ExactResult(plan, best[0], best[0], True)


def _knapsack_table(lens: np.ndarray, a: np.ndarray) -> tuple[list[float], list[float]]:
    """Cumulative tokens and a-mass of sequences by decreasing a / L (fractional knapsack)."""
    by = np.argsort(-a / np.maximum(lens, 1), kind="stable")
    return np.r_[0.0, np.cumsum(lens[by])].tolist(), np.r_[0.0, np.cumsum(a[by])].tolist()


def _absorb(tokens: list[float], mass: list[float], room: float) -> float:
    """Most a-mass that sequences of at most `room` tokens can carry (fractional knapsack)."""
    k = bisect.bisect_right(tokens, room) - 1
    if k + 1 >= len(tokens):
        return mass[-1]
    return mass[k] + (mass[k + 1] - mass[k]) * (room - tokens[k]) / (tokens[k + 1] - tokens[k])
