"""Routing tables of module-graph edges (docs/design.md 4.2, 4.3): which rows each source rank sends
to each destination rank, and the reverse for gradients. Pure data, no process group: the step
plan (`hcp.plan`) fills them identically on every rank, the boundary communicators
(`hcp.comm.boundary`) execute them.

Conventions of the edge into the LLM (the projector's output rows; agreed with the boundary
communicators and the LLM stage):
- Row keys: the image rows of sample s are rows 0..n_s-1 (n_s = its images x patches, images in
  order of appearance). An encoder rank's source tensor is its encoder lane's samples' rows
  concatenated in sample order (projector output flattened to `[rows, H_llm]`).
- Encoder TP > 1: the TP replicas of one lane hold identical rows; row p of the lane's R rows
  is sent by replica floor(p * tp / R) (contiguous, balanced, disjoint parts), which gets back
  the gradients of exactly those rows. The encoder output goes through an op whose
  backward all-reduces over the encoder TP group (Megatron's copy-to-TP-region), which turns the
  replicas' partial gradients into the full one.
- Destination: only LLM first-stage ranks (pp = 0) receive. Each receives exactly the image rows
  that fall in its CP shard (head-tail chunks of the MERGED text + image sequence, `cp_slot`),
  ordered by (its micro-batch order, then slot order inside its local shard); the step plan gives
  each micro-batch its `[start, end)` range of that tensor. Every TP rank of the destination TP
  group receives the same rows; only TP rank 0 is `grad_owner`.
- Group: colocated placement uses the world group (group rank = global rank).

The step plan builds a `RowTable` (all rows of an edge as flat arrays, vectorized) and cuts each
rank's `RankRoute` from it. `build_routes` turns per-rank row keys (which rows each source rank holds, which rows each
destination rank needs) into every rank's `RankRoute`; `min_route_rows` gives the fewest rows
any route can move for the same needs (the figure route bytes are reported against).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np


@dataclass(frozen=True)
class RankRoute:
    """One rank's part of one edge's routing table for one exchange (a step or a micro-batch).

    Ranks are indexed by their position in the edge's communicator group (group rank, not
    global rank). Rows are rows of a 2-D tensor `[rows, hidden]`.

    Forward: this rank sends `src[send_index]` (grouped by destination, in group-rank order,
    `send_splits[j]` rows to group rank j), receives `recv_splits[j]` rows from group rank j
    (concatenated in group-rank order) and places received row i at `dst[recv_index[i]]` of a
    destination tensor of `dst_rows` rows.

    Backward: a row delivered to several replicas of one destination shard (e.g. the TP ranks
    of one LLM TP group) returns its gradient once: received row i sends its gradient back
    only where `grad_owner[i]` is True; on the source, sent row k gets a gradient back iff
    `grad_returns[k]` (aligned with `send_index`), and the source sums what comes back into
    `grad_src` at those `send_index` entries (a source row sent to several destination shards
    receives each of their gradients). `grad_send_splits` / `grad_recv_splits` are the
    backward splits in rows (they follow from `grad_owner` / `grad_returns`).
    """

    send_index: tuple[int, ...]
    send_splits: tuple[int, ...]
    recv_index: tuple[int, ...]
    recv_splits: tuple[int, ...]
    dst_rows: int
    grad_owner: tuple[bool, ...]
    grad_returns: tuple[bool, ...]
    grad_send_splits: tuple[int, ...]
    grad_recv_splits: tuple[int, ...]


def cp_slot(position: np.ndarray, length: np.ndarray, cp_size: np.ndarray):
    """Where merged position `position` of a document of `length` tokens lands under CP size
    `cp_size` (head-tail chunks, docs/design.md section 3; `hcp.parallel.cp_sharding.cp_shard` is the
    same math over whole documents). Element-wise over int64 arrays.

    Returns (cp rank, slot in that rank's local copy of the document): the document is padded to
    2c * k tokens, k = ceil(length / 2c); rank r holds chunks r and 2c-1-r as its local slots
    [0, k) and [k, 2k).
    """
    two_c = 2 * cp_size
    k = -(-length // two_c)
    q = position // k
    head = q < cp_size
    rank = np.where(head, q, two_c - 1 - q)
    slot = position - q * k + np.where(head, 0, k)
    return rank, slot


@dataclass(frozen=True)
class RowTable:
    """All rows of one edge for one exchange, as flat arrays (int64 [R], one entry per row).

    Row `i` is held by source group rank `src[i]` at `src_row[i]` of its source tensor and is
    delivered to destination shard `shard[i]` at `dst_row[i]` of that shard's received tensor.
    `shard_ranks` ([S, replicas] int64, group ranks, ascending in shard order) lists the ranks
    that receive a shard: every replica gets the same rows, replica 0 returns their gradient.
    Built by the step plan (`hcp.plan`); `rank_route` cuts out one rank's `RankRoute`.
    """

    src: np.ndarray
    src_row: np.ndarray
    shard: np.ndarray
    dst_row: np.ndarray
    shard_ranks: np.ndarray
    group_size: int

    def __post_init__(self):
        shards, width = len(self.shard_ranks), int(self.dst_row.max()) + 1 if len(self.src) else 1
        if self.group_size * shards * width < 2**62:  # one int64 key sorts faster than lexsort
            by_src = np.argsort((self.src * shards + self.shard) * width + self.dst_row)
            by_dst = np.argsort((self.shard * self.group_size + self.src) * width + self.dst_row)
        else:
            by_src = np.lexsort((self.dst_row, self.shard, self.src))
            by_dst = np.lexsort((self.dst_row, self.src, self.shard))
        object.__setattr__(self, "_by_src", by_src)
        object.__setattr__(self, "_by_dst", by_dst)
        object.__setattr__(self, "_src_cuts", np.searchsorted(self.src[by_src], np.arange(self.group_size + 1)))
        object.__setattr__(self, "_dst_cuts", np.searchsorted(self.shard[by_dst], np.arange(shards + 1)))
        where = np.full((self.group_size, 2), -1, dtype=np.int64)   # rank -> (shard, replica)
        s, t = np.indices(self.shard_ranks.shape).reshape(2, -1)
        where[self.shard_ranks[s, t]] = np.stack([s, t], 1)
        object.__setattr__(self, "_where", where)

    def shard_rows(self) -> np.ndarray:
        """[S] rows each shard receives."""
        return np.diff(self._dst_cuts)

    def route(self, rank: int) -> RankRoute:
        """Group rank `rank`'s part of the exchange (conventions: `RankRoute`)."""
        g = self.group_size
        mine = self._by_src[self._src_cuts[rank]:self._src_cuts[rank + 1]]
        reps = self.shard_ranks.shape[1]
        rows = np.repeat(mine, reps)
        replica = np.tile(np.arange(reps), len(mine))
        dst = self.shard_ranks[self.shard[rows], replica]
        order = np.lexsort((self.dst_row[rows], dst))
        rows, replica, dst = rows[order], replica[order], dst[order]
        send_splits = np.bincount(dst, minlength=g)
        grad_recv = np.bincount(dst[replica == 0], minlength=g)
        shard, rep = self._where[rank]
        if shard >= 0:
            got = self._by_dst[self._dst_cuts[shard]:self._dst_cuts[shard + 1]]
            recv_splits = np.bincount(self.src[got], minlength=g)
            recv_index, dst_rows = self.dst_row[got], len(got)
        else:
            recv_splits, recv_index, dst_rows = np.zeros(g, dtype=np.int64), np.zeros(0, np.int64), 0
        owner = bool(rep == 0)
        return RankRoute(
            send_index=tuple(self.src_row[rows].tolist()), send_splits=tuple(send_splits.tolist()),
            recv_index=tuple(recv_index.tolist()), recv_splits=tuple(recv_splits.tolist()),
            dst_rows=int(dst_rows), grad_owner=(owner,) * int(dst_rows),
            grad_returns=tuple((replica == 0).tolist()),
            grad_send_splits=tuple((recv_splits if owner else 0 * recv_splits).tolist()),
            grad_recv_splits=tuple(grad_recv.tolist()))



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
