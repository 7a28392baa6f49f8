"""Executor of the graph-aware 1F1B (`hcp.schedule.graph`) on one rank: runs its stage's action
list, with one link per neighbouring stage.

A link turns the schedule's abstract ops (`P2P(kind, micro, peer stage)`) into this rank's
`torch.distributed.P2POp`s:
- `PipeLink`: neighbouring stages of one module's pipeline (this rank to the rank with the
  same TP/CP/DP coordinates on the peer stage); shapes from `spec(micro)`;
- `RouteLink`: an edge between islands, per micro-batch `RankRoute`s run by
  `hcp.comm.island` (encoder last stage -> LLM first stage, fan-in/out, CP, TP);
- `StreamsLink`: the routes of every stream between two islands (a branch: one encoder feeding
  two projectors into the LLM) as one link; the stage's tensor is the streams' rows
  concatenated in stream order, cut by rows the step plan gives.
All ops of one `Exchange` (every peer, both kinds of link) are posted in ONE
`batch_isend_irecv`, so every link of a rank must post on the same process group (e.g. the
world, or the group of all islands' ranks).

The stage's `forward(micro, inputs)` gets `inputs`, {peer stage: received activation (a leaf
that requires grad)} ({} on a source stage, which reads its own micro-batch), and returns the
activation to send (the same tensor goes to every next stage of a branch) or, on a sink stage,
the 0-d loss to differentiate. A backward runs on the sum of the gradients the next stages
returned, then each input leaf's gradient goes back to the stage it came from. Gradients
accumulate in the parameters' `.grad` (synchronous semantics: the same as running the
micro-batches one after another).
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from hcp.comm.boundary import RouteBytes
from hcp.comm.island import IslandEdge, backward_ops, broadcast_rows, forward_ops, post
from hcp.parallel.routing import RankRoute
from hcp.schedule import actions as A
from hcp.schedule.pipeline import StageTimes

_TAGS = {"F": 0, "B": 1}


class PipeLink:
    """Link to the neighbouring stage of the same module's pipeline.

    Args:
        peer: the peer's global rank; spec(micro) -> (shape, dtype) of the activation this
        link carries forward; group: the process group ops are posted on; device: buffers."""

    def __init__(self, peer: int, spec: Callable, group=None, device=None):
        self.peer, self.spec, self.group, self.device = peer, spec, group, device

    def ops(self, kind: str, micro: int, tensor: torch.Tensor | None):
        """(P2P ops, finish() -> received tensor or None) of one schedule op. tensor: what to
        send (SEND_*), this stage's output (RECV_B: the gradient's shape) or None (RECV_F)."""
        if kind.startswith("SEND"):
            buf = tensor.contiguous()
            return [dist.P2POp(dist.isend, buf, self.peer, self.group, _TAGS[kind[-1]])], None
        if kind == "RECV_F":
            shape, dtype = self.spec(micro)
            buf = torch.empty(shape, dtype=dtype, device=self.device)
        else:
            buf = torch.empty_like(tensor)
        return [dist.P2POp(dist.irecv, buf, self.peer, self.group, _TAGS[kind[-1]])], lambda: buf


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


class GraphStageExecutor:
    """Runs one stage's graph-aware 1F1B action list on this rank.

    Args:
        forward: `forward(micro, inputs) -> Tensor` (module docstring);
        links: {peer global stage: `PipeLink` | `RouteLink`} for every neighbour of the stage;
        grad_sync: called before each backward with True only before the last one (e.g. a
            `hcp.train.grad_reduce.GradReducer.sync_in_backward`, so the DP sum of the
            gradients overlaps the last backward), or None.
    """

    def __init__(self, forward: Callable, links: dict, grad_sync: Callable[[bool], None] | None = None):
        self.forward, self.links, self.grad_sync = forward, links, grad_sync
        self.times = StageTimes()
        self.inputs: dict = {}       # micro -> {peer: received leaf}
        self.outputs: dict = {}      # micro -> output (kept until its backward)
        self.grads: dict = {}        # micro -> {peer: gradient of the output}
        self.input_grads: dict = {}  # (micro, peer) -> gradient of that input, to send back

    def run(self, actions) -> StageTimes:
        """Run `actions` in order; busy_s is this thread's CPU time in forward and backward
        (host time on CUDA), wall_s the whole list's wall time."""
        wall0 = time.perf_counter()
        last = max((a.micro for a in actions if isinstance(a, A.Compute) and a.kind == "B"), default=-1)
        for action in actions:
            t0 = time.thread_time()
            if isinstance(action, A.Exchange):
                self._exchange(action.ops)
                continue
            if action.kind == "F":
                self.outputs[action.micro] = self.forward(action.micro,
                                                          self.inputs.get(action.micro, {}))
            else:
                if self.grad_sync is not None:
                    self.grad_sync(action.micro == last)
                self._backward(action.micro)
            self.times.busy_s += time.thread_time() - t0
        self.times.wall_s = time.perf_counter() - wall0
        return self.times

    def _backward(self, i: int) -> None:
        out = self.outputs.pop(i)
        grads = list(self.grads.pop(i, {}).values())
        if out.requires_grad:
            torch.autograd.backward(out, sum(grads[1:], grads[0]) if grads else None)
        for peer, x in self.inputs.pop(i, {}).items():
            self.input_grads[i, peer] = x.grad if x.grad is not None else torch.zeros_like(x)

    def _exchange(self, ops) -> None:
        posted, finishers = [], []
        for op in ops:
            link, i = self.links[op.peer], op.micro
            if op.kind == "SEND_F":
                tensor = self.outputs[i].detach()
            elif op.kind == "SEND_B":
                tensor = self.input_grads.pop((i, op.peer))
            elif op.kind == "RECV_B":
                tensor = self.outputs[i]
            else:
                tensor = None
            p2p, finish = link.ops(op.kind, i, tensor)
            posted += p2p
            if finish is not None:
                finishers.append((op, finish))
        post(posted)
        for op, finish in finishers:
            if op.kind == "RECV_F":
                self.inputs.setdefault(op.micro, {})[op.peer] = finish().requires_grad_()
            else:
                self.grads.setdefault(op.micro, {})[op.peer] = finish()
