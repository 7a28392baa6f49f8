"""Routing tables of module-graph edges (DESIGN.md 4.2, 4.3): which rows each source rank sends
to each destination rank, and the reverse for gradients. Pure data, no process group: the step
plan (`hcp.plan`) fills them identically on every rank, the boundary communicators
(`hcp.comm.boundary`) execute them.
"""
from __future__ import annotations

from dataclasses import dataclass


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
