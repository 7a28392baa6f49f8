"""One module's pipeline on one stage: 1F1B for training, all-forward for evaluation, both as
action lists run by the one executor (`hcp.schedule.executor`) over `PipeLink`s.

`forward(i, x)` runs micro-batch i with the received activation x (None on the first stage) and
returns the activation for the next stage or, on the last, the 0-d scaled loss (or any output in
evaluation). `act_spec(i) -> (shape, dtype)` gives each receive buffer up front. 1F1B
(PipeDream-Flush, Narayanan et al. 2021): at most `p - s` micro-batches alive on stage s, one
weight update after the flush; the number of micro-batches may change every step."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from hcp.comm.p2p import StageLink
from hcp.schedule import actions as A
from hcp.schedule.executor import BusyClock, Executor, StageTimes
from hcp.schedule.links import PipeLink


def _executor(forward: Callable, link: StageLink, act_spec: Callable, grad_sync=None,
              handlers=None) -> Executor:
    """The executor of stage `link.stage`, with a `PipeLink` to each neighbouring stage."""
    prev = link.stage - 1
    links = {peer: PipeLink(peer, act_spec, device=link.device, stage_link=link)
             for peer in (prev, link.stage + 1) if 0 <= peer < len(link.ranks)}
    return Executor(lambda i, x: forward(i, x.get(prev)), links, grad_sync, BusyClock(link.device),
                    link.exchange, handlers)


def one_f_one_b(forward: Callable, link: StageLink, num_micro: int, act_spec: Callable,
                grad_sync: Optional[Callable[[bool], None]] = None) -> StageTimes:
    """Forward and backward of `num_micro` micro-batches on this rank's stage (`link`) in 1F1B
    order (`hcp.schedule.actions.one_f_one_b`); gradients accumulate in the parameters'
    `.grad`. grad_sync(enabled): armed before the last backward (`actions.with_grad_sync`), or
    None. Returns this stage's timings."""
    actions = A.one_f_one_b(link.stage, len(link.ranks), num_micro)
    if grad_sync is not None:
        actions = A.with_grad_sync(actions)
    return run(forward, link, actions, act_spec, grad_sync)


def run(forward: Callable, link: StageLink, actions: list, act_spec: Callable,
        grad_sync: Optional[Callable[[bool], None]] = None,
        handlers: Optional[dict] = None) -> StageTimes:
    """Run this stage's action list `actions` (e.g. the step plan's `RankPlan.actions`: 1F1B,
    or the colocated step around it with `handlers` for its encoder and route actions,
    `hcp.schedule.colocated`). Returns this stage's timings."""
    return _executor(forward, link, act_spec, grad_sync, handlers).run(actions)


@torch.no_grad()
def forward_only(forward: Callable, link: StageLink, num_micro: int, act_spec: Callable) -> list:
    """Forward `num_micro` micro-batches through the pipeline without gradients; returns the
    last stage's outputs in order (an empty list on other stages)."""
    run = _executor(forward, link, act_spec)
    run.run(A.forward_only(link.stage, len(link.ranks), num_micro), train=False)
    return run.results
