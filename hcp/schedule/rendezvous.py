"""Check that a set of stages' action lists (`hcp.schedule.actions`) finishes under NCCL's
rendezvous semantics, without processes.

The model (conservative for messages larger than NCCL's buffers): each stage runs its list in
order; an `Exchange` waits until every op in it is matched by its peer's op, posted in the peer's
same-step batch or earlier (an unbatched send is an Exchange of one op); between two stages the
k-th send matches the k-th receive, and a match of different messages is an error. The k-th
`Route` (a collective) of every list must be the same route (else ValueError); compute and
`EncoderCompute` finish at once. Data dependencies are checked too (a forward after its receive,
a send after its compute, a backward after its forward and its gradient's receive)."""
from __future__ import annotations

from collections import defaultdict

from hcp.schedule.actions import Compute, EncoderCompute, Exchange, Route, SyncGrads

_PAIR = {"SEND_F": "RECV_F", "SEND_B": "RECV_B"}
_PRODUCER = {"SEND_F": "F", "SEND_B": "B"}


class ScheduleDeadlock(RuntimeError):
    """Some stages wait forever; the message names each stuck stage and its pending action."""


class Mailboxes:
    """Batched point-to-point rendezvous of `n` ranks (NCCL's model, module docstring): a rank
    posts a batch of sends and receives at once; on each channel the k-th send matches the k-th
    receive, and the batch is done when every op in it has its counterpart."""

    def __init__(self, n: int):
        self.sends: dict = defaultdict(list)  # channel -> send ops in issue order
        self.recvs: dict = defaultdict(list)  # channel -> receive ops in issue order
        self.slots: list[list] = [[] for _ in range(n)]  # per rank: (channel, index, is_send)
        self.posted = [False] * n

    def done(self, r: int, ops, check) -> bool:
        """Whether rank `r`'s batch is done; the first call posts it (`ops`: (channel, op,
        is_send) each, iterated only then). `check(channel, k, send, recv)` raises on a
        mismatched pair. A done batch closes: the rank's next call posts its next one."""
        if not self.posted[r]:
            for chan, op, is_send in ops:
                table = self.sends if is_send else self.recvs
                self.slots[r].append((chan, len(table[chan]), is_send))
                table[chan].append(op)
            self.posted[r] = True
        for chan, k, is_send in self.slots[r]:
            if len((self.recvs if is_send else self.sends)[chan]) <= k:
                return False
            check(chan, k, self.sends[chan][k], self.recvs[chan][k])
        self.posted[r], self.slots[r] = False, []
        return True


class Collectives:
    """The `Route`s of `n` lists as collectives: the k-th `Route` of every list is one."""

    def __init__(self, n: int):
        self.n, self.count = n, [0] * n
        self.arrived: dict = defaultdict(dict)  # k -> {stage: (action, its clock)}

    def reach(self, s: int, action, clock: float = 0.0) -> float | None:
        """Stage `s` is at `action` (its next collective) at `clock`: the time every stage is
        there (the collective finishes), or None while some stage is not. Raises ValueError
        when the stages reach different collectives."""
        here = self.arrived[self.count[s]]
        here.setdefault(s, (action, clock))
        if len(here) < self.n:
            return None
        kinds = {a for a, _ in here.values()}
        if len(kinds) > 1:
            raise ValueError(f"collective {self.count[s]}: the stages run different ones "
                             f"({sorted(map(str, kinds))})")
        self.count[s] += 1
        return max(t for _, t in here.values())


def run_rendezvous(programs: list[list]) -> list[tuple[int, object]]:
    """Run `programs[s]` (stage s's action list) for every stage until all finish.

    Returns the completed actions as (stage, action) in completion order.

    Raises:
        ScheduleDeadlock: no stage can make progress while some have actions left.
        ValueError: a send matched with a receive of another message, a peer outside the
            stages or equal to the stage itself, or a data dependency broken (names the stage
            and the action).
    """
    n = len(programs)
    pc = [0] * n
    boxes = Mailboxes(n)  # channel (src, dst)
    done: list[set] = [set() for _ in range(n)]  # ("F"|"B"|"RECV_F"|"RECV_B", micro) finished
    receives = [{(op.kind, op.micro) for a in prog if isinstance(a, Exchange) for op in a.ops
                 if not op.is_send} for prog in programs]
    log: list = []
    collectives = Collectives(n)

    def fail(s, action, why):
        raise ValueError(f"stage {s}, {action}: {why}")

    def ops(s, ex: Exchange):
        for op in ex.ops:
            if not 0 <= op.peer < n or op.peer == s:
                fail(s, op, f"peer {op.peer} is not another of the {n} stages")
            if op.is_send and (_PRODUCER[op.kind], op.micro) not in done[s]:
                fail(s, op, f"sends a tensor before its {_PRODUCER[op.kind]}{op.micro} ran")
            yield ((s, op.peer) if op.is_send else (op.peer, s)), op, op.is_send

    def check(chan, k, send, recv):
        if _PAIR[send.kind] != recv.kind or send.micro != recv.micro:
            raise ValueError(f"stages {chan[0]} -> {chan[1]}: {send} is received as {recv}")

    def step(s) -> bool:
        action = programs[s][pc[s]]
        if isinstance(action, (SyncGrads, EncoderCompute)):
            pass
        elif isinstance(action, Route):
            if collectives.reach(s, action) is None:
                return False
        elif isinstance(action, Compute):
            need = {("F", action.micro)} if action.kind == "B" else set()
            need |= {("RECV_" + action.kind, action.micro)} & receives[s]
            if not need <= done[s]:
                fail(s, action, f"runs before {sorted(need - done[s])}")
            if (action.kind, action.micro) in done[s]:
                fail(s, action, "runs twice")
            done[s].add((action.kind, action.micro))
        else:
            if not boxes.done(s, ops(s, action), check):
                return False
            done[s].update((op.kind, op.micro) for op in action.ops if not op.is_send)
        log.append((s, action))
        pc[s] += 1
        return True

    drive(programs, pc, step)
    return log


def drive(programs, pc: list[int], step) -> None:
    """Advance every stage's program counter `pc[s]` with `step(s)` (True when stage s ran its
    next action) until no stage can move.

    Raises:
        ScheduleDeadlock: some stage is stuck before the end of its program (names each one,
            with the action it waits at).
    """
    progress = True
    while progress:
        progress = False
        for s in range(len(programs)):
            while pc[s] < len(programs[s]) and step(s):
                progress = True
    stuck = [s for s in range(len(programs)) if pc[s] < len(programs[s])]
    if stuck:
        raise ScheduleDeadlock("stuck: " + "; ".join(f"stage {s} at action {pc[s]} "
                                                     f"{programs[s][pc[s]]}" for s in stuck))
