"""The one executor of action lists (`hcp.schedule.actions`): 1F1B inside a module, the graph-aware
1F1B across islands, all-forward evaluation; a new schedule is a new builder, never a new loop.

It sees micro-batch indices, a `forward` callable and one link per peer stage
(`hcp.schedule.links`). `forward(micro, inputs)` gets {peer stage: received activation} ({} on a
source stage) and returns the activation to send or, on a sink, the 0-d loss (training) or any
output (evaluation: `Executor.results`). A backward runs on the sum of the next stages'
gradients and sends each input leaf's gradient back. All ops of one `Exchange` go in ONE
`batch_isend_irecv`. Gradients accumulate in `.grad`; `SyncGrads` arms `grad_sync`. The colocated
step's `EncoderCompute` / `Route` actions run by `handlers` ({action type: handler(action)})."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from hcp.comm.island import post
from hcp.comm.trace import span
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
    two per forward and backward. Elsewhere kernels run synchronously and `host_clock` (seconds:
    `time.perf_counter`, or `time.thread_time` for busy time on an oversubscribed CPU) is read
    around each span.
    """

    def __init__(self, device, host_clock: Callable[[], float] = time.perf_counter):
        self.cuda = torch.device(device).type == "cuda"
        self.host_clock = host_clock
        self.events: list = []   # (start, end) CUDA events not read yet
        self.seconds = 0.0

    def span(self, fn, *args):
        """Run `fn(*args)`, timing it; returns its result."""
        if not self.cuda:
            t0 = self.host_clock()
            out = fn(*args)
            self.seconds += self.host_clock() - t0
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


def range_name(action) -> str:
    """The profiler range of `action` (hcp.comm.trace): `hcp.forward`, `hcp.backward`,
    `hcp.send_recv` (one `Exchange`), `hcp.grad_sync_on`, `hcp.encoder_forward`,
    `hcp.route_forward`, ...; a micro-batch's ranges end in its index (`hcp.forward mb3`)."""
    if isinstance(action, A.Exchange):
        return "hcp.send_recv " + ",".join(sorted({op.kind for op in action.ops}))
    if isinstance(action, A.SyncGrads):
        return "hcp.grad_sync_on"
    if isinstance(action, A.Compute):
        return f"hcp.{'forward' if action.kind == 'F' else 'backward'} mb{action.micro}"
    kind = "forward" if getattr(action, "kind", "F") == "F" else "backward"
    name = "encoder" if isinstance(action, A.EncoderCompute) else type(action).__name__.lower()
    return f"hcp.{name}_{kind}"


class Executor:
    """Runs one rank's action list.

    Args:
        forward: `forward(micro, inputs) -> Tensor` (module docstring);
        links: {peer stage: link} for every peer the list names (`hcp.schedule.links`);
        grad_sync: `grad_sync(enabled)` (e.g. `GradReducer.sync_in_backward`, FSDP's
            `set_requires_gradient_sync`), driven by the list's `SyncGrads`; or None;
        clock: the `BusyClock` timing forward and backward (default: host clock on the CPU);
        post: posts one `Exchange`'s ops together and waits for them (`hcp.comm.island.post`:
            `P2POp`s in one `batch_isend_irecv`; a pipeline's `StageLink.exchange`);
        handlers: {action type: handler(action)} of the actions outside the pipeline (module
            docstring); a list naming such an action without its handler raises KeyError.
    """

    def __init__(self, forward: Callable, links: dict,
                 grad_sync: Optional[Callable[[bool], None]] = None,
                 clock: Optional[BusyClock] = None, post: Callable[[list], None] = post,
                 handlers: Optional[dict] = None):
        self.forward, self.links, self.grad_sync, self.post = forward, links, grad_sync, post
        self.handlers = handlers or {}
        self.clock = clock if clock is not None else BusyClock("cpu")
        self.times = StageTimes()
        self.inputs: dict = {}       # micro -> {peer: received activation}
        self.outputs: dict = {}      # micro -> output (kept for its backward or its sends)
        self.grads: dict = {}        # micro -> {peer: gradient of the output}
        self.input_grads: dict = {}  # (micro, peer) -> gradient of that input, to send back
        self.results: list = []      # evaluation: the outputs no stage received, in order

    def run(self, actions, train: bool = True) -> StageTimes:
        """Run `actions` in order. train: keep activations for the backward actions (else
        no leaf requires grad and the unsent outputs end in `results`). busy_s is the compute
        time of the forward and backward passes (`BusyClock`), wall_s the whole list's."""
        t0 = time.perf_counter()
        if self.grad_sync is not None and any(isinstance(a, A.SyncGrads) for a in actions):
            self.grad_sync(False)
        for action in actions:
            with span(range_name, action):
                self._run_one(action, train)
        if not train:
            self.results = [self.outputs.pop(i) for i in sorted(self.outputs)]
        self.times.busy_s = self.clock.total()  # the one wait for the device in a run
        self.times.wall_s = time.perf_counter() - t0
        return self.times

    def _run_one(self, action, train: bool) -> None:
        if isinstance(action, A.Exchange):
            self._exchange(action.ops, train)
        elif isinstance(action, A.SyncGrads):
            if self.grad_sync is not None:
                self.grad_sync(True)
        elif isinstance(action, A.EncoderCompute):
            self.clock.span(self.handlers[A.EncoderCompute], action)
        elif not isinstance(action, A.Compute):
            self.handlers[type(action)](action)
        elif action.kind == "F":
            i = action.micro
            x = self.inputs.get(i, {}) if train else self.inputs.pop(i, {})
            self.outputs[i] = self.clock.span(self.forward, i, x)
        else:
            self._backward(action.micro)

    def _backward(self, i: int) -> None:
        out = self.outputs.pop(i)
        grads = list(self.grads.pop(i, {}).values())
        if out.requires_grad:
            self.clock.span(torch.autograd.backward, out,
                            sum(grads[1:], grads[0]) if grads else None)
        for peer, x in self.inputs.pop(i, {}).items():
            self.input_grads[i, peer] = x.grad if x.grad is not None else torch.zeros_like(x)

    def _exchange(self, ops, train: bool) -> None:
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
        self.post(posted)
        if not train:  # evaluation: a sent output is not needed any more
            for i in {op.micro for op in ops if op.kind == "SEND_F"}:
                del self.outputs[i]
        for op, finish in finishers:
            if op.kind == "RECV_F":
                self.inputs.setdefault(op.micro, {})[op.peer] = finish().requires_grad_(train)
            else:
                self.grads.setdefault(op.micro, {})[op.peer] = finish()
