"""Preemption and time limits: a signal becomes a joint checkpoint, a requeue and an exit.

1. The signal handler only sets a flag (no I/O, no collective);
2. at the next step boundary the flag rides in the step's one metrics collective, read at the
   boundary after (`hcp.train.throughput.WorldStats`: off the critical path), and every rank
   takes the largest (`Preemption.agree`), so all ranks stop at the same step;
3. they save a checkpoint together (`Trainer.save`);
4. rank 0 requeues the job (`scontrol requeue $SLURM_JOB_ID`) and every rank exits with
   SystemExit; the requeued job resumes with `resume=auto` and the same wandb run.
hcp installs its handlers after submitit's (which would requeue before the save); hcp's sbatch
script makes torchrun ignore the signal (`trap '' USR2`). Without `scontrol` the ranks exit with
`launcher.slurm.requeue_exit_code` (requeued only where slurm.conf lists it in `RequeueExit`)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import uuid

import torch
import torch.distributed as dist


class Preemption:
    """Signal flag and step-boundary agreement of one rank.

    Handles `SIG<launcher.slurm.signal>` and SIGUSR2 (submitit's) always, and SIGTERM under
    SLURM only (`SLURM_JOB_ID` set: SLURM's preemption and time-limit notice; a local run keeps
    torch.multiprocessing's terminate-on-failure semantics, and its launcher sends a SIGTERM it
    gets on as `SIG<launcher.slurm.signal>`: `hcp.launch.supervise`).
    """

    def __init__(self, slurm_cfg, device: torch.device, env=os.environ):
        self.cfg, self.device, self.env = slurm_cfg, device, env
        self.received: int = 0
        self.stopping = False  # every rank agreed to stop (`agree`)
        names = [slurm_cfg.signal, "USR2"] + (["TERM"] if "SLURM_JOB_ID" in env else [])
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

    def requeue_and_exit(self, step: int, checkpoint_dir: str) -> None:
        """After the joint save at `step`: rank 0 requeues the job (or says why not), then every
        rank raises SystemExit (0 once requeued; `requeue_exit_code` without scontrol; 128 +
        signal when the run stops for good)."""
        name = signal.Signals(self.received).name
        code, note = self._requeue(checkpoint_dir) if dist.get_rank() == 0 else (self._exit_code(), None)
        if note:
            print(f"hcp: {name} at step {step}: checkpoint saved in {checkpoint_dir}; {note}",
                  file=sys.stderr, flush=True)
        dist.barrier()  # nobody leaves before rank 0 has requeued
        raise SystemExit(code)

    def _exit_code(self) -> int:
        job = self.env.get("SLURM_JOB_ID")
        if job and self._restarts() < self.cfg.max_requeues:
            return 0 if shutil.which("scontrol") else self.cfg.requeue_exit_code
        return 128 + self.received

    def _restarts(self) -> int:
        return int(self.env.get("SLURM_RESTART_COUNT", "0") or 0)

    def _requeue(self, checkpoint_dir: str) -> tuple[int, str]:
        job = self.env.get("SLURM_JOB_ID")
        if not job:  # checkpoint.dir named: the default one lies inside this run's directory
            return 128 + self.received, ("not a SLURM job: to continue, run the same command with "
                                         f"`resume=auto checkpoint.dir={os.path.abspath(checkpoint_dir)}`")
        if self._restarts() >= self.cfg.max_requeues:
            return 128 + self.received, (f"not requeued: job {job} has restarted {self._restarts()} "
                                         f"times (launcher.slurm.max_requeues={self.cfg.max_requeues})")
        if not shutil.which("scontrol"):
            code = self.cfg.requeue_exit_code
            return code, (f"scontrol not found: exiting with code {code}, which SLURM requeues only "
                          f"where slurm.conf has RequeueExit={code}; otherwise resubmit the same "
                          "job script (it resumes from checkpoint.dir with resume=auto)")
        out = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
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
