"""The colocated three-phase schedule of one training step (docs/design.md 4.4).

Under `placement=colocated` every rank runs both the encoder side (its encoder lane's images,
under the encoder's own TP/DP layout) and its part of the LLM (TP x CP x PP). One step:

1. every encoder forward over this rank's encoder samples, then the forward boundary route
   (`hcp.comm.boundary.route_forward`): the LLM's first-stage ranks receive the image rows of
   their CP shards and hold them as ONE leaf tensor that requires grad;
2. the LLM's 1F1B over its micro-batches (a callable from the trainer; each micro-batch reads
   its image rows from the leaf by the plan's row ranges), which accumulates the leaf's gradient;
3. the backward route of the leaf's gradient (`route_backward`), then the encoder backward.

Both routes are collectives over the route's group: every rank runs all three phases in the same
order (ranks without encoder images or without received rows move 0-row tensors), so NCCL sees
the same sequence of collectives everywhere. Cutting the step at the leaf keeps the encoder out
of the LLM's pipeline schedule: the encoder runs once per step over all of this rank's images
(one large batch instead of one per micro-batch), and its gradient leaves in one message.

Several encoders and streams (`run_streams`, `hcp.model.encoder_side.EncoderSide`): phase 1
runs every encoder and routes every stream (one `all_to_all_single` per edge into the LLM, in
stream order); phase 3 routes every stream's gradient back, then runs each encoder's backward.

Precision (`hcp.config.precision.Precision`): the encoder forward (phase 1, and its phase-3
recompute) runs under the run's autocast, as the LLM does, and its rows leave in the compute
dtype, so both routes carry bf16 rows and gradients under `precision=bf16`.

Encoder recompute (`recompute=True`, `vision.layout.recompute=full`): phase 1 runs without
autograd and phase 3 recomputes the encoder forward before its backward, so no encoder
activation is held across phase 2 (the price: one more encoder forward, its collectives
included). Weight/optimizer offload during phase 2 (`offload`) is CUDA-only and not done here.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from hcp.comm.boundary import RouteBytes, route_backward, route_forward
from hcp.config.precision import Precision
from hcp.parallel.routing import RankRoute


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
    """Runs one step's three phases on this rank.

    Args:
        encoder: this rank's encoder side (`hcp.model.llava.LlavaEncoder`: pixel_values
            [I, C, H, W] -> rows [I * P, H], for `run`; or an `EncoderSide`, for `run_streams`;
            its outputs' backward all-reduces over each encoder's TP group).
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

    def run(self, pixel_values: torch.Tensor, route: RankRoute,
            llm_phase: Callable[[torch.Tensor], Any]) -> tuple[Any, PhaseTimes]:
        """One step of one encoder side with one stream (`LlavaEncoder`): returns (what
        `llm_phase(leaf)` returned, this rank's `PhaseTimes`).

        pixel_values: this rank's encoder samples' images in order [I, C, H, W] (I may be 0);
        route: this rank's `RankRoute` of the image edge for the step; llm_phase: runs the
        LLM's micro-batches (forward and backward) reading image rows from `leaf`
        [route.dst_rows, H] (0 rows on ranks that receive none). The encoder's parameter
        gradients are accumulated into `.grad` as usual; nothing is reduced over DP here.
        """
        return self._run(lambda: {"projector": self.encoder(pixel_values)}, {"projector": route},
                         lambda leaves: llm_phase(leaves["projector"]), (("projector",),))

    def run_streams(self, inputs: dict, routes: dict, llm_phase: Callable[[dict], Any]) -> tuple[Any, PhaseTimes]:
        """One step of several encoders and streams (`hcp.model.encoder_side.EncoderSide`):
        every encoder forward (phase 1), then each stream's forward route in stream order; the
        LLM phase reads {projector: leaf [route.dst_rows, H]}; then each stream's backward
        route in stream order and each encoder's backward (phase 3), encoder by encoder in
        graph order (a branch's tower gets the sum of its projectors' gradients in one pass).
        Every rank runs the same routes in the same order (NCCL sees one sequence).

        inputs: {encoder: this rank's encoder samples' inputs [I_e, C, H, W]}; routes:
        {projector: this rank's `RankRoute` of its edge into the LLM}, one per stream.
        Raises KeyError when a stream has no route."""
        side = self.encoder
        per_encoder = tuple(side.streams_of(e) for e in side.encoder_names)
        return self._run(lambda: side(inputs), {s.projector: routes[s.projector] for s in side.streams},
                         llm_phase, per_encoder)

    def _run(self, forward, routes: dict, llm_phase, per_encoder) -> tuple[Any, PhaseTimes]:
        """The three phases; `forward()` -> {projector: rows}, `per_encoder`: the projectors of
        each encoder (one backward each)."""
        times = PhaseTimes()
        wall0 = time.perf_counter()
        forward = self._compute(forward)
        tick = time.thread_time()

        def lap(name: str) -> None:
            nonlocal tick
            now = time.thread_time()
            setattr(times, name, getattr(times, name) + now - tick)
            tick = now

        no_grad = torch.no_grad() if self.recompute else contextlib.nullcontext()
        with no_grad:
            outs = forward()                                              # {p: [rows_p, H]}
        lap("encoder_forward")
        leaves = {s: route_forward(outs[s].detach(), r, self.group, self.counter).requires_grad_()
                  for s, r in routes.items()}
        lap("route_forward")

        result = llm_phase(leaves)
        lap("llm")

        grads = {s: route_backward(leaf.grad if leaf.grad is not None else torch.zeros_like(leaf),
                                   routes[s], outs[s].shape[0], self.group, self.counter)
                 for s, leaf in leaves.items()}
        lap("route_backward")
        if self.recompute and any(w.requires_grad for w in self.encoder.parameters()):
            outs = forward()  # a frozen encoder needs no recompute
        for projectors in per_encoder:
            pairs = [(outs[s], grads[s]) for s in projectors if outs[s].requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        lap("encoder_backward")
        times.wall = time.perf_counter() - wall0
        return result, times

    def _compute(self, forward):
        """`forward` under the precision policy: autocast, rows out in the compute dtype."""
        p = self.precision

        def run() -> dict:
            with p.autocast(self.device_type):
                return {s: p.to_wire(rows) for s, rows in forward().items()}
        return run
