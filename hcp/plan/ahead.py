"""Plan ahead: the data-iterator wrapper that computes step k+1's plan while step k runs.

`PlanAhead(sampler, prepare)` yields, per step, the global batch's sample indices and
`prepare(indices)` (the step plan and whatever this rank loads for it), computed on one
background thread that starts on step k+1 as soon as step k's result is handed out. It reports
per step the time `prepare` took on its thread and the part of it hidden behind the caller's work
(`plan_s - wait_s`, where `wait_s` is how long `next()` blocked). The sampler's position stays
the number of consumed global batches, so checkpoints and resume are unchanged.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable


class PlanAhead:
    """Prefetching wrapper around a `hcp.data.loader.GlobalBatchSampler`.

    Args:
        sampler: has `position` (consumed batches) and `batch(k)` (indices of batch k).
        prepare: indices -> anything (run on the background thread; must not touch process
            groups: collectives issued from two threads could cross).

    Exceptions raised by `prepare` surface from the `next()` call that wants that step.
    """

    def __init__(self, sampler, prepare: Callable):
        self.sampler, self.prepare = sampler, prepare
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hcp-plan")
        self._pending = None  # (position, future)

    def _job(self, position: int):
        t0 = time.perf_counter()
        indices = self.sampler.batch(position)
        out = self.prepare(indices)
        return indices, out, time.perf_counter() - t0

    def _submit(self, position: int) -> None:
        self._pending = (position, self._pool.submit(self._job, position))

    def next(self):
        """(indices, prepare(indices), {"plan_s", "plan_hidden_s"}) of the next global batch;
        starts preparing the one after it."""
        position = self.sampler.position
        if self._pending is None or self._pending[0] != position:  # first step or after resume
            self._submit(position)
        t0 = time.perf_counter()
        indices, out, plan_s = self._pending[1].result()
        wait = time.perf_counter() - t0
        self.sampler.position = position + 1
        self._submit(position + 1)
        return indices, out, {"plan_s": plan_s, "plan_hidden_s": max(0.0, plan_s - wait)}

    def close(self) -> None:
        """Stop the thread (an unfinished prefetch is discarded)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._pending = None
