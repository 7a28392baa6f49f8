"""Timing model of the 1F1B pipeline schedule (non-interleaved, PipeDream-Flush / Megatron-LM).

Stage s of p runs `min(p - 1 - s, M)` warm-up forwards, then alternates one forward and one
backward, then drains the remaining backwards, all in micro-batch order. Dependencies:
`F(s, j)` after `F(s - 1, j)`; `B(s, j)` after `B(s + 1, j)` (on the last stage after
`F(p - 1, j)`). A stage runs one op at a time, in its order, each as early as allowed.
Inter-stage transfers take no time here (fold them into the per-micro-batch overhead).

Durations in seconds, finite and >= 0: `fwd[s, j]`, `bwd[s, j]` (shape `[p, M]`). The iteration
time is the end of the last op (`B(0, M - 1)`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Op:
    """One executed op: `kind` "F" or "B" of micro-batch `micro_batch` on `stage`, seconds."""

    stage: int
    micro_batch: int
    kind: str
    start: float
    end: float


@dataclass
class Timeline:
    """Every op's start and end (seconds) and the iteration time."""

    ops: list[Op]
    iteration_time: float

    def busy(self, stage: int) -> float:
        """Seconds stage `stage` spends running ops."""
        return sum(o.end - o.start for o in self.ops if o.stage == stage)


def stage_order(stage: int, num_stages: int, num_micro_batches: int) -> list[tuple[str, int]]:
    """The 1F1B op order of one stage: `[("F", 0), ..., ("B", M - 1)]`."""
    m = num_micro_batches
    warm = min(num_stages - 1 - stage, m)
    order = [("F", j) for j in range(warm)]
    for j in range(m - warm):
        order += [("F", warm + j), ("B", j)]
    return order + [("B", j) for j in range(m - warm, m)]


def simulate_1f1b(fwd: np.ndarray, bwd: np.ndarray, record: bool = True) -> Timeline:
    """Replay 1F1B over `fwd`, `bwd` (`[p, M]` seconds); with `record=False` the timeline holds
    no ops (faster, for the solver's candidate comparisons)."""
    fwd = np.asarray(fwd, dtype=np.float64)
    bwd = np.asarray(bwd, dtype=np.float64)
    if fwd.shape != bwd.shape or fwd.ndim != 2 or fwd.shape[1] == 0:
        raise ValueError(f"fwd {fwd.shape} and bwd {bwd.shape} must both be [stages, M>0]")
    for name, d in (("fwd", fwd), ("bwd", bwd)):
        bad = ~((d >= 0) & (d < np.inf))  # NaN fails both comparisons
        if bad.any():
            s, j = np.argwhere(bad)[0]
            raise ValueError(f"{name}[stage {s}, micro-batch {j}] = {d[s, j]}: durations must "
                             f"be finite seconds >= 0; check the cost model that produced it")
    p, m = fwd.shape
    end = [0.0] * (2 * p * m)  # op index: kind * p * m + s * m + j (kind 0 = F, 1 = B)
    dur = fwd.ravel().tolist() + bwd.ravel().tolist()
    free = [0.0] * p
    ops: list[Op] = []
    for op, s, dep in _topological(p, m):
        start = free[s] if dep < 0 or free[s] >= end[dep] else end[dep]
        end[op] = free[s] = start + dur[op]
        if record:
            ops.append(Op(s, op % m, "FB"[op // (p * m)], start, end[op]))
    return Timeline(ops, max(free))


@functools.lru_cache(maxsize=256)
def _topological(p: int, m: int) -> tuple[tuple[int, int, int], ...]:
    """Every op of 1F1B on p stages and m micro-batches as `(op, stage, op it waits for or -1)`
    (op index `kind * p * m + s * m + j`, kind 0 = F, 1 = B), in an order where each comes
    after the op it waits for and after the previous op of its stage (`stage_order`). With
    w_s = min(p - 1 - s, m) warm-up forwards on stage s: all warm-ups, stage by stage (F(s, j)
    waits for F(s - 1, j), a warm-up of stage s - 1 as w_{s-1} >= w_s); then per k the k-th
    steady pair of every stage, the forwards F(s, w_s + k) first (each waits for
    F(s - 1, w_s + k): stage s - 1's pair k - 1 or a warm-up), then the backwards B(s, k) by
    descending s (it waits for B(s + 1, k), stage s + 1's pair k, as w_{s+1} <= w_s); then
    the cool-down backwards B(s, j), j >= m - w_s, by ascending j and descending s."""
    warm = [min(p - 1 - s, m) for s in range(p)]
    size = p * m

    def f(s, j):
        return (s * m + j, s, (s - 1) * m + j if s else -1)

    def b(s, j):
        return (size + s * m + j, s, size + (s + 1) * m + j if s < p - 1 else s * m + j)

    out = [f(s, j) for s in range(p) for j in range(warm[s])]
    for k in range(m):  # the last stage (w = 0) has m steady pairs, the others fewer
        out += [f(s, warm[s] + k) for s in range(p) if k < m - warm[s]]
        out += [b(s, k) for s in reversed(range(p)) if k < m - warm[s]]
    out += [b(s, j) for j in range(m) for s in reversed(range(p)) if j >= m - warm[s]]
    return tuple(out)
