"""Differentiable collectives for tensor and context parallelism (the f/g operators of
Megatron-LM, Shoeybi et al. 2019, and the sequence-parallel pair of Korthikanti et al. 2022).

Each function takes `group: ProcessGroup | None`; None (or a group of size 1) makes it the
identity, so a module written once runs with or without parallelism.

| function            | forward                          | backward                          |
| copy_to_group       | identity                         | all-reduce (sum)                  |
| reduce_from_group   | all-reduce (sum)                 | identity                          |
| gather_from_group   | all-gather along `dim`           | keep this rank's slice            |
| gather_seq          | all-gather along dim 0           | reduce-scatter along dim 0        |
| reduce_scatter_seq  | reduce-scatter along dim 0       | all-gather along dim 0            |
| split_seq           | keep this rank's slice of dim 0  | all-gather along dim 0            |

`all_gather_rows` and `reduce_scatter_rows` are gather_seq's two collectives without autograd,
for a custom autograd Function that owns its gradient buffer (CP attention).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


# all_gather_into_tensor is deprecated in newer torch under this name; the lower bound has only it
_ALL_GATHER_INTO = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER_FROM = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""The tensor form of reduce-scatter (one flat input, no list of parts: NCCL's own call)."""


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x


def _all_gather(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    if dim == 0:  # straight into one tensor: no list of parts to concatenate (gloo: ~30x less
        out = x.new_empty((group_size(group) * x.shape[0], *x.shape[1:]))  # caller CPU time)
        _ALL_GATHER_INTO(out, x.contiguous(), group=group)
        return out
    parts = [torch.empty_like(x) for _ in range(group_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _reduce_scatter0(x: torch.Tensor, group) -> torch.Tensor:
    """Sum `x` [n * S, ...] over the group and keep this rank's [S, ...] slice of dim 0. On gloo
    as an all-to-all (slice j to rank j) and a local sum of the n slices received: the bytes of
    a reduce-scatter, without gloo's slow reduce_scatter (a fixed cost per call) or the twice
    as many bytes of an all-reduce."""
    n = group_size(group)
    if dist.get_backend(group) == "gloo":
        x = x.contiguous()
        received = torch.empty_like(x)
        dist.all_to_all_single(received, x, group=group)
        return received.view(n, -1, *x.shape[1:]).sum(0)
    x = x.contiguous()  # [n * S, ...]: rank j's slice is the j-th chunk of dim 0
    out = x.new_empty((x.shape[0] // n, *x.shape[1:]))
    _REDUCE_SCATTER_FROM(out, x, group=group)
    return out


def _slice(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    return x.chunk(group_size(group), dim=dim)[group_rank(group)].contiguous()


def _pair(name: str, forward, backward) -> type:
    """An autograd Function `apply(x, group)` computing `forward(x, group)`, whose backward is
    `backward(grad, group)`: each row of the module docstring's table is one pair."""

    def fwd(ctx, x, group):
        ctx.group = group
        return forward(x, group)

    def bwd(ctx, grad):
        return backward(grad, ctx.group), None

    return type(name, (torch.autograd.Function,),
                {"forward": staticmethod(fwd), "backward": staticmethod(bwd)})


_CopyToGroup = _pair("_CopyToGroup", lambda x, g: x.view_as(x), _all_reduce)
_ReduceFromGroup = _pair("_ReduceFromGroup", _all_reduce, lambda grad, g: grad)
_GatherSeq = _pair("_GatherSeq", lambda x, g: _all_gather(x, g, 0), _reduce_scatter0)
_ReduceScatterSeq = _pair("_ReduceScatterSeq", _reduce_scatter0,
                          lambda grad, g: _all_gather(grad, g, 0))
_SplitSeq = _pair("_SplitSeq", lambda x, g: _slice(x, g, 0),
                  lambda grad, g: _all_gather(grad, g, 0))


class _GatherFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _slice(grad, ctx.group, ctx.dim), None, None


def copy_to_group(x: torch.Tensor, group) -> torch.Tensor:
    return x if group_size(group) == 1 else _CopyToGroup.apply(x, group)


def reduce_from_group(x: torch.Tensor, group) -> torch.Tensor:
    return x if group_size(group) == 1 else _ReduceFromGroup.apply(x, group)


def gather_from_group(x: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    return x if group_size(group) == 1 else _GatherFromGroup.apply(x, group, dim)


def all_gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    """`gather_seq` without autograd, for a custom autograd Function that reduces its own
    gradient buffer with `reduce_scatter_rows`."""
    return x if group_size(group) == 1 else _all_gather(x, group, 0)


def reduce_scatter_rows(x: torch.Tensor, group) -> torch.Tensor:
    """Sum x [n * S, ...] (a buffer the caller owns and no longer reads) over the group and
    return this rank's [S, ...] rows, in x's memory where the collective allows."""
    return x if group_size(group) == 1 else _reduce_scatter0(x, group)


def gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    """x [T / n, ...] -> [T, ...] in rank order; backward sums the gradients of each slice on
    its owner (reduce-scatter)."""
    return x if group_size(group) == 1 else _GatherSeq.apply(x, group)


def reduce_scatter_seq(x: torch.Tensor, group) -> torch.Tensor:
    """x [T, ...] (partial sums) -> this rank's slice [T / n, ...] of the sum."""
    return x if group_size(group) == 1 else _ReduceScatterSeq.apply(x, group)


def split_seq(x: torch.Tensor, group) -> torch.Tensor:
    """x [T, ...] (replicated) -> this rank's slice [T / n, ...]."""
    return x if group_size(group) == 1 else _SplitSeq.apply(x, group)
