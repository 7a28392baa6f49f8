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
    f_end = [[-1.0] * m for _ in range(p)]
    b_end = [[-1.0] * m for _ in range(p)]
    orders = [stage_order(s, p, m) for s in range(p)]
    ptr, free = [0] * p, [0.0] * p
    fl, bl = fwd.tolist(), bwd.tolist()
    ops: list[Op] = []
    remaining = 2 * p * m
    while remaining:
        progressed = False
        for s in range(p):
            order = orders[s]
            while ptr[s] < len(order):
                kind, j = order[ptr[s]]
                if kind == "F":
                    ready = f_end[s - 1][j] if s else 0.0
                else:
                    ready = b_end[s + 1][j] if s < p - 1 else f_end[s][j]
                if ready < 0:
                    break
                start = max(free[s], ready)
                end = start + (fl if kind == "F" else bl)[s][j]
                (f_end if kind == "F" else b_end)[s][j] = end
                free[s] = end
                if record:
                    ops.append(Op(s, j, kind, start, end))
                ptr[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # impossible for 1F1B orders; guards against a broken order
            raise RuntimeError("pipeline schedule deadlocked")
    return Timeline(ops, max(free))
