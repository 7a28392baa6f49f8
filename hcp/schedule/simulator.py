"""Timing model of the 1F1B pipeline schedule (non-interleaved, PipeDream-Flush / Megatron-LM).

Each stage runs the computes of its 1F1B action list (`hcp.schedule.actions.one_f_one_b`, the
list the executor runs: warm-up forwards, then one forward and one backward, then the remaining
backwards, all in micro-batch order). Dependencies:
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

from hcp.schedule.actions import compute_order, one_f_one_b


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
    """The 1F1B op order of one stage, `[("F", 0), ..., ("B", M - 1)]`: the computes of the
    executor's action list (`hcp.schedule.actions.one_f_one_b`)."""
    return list(_stage_order(stage, num_stages, num_micro_batches))


@functools.lru_cache(maxsize=4096)
def _stage_order(stage: int, num_stages: int, num_micro_batches: int):
    """`compute_order(one_f_one_b(...))` without building the action list (the solver times
    thousands of candidate pipelines): `w = min(p - s - 1, m)` warm-up forwards, then forward
    `w + i` and backward `i` in turn, then the remaining backwards (tests/test_simulator.py
    checks it against the action list)."""
    m = num_micro_batches
    if not 0 <= stage < num_stages or m < 0:
        return tuple(compute_order(one_f_one_b(stage, num_stages, m)))  # its error
    w = min(num_stages - stage - 1, m)
    order = [("F", j) for j in range(w)]
    for i in range(m - w):
        order += [("F", w + i), ("B", i)]
    return tuple(order + [("B", j) for j in range(m - w, m)])


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
    after the op it waits for and after the previous op of its stage (`stage_order`): the
    stages' orders merged by advancing every stage as far as its dependencies allow, in turn.
    F(s, j) waits for F(s - 1, j); B(s, j) for B(s + 1, j), on the last stage for F(p - 1, j)."""
    size = p * m
    orders = [[(size if k == "B" else 0) + s * m + j for k, j in _stage_order(s, p, m)]
              for s in range(p)]
    dep = [(op - m if op >= m else -1) for op in range(size)]  # F(s, j) <- F(s - 1, j)
    dep += [(op + m if op < 2 * size - m else op - size) for op in range(size, 2 * size)]
    done, pc, out = bytearray(2 * size), [0] * p, []
    while len(out) < 2 * size:
        for s in range(p):
            order, k = orders[s], pc[s]
            while k < len(order):
                op = order[k]
                d = dep[op]
                if d >= 0 and not done[d]:
                    break
                out.append((op, s, d))
                done[op] = 1
                k += 1
            pc[s] = k
    return tuple(out)
