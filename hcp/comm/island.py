"""Non-colocated boundary communicator (docs/design.md 4.2): per micro-batch, batched point-to-point
ops (`dist.batch_isend_irecv`) on the edge's dedicated group move a routing table's rows from the
encoder island's last-stage ranks to the LLM's first-stage ranks, and their gradients back.

The table is a `hcp.parallel.routing.RankRoute` (built per micro-batch by `build_routes` over
`hcp.parallel.islands.edge_ranks`): this rank sends `src[send_index]` in blocks of
`send_splits[j]` rows to group rank j and receives `recv_splits[j]` rows; backward, a row
returns its gradient only where `grad_owner` is True and the source sums it back at
`send_index`. Shapes come from the route (nothing is exchanged to learn them). Destination TP:
`direct` (every TP rank receives) or `leader` (TP rank 0 receives, then `broadcast_rows` inside
the TP group: the fewest cross-island bytes, the default). NCCL: all of one micro-batch's ops of
this rank go in ONE `batch_isend_irecv` (`forward_ops` / `backward_ops` hand them out to post
with the pipeline's ops); the first P2P call on an NCCL group follows a collective (`warm_up`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from hcp.comm.boundary import RouteBytes, grads_to_send, place_rows, rows_to_send, sum_grads
from hcp.parallel.routing import RankRoute

TAG_F, TAG_B = 2, 3  # activations and gradients of boundary rows (gloo matches tags, NCCL ignores)


@dataclass(frozen=True)
class IslandEdge:
    """This rank's view of an edge group.

    Args:
        ranks: global ranks of the group (`hcp.parallel.islands.edge_ranks`); the route's
            group rank j is `ranks[j]`.
        rank: this rank's group rank.
        group: the process group the ops are posted on (None: the world); it must contain
            `ranks`. A dedicated group over `ranks` keeps the edge's traffic apart; a schedule
            that posts boundary and pipeline ops of one step in ONE batch needs one group for
            both (`batch_isend_irecv` requires it), e.g. the group of all islands' ranks.
    """

    ranks: tuple[int, ...]
    rank: int
    group: object = None


def warm_up(edge: IslandEdge, device=None) -> None:
    """One all-reduce on the edge group: NCCL needs a collective on a group before its first
    point-to-point call (every member must call this once, in the same order)."""
    dist.all_reduce(torch.zeros(1, device=device), group=edge.group)


def _p2p(send: torch.Tensor, send_splits, recv: torch.Tensor, recv_splits, edge: IslandEdge,
         tag: int, counter_add: Callable[[int], None] | None) -> list:
    """P2P ops moving `send`'s blocks to their peers and filling `recv`'s blocks; the block
    for this rank itself is copied at once."""
    ops = []
    sent = send.split(list(send_splits))
    got = recv.split(list(recv_splits))
    for j, (s, r) in enumerate(zip(sent, got)):
        if j == edge.rank:
            r.copy_(s)
            continue
        if s.shape[0]:
            ops.append(dist.P2POp(dist.isend, s, edge.ranks[j], edge.group, tag))
            if counter_add is not None:
                counter_add(s.numel() * s.element_size())
        if r.shape[0]:
            ops.append(dist.P2POp(dist.irecv, r, edge.ranks[j], edge.group, tag))
    return ops


def forward_ops(src: torch.Tensor, route: RankRoute, edge: IslandEdge,
                counter: RouteBytes | None = None) -> tuple[list, Callable[[], torch.Tensor]]:
    """The forward move of one micro-batch as P2P ops, and `finish()` -> dst [route.dst_rows, H]
    (zeros where no row arrives) to call once the ops completed.

    src: [rows, H] this rank's source rows (0 rows on a destination-only rank, same H and
    dtype). Raises ValueError when src is not 2-D or the route indexes rows it does not have.
    """
    send = rows_to_send(src, route, "island forward")
    recv = src.new_empty(sum(route.recv_splits), src.shape[1])
    add = None if counter is None else (lambda n: setattr(counter, "forward", counter.forward + n))
    ops = _p2p(send, route.send_splits, recv, route.recv_splits, edge, TAG_F, add)
    return ops, lambda: place_rows(recv, route)


def backward_ops(grad_dst: torch.Tensor, route: RankRoute, src_rows: int, edge: IslandEdge,
                 counter: RouteBytes | None = None) -> tuple[list, Callable[[], torch.Tensor]]:
    """The backward move of one micro-batch as P2P ops, and `finish()` -> the gradient of the
    source rows [src_rows, H] (the sum of what each destination shard returned; zeros for rows
    sent nowhere). grad_dst: [route.dst_rows, H] (0 rows on a source-only rank, same H and
    dtype)."""
    send = grads_to_send(grad_dst, route)
    back = grad_dst.new_empty(sum(route.grad_recv_splits), grad_dst.shape[1])
    add = (None if counter is None
           else (lambda n: setattr(counter, "backward", counter.backward + n)))
    ops = _p2p(send, route.grad_send_splits, back, route.grad_recv_splits, edge, TAG_B, add)
    return ops, lambda: sum_grads(back, route, src_rows)


def post(ops: list) -> None:
    """Post `ops` in one `batch_isend_irecv` and wait for all (nothing when empty)."""
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def island_forward(src: torch.Tensor, route: RankRoute, edge: IslandEdge,
                   counter: RouteBytes | None = None) -> torch.Tensor:
    """Forward move of one micro-batch, no autograd: src [rows, H] -> dst [route.dst_rows, H].
    Only the ranks this rank exchanges rows with need to call it (with their own routes)."""
    ops, finish = forward_ops(src, route, edge, counter)
    post(ops)
    return finish()


def island_backward(grad_dst: torch.Tensor, route: RankRoute, src_rows: int, edge: IslandEdge,
                    counter: RouteBytes | None = None) -> torch.Tensor:
    """Backward move of one micro-batch, no autograd: grad_dst [route.dst_rows, H] -> the
    source's gradient [src_rows, H]."""
    ops, finish = backward_ops(grad_dst, route, src_rows, edge, counter)
    post(ops)
    return finish()


def broadcast_rows(dst: torch.Tensor | None, rows: int, hidden: int, dtype, leader: int, group,
                   device=None) -> torch.Tensor:
    """The `leader` variant's second step: the destination TP group's leader (global rank
    `leader`, TP rank 0, the only TP rank in the route) broadcasts its received rows
    [rows, hidden] to the other TP ranks. dst: the leader's rows (None elsewhere); rows: from
    the leader's route (`RankRoute.dst_rows`, which every TP rank computes from the plan).
    Backward needs no step: only the leader returns gradients (`grad_owner`), as in `direct`."""
    if dst is None:
        dst = torch.empty(rows, hidden, dtype=dtype, device=device)
    elif tuple(dst.shape) != (rows, hidden):
        raise ValueError(f"broadcast_rows: the leader holds {list(dst.shape)} rows, expected "
                         f"[{rows}, {hidden}]")
    dist.broadcast(dst, leader, group=group)
    return dst
