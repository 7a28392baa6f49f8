"""A slow rank, named: every `trainer.log_every` steps the logging rank compares each rank's own
time per step (its compute, `StageTimes.busy_s`, plus its wait for its data, the plan-ahead
queue) with the median rank's, and names a rank above `trainer.straggler_factor` times it, as
Megatron-LM's straggler detector does (megatron/core/utils.py `StragglerDetector`).

The ranks' seconds ride in the all-gather each step already issues for its world figures
(`hcp.train.throughput.WorldStats`): no collective of its own. A rank's wall time per step says
nothing here: a collective makes every rank wait for the slowest, so all walls are equal.
"""
from __future__ import annotations

import statistics


class StragglerWatch:
    """Sums each rank's seconds per step between two reports (`add`, `report`).

    Args:
        factor: `trainer.straggler_factor` (0: off, `report` names no one).
    """

    def __init__(self, factor: float):
        self.factor = factor
        self.compute: list[float] = []  # per rank, seconds summed over the window
        self.wait: list[float] = []
        self.steps = 0

    def add(self, compute: list[float], wait: list[float]) -> None:
        """One step's seconds of every rank (in rank order): compute and data wait."""
        if not self.compute:
            self.compute, self.wait = [0.0] * len(compute), [0.0] * len(wait)
        self.compute = [a + b for a, b in zip(self.compute, compute)]
        self.wait = [a + b for a, b in zip(self.wait, wait)]
        self.steps += 1

    def report(self, step: int) -> list[str]:
        """Lines naming each rank whose compute + data wait per step over the steps added since
        the last report (ending at `step`, the last one landed) is above `factor` x the median
        rank's; then starts a new window."""
        lines = []
        if self.factor > 0 and self.steps:
            n = self.steps
            own = [(c + w) / n for c, w in zip(self.compute, self.wait)]
            median = statistics.median(own)
            for rank, seconds in enumerate(own):
                if seconds > self.factor * median:
                    lines.append(
                        f"hcp: straggler: rank {rank} took {seconds:.3f} s per step (compute "
                        f"{self.compute[rank] / n:.3f} s + data wait {self.wait[rank] / n:.3f} s) "
                        f"over steps {step - n + 1}-{step}, {seconds / max(median, 1e-12):.1f}x "
                        f"the median rank's {median:.3f} s (trainer.straggler_factor="
                        f"{self.factor:g})")
        self.compute, self.wait, self.steps = [], [], 0
        return lines
