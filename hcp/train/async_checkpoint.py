"""Checkpoints written while training goes on (`checkpoint.async=true`), with torch DCP's
`async_save`: the shards are staged (copied) to host memory, pinned where a CUDA device exists,
before the call returns, so the next step may update the weights in place; the files are then
written by a background thread, whose collectives (DCP's plan and metadata exchange) run on a
process group of their own, never beside the training's on the same group.

A save's folder is written as `.tmp-step_XXXXXXXX/` and renamed into place (`hcp.train.checkpoint`)
by rank 0 only when DCP's save finished there: DCP's coordinator writes `.metadata` after every
rank's data files are written, and every rank wrote its RNG file before its save began, so a
crash during a write leaves only the `.tmp-` folder, which `resume=auto` ignores. A later save
and the end of the run wait for the previous write (`AsyncWriter.wait`), and re-raise its error.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions


class AsyncWriter:
    """One rank's background checkpoint writes, one at a time.

    `submit(state, path, publish)` stages `state` (a DCP state dict) and returns; the write goes
    on in a thread, then `publish()` runs there (rank 0 renames the folder into place; None on
    the other ranks). `wait()` blocks until the pending write and its publish are done.
    The process group of the writes is created by the first `submit`, which every rank reaches
    at the same save (a collective, in the same order everywhere)."""

    def __init__(self):
        on_device = torch.cuda.is_available()
        self.stager = DefaultStager(StagingOptions(
            use_pinned_memory=on_device, use_shared_memory=False, use_async_staging=False,
            use_non_blocking_copy=on_device))
        self.group = None
        self.pending: Optional[Future] = None
        self.path = ""

    def submit(self, state: dict, path: str, publish: Optional[Callable[[], None]]) -> None:
        """Wait for the previous write, stage `state` to host memory and start writing it to
        `path` (a DCP checkpoint folder); `publish` runs once the write finished without error.

        Raises the previous write's error (`wait`)."""
        self.wait()
        if self.group is None:
            self.group = dist.new_group(backend="gloo")
        written = dcp.async_save(state, checkpoint_id=path, process_group=self.group,
                                 async_stager=self.stager)
        done: Future = Future()

        def finish(write: Future) -> None:
            try:
                write.result()
                if publish is not None:
                    publish()
                done.set_result(None)
            except BaseException as e:  # noqa: BLE001 - handed to `wait`
                done.set_exception(e)
        written.add_done_callback(finish)
        self.pending, self.path = done, path

    def wait(self) -> None:
        """Block until the pending write (if any) is on disk and published.

        Raises:
            RuntimeError: the write or the publish failed on some rank (DCP's
                `CheckpointException`, a `BaseException`, or an `OSError` as its cause); the
                folder stays a `.tmp-` one, which `resume=auto` ignores."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        try:
            pending.result()
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            cause = (str(e).splitlines() or [type(e).__name__])[0]
            raise RuntimeError(f"checkpoint.async: writing {self.path} failed ({cause}); it is not "
                               "a complete checkpoint (resume=auto skips it)") from e
