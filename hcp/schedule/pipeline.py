"""Pipeline executors of one module: 1F1B for training, all-forward for evaluation.

1F1B (one forward, one backward; PipeDream-Flush, Narayanan et al. 2021, as in Megatron-LM's
`forward_backward_pipelining_without_interleaving`): with p stages and m micro-batches, stage s
runs `w = min(p - s - 1, m)` warm-up forwards, then m - w steady pairs (forward of micro-batch
i, backward of micro-batch i - w), then w cool-down backwards. At most w + 1 micro-batches'
activations are alive on a stage, and all weights are updated once after the flush (synchronous
semantics: the result equals running the m micro-batches one after another).

m may change every iteration: the caller tells every stage (e.g. by a broadcast from the first
stage, which holds the data). The micro-batches' shapes travel with their activations
(`hcp.comm.p2p.StageLink`). With p = 1 this is plain gradient accumulation (forward, backward,
per micro-batch) and nothing is sent.

The schedule sees micro-batches and a `forward` callable, never datasets or models:
`forward(batch, x)` takes the first stage's micro-batch (or a later stage's received
`StageMeta`) and the received activation (None on the first stage) and returns the activation
for the next stage, or on the last stage a 0-d tensor to differentiate (the scaled loss).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from hcp.comm.p2p import StageLink, StageMeta


@dataclass
class StageTimes:
    """Seconds this stage spent computing (forward + backward) and in the whole schedule."""

    busy_s: float = 0.0
    wall_s: float = 0.0


def _now() -> float:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()  # kernels are asynchronous: time what ran, not what was queued
    return time.perf_counter()


class _Runner:
    def __init__(self, forward, link: StageLink, stage: int, num_stages: int, batches):
        self.forward, self.link, self.batches = forward, link, batches
        self.first, self.last = stage == 0, stage == num_stages - 1
        self.times = StageTimes()
        self.alive: deque = deque()

    def _timed(self, fn, *args):
        t0 = _now()
        out = fn(*args)
        self.times.busy_s += _now() - t0
        return out

    def run_forward(self, i: int, keep: bool):
        if self.first:
            x, batch = None, self.batches[i]
            meta = StageMeta.of(batch) if not self.last else None
        else:
            x, meta = self.link.recv_forward()
            batch = meta
        out = self._timed(self.forward, batch, x)
        if not self.last:
            self.link.send_forward(out, meta)
        if keep:
            self.alive.append((x, out))
        return out

    def run_backward(self) -> None:
        x, out = self.alive.popleft()
        grad = None if self.last else self.link.recv_backward(out)
        self._timed(torch.autograd.backward, out, grad)
        if not self.first:
            self.link.send_backward(x.grad)


def one_f_one_b(forward: Callable, link: StageLink, stage: int, num_stages: int, batches,
                num_micro: int, grad_sync: Optional[Callable[[bool], None]] = None) -> StageTimes:
    """Run forward and backward of `num_micro` micro-batches on this stage; gradients accumulate
    in the parameters' `.grad`.

    batches: the micro-batches on the first stage (None elsewhere). grad_sync(enabled) is called
    before each backward, with True only before the last one, so a sharded-DP wrapper reduces
    gradients once per step (after the last micro-batch). Returns this stage's timings.
    """
    run = _Runner(forward, link, stage, num_stages, batches)
    t0 = time.perf_counter()
    warmup = min(num_stages - stage - 1, num_micro)
    done = 0

    def backward():
        nonlocal done
        done += 1
        if grad_sync is not None:
            grad_sync(done == num_micro)
        run.run_backward()

    for i in range(warmup):
        run.run_forward(i, keep=True)
    for i in range(warmup, num_micro):
        run.run_forward(i, keep=True)
        backward()
    for _ in range(warmup):
        backward()
    link.flush()
    run.times.wall_s = time.perf_counter() - t0
    return run.times


@torch.no_grad()
def forward_only(forward: Callable, link: StageLink, stage: int, num_stages: int, batches,
                 num_micro: int) -> list:
    """Forward `num_micro` micro-batches through the pipeline without gradients; returns the
    last stage's outputs in order (an empty list on other stages)."""
    run = _Runner(forward, link, stage, num_stages, batches)
    outputs = [run.run_forward(i, keep=False) for i in range(num_micro)]
    link.flush()
    return outputs if run.last else []
