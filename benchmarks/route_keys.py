"""Routes from per-rank row keys: the reference the tests check the step plan's routes against
(and build hand-made routes with), plus the fewest rows any route can move (`min_route_rows`,
what route bytes are reported against). Pure numpy, no process group; the training path routes
through `hcp.plan` only."""
from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from hcp.parallel.routing import RankRoute


def build_routes(src_keys: Sequence[np.ndarray], dst_keys: Sequence[np.ndarray],
                 grad_owner: Sequence[np.ndarray] | None = None,
                 ranks: Iterable[int] | None = None) -> dict[int, RankRoute]:
    """Routing table of one exchange from per-rank row keys (vectorized numpy, no process group).

    A key is any int64 naming one row of the edge's global data, e.g. a global image-row id
    (sample offset + row within the sample). Group rank r's source tensor holds rows
    `src_keys[r]` (int [rows_r], unique within the rank) and its destination tensor must hold
    rows `dst_keys[r]` (int [dst_rows_r], unique within the rank); a rank outside one side
    passes an empty array.

    A key held by k > 1 source ranks (replicas, e.g. the TP ranks of one encoder lane) is sent
    by exactly one of them: with h_0 < ... < h_{k-1} its holders and p its row in h_0's
    tensor of n rows, holder h_{p*k//n} (contiguous blocks, so identical replicas split the
    rows evenly and disjointly). Each delivery of one row to one destination rank moves the
    row once; within a (source, destination) pair rows travel in destination-row order.

    grad_owner[r] (bool [dst_rows_r], default all True): whether destination row i of rank r
    returns its gradient; set it True on exactly one replica of a destination shard (e.g. TP
    rank 0 of the LLM's TP group) so a gradient returns once per shard.

    ranks: the group ranks whose `RankRoute` to build (default all). A rank needs only its own;
    the cost is a few sorts of all rows (about 1 s for 4096 ranks and 9.4 M deliveries).

    Raises:
        ValueError: lists of different lengths, a key repeated within one rank's source (or
            within a built rank's destination), a destination key no source holds, or a
            grad_owner of the wrong shape.
    """
    world = len(src_keys)
    if len(dst_keys) != world or (grad_owner is not None and len(grad_owner) != world):
        raise ValueError(f"build_routes: src_keys ({world}), dst_keys ({len(dst_keys)}) and "
                         "grad_owner must have one entry per group rank")
    ranks = list(range(world)) if ranks is None else list(ranks)
    s_key, s_rank, s_pos = _flatten(src_keys)
    d_key, d_rank, d_pos = _flatten(dst_keys)
    owner = (np.ones(len(d_key), dtype=bool) if grad_owner is None
             else _flatten_owner(grad_owner, dst_keys))

    # one sender per key: entries sorted by key, holders in rank order (stable sort)
    order = np.argsort(s_key, kind="stable")
    s_key, s_rank, s_pos = s_key[order], s_rank[order], s_pos[order]
    dup = (s_key[1:] == s_key[:-1]) & (s_rank[1:] == s_rank[:-1])
    if dup.any():
        i = int(np.flatnonzero(dup)[0])
        raise ValueError(f"build_routes: src_keys[{int(s_rank[i])}] holds key {int(s_key[i])} twice")
    is_first = np.ones(len(s_key), dtype=bool)
    is_first[1:] = s_key[1:] != s_key[:-1]
    first = np.flatnonzero(is_first)
    keys = s_key[first]
    count = np.diff(np.append(first, len(s_key)))
    rows_first = np.array([len(k) for k in src_keys], dtype=np.int64)[s_rank[first]]
    pick = first + (s_pos[first] * count) // np.maximum(rows_first, 1)
    send_rank, send_pos = s_rank[pick], s_pos[pick]

    where = np.minimum(np.searchsorted(keys, d_key), max(len(keys) - 1, 0))
    found = keys[where] == d_key if len(keys) else np.zeros(len(d_key), dtype=bool)
    if not found.all():
        bad = int(np.flatnonzero(~found)[0])
        raise ValueError(f"build_routes: destination rank {int(d_rank[bad])} needs key "
                         f"{int(d_key[bad])}, which no source rank holds")
    src_of, pos_of = send_rank[where], send_pos[where]                 # [deliveries]

    # deliveries are in (destination rank, destination row) order; stable sorts keep it
    d_start = np.searchsorted(d_rank, np.arange(world + 1))
    mine = np.isin(src_of, ranks)
    out_all = np.flatnonzero(mine)
    out_all = out_all[np.argsort(src_of[out_all] * world + d_rank[out_all], kind="stable")]
    o_start = np.searchsorted(src_of[out_all], np.arange(world + 1))
    routes = {}
    for r in ranks:
        out = out_all[o_start[r]:o_start[r + 1]]
        inc = np.arange(d_start[r], d_start[r + 1])
        inc = inc[np.argsort(src_of[inc], kind="stable")]
        if len(np.unique(d_key[inc])) != len(inc):
            raise ValueError(f"build_routes: dst_keys[{r}] holds a key twice")
        routes[r] = RankRoute(
            send_index=tuple(pos_of[out].tolist()),
            send_splits=_counts(d_rank[out], world),
            recv_index=tuple(d_pos[inc].tolist()),
            recv_splits=_counts(src_of[inc], world),
            dst_rows=len(dst_keys[r]),
            grad_owner=tuple(owner[inc].tolist()),
            grad_returns=tuple(owner[out].tolist()),
            grad_send_splits=_counts(src_of[inc][owner[inc]], world),
            grad_recv_splits=_counts(d_rank[out][owner[out]], world),
        )
    return routes


def min_route_rows(dst_keys: Sequence[np.ndarray], dst_shard: Sequence[int] | None = None) -> tuple[int, int]:
    """The fewest rows any route can move for these destination needs: (forward, backward).

    Forward: each needed row delivered once to each destination rank that needs it. Backward:
    each row's gradient once per destination shard, where `dst_shard[r]` names rank r's shard
    (ranks holding replicas of one shard, e.g. one LLM TP group, share an id; default: every
    rank its own shard). Rows a rank sends to itself count too (the colocated
    `all_to_all_single` copies them), as they do in the moved bytes.
    """
    keys, rank, _ = _flatten(dst_keys)
    shard = rank if dst_shard is None else np.asarray(list(dst_shard), dtype=np.int64)[rank]
    return _distinct_pairs(rank, keys), _distinct_pairs(shard, keys)


def _distinct_pairs(a: np.ndarray, b: np.ndarray) -> int:
    """Number of distinct (a[i], b[i]) pairs."""
    if len(a) == 0:
        return 0
    order = np.lexsort((b, a))
    a, b = a[order], b[order]
    return int(1 + np.count_nonzero((a[1:] != a[:-1]) | (b[1:] != b[:-1])))


def _flatten(per_rank: Sequence[np.ndarray]):
    """(keys, rank, position) of every row of every rank, int64 [rows], in (rank, row) order."""
    arrays = [np.asarray(k, dtype=np.int64).reshape(-1) for k in per_rank]
    sizes = np.array([len(a) for a in arrays], dtype=np.int64)
    keys = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
    rank = np.repeat(np.arange(len(arrays), dtype=np.int64), sizes)
    pos = np.arange(len(keys), dtype=np.int64) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    return keys, rank, pos


def _flatten_owner(grad_owner: Sequence[np.ndarray], dst_keys: Sequence[np.ndarray]) -> np.ndarray:
    parts = []
    for r, (own, keys) in enumerate(zip(grad_owner, dst_keys)):
        own = np.asarray(own, dtype=bool).reshape(-1)
        if len(own) != len(keys):
            raise ValueError(f"build_routes: grad_owner[{r}] has {len(own)} entries for "
                             f"{len(keys)} destination rows")
        parts.append(own)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=bool)


def _counts(ranks: np.ndarray, world: int) -> tuple[int, ...]:
    return tuple(np.bincount(ranks, minlength=world).tolist())
