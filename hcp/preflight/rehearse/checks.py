"""The rehearsal's checks over every rank's recorded trace (`hcp.preflight.rehearse.record`).

- `check_creations`: every rank created the same process groups in the same order (NCCL builds
  each `new_group` by a split of the world communicator that every rank must call in order).
- `check_collectives`: every member of every group issued the same sequence of collectives
  (op, shapes, dtype) on it; an all-to-all's splits agree pairwise.
- `check_rendezvous`: every send has its receive (same shape and dtype) and the whole trace
  finishes under NCCL's rendezvous rules: a batch of sends and receives waits until every op
  of it is matched, a collective until every member reached it (the conservative model of
  `hcp.schedule.rendezvous`, whose `drive` runs it).
Each returns `Mismatch`es; ranks outside the rehearsed subset (`rehearse.ranks`) are skipped.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from hcp.schedule.rendezvous import Mailboxes, ScheduleDeadlock, drive


@dataclass
class Mismatch:
    """One fault: `what` (`group creation`, `collective`, `send/recv`, `deadlock`, `memory`),
    the `ranks` involved, the training `step` (0: set-up), the `position` in the sequence
    compared, and each side's record (`sides`: rank -> text, "nothing" when absent)."""

    what: str
    ranks: list[int]
    step: int | None
    position: int | None
    sides: dict[int, str]
    note: str = ""

    def __str__(self) -> str:
        where = f" step {self.step}" if self.step is not None else ""
        pos = f" position {self.position}" if self.position is not None else ""
        head = f"{self.what}: ranks {self.ranks}{where}{pos}{': ' + self.note if self.note else ''}"
        return "\n".join([head] + [f"    rank {r}: {s}" for r, s in self.sides.items()])


def _first_difference(seqs: dict[int, list], key=lambda x: x):
    """(position, ranks that differ from the lowest rank there) of the first position where
    the sequences disagree, or None."""
    ref_rank = min(seqs)
    ref = seqs[ref_rank]
    for i in range(max(len(s) for s in seqs.values())):
        want = key(ref[i]) if i < len(ref) else None
        bad = [r for r, s in sorted(seqs.items()) if (key(s[i]) if i < len(s) else None) != want]
        if bad:
            return i, ref_rank, bad
    return None


def check_creations(creations: dict[int, list[tuple[int, ...]]]) -> list[Mismatch]:
    """`creations`: rank -> ranks of each group it created, in order."""
    found = _first_difference(creations)
    if found is None:
        return []
    i, ref, bad = found

    def text(r):
        seq = creations[r]
        return f"new_group({list(seq[i])}) (creation {i + 1} of {len(seq)})" if i < len(seq) else \
            f"nothing (it created {len(seq)} groups)"
    return [Mismatch("group creation", [ref] + bad[:7], None, i,
                     {r: text(r) for r in [ref] + bad[:7]},
                     f"{len(bad)} of {len(creations)} ranks create another group sequence than "
                     f"rank {ref}; NCCL needs every rank to create every group in one order")]


def group_sequences(traces: dict[int, list]) -> dict[tuple, dict[int, list]]:
    """(group name, group ranks) -> member rank -> its collectives on that group, in order.
    Every rehearsed member is listed, also one that issued nothing there."""
    seqs: dict[tuple, dict[int, list]] = defaultdict(dict)
    for rank, ops in traces.items():
        for op in ops:
            if op.kind == "collective":
                seqs[op.group_name, op.group].setdefault(rank, []).append(op)
    for (name, group), members in seqs.items():
        for r in group:
            if r in traces:
                members.setdefault(r, [])
    return seqs


def check_collectives(traces: dict[int, list]) -> list[Mismatch]:
    """`traces`: rank -> its recorded `Op`s. One mismatch per group at most (its first)."""
    out = []
    for (_, group), members in group_sequences(traces).items():
        found = _first_difference(members, key=lambda op: op.signature())
        if found is None:
            out += _check_splits(members)
            continue
        i, ref, bad = found
        ops = {r: (members[r][i] if i < len(members[r]) else None) for r in [ref] + bad}
        step = next((op.step for op in ops.values() if op is not None), None)
        out.append(Mismatch("collective", [ref] + bad, step, i,
                            {r: str(op) if op
                             else f"nothing (it issued {len(members[r])} on this group)"
                             for r, op in ops.items()},
                            f"members of group {list(group)} issue different collectives"))
    return out


def _check_splits(members: dict[int, list]) -> list[Mismatch]:
    """All-to-all: what member a sends to b equals what b expects from a."""
    out = []
    ranks = sorted(members)
    for i, ops in enumerate(zip(*(members[r] for r in ranks))):
        if ops[0].splits is None:
            continue
        group = ops[0].group
        by = dict(zip(ranks, ops))
        for a in ranks:
            for b in ranks:
                sent, expected = by[a].splits[1][group.index(b)], by[b].splits[0][group.index(a)]
                if sent != expected:
                    out.append(Mismatch("collective", [a, b], by[a].step, i,
                                        {a: f"{by[a]} sends {sent} rows to rank {b}",
                                         b: f"{by[b]} expects {expected} rows from rank {a}"},
                                        "all-to-all splits disagree"))
                    return out
    return out


@dataclass(frozen=True)
class _Batch:
    ops: tuple  # Op, in issue order

    def __str__(self):
        return "batch [" + "; ".join(f"{op.kind} {str(op)}" for op in self.ops) + "]"


@dataclass(frozen=True)
class _Collective:
    key: tuple  # (group name, group ranks)
    index: int  # its index in the rank's sequence on that group
    op: object

    def __str__(self):
        return f"collective {self.op}"


def programs_of(traces: dict[int, list], world: int) -> list[list]:
    """Each rank's trace as a program of `_Batch` (sends/receives posted together) and
    `_Collective` steps; ranks not rehearsed get an empty program and are not waited for."""
    programs: list[list] = [[] for _ in range(world)]
    for rank, ops in traces.items():
        counts: dict[tuple, int] = defaultdict(int)
        prog, batch, batch_id = programs[rank], [], None
        for op in ops:
            if op.kind == "collective" or op.batch != batch_id:
                if batch:
                    prog.append(_Batch(tuple(batch)))
                batch, batch_id = [], None
            if op.kind == "collective":
                key = (op.group_name, op.group)
                prog.append(_Collective(key, counts[key], op))
                counts[key] += 1
            elif op.peer in traces:
                batch.append(op)
                batch_id = op.batch
        if batch:
            prog.append(_Batch(tuple(batch)))
    return programs


def check_rendezvous(traces: dict[int, list], world: int) -> list[Mismatch]:
    """Run every rank's program to the end under the rendezvous model; a send matched with a
    receive of another shape or dtype, or a rank that can never go on, is a mismatch."""
    programs = programs_of(traces, world)
    pc = [0] * world
    boxes = Mailboxes(world)  # channel (group name, src, dst)
    reached: dict[tuple, dict[int, int]] = defaultdict(dict)  # key -> rank -> collectives reached
    faults: list[Mismatch] = []

    def ops(rank, batch):
        for op in batch.ops:
            src, dst = (rank, op.peer) if op.kind == "send" else (op.peer, rank)
            yield (op.group_name, src, dst), op, op.kind == "send"

    def check(chan, k, send, recv):
        if (send.shapes, send.dtype) != (recv.shapes, recv.dtype):
            _, src, dst = chan
            raise _Fault(Mismatch("send/recv", [src, dst], send.step, k,
                                  {src: f"send {send}", dst: f"recv {recv}"},
                                  f"message {k} from rank {src} to rank {dst} is received "
                                  "with another shape or dtype"))

    def step(rank) -> bool:
        item = programs[rank][pc[rank]]
        if isinstance(item, _Collective):
            reached[item.key][rank] = item.index + 1
            members = [r for r in item.key[1] if r in traces]
            if any(reached[item.key].get(r, 0) < item.index + 1 for r in members):
                return False
        elif not boxes.done(rank, ops(rank, item), check):
            return False
        pc[rank] += 1
        return True

    try:
        drive(programs, pc, step)
    except _Fault as f:
        faults.append(f.mismatch)
    except ScheduleDeadlock:
        stuck = [r for r in range(world) if pc[r] < len(programs[r])]
        sides = {r: str(programs[r][pc[r]]) for r in stuck[:8]}
        steps = [_step_of(programs[r][pc[r]]) for r in stuck]
        faults.append(Mismatch("deadlock", stuck, min(steps), None, sides,
                               f"{len(stuck)} ranks wait forever (a send without its receive, a "
                               "receive without its send, or a collective some member never "
                               "reaches); each shown at the op it waits in"))
    return faults


def _step_of(item) -> int:
    return item.op.step if isinstance(item, _Collective) else item.ops[0].step


class _Fault(Exception):
    def __init__(self, mismatch: Mismatch):
        super().__init__(str(mismatch))
        self.mismatch = mismatch
