"""What stops a run, said plainly: a NaN/Inf loss or gradient norm (`NonFiniteGuard`, per
`trainer.on_nonfinite`), and a failing rank (`report_rank_failure`, naming the rank).

A rank that dies without an exception (killed) is reported by its launcher: `python train.py`
names the rank, the signal or exit code and its step (`hcp.launch.supervise`), srun with
`--kill-on-bad-exit=1` (hcp's sbatch script; `SLURM_KILL_BAD_EXIT=1` under submitit) names the
task and ends the step at once, torchrun names the local rank; the surviving ranks' collectives
fail on the closed connection, or at the latest after `launcher.timeout_s`.
"""
from __future__ import annotations

import contextlib
import math
import os
import socket
import sys

import torch

TEST_NONFINITE_ENV = "HCP_TEST_NONFINITE_STEP"
"""Test-only hook: at this step (1-based) the loss, the gradient norm and every gradient become
NaN before the check, as after a real overflow."""


class NonFiniteError(FloatingPointError):
    """The loss or gradient norm of a step is NaN or Inf and `trainer.on_nonfinite=stop`."""


class NonFiniteGuard:
    """Checks each step before the optimizer update.

    The loss and the global gradient norm are the same float on every rank (both are reduced
    over all ranks in `hcp.train.step`), so every rank takes the same decision without another
    collective. Under `stop` the error is raised before the optimizer step and before any save:
    the weights in memory and the latest checkpoint on disk stay as they were.
    """

    def __init__(self, policy: str, model: torch.nn.Module, checkpoint_dir: str):
        self.policy, self.model, self.checkpoint_dir = policy, model, checkpoint_dir
        self.skipped: list[int] = []
        hook = os.environ.get(TEST_NONFINITE_ENV)
        self._inject_at = int(hook) if hook else None

    def update_ok(self, step: int, loss: float, grad_norm: float) -> bool:
        """True: apply this step's update. False (`skip`): drop it; the caller zeroes the
        gradients and leaves the optimizer and LR schedule untouched.

        Raises:
            NonFiniteError: non-finite loss or gradient norm under `stop`, naming the step.
        """
        if step == self._inject_at:
            loss = grad_norm = float("nan")
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.fill_(float("nan"))
        if math.isfinite(loss) and math.isfinite(grad_norm):
            return True
        what = f"step {step}: loss={loss} grad_norm={grad_norm} is not finite"
        if self.policy == "skip":
            self.skipped.append(step)
            if os.environ.get("RANK", "0") == "0":
                print(f"hcp: {what}; update skipped (trainer.on_nonfinite=skip, {len(self.skipped)} "
                      "so far)", file=sys.stderr, flush=True)
            return False
        from hcp.train.checkpoint import latest

        raise NonFiniteError(f"{what}; stopped before the update (trainer.on_nonfinite=stop). Latest "
                             f"checkpoint, untouched: {latest(self.checkpoint_dir)}. Fix: lower "
                             "optim.lr or raise optim.warmup_ratio and resume=auto, or "
                             "trainer.on_nonfinite=skip")


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
