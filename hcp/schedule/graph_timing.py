"""Timing model of action lists (`hcp.schedule.actions`): when each compute runs, each stage's busy
time and its pipeline bubble.

The rules are `hcp.schedule.rendezvous`'s with clocks: a compute takes its duration; an
`Exchange` completes when every op in it is matched (transfers take no time), so a stage also
waits where its batching makes it wait, which the dependency-only `hcp.schedule.simulator` does
not see. The colocated step replays too: `EncoderCompute` takes `encoder[s][0]` / `[1]` seconds
(busy); a `Route` is a collective of every list. A stage's bubble is `1 - busy / iteration time`."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from hcp.schedule.actions import Compute, EncoderCompute, Route, SyncGrads
from hcp.schedule.rendezvous import Collectives, drive


@dataclass(frozen=True)
class ActionTimeline:
    """starts[s][k] / ends[s][k]: seconds of stage s's k-th compute (list order);
    busy[s]: its compute seconds; iteration_time: when the last stage finishes."""

    starts: list[list[float]]
    ends: list[list[float]]
    busy: list[float]
    iteration_time: float

    def bubble(self, stage: int) -> float:
        """Idle share of the step on `stage`, in [0, 1] (0 for an empty step)."""
        t = self.iteration_time
        return 0.0 if t <= 0 else 1.0 - self.busy[stage] / t


def time_actions(programs: list[list], fwd, bwd, encoder=None) -> ActionTimeline:
    """Replay `programs[s]` (stage s's action list) with `fwd[s][i]` / `bwd[s][i]` seconds for
    the forward / backward of micro-batch i on stage s (finite, >= 0), and `encoder[s]` =
    (forward, backward) seconds of stage s's `EncoderCompute`s (default 0).

    Raises:
        ScheduleDeadlock: the lists cannot finish (check them with `run_rendezvous`, which
            names the mismatch).
        ValueError: a negative or non-finite duration.
    """
    n = len(programs)
    for name, d in (("fwd", fwd), ("bwd", bwd)):
        for s in range(n):
            for i, v in enumerate(d[s]):
                if not 0 <= v < float("inf"):
                    raise ValueError(f"{name}[stage {s}][micro-batch {i}] = {v}: durations must be "
                                     "finite seconds >= 0")
    pc, clock = [0] * n, [0.0] * n
    posted_at: list[float | None] = [None] * n
    slots: list[list] = [[] for _ in range(n)]
    sends: dict = defaultdict(list)   # (src, dst) -> posting times of sends, in issue order
    recvs: dict = defaultdict(list)   # (src, dst) -> posting times of receives, in issue order
    starts: list[list[float]] = [[] for _ in range(n)]
    ends: list[list[float]] = [[] for _ in range(n)]
    busy = [0.0] * n
    collectives = Collectives(n)

    def step(s) -> bool:
        action = programs[s][pc[s]]
        if isinstance(action, SyncGrads):
            pass
        elif isinstance(action, EncoderCompute):
            d = 0.0 if encoder is None else float(encoder[s][action.kind == "B"])
            clock[s] += d
            busy[s] += d
        elif isinstance(action, Route):
            done = collectives.reach(s, action, clock[s])
            if done is None:
                return False
            clock[s] = done
        elif isinstance(action, Compute):
            d = float((fwd if action.kind == "F" else bwd)[s][action.micro])
            starts[s].append(clock[s])
            clock[s] += d
            ends[s].append(clock[s])
            busy[s] += d
        else:
            if posted_at[s] is None:
                posted_at[s] = clock[s]
                for op in action.ops:
                    chan, table = ((s, op.peer), sends) if op.is_send else ((op.peer, s), recvs)
                    slots[s].append((chan, len(table[chan]), op.is_send))
                    table[chan].append(clock[s])
            done = clock[s]
            for chan, k, is_send in slots[s]:
                other = recvs if is_send else sends
                if len(other[chan]) <= k:
                    return False
                done = max(done, other[chan][k])
            clock[s], posted_at[s], slots[s] = done, None, []
        pc[s] += 1
        return True

    drive(programs, pc, step)
    return ActionTimeline(starts, ends, busy, max(clock, default=0.0))

