"""The colocated three-phase schedule of one training step (DESIGN.md 4.4).

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
            [I, C, H, W] -> rows [I * P, H]; its output's backward all-reduces over the encoder
            TP group).
        group: the route's process group (colocated: the world, or the ranks both modules span).
        recompute: encoder recompute (module docstring).
        counter: accumulates the bytes both routes send from this rank.
    """

    encoder: nn.Module
    group: Any = None
    recompute: bool = False
    counter: RouteBytes = field(default_factory=RouteBytes)

    def run(self, pixel_values: torch.Tensor, route: RankRoute,
            llm_phase: Callable[[torch.Tensor], Any]) -> tuple[Any, PhaseTimes]:
        """One step: returns (what `llm_phase(leaf)` returned, this rank's `PhaseTimes`).

        pixel_values: this rank's encoder samples' images in order [I, C, H, W] (I may be 0);
        route: this rank's `RankRoute` of the image edge for the step; llm_phase: runs the
        LLM's micro-batches (forward and backward) reading image rows from `leaf`
        [route.dst_rows, H] (0 rows on ranks that receive none). The encoder's parameter
        gradients are accumulated into `.grad` as usual; nothing is reduced over DP here.
        """
        times = PhaseTimes()
        wall0 = time.perf_counter()
        tick = time.thread_time()

        def lap(name: str) -> None:
            nonlocal tick
            now = time.thread_time()
            setattr(times, name, getattr(times, name) + now - tick)
            tick = now

        no_grad = torch.no_grad() if self.recompute else contextlib.nullcontext()
        with no_grad:
            out = self.encoder(pixel_values)                              # [I * P, H]
        lap("encoder_forward")
        leaf = route_forward(out.detach(), route, self.group, self.counter).requires_grad_()
        lap("route_forward")

        result = llm_phase(leaf)
        lap("llm")

        grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
        grad_src = route_backward(grad, route, out.shape[0], self.group, self.counter)
        lap("route_backward")
        if self.recompute and any(p.requires_grad for p in self.encoder.parameters()):
            out = self.encoder(pixel_values)  # a frozen encoder needs no recompute
        if out.requires_grad:
            out.backward(grad_src)
        lap("encoder_backward")
        times.wall = time.perf_counter() - wall0
        return result, times
