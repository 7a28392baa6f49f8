"""The launching process watches the local ranks it started (`hcp.launch.launch.start_local_ranks`).

- A signal to the launcher alone (a scheduler, an IDE's stop button, a supervisor, `kill PID`)
  reaches every rank: SIGINT is forwarded as SIGINT, so every rank stops at once, as after a
  terminal's Ctrl-C (what is on disk is what `trainer.save_every` saved); SIGTERM is forwarded as
  the preemption signal `SIG<launcher.slurm.signal>`, so every rank takes part in one checkpoint
  at the next step boundary and stops (`hcp.launch.preempt`). The launcher waits until every rank
  has stopped and only then raises `Interrupted`: the hint it prints names what is on disk then.
- A rank that ends without a Python exception (SIGKILL, the out-of-memory killer, `os._exit`)
  becomes `RankDied`, naming the rank, the signal or exit code and the step it was in: each rank
  records its completed steps in memory shared with the launcher (`record_step`, one host write
  per step, no collective). A rank that raised keeps torch's traceback (its own `hcp: rank R/W
  ... failed` line names it, `hcp.train.failures`).
"""
from __future__ import annotations

import contextlib
import os
import signal
from typing import Callable, Optional

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


def step_board(start_method: str, nproc: int):
    """Shared memory for the completed step of each of `nproc` local ranks (-1: none recorded yet)."""
    import multiprocessing

    board = multiprocessing.get_context(start_method).Array("q", nproc, lock=False)
    board[:] = [-1] * nproc
    return board


def join_board(board, local_rank: int) -> None:
    """In a local rank: record this rank's steps in `board` (set once, as the rank starts)."""
    global _board
    _board = (board, local_rank)


def record_step(step: int) -> None:
    """Record that this rank has completed `step` steps (0: it starts the first; a no-op
    outside hcp's local launch)."""
    if _board is not None:
        _board[0][_board[1]] = step


def join_ranks(context, board, forward: dict[int, int]) -> None:
    """Wait for every rank of `context` (torch's ProcessContext) to end. While waiting, each
    signal in `forward` is sent on to every live rank as `forward[signal]`.

    Raises:
        Interrupted: a forwarded signal, once every rank has stopped.
        RankDied: a rank ended without a Python exception (the others were terminated).
        torch.multiprocessing.ProcessRaisedException: a rank raised (its traceback).
    """
    from torch.multiprocessing.spawn import ProcessException

    got: list[int] = []

    def on_signal(signum, frame):
        got.append(signum)
        for p in context.processes:
            if p.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, forward[signum])

    before = {s: signal.signal(s, on_signal) for s in forward}
    try:
        while not context.join():
            pass
    except ProcessException as e:
        if not got:  # after a forwarded signal every rank's end is expected
            died = _died(context, board, e.error_index)
            if died is None:
                raise
            raise died from None
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
    if got:
        raise Interrupted(got[0])


def run_in_process(fn: Callable[[], None], save_signal: int) -> None:
    """Run the only local rank, `fn()`, in this process with `join_ranks`'s semantics: SIGTERM
    is handed to the rank's own `save_signal` handler (`hcp.launch.preempt.Preemption`: save at
    the next step boundary, then stop) or, before the rank has one, stops it at once; SIGINT
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
        handler(save_signal, frame)

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
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        if code == -signal.SIGKILL:
            how += " (sent by a user, a scheduler or the out-of-memory killer)"
        step = board[i]
        when = f"during step {step + 1}" if step >= 0 else "before its first training step"
        return RankDied(f"rank {i}/{n} {how} {when}; the other ranks were stopped")
    return None
