"""Links of the executor (`hcp.schedule.executor`): each turns the schedule's abstract ops
(`P2P(kind, micro, peer stage)`) into this rank's `torch.distributed.P2POp`s.

- `PipeLink`: neighbouring stages of one module's pipeline; shapes from `spec(micro)`, known on
  every stage beforehand (a send of another shape raises);
- `RouteLink`: an edge between islands, per micro-batch `RankRoute`s run by `hcp.comm.island`;
- `StreamsLink`: every stream's routes between two islands as one link (the streams' rows
  concatenated in stream order, cut by the plan's row counts).
All ops of one `Exchange` go in ONE `batch_isend_irecv`, so every link of a rank posts on the
same process group."""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from hcp.comm.boundary import RouteBytes
from hcp.comm.island import IslandEdge, backward_ops, broadcast_rows, forward_ops
from hcp.parallel.routing import RankRoute

_TAGS = {"F": 0, "B": 1}


class PipeLink:
    """Link to the neighbouring stage of the same module's pipeline.

    Args:
        peer: the peer's global rank (or, with `stage_link`, its stage index there);
        spec(micro) -> (shape, dtype) of the activation this link carries forward; group: the
        process group ops are posted on; device: buffers; stage_link: a
        `hcp.comm.p2p.StageLink` whose `exchange` posts this link's ops (as its
        (is_send, tensor, peer stage, "F" | "B") tuples) instead of `torch.distributed.P2POp`s.
    """

    def __init__(self, peer: int, spec: Callable, group=None, device=None, stage_link=None):
        self.peer, self.spec, self.group, self.device = peer, spec, group, device
        self.stage_link = stage_link

    def ops(self, kind: str, micro: int, tensor: torch.Tensor | None):
        """(P2P ops, finish() -> received tensor or None) of one schedule op. tensor: what to
        send (SEND_*), this stage's output (RECV_B: the gradient's shape) or None (RECV_F)."""
        if kind == "SEND_F":
            self._check(tensor, micro)
        if kind.startswith("SEND"):
            return [self._op(True, tensor.contiguous(), kind[-1])], None
        if kind == "RECV_F":
            shape, dtype = self.spec(micro)
            buf = torch.empty(shape, dtype=dtype, device=self.device)
        else:
            buf = torch.empty_like(tensor)
        return [self._op(False, buf, kind[-1])], lambda: buf

    def _op(self, is_send: bool, buf: torch.Tensor, tag: str):
        if self.stage_link is not None:
            return is_send, buf, self.peer, tag
        return dist.P2POp(dist.isend if is_send else dist.irecv, buf, self.peer, self.group,
                          _TAGS[tag])

    def _check(self, out: torch.Tensor, micro: int) -> None:
        shape, dtype = self.spec(micro)
        if tuple(out.shape) != tuple(shape) or out.dtype != dtype:
            raise RuntimeError(f"micro-batch {micro}: this stage's output is {out.dtype} "
                               f"{tuple(out.shape)} but the next stage expects {dtype} "
                               f"{tuple(shape)} (the link's spec and the model disagree)")


class RouteLink:
    """Link over an island edge: micro-batch i moves by `routes[i]` (`hcp.comm.island`).

    Args:
        edge: this rank's `IslandEdge`; routes: this rank's `RankRoute` of every micro-batch;
        hidden, dtype, device: of the rows; counter: accumulates the bytes this rank sends;
        leader: on a destination rank under the `leader` variant (`hcp.comm.island`), the
        (TP group, leader's global rank, rows of every micro-batch) with which the received rows
        are broadcast inside the destination TP group; every TP rank of the stage gives it.
    """

    def __init__(self, edge: IslandEdge, routes: Sequence[RankRoute], hidden: int, dtype,
                 device=None, counter: RouteBytes | None = None, leader=None):
        self.edge, self.routes, self.counter, self.leader = edge, list(routes), counter, leader
        self.empty = torch.empty(0, hidden, dtype=dtype, device=device)

    def ops(self, kind: str, micro: int, tensor: torch.Tensor | None):
        """As `PipeLink.ops`."""
        route = self.routes[micro]
        if kind == "SEND_F":
            return forward_ops(tensor, route, self.edge, self.counter)[0], None
        if kind == "RECV_F":
            ops, finish = forward_ops(self.empty, route, self.edge, self.counter)
            if self.leader is None:
                return ops, finish
            group, leader, rows = self.leader
            me = self.edge.ranks[self.edge.rank]
            return ops, lambda: broadcast_rows(finish() if me == leader else None, rows[micro],
                                               self.empty.shape[1], self.empty.dtype, leader,
                                               group, self.empty.device)
        if kind == "SEND_B":
            return backward_ops(tensor, route, 0, self.edge, self.counter)[0], None
        return backward_ops(self.empty, route, tensor.shape[0], self.edge, self.counter)


class StreamsLink:
    """The `RouteLink`s of several streams between the same two stages as one link: the tensor
    a stage sends or receives is every stream's rows concatenated in stream order.

    Args:
        links: one `RouteLink` per stream, in stream order (the same order on both islands);
        rows: per stream, per micro-batch, the rows of that stream in THIS rank's tensor (on
            the source: the rows the lane computed, `RankPlan.encoder_rows`; on a destination:
            the rows of its shard, `MicroBatchPlan.stream_rows`), so nothing is exchanged to
            learn the cut.
    """

    def __init__(self, links: Sequence[RouteLink], rows: Sequence[Sequence[int]]):
        self.links, self.rows = list(links), [list(r) for r in rows]

    def ops(self, kind: str, micro: int, tensor: torch.Tensor | None):
        """As `PipeLink.ops`, over every stream's route in one list of ops."""
        parts = ([None] * len(self.links) if tensor is None else
                 tensor.split([r[micro] for r in self.rows]))
        ops, finishers = [], []
        for link, part in zip(self.links, parts):
            p2p, finish = link.ops(kind, micro, part)
            ops += p2p
            finishers.append(finish)
        if kind.startswith("SEND"):
            return ops, None
        return ops, lambda: torch.cat([f() for f in finishers])
