"""What stops a run, said plainly: a NaN/Inf loss or gradient norm (`NonFiniteGuard`, per
`trainer.on_nonfinite`), and a failing rank (`report_rank_failure`, naming the rank).

A rank that dies without an exception (killed) is reported by its launcher: `python train.py`
names the rank, the signal or exit code and its step (`hcp.launch.supervise`), srun with
`--kill-on-bad-exit=1` (hcp's sbatch script; `SLURM_KILL_BAD_EXIT=1` under submitit) names the
task and ends the step at once, torchrun names the local rank; the surviving ranks' collectives
fail on the closed connection, or at the latest after `launcher.timeout_s`.
"""
from __future__ import annotations

import collections
import contextlib
import math
import os
import socket
import sys

import torch

TEST_NONFINITE_ENV = "HCP_TEST_NONFINITE_STEP"
"""Test-only hook: at these steps (1-based, comma-separated) the loss, the gradient norm and
every gradient become NaN before the check, as after a real overflow."""
SPIKE_WINDOW = 20
"""Finite losses of the previous steps whose mean a loss spike is measured against."""
SHOWN_SAMPLES = 16
"""Sample indices a non-finite step's line shows of its global batch (then how many more)."""


class NonFiniteError(FloatingPointError):
    """The loss or gradient norm of a step is NaN or Inf and `trainer.on_nonfinite=stop`."""


def batch_text(indices) -> str:
    """`samples [3, 17, ...] (+N more)` of a global batch's dataset indices."""
    shown = ", ".join(str(i) for i in indices[:SHOWN_SAMPLES])
    more = f" (+{len(indices) - SHOWN_SAMPLES} more)" if len(indices) > SHOWN_SAMPLES else ""
    return f"samples [{shown}{', ...' if more else ''}]{more}"


class NonFiniteGuard:
    """Checks each step before the optimizer update.

    The loss and the global gradient norm are the same float on every rank (both are reduced
    over all ranks in `hcp.train.step`), so every rank takes the same decision without another
    collective. Under `stop` the error is raised before the optimizer step and before any save:
    the weights in memory and the latest checkpoint on disk stay as they were. Under `skip`
    each skipped step is said in one line, and the step after `max_skipped` skipped ones stops
    the run as `stop` does (None: no limit). A finite loss above `spike_factor` x the mean of
    the previous `SPIKE_WINDOW` finite losses is said in one line with its batch (0: never), as
    Megatron-LM's `--check-for-spiky-loss` looks for one; the update goes on.
    """

    def __init__(self, policy: str, model: torch.nn.Module, checkpoint_dir: str,
                 max_skipped: int | None = None, spike_factor: float = 0.0):
        self.policy, self.model, self.checkpoint_dir = policy, model, checkpoint_dir
        self.max_skipped, self.spike_factor = max_skipped, spike_factor
        self.recent: collections.deque = collections.deque(maxlen=SPIKE_WINDOW)
        self.skipped: list[int] = []
        hook = os.environ.get(TEST_NONFINITE_ENV)
        self._inject_at = {int(s) for s in hook.split(",")} if hook else set()

    def update_ok(self, step: int, loss: float, grad_norm: float, indices=()) -> bool:
        """True: apply this step's update. False (`skip`): drop it; the caller zeroes the
        gradients and leaves the optimizer and LR schedule untouched. `indices`: the step's
        global batch (dataset sample indices), named in the line and the error.

        Raises:
            NonFiniteError: non-finite loss or gradient norm under `stop`, or under `skip` past
                `max_skipped` skipped steps, naming the step and its batch.
        """
        if step in self._inject_at:
            loss = grad_norm = float("nan")
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.fill_(float("nan"))
        batch = f"global batch: {batch_text(list(indices))}" if len(indices) else ""
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self._spike(step, loss, batch)
            return True
        what = f"step {step}: loss={loss} grad_norm={grad_norm} is not finite"
        limit = self.max_skipped
        if self.policy == "skip" and (limit is None or len(self.skipped) < limit):
            self.skipped.append(step)
            if os.environ.get("RANK", "0") == "0":
                cap = "no limit" if limit is None else f"trainer.max_skipped_steps={limit}"
                print(f"hcp: {what}; update skipped ({len(self.skipped)} skipped so far, {cap}; "
                      f"trainer.on_nonfinite=skip); {batch}", file=sys.stderr, flush=True)
            return False
        from hcp.train.checkpoint import latest

        why = ("trainer.on_nonfinite=stop" if self.policy != "skip" else
               f"{limit} steps skipped already: trainer.max_skipped_steps={limit}, "
               f"at steps {self.skipped}")
        other = ("trainer.on_nonfinite=skip" if self.policy != "skip" else "a larger "
                 "trainer.max_skipped_steps (null: no limit), after a look at those samples")
        raise NonFiniteError(f"{what}; stopped before the update ({why}); {batch}. Latest "
                             f"checkpoint, untouched: {latest(self.checkpoint_dir)}. Fix: lower "
                             f"optim.lr or raise optim.warmup_ratio and resume=auto, or {other}")

    def _spike(self, step: int, loss: float, batch: str) -> None:
        """Say a loss above `spike_factor` x the mean of the window (once the window is full)."""
        full = len(self.recent) == SPIKE_WINDOW
        mean = sum(self.recent) / max(1, len(self.recent))
        if self.spike_factor and full and loss > self.spike_factor * mean:
            if os.environ.get("RANK", "0") == "0":
                print(f"hcp: step {step}: loss spike: {loss:.4g} is {loss / mean:.1f}x the mean "
                      f"{mean:.4g} of the previous {SPIKE_WINDOW} steps (trainer.loss_spike_factor="
                      f"{self.spike_factor:g}; the update goes on); {batch}", file=sys.stderr,
                      flush=True)
        self.recent.append(loss)


@contextlib.contextmanager
def report_rank_failure():
    """Print `hcp: rank R/W on HOST failed: TYPE: message` to stderr when the body raises
    (not for SystemExit / KeyboardInterrupt), then re-raise: every log line of a failed job
    names the failing rank, whatever the launcher prints. A rank of hcp's own local launch
    records the time instead and its launcher names the first rank that raised
    (`hcp.launch.supervise.record_failure`): the survivors' errors do not come first."""
    from hcp.launch.supervise import record_failure

    try:
        yield
    except Exception as e:
        if record_failure():
            raise
        rank, world = os.environ.get("RANK", "?"), os.environ.get("WORLD_SIZE", "?")
        print(f"hcp: rank {rank}/{world} on {socket.gethostname()} failed: {type(e).__name__}: {e}",
              file=sys.stderr, flush=True)
        raise
