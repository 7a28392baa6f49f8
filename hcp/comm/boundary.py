"""Colocated boundary communicator (docs/design.md 4.2): moves rows between the ranks of one group
by a routing table (`hcp.parallel.routing.RankRoute`) with one `all_to_all_single` per direction.

Forward: rank r sends `src[send_index]` (`send_splits[j]` rows to group rank j) and scatters the
`recv_splits` rows it receives into `[dst_rows, H]` at `recv_index`. Backward: a received row
whose `grad_owner` is True returns its gradient; the source sums them back (`index_add_` at
`send_index` where `grad_returns`); unsent rows get zero gradient. Both directions are
collectives every rank of the group calls in the same order (0-row tensors where it has
nothing), so they are also plain functions (`route_forward`, `route_backward`) a schedule calls
explicitly. The row gathers and scatters are shared with `hcp.comm.island`."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from hcp.parallel.routing import RankRoute
from hcp.parallel.upload import upload


@dataclass
class RouteBytes:
    """Bytes this rank sent through boundary routes, per direction (rows sent to itself
    included: `all_to_all_single` copies them too). Summed over the group's ranks they compare
    with `hcp.parallel.routing.min_route_rows` times H times the element size."""

    forward: int = 0
    backward: int = 0


def _index(values, device) -> torch.Tensor:
    return upload(values, device, torch.long)


def _where(mask, device) -> torch.Tensor:
    """The positions where the host mask `mask` is true, as an index on `device` (a boolean
    index on the device would be a `nonzero`: a device-to-host sync)."""
    return _index([i for i, m in enumerate(mask) if m], device)


def rows_to_send(src: torch.Tensor, route: RankRoute, who: str) -> torch.Tensor:
    """`src[send_index]`: the rows this rank sends, grouped by destination (no autograd).
    Raises ValueError naming `who` when src is not [rows, H] or lacks a row the route sends."""
    if src.dim() != 2:
        raise ValueError(f"{who}: src must be [rows, H], got {list(src.shape)}")
    if route.send_index and max(route.send_index) >= src.shape[0]:
        raise ValueError(f"{who}: the route sends row {max(route.send_index)} but src "
                         f"has {src.shape[0]} rows")
    return src.detach().index_select(0, _index(route.send_index, src.device))


def place_rows(recv: torch.Tensor, route: RankRoute) -> torch.Tensor:
    """The received rows [sum(recv_splits), H] at their places of dst [route.dst_rows, H]
    (zeros where no row arrives)."""
    dst = recv.new_zeros(route.dst_rows, recv.shape[1])
    return dst.index_copy_(0, _index(route.recv_index, recv.device), recv)


def grads_to_send(grad_dst: torch.Tensor, route: RankRoute) -> torch.Tensor:
    """The gradients this rank returns: of each received row it owns (`grad_owner`)."""
    received = grad_dst.detach().index_select(0, _index(route.recv_index, grad_dst.device))
    return received.index_select(0, _where(route.grad_owner, grad_dst.device))


def sum_grads(back: torch.Tensor, route: RankRoute, src_rows: int) -> torch.Tensor:
    """The returned gradients `back` summed into the source's gradient [src_rows, H] at the
    sent rows that get one (`grad_returns`); zeros for rows sent nowhere."""
    index = _index(route.send_index,
                   back.device).index_select(0, _where(route.grad_returns, back.device))
    return back.new_zeros(src_rows, back.shape[1]).index_add_(0, index, back)


def _exchange(send: torch.Tensor, send_splits, recv_splits, group) -> torch.Tensor:
    """One all_to_all_single: send [sum(send_splits), H] -> received [sum(recv_splits), H]."""
    recv = send.new_empty(sum(recv_splits), send.shape[1])
    dist.all_to_all_single(recv, send.contiguous(), output_split_sizes=list(recv_splits),
                           input_split_sizes=list(send_splits), group=group)
    return recv


def route_forward(src: torch.Tensor, route: RankRoute, group=None,
                  counter: RouteBytes | None = None) -> torch.Tensor:
    """Forward move, no autograd: src [rows, H] -> dst [route.dst_rows, H] (zeros where no row
    arrives). Every rank of `group` must call it. Raises ValueError when src is not 2-D or the
    route indexes rows src does not have."""
    send = rows_to_send(src, route, "route_forward")
    recv = _exchange(send, route.send_splits, route.recv_splits, group)
    if counter is not None:
        counter.forward += send.numel() * send.element_size()
    return place_rows(recv, route)


def route_backward(grad_dst: torch.Tensor, route: RankRoute, src_rows: int, group=None,
                   counter: RouteBytes | None = None) -> torch.Tensor:
    """Backward move, no autograd: the destination's gradient [route.dst_rows, H] -> the
    gradient of the source tensor [src_rows, H] (the sum of what each destination shard
    returned for each row; zeros for rows sent nowhere). Every rank of `group` must call it."""
    send = grads_to_send(grad_dst, route)
    back = _exchange(send, route.grad_send_splits, route.grad_recv_splits, group)
    if counter is not None:
        counter.backward += send.numel() * send.element_size()
    return sum_grads(back, route, src_rows)


class _Route(torch.autograd.Function):
    @staticmethod
    def forward(ctx, src, route, group, counter):
        ctx.route, ctx.group, ctx.counter, ctx.rows = route, group, counter, src.shape[0]
        return route_forward(src, route, group, counter)

    @staticmethod
    def backward(ctx, grad_dst):
        grad = route_backward(grad_dst.contiguous(), ctx.route, ctx.rows, ctx.group, ctx.counter)
        return grad, None, None, None


def route_rows(src: torch.Tensor, route: RankRoute, group=None,
               counter: RouteBytes | None = None) -> torch.Tensor:
    """Differentiable row move: src [rows, H] -> dst [route.dst_rows, H]; backward returns to
    each source row the gradients of its deliveries (once per destination shard).

    Autograd runs the backward collective only where the output's graph reaches it: use it
    when every rank of `group` differentiates through its output (e.g. every rank's src requires
    grad), otherwise call `route_forward` / `route_backward` explicitly.
    """
    return _Route.apply(src, route, group, counter)
