"""Row packing for the dynamic-CP solver (hcp/dcp/solver.py, steps 2-3 and 4b): sequences ->
micro-batch rows of `pool` ranks, each sequence on an aligned power-of-two CP block, under the
per-rank token cap (head-tail padding counted). Seconds and tokens throughout.
"""
from __future__ import annotations

import bisect
import heapq

import numpy as np

from hcp.dcp.lower_bound import cp_sizes
from hcp.dcp.packing import Group, Packing, Round, fill_idle, rank_tokens_of

# A micro-batch j much slower than the rest (one sequence longer than the level even on the
# whole pool) stalls 1F1B: its backwards on stages s < p - 1 delay their forwards of j + p - s,
# which the last stage waits for after running only j + 1 .. j + p - s - 1. Its p - 1
# "escort" rows are filled up to ESCORT_LIFT x its excess above the level (the token cap
# usually binds first); descending order puts them right after it, where they overlap the stall
# with useful work (measured on the seed-sized benchmark: lifts 1-5 within 0.001, 0.5 worse).
ESCORT_LIFT = 2.0


class _Row:
    """One micro-batch under construction: a free-rank bit mask, `nfree` and groups as
    `[offset, c, seq indices, tokens per rank (padding counted), load (s)]`."""

    def __init__(self, pool: int):
        self.pool, self.mask, self.nfree = pool, (1 << pool) - 1, pool
        self.groups: list[list] = []

    def take_block(self, c: int) -> int:
        """Mark the first free aligned block of c ranks busy; return its offset (-1 if none)."""
        full = (1 << c) - 1
        for o in range(0, self.pool, c):
            if (self.mask >> o) & full == full:
                self.mask &= ~(full << o)
                self.nfree -= c
                return o
        return -1

    def free_ranks(self) -> list[int]:
        return [k for k in range(self.pool) if (self.mask >> k) & 1]


def _place_multi(rows, order, cs, lens, height, tau, pool, m):
    """Step 3 for sequences with c > 1 (`order` sorted by c, then height, descending; sizes
    only shrink, so a row with >= c free ranks always has a free aligned block of c). The
    groups of each size are kept in row order, as a scan of the rows would meet them."""
    by_c: dict[int, list] = {}  # CP size -> [(row index, creation count, group)], sorted
    made = 0
    by_free = [[] for _ in range(pool + 1)]  # free ranks -> heap of row indices (lazy: a
    for ri, r in enumerate(rows):  # row whose count has changed since is skipped)
        by_free[r.nfree].append(ri)

    def least_open(c: int) -> int:  # the first row with the fewest free ranks >= c, or -1
        for v in range(c, pool + 1):
            heap = by_free[v]
            while heap and rows[heap[0]].nfree != v:
                heapq.heappop(heap)
            if heap:
                return heap[0]
        return -1

    cs, height, lens = cs.tolist(), height.tolist(), lens.tolist()
    need = {}  # CP size -> the fewest tokens per rank of any sequence of that size: a group
    for i in order:  # with less room is full for good and leaves by_c
        need[cs[i]] = min(need.get(cs[i], m), rank_tokens_of(lens[i], cs[i]))
    for i in order:
        c, h = cs[i], height[i]
        n = rank_tokens_of(lens[i], c)
        groups = [g for _, _, g in by_c.get(c, ()) if g[3] + n <= m]
        under = [g for g in groups if g[4] + h <= tau]
        if under:
            g = max(under, key=lambda g: g[4])
        else:
            ri = least_open(c)
            if ri >= 0 or not groups:
                if ri < 0:
                    rows.append(_Row(pool))
                    ri = len(rows) - 1
                r = rows[ri]
                g = [r.take_block(c), c, [], 0, 0.0]
                heapq.heappush(by_free[r.nfree], ri)
                r.groups.append(g)
                bisect.insort(by_c.setdefault(c, []), (ri, made, g), key=lambda e: e[:2])
                made += 1
            else:
                g = min(groups, key=lambda g: g[4])
        g[2].append(i)
        g[3] += n
        g[4] += h
        if g[3] + need[c] > m:
            by_c[c] = [e for e in by_c[c] if e[2] is not g]


def _place_single(rows, order, lens, heights, pool, m, offsets):
    """Step 3 for sequences with c = 1: LPT over the free ranks and the open groups (a short
    sequence may join a group of size c at its per-rank cost `heights[log2 c, i]`), tokens
    per rank capped (padding counted). A free rank of row r starts at load `offsets[r]`
    (seconds) so ramp rows end up lighter; the recorded loads exclude it."""
    heap = []
    for ri, r in enumerate(rows):
        heap += [(offsets[ri] + g[4], ri, g[0], g) for g in r.groups]
        heap += [(offsets[ri], ri, k, None) for k in r.free_ranks()]
    heapq.heapify(heap)
    shortest = int(lens[order].min()) if order else 0
    # Python scalars, the helpers inlined (_fit_len, rank_tokens_of): the loop is per sequence
    lens, heights = lens.tolist(), heights.tolist()
    one = heights[0]
    push, pop, replace = heapq.heappush, heapq.heappop, heapq.heapreplace
    waiting = []  # slots too full for the current sequence, by room: `order` is longest first,
    for i in order:  # so a slot comes back once the sequences get short enough to fit it
        n = lens[i]
        while waiting and -waiting[0][0] >= n:
            push(heap, pop(waiting)[1])
        while heap:  # the least loaded slot stays on top until it is known to fit
            key, ri, k, g = top = heap[0]
            if g is None:
                g = [k, 1, [], 0, 0.0]
                rows[ri].mask &= ~(1 << k)
                rows[ri].nfree -= 1
                rows[ri].groups.append(g)
                heap[0] = top = (key, ri, k, g)  # same order: keys and slots are unique
            c = g[1]
            room = m - g[3] if c == 1 else 2 * c * ((m - g[3]) // 2)
            if n <= room:
                break
            pop(heap)
            if room >= shortest:  # full for this one; a shorter sequence may still fit
                push(waiting, (-room, top))
        else:
            r = _Row(pool)
            rows.append(r)
            offsets.append(0.0)
            ri, key = len(rows) - 1, 0.0
            g = [r.take_block(1), 1, [], 0, 0.0]
            r.groups.append(g)
            for q in r.free_ranks():
                push(heap, (0.0, ri, q, None))
            push(heap, (key, ri, g[0], g))
            c = 1
        if c == 1:
            h = one[i]
            g[3] += n
        else:
            h = heights[c.bit_length() - 1][i]
            g[3] += 2 * (-(-n // (2 * c)))
        g[2].append(i)
        g[4] += h
        replace(heap, (key + h, ri, g[0], g))  # the slot on top takes its new load


def level_plan(lens, heights, feasible, rows_target, pool, m, fractions, n_open: int = 0,
                escort: int = 0) -> tuple[Packing, int, int, bool]:
    """Steps 2-3 for one micro-batch count: `rows_target` row-equivalents of work, as one light
    row per entry of `fractions` (filled to that fraction of the level; the first `n_open` open
    the pipeline) and full rows for the rest. With `escort > 0`, each body row whose slowest
    group exceeds the level `tau` by `e` seconds (a sequence too long for tau even on the whole
    pool) gets `escort` body rows filled up to `ESCORT_LIFT * e` above the level (token cap
    permitting; see `ESCORT_LIFT`). Returns the plan (light rows first, in `fractions` order),
    its opening-row and light-row counts (rows left empty are dropped) and whether any row was
    escorted."""
    cmin_idx = np.argmax(feasible, axis=0)
    n_idx = np.arange(lens.size)
    work = float((cp_sizes(pool)[cmin_idx] * heights[cmin_idx, n_idx]).sum())
    tau = work / (pool * rows_target)
    ok = feasible & (heights <= tau)
    # none under tau: the fastest feasible size (not the largest: above a node, InfiniBand can
    # make a larger CP group slower)
    c_idx = np.where(ok.any(axis=0), np.argmax(ok, axis=0), np.argmin(heights, axis=0))
    cs = cp_sizes(pool)[c_idx]
    height = heights[c_idx, n_idx]
    body = [_Row(pool) for _ in range(max(1, int(round(rows_target - np.sum(fractions)))))]
    multi = np.flatnonzero(cs > 1)
    multi = multi[np.lexsort((-height[multi], -cs[multi]))]
    _place_multi(body, multi.tolist(), cs, lens, height, tau, pool, m)
    single = np.flatnonzero(cs == 1)
    single = single[np.argsort(-height[single], kind="stable")]
    rows = [_Row(pool) for _ in fractions] + body
    slots = sum(r.nfree for r in body) + pool * float(np.sum(fractions))
    level = float(height[single].sum()) / max(1.0, slots)
    offsets = [(1.0 - f) * level for f in fractions] + [0.0] * len(body)
    excess = [max((g[4] for g in r.groups), default=0.0) - tau for r in body]
    heavy = sum(e > 0 for e in excess)
    if escort and heavy:
        calm = [ri for ri, e in enumerate(excess) if e <= 0][:escort * heavy]
        lift = -ESCORT_LIFT * max(excess)
        for ri in calm:
            offsets[len(fractions) + ri] = lift
    _place_single(rows, single.tolist(), lens, heights, pool, m, offsets)
    plan = Packing()
    opened = light = 0
    for ri, r in enumerate(rows):
        groups = [Group(sorted(g[2]), g[1], g[0]) for g in r.groups if g[2]]
        if groups:
            plan.rounds.append(Round(fill_idle(groups, pool)))
            opened += ri < n_open
            light += ri < len(fractions)
    return plan, opened, light, bool(escort and heavy)


def shaped_plan(lens, heights, feasible, shape, pool, m, scale) -> Packing:
    """Rows with target heights proportional to `shape` (one entry per row, e.g. the optimal
    micro-batch sizes of the pipeline LP, hcp/dcp/pipeline_bound.py), scaled so that the
    targets hold `scale` x the batch's rank-seconds at the smallest feasible CP sizes.
    Sequences take the smallest feasible c whose height fits the tallest target; those with
    c > 1, largest c first, then tallest, go where they leave the most room under the target
    (joining a group of their size with token room or opening a block in a row with enough free
    ranks; a new row when none can); sequences with c = 1 fill the rows by LPT, each row's
    free ranks starting at (tallest target - its target), so rows end near their targets."""
    cmin_idx = np.argmax(feasible, axis=0)
    n_idx = np.arange(lens.size)
    work = float((cp_sizes(pool)[cmin_idx] * heights[cmin_idx, n_idx]).sum())
    shape = np.asarray(shape, dtype=np.float64) / float(np.max(shape))
    targets = list(shape * scale * work / (pool * shape.sum()))
    peak = max(targets)
    ok = feasible & (heights <= peak)
    c_idx = np.where(ok.any(axis=0), np.argmax(ok, axis=0), np.argmin(heights, axis=0))
    cs = cp_sizes(pool)[c_idx]
    height = heights[c_idx, n_idx]
    rows = [_Row(pool) for _ in targets]
    by_size: list[dict[int, list]] = [{} for _ in targets]  # per row: CP size -> its groups
    multi = np.flatnonzero(cs > 1)
    for i in multi[np.lexsort((-height[multi], -cs[multi]))].tolist():
        c, h = int(cs[i]), float(height[i])
        n = rank_tokens_of(int(lens[i]), c)
        best = None  # (room left under the target, row, group or None for a new block)
        for ri, r in enumerate(rows):
            room = targets[ri] - h
            if best is not None and room <= best[0]:
                continue  # no group of this row can leave more room
            if r.nfree >= c:
                best = (room, ri, None)
            for g in by_size[ri].get(c, ()):
                if g[3] + n <= m and (best is None or room - g[4] > best[0]):
                    best = (room - g[4], ri, g)
        if best is None:
            rows.append(_Row(pool))
            by_size.append({})
            targets.append(peak)
            best = (0.0, len(rows) - 1, None)
        _, ri, g = best
        if g is None:
            g = [rows[ri].take_block(c), c, [], 0, 0.0]
            rows[ri].groups.append(g)
            by_size[ri].setdefault(c, []).append(g)
        g[2].append(int(i))
        g[3] += n
        g[4] += h
    single = np.flatnonzero(cs == 1)
    single = single[np.argsort(-height[single], kind="stable")]
    _place_single(rows, single.tolist(), lens, heights, pool, m, [peak - t for t in targets])
    plan = Packing()
    for r in rows:
        groups = [Group(sorted(g[2]), g[1], g[0]) for g in r.groups if g[2]]
        if groups:
            plan.rounds.append(Round(fill_idle(groups, pool)))
    return plan
