"""Executor of one stage's action list (`hcp.schedule.actions`): 1F1B for training, all-forward
for evaluation, and any other schedule expressed as actions.

The executor sees micro-batches and a `forward` callable, never datasets or models:
`forward(batch, x)` takes the first stage's micro-batch (or a later stage's `StageMeta`) and
the received activation (None on the first stage) and returns the activation for the next stage
(in the dtype it travels in), or on the last stage a 0-d tensor to differentiate (the scaled
loss) or, in evaluation, any output. Every stage knows every micro-batch's `StageMeta` before
the schedule starts (`hcp.comm.p2p.broadcast_metas`), so `act_spec(meta) -> (shape, dtype)`
gives each receive buffer up front and each step's sends and receives are posted together
(`StageLink.exchange`). A send whose tensor does not have that shape raises instead of letting
the peer read a wrong-sized message.

1F1B (PipeDream-Flush, Narayanan et al. 2021): at most `p - s` micro-batches' activations are
alive on stage s, and all weights are updated once after the flush (synchronous semantics: the
result equals running the micro-batches one after another). The number of micro-batches may
change every step.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from hcp.comm.p2p import StageLink
from hcp.schedule import actions as A


@dataclass
class StageTimes:
    """Seconds this stage spent computing (forward + backward) and in the whole schedule."""

    busy_s: float = 0.0
    wall_s: float = 0.0


class BusyClock:
    """Sums the time spent in the spans it runs (`span`), without stalling the device.

    On CUDA a pair of events is recorded around each span (kernels run asynchronously, so the
    host clock would time what was queued, not what ran) and all pairs are read in `total()`,
    which waits once for the last event: one device-to-host sync per schedule run instead of
    two per forward and backward. Elsewhere kernels run synchronously and the host clock is
    read around each span.
    """

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.events: list = []   # (start, end) CUDA events not read yet
        self.seconds = 0.0

    def span(self, fn, *args):
        """Run `fn(*args)`, timing it; returns its result."""
        if not self.cuda:
            t0 = time.perf_counter()
            out = fn(*args)
            self.seconds += time.perf_counter() - t0
            return out
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn(*args)
        end.record()
        self.events.append((start, end))
        return out

    def total(self) -> float:
        """Seconds in every span so far (CUDA: waits for the last span's end event)."""
        if self.events:
            self.events[-1][1].synchronize()
            self.seconds += sum(s.elapsed_time(e) for s, e in self.events) / 1e3  # ms -> s
            self.events = []
        return self.seconds


class StageExecutor:
    """Runs action lists on one stage.

    Args:
        forward: see the module docstring; link: this rank's `StageLink`; stage, num_stages:
            this stage's index and the pipeline depth; batches: the first stage's micro-batches
            (None elsewhere); metas: every micro-batch's `StageMeta` (every stage);
            act_spec(meta) -> (shape, dtype) of the activation sent between stages.
    """

    def __init__(self, forward: Callable, link: StageLink, stage: int, num_stages: int, batches,
                 metas, act_spec: Callable):
        self.forward, self.link, self.batches, self.metas = forward, link, batches, metas
        self.act_spec = act_spec
        self.first, self.last = stage == 0, stage == num_stages - 1
        self.times = StageTimes()
        self.clock = BusyClock(link.device)
        self.inputs: dict = {}     # micro -> received activation (a leaf)
        self.outputs: dict = {}    # micro -> this stage's output (kept for backward or sending)
        self.grads: dict = {}      # micro -> received gradient of the output
        self.input_grads: dict = {}  # micro -> gradient of the input, to send back
        self.results: list = []    # last stage, evaluation: outputs in order

    def run(self, actions, train: bool,
            grad_sync: Optional[Callable[[bool], None]] = None) -> StageTimes:
        """Run `actions` in order. train: keep activations for the backward actions;
        grad_sync(enabled) is called before each backward, True only before the last one.
        `busy_s` is the compute time of the forward and backward passes (`BusyClock`)."""
        t0 = time.perf_counter()
        backwards = [a for a in actions if isinstance(a, A.Compute) and a.kind == "B"]
        for action in actions:
            if isinstance(action, A.Exchange):
                self._exchange(action.ops, train)
            elif action.kind == "F":
                self._forward(action.micro, train)
            else:
                if grad_sync is not None:
                    grad_sync(action is backwards[-1])
                self._backward(action.micro)
        self.times.busy_s = self.clock.total()  # the one wait for the device in a run
        self.times.wall_s = time.perf_counter() - t0
        return self.times

    def _forward(self, i: int, train: bool) -> None:
        x = self.inputs.get(i) if train else self.inputs.pop(i, None)
        out = self.clock.span(self.forward, self.batches[i] if self.first else self.metas[i], x)
        if self.last and not train:
            self.results.append(out)
        else:
            self.outputs[i] = out

    def _backward(self, i: int) -> None:
        out = self.outputs.pop(i)
        self.clock.span(torch.autograd.backward, out, self.grads.pop(i, None))
        x = self.inputs.pop(i, None)
        if x is not None:
            self.input_grads[i] = x.grad

    def _exchange(self, ops, train: bool) -> None:
        posted, received = [], []
        for op in ops:
            if op.kind == "SEND_F":
                out = self.outputs[op.micro] if train else self.outputs.pop(op.micro)
                self._check(out, op.micro)
                tensor = out.detach().contiguous()
            elif op.kind == "SEND_B":
                tensor = self.input_grads.pop(op.micro).contiguous()
            elif op.kind == "RECV_F":
                shape, dtype = self.act_spec(self.metas[op.micro])
                tensor = torch.empty(shape, dtype=dtype, device=self.link.device)
                received.append((self.inputs, op.micro, tensor))
            else:
                out = self.outputs[op.micro]
                tensor = torch.empty(out.shape, dtype=out.dtype, device=out.device)
                received.append((self.grads, op.micro, tensor))
            posted.append((op.is_send, tensor, op.peer, op.kind[-1]))
        self.link.exchange(posted)
        for table, i, tensor in received:
            table[i] = tensor.requires_grad_(train and table is self.inputs)

    def _check(self, out: torch.Tensor, i: int) -> None:
        shape, dtype = self.act_spec(self.metas[i])
        if tuple(out.shape) != tuple(shape) or out.dtype != dtype:
            raise RuntimeError(f"micro-batch {i}: this stage's output is {out.dtype} "
                               f"{tuple(out.shape)} but the next stage expects {dtype} "
                               f"{tuple(shape)} (act_spec and the model disagree)")


def one_f_one_b(forward: Callable, link: StageLink, stage: int, num_stages: int, batches, metas,
                act_spec: Callable, grad_sync: Optional[Callable[[bool], None]] = None) -> StageTimes:
    """Forward and backward of the `len(metas)` micro-batches on this stage in 1F1B order
    (`hcp.schedule.actions.one_f_one_b`); gradients accumulate in the parameters' `.grad`.
    Arguments as `StageExecutor` and `StageExecutor.run`. Returns this stage's timings."""
    run = StageExecutor(forward, link, stage, num_stages, batches, metas, act_spec)
    return run.run(A.one_f_one_b(stage, num_stages, len(metas)), train=True, grad_sync=grad_sync)


@torch.no_grad()
def forward_only(forward: Callable, link: StageLink, stage: int, num_stages: int, batches, metas,
                 act_spec: Callable) -> list:
    """Forward the `len(metas)` micro-batches through the pipeline without gradients; returns
    the last stage's outputs in order (an empty list on other stages)."""
    run = StageExecutor(forward, link, stage, num_stages, batches, metas, act_spec)
    run.run(A.forward_only(stage, num_stages, len(metas)), train=False)
    return run.results
