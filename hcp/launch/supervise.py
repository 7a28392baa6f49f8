"""The launching process watches the local ranks it started (`hcp.launch.launch.start_local_ranks`).

- A signal to the launcher alone (a scheduler, an IDE's stop button, a supervisor, `kill PID`)
  reaches every rank: SIGINT is forwarded as SIGINT, so every rank stops at once, as after a
  terminal's Ctrl-C (what is on disk is what `trainer.save_every` saved); SIGTERM is forwarded as
  the preemption signal `SIG<launcher.slurm.signal>`, so every rank takes part in one checkpoint
  at the next step boundary and stops (`hcp.launch.preempt`). The launcher waits until every rank
  has stopped and only then raises `Interrupted`: the hint it prints names what is on disk then.
- Ranks start with the default SIGINT disposition, whatever the launcher inherited (a job
  started in the background of a shell script ignores SIGINT). A forwarded signal that ranks do
  not act on does not leave the launcher waiting forever: after a grace period (`grace_s`) it
  sends SIGTERM, then SIGKILL after `KILL_GRACE_S` more, as torchrun does.
- A rank that ends without a Python exception (SIGKILL, the out-of-memory killer, `os._exit`)
  becomes `RankDied`, naming the rank, the signal or exit code and the step it was in: each rank
  records its completed steps in memory shared with the launcher (`record_step`, one host write
  per step, no collective).
- A rank that raised becomes `RankRaised`, naming the rank that raised FIRST (each rank records
  when it raised, `record_failure`), not the survivors whose collectives then failed on the
  closed connection ("connection closed by peer"); they are summed up after it. The ranks of
  this launch print no failure line of their own, and torch's "Terminating process" warnings
  are silenced, so the cause is the first line the user reads.

Shared memory (`step_board`), int64, for `n` local ranks: `[0, n)` completed steps, `[n, 2n)`
when each rank raised (CLOCK_MONOTONIC ns, 0: it did not), `[2n]` the signal the launcher got.
"""
from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import sys
import time
from typing import Callable, Optional

KILL_GRACE_S = 30.0
"""Seconds between SIGTERM and SIGKILL when ranks ignore a forwarded signal (torchrun's default
`--shutdown-timeout`)."""

_board: Optional[tuple] = None
"""In a local rank: (the launcher's shared int64 array of completed steps, this rank's index)."""


class Interrupted(KeyboardInterrupt):
    """The launcher got signal `signum`, forwarded it to every local rank, and all have stopped."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class RankDied(RuntimeError):
    """A local rank ended without a Python exception (killed by a signal, or an exit code other
    than 0); the message names the rank, how it ended and the last step it completed."""


class RankRaised(RuntimeError):
    """A local rank raised: the message names the first rank that raised, its step and its
    error (`TYPE: message`) and sums up the ranks that failed after it; `traceback` is that
    rank's traceback (text)."""

    def __init__(self, message: str, traceback: str):
        super().__init__(message)
        self.traceback = traceback


def step_board(start_method: str, nproc: int):
    """Shared memory of `nproc` local ranks and their launcher (module docstring's layout)."""
    import multiprocessing

    board = multiprocessing.get_context(start_method).Array("q", 2 * nproc + 1, lock=False)
    board[:] = [-1] * nproc + [0] * (nproc + 1)
    return board


def _ranks(board) -> int:
    return (len(board) - 1) // 2


def launcher_signal() -> int:
    """In a local rank: the signal its launcher got and forwarded (0: none, or not a local
    launch), so that a rank names SIGTERM when its launcher turned it into the save signal."""
    return int(_board[0][-1]) if _board is not None else 0


def record_failure() -> bool:
    """In a local rank that raised: record when (the launcher names the first); True when the
    launcher will report the failure (a local launch), False outside one."""
    if _board is None:
        return False
    _board[0][_ranks(_board[0]) + _board[1]] = time.monotonic_ns()
    return True


def join_board(board, local_rank: int) -> None:
    """In a local rank: record this rank's steps in `board` (set once, as the rank starts)."""
    global _board
    _board = (board, local_rank)


def record_step(step: int) -> None:
    """Record that this rank has completed `step` steps (0: it starts the first; a no-op
    outside hcp's local launch)."""
    if _board is not None:
        _board[0][_board[1]] = step


def default_sigint() -> None:
    """In a local rank as it starts: SIGINT raises KeyboardInterrupt, even where the launcher
    inherited it ignored (a background job of a shell script), so a forwarded SIGINT stops it."""
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _send(context, signum: int) -> list[int]:
    """Send `signum` to every live rank of `context`; the local ranks it went to."""
    sent = []
    for i, p in enumerate(context.processes):
        if p.exitcode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signum)
                sent.append(i)
    return sent


def join_ranks(context, board, forward: dict[int, int],
               grace_s: Optional[dict[int, float]] = None) -> None:
    """Wait for every rank of `context` (torch's ProcessContext) to end. While waiting, each
    signal in `forward` is sent on to every live rank as `forward[signal]`; ranks still alive
    `grace_s[signal]` seconds later (default `KILL_GRACE_S`) get SIGTERM, and SIGKILL
    `KILL_GRACE_S` after that.

    Raises:
        Interrupted: a forwarded signal, once every rank has stopped.
        RankDied: a rank ended without a Python exception (the others were terminated).
        RankRaised: a rank raised (the first that did, with its traceback).
    """
    from torch.multiprocessing.spawn import ProcessException

    got: list[int] = []
    escalate: list = []  # (when, signal) still to send once a forwarded signal is pending

    def on_signal(signum, frame):
        if not got:
            board[-1] = signum  # the ranks name the signal the launcher got (`launcher_signal`)
            grace = (grace_s or {}).get(signum, KILL_GRACE_S)
            now = time.monotonic()
            escalate[:] = [(now + grace, signal.SIGTERM),
                           (now + grace + KILL_GRACE_S, signal.SIGKILL)]
        got.append(signum)
        _send(context, forward[signum])

    before = {s: signal.signal(s, on_signal) for s in forward}
    spawn_log = logging.getLogger("torch.multiprocessing.spawn")
    level = spawn_log.level
    spawn_log.setLevel(logging.ERROR)  # "Terminating process ...": hcp says what happened
    try:
        while not context.join(timeout=0.5):
            if escalate and time.monotonic() >= escalate[0][0]:
                _, signum = escalate.pop(0)
                late = _send(context, signum)
                if late:
                    print(f"hcp: local rank(s) {', '.join(map(str, late))} still running after "
                          f"{signal.Signals(got[0]).name}: sent {signum.name}",
                          file=sys.stderr, flush=True)
    except ProcessException as e:
        if not got:  # after a forwarded signal every rank's end is expected
            raise (_died(context, board, e.error_index) or _raised(context, board, e)) from None
    finally:
        spawn_log.setLevel(level)
        for s, handler in before.items():
            signal.signal(s, handler)
    if got:
        raise Interrupted(got[0])


def run_in_process(fn: Callable[[], None], save_signal: int) -> None:
    """Run the only local rank, `fn()`, in this process with `join_ranks`'s semantics: SIGTERM
    is handed, as SIGTERM, to the rank's own `save_signal` handler (`hcp.launch.preempt.Preemption`:
    save at the next step boundary, then stop) or, before the rank has one, stops it at once; SIGINT
    is Python's KeyboardInterrupt, as for any local run. A rank's own SIGTERM handler (SLURM)
    replaces this one.

    Raises:
        Interrupted: after a SIGTERM, once the rank has stopped (its SystemExit replaced).
    """
    got: list[int] = []

    def on_term(signum, frame):
        got.append(signum)
        handler = signal.getsignal(save_signal)
        if not callable(handler):  # still starting: nothing to save yet
            raise Interrupted(signum)
        handler(signum, frame)  # `Preemption` records SIGTERM itself: its line names it

    before = signal.signal(signal.SIGTERM, on_term)
    try:
        fn()
    except (SystemExit, KeyboardInterrupt):
        if not got:
            raise
    finally:
        signal.signal(signal.SIGTERM, before)
    if got:
        raise Interrupted(got[0])


def _died(context, board, first: int) -> Optional[RankDied]:
    """`RankDied` for the rank that ended without a Python exception, the one torch saw first
    if it did, else another (a rank that raised may only have seen a peer vanish); None when
    every failed rank raised. SIGTERM from torch itself (it terminates the others) is no cause."""
    n = len(context.processes)
    for i in [first, *range(n)]:
        code = context.processes[i].exitcode
        if code in (0, None) or os.access(context.error_files[i], os.R_OK):
            continue
        if code == -signal.SIGTERM and i != first:
            continue
        how = (f"was killed by {signal.Signals(-code).name}" if code < 0
               else f"exited with code {code}")
        if code == -signal.SIGKILL:
            how += " (sent by a user, a scheduler or the out-of-memory killer)"
        step = board[i]
        when = f"during step {step + 1}" if step >= 0 else "before its first training step"
        return RankDied(f"rank {i}/{n} {how} {when}; the other ranks were stopped")
    return None


def _last_line(text: str, limit: int = 300) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    last = lines[-1].strip() if lines else "?"
    return last if len(last) <= limit else last[:limit] + " ..."


def _raised(context, board, error: Exception) -> Exception:
    """`RankRaised` for the rank that raised first (`record_failure` times; torch's first seen
    when none recorded), summing up the ranks that raised after it; `error` itself when no
    rank left a traceback."""
    n = len(context.processes)
    tracebacks = {}
    for i in range(n):
        with contextlib.suppress(OSError, EOFError, pickle.UnpicklingError):
            with open(context.error_files[i], "rb") as fh:
                tracebacks[i] = pickle.load(fh)
    if not tracebacks:
        return error
    when = {i: board[n + i] or float("inf") for i in tracebacks}
    first = min(tracebacks, key=lambda i: (when[i], i != getattr(error, "error_index", -1)))
    step = board[first]
    during = f"during step {step + 1}" if step >= 0 else "before its first training step"
    message = f"rank {first}/{n} failed {during}: {_last_line(tracebacks[first])}"
    after = sorted(i for i in tracebacks if i != first)
    if after:
        message += (f" (then rank{'s' * (len(after) > 1)} {', '.join(map(str, after))} failed on "
                    f"it, e.g. {_last_line(tracebacks[after[0]], 120)})")
    return RankRaised(message, tracebacks[first])
