"""`profile.steps=[first, last]`: a `torch.profiler` trace of those steps on every rank, and with
`profile.memory=true` CUDA's memory snapshot of the same steps.

Each rank writes `<run dir>/profile/rank<R>_steps<first>-<last>.json` (Chrome trace JSON: open it
in https://ui.perfetto.dev or `chrome://tracing`; TensorBoard's profiler plugin reads the
folder). hcp's actions are named ranges on the rank's thread (`hcp.comm.trace`): `hcp.step N`,
`hcp.data_wait`, `hcp.forward mbI` / `hcp.backward mbI`, `hcp.send_recv ...`,
`hcp.encoder_forward`, `hcp.route_forward`, `hcp.cp_attention_forward ...`, `hcp.grad_sync`,
`hcp.clip`, `hcp.optimizer`. The memory snapshot, `rank<R>_memory_steps<first>-<last>.pickle`,
opens at https://pytorch.org/memory_viz. Nothing is recorded outside those steps: the ranges
are no-ops there (`hcp.comm.trace.span`).
"""
from __future__ import annotations

import contextlib
import os

import torch

from hcp.comm.trace import span

MEMORY_ENTRIES = 100_000
"""Allocation events CUDA's memory history keeps (a few KB each in the snapshot)."""


class StepProfiler:
    """Starts the profiler before step `first` and writes its trace after step `last`.

    Args:
        steps: `profile.steps` (`[first, last]` or `[step]`, 1-based) or None (off);
        memory: `profile.memory`; run_dir: the run directory; rank: this rank;
        device: this rank's device; say: prints one line (the logging rank's `RunLogger.write`,
            None on the other ranks).
    """

    def __init__(self, steps, memory: bool, run_dir: str, rank: int, device: torch.device,
                 say=None):
        self.first, self.last = (steps[0], steps[-1]) if steps else (None, None)
        self.memory = memory and device.type == "cuda"
        self.rank, self.device, self.say = rank, device, say
        self.folder = os.path.join(run_dir, "profile")
        self.prof = None
        if steps and memory and device.type != "cuda" and say is not None:
            say(f"hcp: profile.memory: no CUDA memory snapshot on {device.type} ranks (only the "
                "trace of profile.steps is written)")

    @contextlib.contextmanager
    def step(self, step: int):
        """Runs step `step` (1-based) inside the profiler when it is one of `steps`, named
        `hcp.step <step>` in the trace."""
        if step == self.first:
            self._start()
        with span(f"hcp.step {step}") if self.prof is not None else contextlib.nullcontext():
            yield
        if step == self.last and self.prof is not None:
            self._stop()

    def _start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        if self.memory:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_ENTRIES)
        self.prof = torch.profiler.profile(activities=activities, record_shapes=True)
        self.prof.__enter__()

    def _stop(self) -> None:
        self.prof.__exit__(None, None, None)
        os.makedirs(self.folder, exist_ok=True)
        tag = f"steps{self.first}-{self.last}"
        trace = os.path.join(self.folder, f"rank{self.rank}_{tag}.json")
        self.prof.export_chrome_trace(trace)
        self.prof = None
        if self.memory:
            snapshot = os.path.join(self.folder, f"rank{self.rank}_memory_{tag}.pickle")
            torch.cuda.memory._dump_snapshot(snapshot)
            torch.cuda.memory._record_memory_history(enabled=None)
        if self.say is not None:
            what = "traces and memory snapshots" if self.memory else "traces"
            self.say(f"hcp: profile of steps {self.first}-{self.last}: {what} of every rank in "
                     f"{self.folder} (this rank's: {os.path.basename(trace)}; open in "
                     "https://ui.perfetto.dev)")
