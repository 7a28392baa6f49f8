"""Routing tables of module-graph edges (docs/design.md 4.2, 4.3): which rows each source rank sends
to each destination rank, and the reverse for gradients. Pure data: the step plan fills them
identically on every rank, the boundary communicators (`hcp.comm.boundary`) execute them.

Conventions of the edge into the LLM:
- Row keys: sample s's image rows are 0..n_s-1 (images x patches, in order of appearance); an
  encoder rank's source tensor is its lane's samples' rows in sample order, `[rows, H_llm]`.
- Encoder TP > 1: row p of a lane's R rows is sent by replica floor(p * tp / R), which gets
  back exactly those rows' gradients (the output's backward all-reduces over the encoder TP).
- Destination: LLM first-stage ranks receive the rows of their CP shard of the MERGED sequence
  (`cp_slot`), ordered by micro-batch then local slot; every TP rank receives, TP rank 0 is
  `grad_owner`. Colocated placement uses the world group.
The step plan builds a `RowTable` (all rows of an edge, vectorized) and cuts each `RankRoute`
from it; benchmarks/route_keys.py builds routes from per-rank keys (the tests' reference)."""
from __future__ import annotations

from dataclasses import dataclass

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
    `cp_size` (head-tail chunks, docs/design.md section 3; `hcp.parallel.cp_sharding.cp_shard` is
    the same math over whole documents). Element-wise over int64 arrays.

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
        object.__setattr__(self, "_src_cuts",
                           np.searchsorted(self.src[by_src], np.arange(self.group_size + 1)))
        object.__setattr__(self, "_dst_cuts",
                           np.searchsorted(self.shard[by_dst], np.arange(shards + 1)))
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
            recv_splits, recv_index, dst_rows = (np.zeros(g, dtype=np.int64), np.zeros(0, np.int64),
                                                 0)
        owner = bool(rep == 0)
        return RankRoute(
            send_index=tuple(self.src_row[rows].tolist()), send_splits=tuple(send_splits.tolist()),
            recv_index=tuple(recv_index.tolist()), recv_splits=tuple(recv_splits.tolist()),
            dst_rows=int(dst_rows), grad_owner=(owner,) * int(dst_rows),
            grad_returns=tuple((replica == 0).tolist()),
            grad_send_splits=tuple((recv_splits if owner else 0 * recv_splits).tolist()),
            grad_recv_splits=tuple(grad_recv.tolist()))
