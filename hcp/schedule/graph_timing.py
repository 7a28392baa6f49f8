"""Timing model of action lists (`hcp.schedule.actions`, e.g. the graph-aware 1F1B of
`hcp.schedule.graph`): when each compute runs, each stage's busy time and its pipeline bubble.

The rules are `hcp.schedule.rendezvous`'s, with clocks: a stage runs its list in order; a
compute takes its duration; an `Exchange` is posted at the stage's current time and completes
when every op in it is matched, at the latest posting time among it and its matching ops'
batches (transfers take no time: fold them into the durations). So a stage also waits where its
batching makes it wait (e.g. a 1F1B steady step holds the next forward until the gradient it
batched with arrived), which a dependency-only model (`hcp.schedule.simulator`) does not see;
for a plain pipeline the two agree. The colocated step's lists (`actions.colocated`) replay
too: an `EncoderCompute` takes `encoder[s][0]` (forward) or `[1]` (backward) seconds and counts
as busy; a `Route` is a collective of every list (`rendezvous.Collectives`), finishing when the
last stage reaches it. starts / ends list the micro-batch computes only.

Per island, the bubble of a stage is `1 - busy / iteration time`: the share of the step that
stage sits idle (the regime benchmark reports it per island; docs/design.md 4.4).
"""
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

