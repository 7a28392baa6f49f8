"""The colocated three-phase schedule of one training step (docs/design.md 4.4).

Under `placement=colocated` every rank runs its encoder lane and its part of the LLM. One step:
1. every encoder forward over this rank's encoder samples, then the forward route
   (`hcp.comm.boundary.route_forward`): first-stage LLM ranks hold their CP shards' image rows
   as ONE leaf that requires grad;
2. the LLM's 1F1B (each micro-batch reads its rows from the leaf by the plan's row ranges);
3. the backward route of the leaf's gradient (`route_backward`), then the encoder backward.
The step is an action list (`hcp.schedule.actions.colocated`) run by the one executor;
`ColocatedStep.phases` gives the handlers of its `EncoderCompute` and `Route` actions. Both
routes are collectives: every rank runs all three phases in the same order (0-row tensors where
it has nothing). Several streams (`run_streams`): one `all_to_all_single` per edge, in stream
order. Rows and gradients travel in the compute dtype. Encoder recompute (`recompute=True`):
phase 1 runs without autograd and phase 3 recomputes the forward before its backward."""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from hcp.comm.boundary import RouteBytes, route_backward, route_forward
from hcp.config.precision import Precision
from hcp.model.encoder_side import EncoderSide
from hcp.parallel.routing import RankRoute
from hcp.schedule import actions as A
from hcp.schedule.executor import Executor


@dataclass
class PhaseTimes:
    """Thread CPU seconds this rank spent in each part of the step (busy time, not wall time:
    on an oversubscribed CPU an idle rank lends its core, so wall time hides imbalance), and
    the step's wall time. On CUDA these are host times only."""

    encoder_forward: float = 0.0
    route_forward: float = 0.0
    llm: float = 0.0
    route_backward: float = 0.0
    encoder_backward: float = 0.0
    wall: float = 0.0

    @property
    def encoder(self) -> float:
        return self.encoder_forward + self.encoder_backward

    @property
    def busy(self) -> float:
        return (self.encoder_forward + self.route_forward + self.llm + self.route_backward
                + self.encoder_backward)


@dataclass
class ColocatedStep:
    """The encoder side's part of the colocated step on this rank.

    Args:
        encoder: this rank's encoder side (`hcp.model.llava.LlavaEncoder`: pixel_values
            [I, C, H, W] -> rows [I * P, H], one stream `projector`; or an `EncoderSide`; its
            outputs' backward all-reduces over each encoder's TP group).
        group: the route's process group (colocated: the world, or the ranks both modules span).
        recompute: encoder recompute (module docstring).
        counter: accumulates the bytes both routes send from this rank.
        precision: the run's `Precision` (or its name); device_type: of the encoder (autocast).
    """

    encoder: nn.Module
    group: Any = None
    recompute: bool = False
    counter: RouteBytes = field(default_factory=RouteBytes)
    precision: Precision | str = "fp32"
    device_type: str = "cpu"

    def __post_init__(self):
        self.precision = Precision.of(self.precision)

    def phases(self, inputs, routes: dict, attach: Callable[[dict], None]) -> "Phases":
        """The handlers of one step's `EncoderCompute` and `Route` actions.

        inputs: this rank's encoder samples' inputs in order ([I, C, H, W] for a `LlavaEncoder`,
        {encoder: [I_e, C, H, W]} for an `EncoderSide`; I may be 0); routes: {projector: this
        rank's `RankRoute` of its edge into the LLM}; attach(leaves): called once every stream's
        forward route ran, with {projector: leaf [route.dst_rows, H]} (0 rows on ranks that
        receive none) from which the LLM's micro-batches read their rows."""
        if isinstance(self.encoder, EncoderSide):
            side = self.encoder
            forward, per_encoder = (lambda: side(inputs)), tuple(side.streams_of(e)
                                                                 for e in side.encoder_names)
        else:
            forward, per_encoder = (lambda: {"projector": self.encoder(inputs)}), (("projector",),)
        return Phases(self, self._compute(forward), routes, attach, per_encoder)

    def run(self, pixel_values: torch.Tensor, route: RankRoute,
            llm_phase: Callable[[torch.Tensor], Any]) -> tuple[Any, PhaseTimes]:
        """One step of a `LlavaEncoder` whose LLM phase is the callable `llm_phase(leaf)`
        (benchmarks, tests): returns (what it returned, this rank's `PhaseTimes`)."""
        return self._run(pixel_values, {"projector": route},
                         lambda leaves: llm_phase(leaves["projector"]))

    def run_streams(self, inputs: dict, routes: dict,
                    llm_phase: Callable[[dict], Any]) -> tuple[Any, PhaseTimes]:
        """As `run`, for an `EncoderSide`: routes {projector: `RankRoute`} (KeyError when a
        stream has none), `llm_phase({projector: leaf})`."""
        routes = {s.projector: routes[s.projector] for s in self.encoder.streams}
        return self._run(inputs, routes, llm_phase)

    def _run(self, inputs, routes: dict, llm_phase) -> tuple[Any, PhaseTimes]:
        result = []
        phases = self.phases(inputs, routes, lambda leaves: result.append(llm_phase(leaves)))
        Executor(None, {}, handlers=phases.handlers).run(A.colocated([], routes))
        return result[0], phases.times

    def _compute(self, forward):
        """`forward` under the precision policy: autocast, rows out in the compute dtype."""
        p = self.precision

        def run() -> dict:
            with p.autocast(self.device_type):
                return {s: p.to_wire(rows) for s, rows in forward().items()}
        return run


class Phases:
    """One step's encoder and route actions on this rank (`ColocatedStep.phases`):
    `handlers` for the executor, `times` (`PhaseTimes`; what runs between them is the LLM's)."""

    def __init__(self, step: ColocatedStep, forward, routes: dict, attach, per_encoder):
        self.step, self.forward, self.routes, self.attach = step, forward, routes, attach
        self.per_encoder = per_encoder
        self.outs: dict = {}    # projector -> encoder rows [rows_p, H]
        self.leaves: dict = {}  # projector -> received rows, a leaf that requires grad
        self.grads: dict = {}   # projector -> gradient of its rows, routed back
        self.times = PhaseTimes()
        self.handlers = {A.EncoderCompute: self.encoder, A.Route: self.route}
        self.tick, self.wall0 = time.thread_time(), time.perf_counter()

    def _lap(self, name: str) -> None:
        now = time.thread_time()
        setattr(self.times, name, getattr(self.times, name) + now - self.tick)
        self.tick = now

    def encoder(self, action: A.EncoderCompute) -> None:
        step = self.step
        if action.kind == "F":
            self.tick, self.wall0 = time.thread_time(), time.perf_counter()
            with torch.no_grad() if step.recompute else contextlib.nullcontext():
                self.outs = self.forward()
            self._lap("encoder_forward")
            return
        self._lap("llm")
        if step.recompute and any(w.requires_grad for w in step.encoder.parameters()):
            self.outs = self.forward()  # a frozen encoder needs no recompute
        for projectors in self.per_encoder:
            pairs = [(self.outs[s], self.grads[s]) for s in projectors
                     if self.outs[s].requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        self._lap("encoder_backward")
        self.times.wall = time.perf_counter() - self.wall0

    def route(self, action: A.Route) -> None:
        step, s = self.step, action.stream
        self._lap("llm")
        if action.kind == "F":
            self.leaves[s] = route_forward(self.outs[s].detach(), self.routes[s], step.group,
                                           step.counter).requires_grad_()
            self._lap("route_forward")
            if len(self.leaves) == len(self.routes):
                self.attach(self.leaves)
            return
        leaf = self.leaves[s]
        self.grads[s] = route_backward(leaf.grad
                                       if leaf.grad is not None else torch.zeros_like(leaf),
                                       self.routes[s], self.outs[s].shape[0], step.group,
                                       step.counter)
        self._lap("route_backward")
