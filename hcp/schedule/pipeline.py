"""One module's pipeline on one stage: 1F1B for training, all-forward for evaluation, both as
action lists (`hcp.schedule.actions`) run by the one executor (`hcp.schedule.executor`) over
`PipeLink`s to the neighbouring stages.

`forward(batch, x)` takes the first stage's micro-batch (or a later stage's `StageMeta`) and the
received activation (None on the first stage) and returns the activation for the next stage (in
the dtype it travels in), or on the last stage a 0-d tensor to differentiate (the scaled loss)
or, in evaluation, any output. Every stage knows every micro-batch's `StageMeta` before the
schedule starts (`hcp.comm.p2p.broadcast_metas`, or the step plan), so `act_spec(meta) ->
(shape, dtype)` gives each receive buffer up front.

1F1B (PipeDream-Flush, Narayanan et al. 2021): at most `p - s` micro-batches' activations are
alive on stage s, and all weights are updated once after the flush (synchronous semantics: the
result equals running the micro-batches one after another). The number of micro-batches may
change every step.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from hcp.comm.p2p import StageLink
from hcp.schedule import actions as A
from hcp.schedule.executor import BusyClock, Executor, StageTimes
from hcp.schedule.links import PipeLink


def _executor(forward: Callable, link: StageLink, batches, metas, act_spec: Callable,
              grad_sync=None) -> Executor:
    """The executor of stage `link.stage`: its micro-batch (first stage) or meta, and the
    activation received from the previous stage."""
    prev, first = link.stage - 1, link.stage == 0
    links = {peer: PipeLink(peer, lambda i: act_spec(metas[i]), device=link.device, stage_link=link)
             for peer in (prev, link.stage + 1) if 0 <= peer < len(link.ranks)}
    return Executor(lambda i, x: forward(batches[i] if first else metas[i], x.get(prev)), links,
                    grad_sync, BusyClock(link.device), link.exchange)


def one_f_one_b(forward: Callable, link: StageLink, stage: int, num_stages: int, batches, metas,
                act_spec: Callable, grad_sync: Optional[Callable[[bool], None]] = None) -> StageTimes:
    """Forward and backward of the `len(metas)` micro-batches on this stage in 1F1B order
    (`hcp.schedule.actions.one_f_one_b`); gradients accumulate in the parameters' `.grad`.
    batches: the first stage's micro-batches (None elsewhere); metas: every micro-batch's
    `StageMeta`; grad_sync(enabled): armed before the last backward (`actions.with_grad_sync`),
    or None. Returns this stage's timings."""
    actions = A.one_f_one_b(stage, num_stages, len(metas))
    if grad_sync is not None:
        actions = A.with_grad_sync(actions)
    return _executor(forward, link, batches, metas, act_spec, grad_sync).run(actions)


@torch.no_grad()
def forward_only(forward: Callable, link: StageLink, stage: int, num_stages: int, batches, metas,
                 act_spec: Callable) -> list:
    """Forward the `len(metas)` micro-batches through the pipeline without gradients; returns
    the last stage's outputs in order (an empty list on other stages)."""
    run = _executor(forward, link, batches, metas, act_spec)
    run.run(A.forward_only(stage, num_stages, len(metas)), train=False)
    return run.results
