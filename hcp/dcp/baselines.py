"""Baseline planners the solver is measured against (our own code, from published descriptions).

- `packing_only`: what a run without dynamic CP does. Every pack uses the static CP size
  `c_static = min_cp(max_len)` (fixed per run from its configured maximum length), packs of
  `m` tokens per rank (head-tail padding counted) are filled first-fit in arrival order, and
  each micro-batch runs
  `pool / c_static` consecutive packs side by side (one per DP lane).
- `greedy`: Megatron-LM's dynamic ("hybrid") CP as described in docs/design.md section 5: sort by
  length descending; CP size per sequence `max(1, pow2ceil(L / m))`; workload `L^2 / c`; place
  each sequence in a new group while an aligned block of its size is free, else in the least
  loaded group of its size with room, else defer it to the next micro-batch; then double the
  smallest group while the block it doubles into is idle.
"""
from __future__ import annotations

import numpy as np

from hcp.dcp.packing import Group, Round, Packing, fill_idle, rank_tokens, rank_tokens_of


def pow2ceil(x) -> np.ndarray:
    """Smallest power of two >= x (>= 1), elementwise, int64."""
    x = np.maximum(np.asarray(x, dtype=np.int64), 1)
    return (1 << np.ceil(np.log2(x)).astype(np.int64)).astype(np.int64)


def min_cp(lengths, max_tokens_per_rank: int) -> np.ndarray:
    """Smallest power-of-two CP size that holds each length under the per-rank cap, head-tail
    padding counted (`plan.rank_tokens`); Megatron's `pow2ceil(L / m)` when that fits."""
    lens = np.asarray(lengths, dtype=np.int64)
    c = pow2ceil(-(-lens // max_tokens_per_rank))
    over = rank_tokens(lens, c) > max_tokens_per_rank
    while over.any() and c.max() < 2**40:  # padding pushed it over: the next size
        c = np.where(over, 2 * c, c)
        over = rank_tokens(lens, c) > max_tokens_per_rank
    return c


def packing_only(lengths, pool: int, max_tokens_per_rank: int,
                 max_len: int | None = None) -> Packing:
    """First-fit packs of `c_static * m` tokens at the static CP size (see module docstring)."""
    lens = np.asarray(lengths, dtype=np.int64)
    max_len = int(lens.max()) if max_len is None else max(int(max_len), int(lens.max()))
    c = int(min_cp(max_len, max_tokens_per_rank))
    if c > pool:
        raise ValueError(f"max_len {max_len} needs CP {c} > pool {pool} at "
                         f"{max_tokens_per_rank} tokens per rank; lower --max-len")
    cap = max_tokens_per_rank
    free = np.empty(0, dtype=np.int64)
    packs: list[list[int]] = []
    for i, n in enumerate(rank_tokens(lens, c).tolist()):
        fits = np.flatnonzero(free >= n)
        if fits.size:
            k = int(fits[0])
        else:
            k = len(packs)
            packs.append([])
            free = np.append(free, cap)
        packs[k].append(i)
        free[k] -= n
    lanes = pool // c
    plan = Packing()
    for start in range(0, len(packs), lanes):
        groups = [Group(p, c, k * c) for k, p in enumerate(packs[start:start + lanes])]
        plan.rounds.append(Round(fill_idle(groups, pool)))
    return plan


def _greedy_micro_batch(order, lens, cps, own, pool, m):
    """Fill one micro-batch from `order`; return its groups and the deferred indices. Group
    tokens are per rank (`rank_tokens` at the group's size), loads `L^2 / c`. `lens`, `cps`:
    Python lists (tokens, CP size per sequence; scalar indexing of numpy arrays would dominate),
    `own` each sequence's tokens per rank at its CP size."""
    free = (1 << pool) - 1  # bit k set: rank k idle

    def block_free(o, c):
        return (free >> o) & ((1 << c) - 1) == (1 << c) - 1

    groups: list[dict] = []
    by_c: dict[int, list[dict]] = {}  # groups per CP size
    room: dict[int, int] = {}  # per CP size, the most tokens one of its groups can still take
    most_room = 0  # max(room.values())
    deferred: list[int] = []
    shortest = min(map(own.__getitem__, order))  # fewest per-rank tokens
    for k, i in enumerate(order):
        L, c = lens[i], cps[i]
        n = own[i]  # per-rank tokens at c
        if not free and most_room < shortest:
            deferred.extend(order[k:])  # nothing left fits anywhere in this micro-batch
            break
        o = next((o for o in range(0, pool, c) if block_free(o, c)), -1) if free else -1
        if o >= 0:
            free &= ~(((1 << c) - 1) << o)
            g = {"seqs": [i], "c": c, "off": o, "tok": n, "load": L * L / c}
            groups.append(g)
            by_c.setdefault(c, []).append(g)
        elif room.get(c, 0) >= n:
            g = min((g for g in by_c[c] if g["tok"] + n <= m), key=lambda g: g["load"])
            g["seqs"].append(i)
            g["tok"] += n
            g["load"] += L * L / c
        else:
            deferred.append(i)
            continue
        room[c] = max(m - g["tok"] for g in by_c[c])
        most_room = max(room.values())
    doubled = True
    while free and doubled:
        doubled = False
        for g in sorted(groups, key=lambda g: (g["c"], g["off"])):
            c2 = 2 * g["c"]
            base = g["off"] - g["off"] % c2
            mine = ((1 << g["c"]) - 1) << g["off"]
            want = ((1 << c2) - 1) << base
            if (c2 <= pool and (free | mine) & want == want
                    and sum(rank_tokens_of(lens[i], c2) for i in g["seqs"]) <= m):
                free &= ~want  # (the padding at c = 1 -> 2 counted)
                g["c"], g["off"], doubled = c2, base, True
                break
    return [Group(g["seqs"], g["c"], g["off"]) for g in groups], deferred


def greedy(lengths, pool: int, max_tokens_per_rank: int) -> Packing:
    """Megatron-LM-style dynamic CP (see module docstring); micro-batches in build order."""
    lens = np.asarray(lengths, dtype=np.int64)
    cps = min_cp(lens, max_tokens_per_rank).tolist()
    order = np.argsort(-lens, kind="stable").tolist()
    plan, as_list = Packing(), lens.tolist()
    own = [rank_tokens_of(x, c) for x, c in zip(as_list, cps)]
    while order:
        groups, order = _greedy_micro_batch(order, as_list, cps, own, pool, max_tokens_per_rank)
        plan.rounds.append(Round(fill_idle(groups, pool)))
    return plan
