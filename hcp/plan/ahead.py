"""Plan ahead: the data-iterator wrapper that computes step k+1's plan while step k runs.

`PlanAhead(sampler, prepare)` yields, per step, the global batch's indices and
`prepare(indices)` (the step plan and this rank's data), computed on one background thread, and
reports the time `prepare` took and how much of it was hidden (`plan_s - wait_s`). The sampler's
position stays the number of consumed batches (checkpoints and resume unchanged). With
`planner` (a picklable `indices -> plan`) the pure planning runs in a spawned worker process, so
it does not hold the GIL against the training thread; the thread then runs
`prepare(indices, plan)`. The planning path imports no torch, so the worker starts fast.
`use_worker` is the default rule (`trainer.plan_process`)."""
from __future__ import annotations

import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from typing import Callable

_PLANNER: Callable | None = None  # in the worker process: the planner it was started with


def _install(planner: Callable) -> None:
    global _PLANNER
    _PLANNER = planner


def _ready() -> bool:
    """In the worker: nothing; returns once the worker is up and its planner installed."""
    return _PLANNER is not None


def use_worker(setting: bool | None, device_type: str) -> bool:
    """Whether a planner runs in the worker process: `setting` (`trainer.plan_process`) when
    given, else on GPU ranks only: there the training thread launches kernels, which planning
    on a thread would delay (the GIL), and each rank has cores of its own. CPU (gloo) ranks
    already share the cores; a worker per rank would compete for them and import torch again."""
    return device_type == "cuda" if setting is None else bool(setting)


def _plan(indices) -> tuple[object, float]:
    """In the worker: (the plan of `indices`, the worker's CPU seconds for it)."""
    cpu = time.process_time()
    return _PLANNER(indices), time.process_time() - cpu


class PlanAhead:
    """Prefetching wrapper around a `hcp.data.loader.GlobalBatchSampler`.

    Args:
        sampler: has `position` (consumed batches) and `batch(k)` (indices of batch k).
        prepare: indices -> anything, or `(indices, plan) -> anything` with `planner` (run on
            the background thread; must not touch process groups: collectives issued from two
            threads could cross).
        planner: optional picklable `indices -> plan`, run in a spawned worker process (no
            process groups, no CUDA there).

    Exceptions raised by `planner` or `prepare` surface from the `next()` call that wants that
    step.
    """

    def __init__(self, sampler, prepare: Callable, planner: Callable | None = None):
        self.sampler, self.prepare = sampler, prepare
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hcp-plan")
        self._worker = None if planner is None else ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn"), initializer=_install,
            initargs=(planner,))
        if self._worker is not None:
            self._worker.submit(_ready)  # spawn and import now, behind the caller's set-up
        self._pending = None  # (position, future)

    def _job(self, position: int):
        t0 = time.perf_counter()
        indices = self.sampler.batch(position)
        if self._worker is None:
            out, cpu = self.prepare(indices), None
        else:
            plan, cpu = self._worker.submit(_plan, indices).result()
            out = self.prepare(indices, plan)
        return indices, out, time.perf_counter() - t0, cpu

    def _submit(self, position: int) -> None:
        self._pending = (position, self._pool.submit(self._job, position))

    def next(self):
        """(indices, prepare's result, stats) of the next global batch; starts preparing the one
        after it. Stats: `plan_s` (seconds the background job took), `plan_hidden_s` (the part
        behind the caller's work) and, with a planner, `plan_cpu_s` (the worker's CPU seconds)."""
        position = self.sampler.position
        if self._pending is None or self._pending[0] != position:  # first step or after resume
            self._submit(position)
        t0 = time.perf_counter()
        indices, out, plan_s, cpu = self._pending[1].result()
        wait = time.perf_counter() - t0
        self.sampler.position = position + 1
        self._submit(position + 1)
        stats = {"plan_s": plan_s, "plan_hidden_s": max(0.0, plan_s - wait)}
        if cpu is not None:
            stats["plan_cpu_s"] = cpu
        return indices, out, stats

    def close(self) -> None:
        """Stop the thread and the worker process (an unfinished prefetch is discarded)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._worker is not None:
            self._worker.shutdown(wait=True, cancel_futures=True)
        self._pending = None
