"""Preemption, time limits and cancellation: a signal becomes a joint checkpoint and an exit.

Two signals, two meanings (the practice of submitit and Megatron-LM's SLURM scripts):
- `SIG<launcher.slurm.signal>` (SIGUSR2: SLURM's time-limit warning `--signal=USR2@N`, or a
  preemption under `preempt_send_user_signal`) means *save and requeue*: the job goes on later;
- SIGTERM (`scancel`, a preemption that SLURM requeues by itself when the job allows it, a
  plain `kill` of torchrun or of hcp's launcher) means *save if there is time, then exit
  without requeueing*: a cancelled job stays cancelled.

1. The signal handler only sets a flag (no I/O, no collective);
2. at the next step boundary the flag rides in the step's one metrics collective, read at the
   boundary after (`hcp.train.throughput.WorldStats`: off the critical path), and every rank
   takes the largest (`Preemption.agree`; SIGTERM, 15, outranks SIGUSR2, 12: a cancel wins), so
   all ranks stop at the same step;
3. they save a checkpoint together (`Trainer.save`; SLURM sends SIGKILL `KillWait` seconds after
   SIGTERM, so a save that does not finish by then leaves the previous checkpoint the newest);
4. after SIGUSR2 rank 0 requeues the job (`scontrol requeue $SLURM_JOB_ID`); every rank exits
   with SystemExit; the requeued job resumes with `resume=auto` and the same wandb run.
hcp installs its handlers after submitit's (which would requeue before the save); hcp's sbatch
script makes torchrun ignore SIGUSR2 (`trap '' USR2`) and torchrun forwards SIGTERM to its
workers. Without `scontrol` the ranks exit with `launcher.slurm.requeue_exit_code` (requeued
only where slurm.conf lists it in `RequeueExit`)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import uuid

import torch
import torch.distributed as dist

from hcp.launch.supervise import launcher_signal


class Preemption:
    """Signal flag and step-boundary agreement of one rank.

    Handles `SIG<launcher.slurm.signal>` and SIGUSR2 (submitit's) always (save and requeue),
    and SIGTERM (save and stop) where an outside launcher sends it: under SLURM (`SLURM_JOB_ID`:
    scancel, preemption) and under torchrun (`TORCHELASTIC_RUN_ID`: torchrun forwards the SIGTERM
    it gets to its workers). Ranks of hcp's own local launch keep torch.multiprocessing's
    terminate-on-failure SIGTERM; their launcher forwards a SIGTERM it gets as
    `SIG<launcher.slurm.signal>` and says which signal it was (`hcp.launch.supervise`).
    """

    def __init__(self, slurm_cfg, device: torch.device, env=os.environ):
        self.cfg, self.device, self.env = slurm_cfg, device, env
        self.received: int = 0
        self.stopping = False  # every rank agreed to stop (`agree`)
        outside = "SLURM_JOB_ID" in env or "TORCHELASTIC_RUN_ID" in env
        names = [slurm_cfg.signal, "USR2"] + (["TERM"] if outside else [])
        for name in dict.fromkeys(names):
            signal.signal(getattr(signal, "SIG" + name), self._flag)

    def _flag(self, signum, frame) -> None:
        self.received = self.received or signum

    def agree(self, flag: int) -> None:
        """Take `flag`, the largest of every rank's `received` gathered at the previous step
        boundary and read at this one (`hcp.train.throughput.WorldStats`; every rank passes the
        same): when set, every rank stops now (`stopping`) under that signal. A local flag is
        never cleared here (it counts at the next boundary)."""
        if flag:
            self.received, self.stopping = int(flag), True

    @property
    def cancelled(self) -> bool:
        """The agreed signal is SIGTERM: stop for good, never requeue (module docstring)."""
        return self.received == signal.SIGTERM

    def requeue_and_exit(self, step: int, checkpoint_dir: str) -> None:
        """After the joint save at `step`: rank 0 requeues the job after the requeue signal (or
        says why not; never after SIGTERM), then every rank raises SystemExit (0 once requeued;
        `requeue_exit_code` without scontrol; 128 + signal when the run stops for good). The
        line names the signal the run got (`hcp.launch.supervise.launcher_signal` when hcp's
        launcher forwarded it)."""
        name = signal.Signals(launcher_signal() or self.received).name
        code, note = (self._requeue(checkpoint_dir) if dist.get_rank() == 0
                      else (self._exit_code(), None))
        if note:
            print(f"hcp: {name} at step {step}: checkpoint saved in {checkpoint_dir}; {note}",
                  file=sys.stderr, flush=True)
        dist.barrier()  # nobody leaves before rank 0 has requeued
        raise SystemExit(code)

    def _exit_code(self) -> int:
        job = self.env.get("SLURM_JOB_ID")
        if job and not self.cancelled and self._restarts() < self.cfg.max_requeues:
            return 0 if shutil.which("scontrol") else self.cfg.requeue_exit_code
        return 128 + self.received

    def _restarts(self) -> int:
        return int(self.env.get("SLURM_RESTART_COUNT", "0") or 0)

    def _requeue(self, checkpoint_dir: str) -> tuple[int, str]:
        job = self.env.get("SLURM_JOB_ID")
        if not job:  # checkpoint.dir named: the default one lies inside this run's directory
            return 128 + self.received, ("not a SLURM job: to continue, run the same command with "
                                         f"`resume=auto "
                                         f"checkpoint.dir={os.path.abspath(checkpoint_dir)}`")
        if self.cancelled:
            return 128 + self.received, (
                "not requeued: SIGTERM means stop (scancel; a preemption that SLURM requeues by "
                f"itself resumes from here); to go on, resubmit the same job: it resumes from "
                f"{checkpoint_dir}")
        if self._restarts() >= self.cfg.max_requeues:
            return 128 + self.received, (f"not requeued: job {job} has restarted "
                                         f"{self._restarts()} times "
                                         f"(launcher.slurm.max_requeues={self.cfg.max_requeues})")
        if not shutil.which("scontrol"):
            code = self.cfg.requeue_exit_code
            return code, (f"scontrol not found: exiting with code {code}, which SLURM requeues "
                          f"only where slurm.conf has RequeueExit={code}; otherwise resubmit the "
                          f"same job script (it resumes from checkpoint.dir with resume=auto)")
        out = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True,
                             timeout=60)
        if out.returncode:
            return 1, f"`scontrol requeue {job}` failed: {(out.stderr or out.stdout).strip()}"
        return 0, f"requeued job {job}; it resumes from this checkpoint"


def resume_after_requeue(cfg, env=os.environ) -> None:
    """A requeued SLURM job (`SLURM_RESTART_COUNT` > 0) with `resume` unset resumes from its
    `checkpoint.dir` (`resume=auto`): the sbatch script passes resume=auto itself, a submitit
    job re-runs the submitted overrides as they were."""
    if cfg.resume is None and int(env.get("SLURM_RESTART_COUNT", "0") or 0) > 0:
        cfg.resume = "auto"


def continue_wandb_run(logger, run_dir: str, resumed: bool) -> None:
    """Make the logging rank's wandb run continue across requeues: the run id is kept in
    `run_dir/wandb_run_id` (a requeued job keeps its run directory); a resumed run reuses it, a
    fresh run writes a new one. Sets WANDB_RUN_ID and WANDB_RESUME=allow, which `wandb.init` reads.
    `logger`: the `logger` block (`hcp.config.schema.LoggerConfig`); nothing to do unless wandb."""
    if logger.name != "wandb":
        return
    path = os.path.join(run_dir, "wandb_run_id")
    run_id = None
    if resumed and os.path.isfile(path):
        with open(path) as f:
            run_id = f.read().strip() or None
    if run_id is None:
        run_id = uuid.uuid4().hex[:8]
        os.makedirs(run_dir, exist_ok=True)
        with open(path, "w") as f:
            f.write(run_id + "\n")
    os.environ.update(WANDB_RUN_ID=run_id, WANDB_RESUME="allow")
