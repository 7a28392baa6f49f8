"""Write, print or submit an sbatch script for a recipe and its overrides.

    python -m hcp.launch.sbatch --dry-run +recipe=llama13b_dynamic_cp launcher=slurm_h100
    python -m hcp.launch.sbatch +recipe=llama_tiny launcher=slurm launcher.nproc_per_node=4

Nodes and tasks come from `launcher.nnodes` / `launcher.nproc_per_node`, the rest from
`launcher.slurm` (partition, time, signal and lead time, setup lines). The launch inputs are
checked first (`hcp.launch.slurm.check_job`): a bad one fails here, before submission, with the fix.

The job runs `train.py` in one of two ways (`launcher.slurm.launch`):
- `srun`: one task per GPU; each task joins the launch from the SLURM variables;
- `torchrun`: one task per node running torchrun with a c10d rendezvous at the first node;
  torchrun ignores the preemption signal (`trap '' SIG`) so that only its workers act on it.
Either way with `--kill-on-bad-exit=1` (a failing task ends the step at once), a clock-free
run directory (`outputs/slurm-$SLURM_JOB_ID`, or `--run-dir`; a requeued job keeps its id) and
`resume=auto`, so a requeued job resumes from its own `checkpoint.dir`.
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time

from hcp.config.compose import CONF_DIR
from hcp.config.errors import ConfigError

REPO = os.path.dirname(CONF_DIR)


def render(cfg, overrides: list[str], run_dir: str, log: str, job_name: str,
           python: str = sys.executable) -> str:
    """The sbatch script for `cfg` (composed from `overrides`) as text; `run_dir` may hold
    `$SLURM_JOB_ID` (expanded in the job), `log` sbatch's `%j`."""
    lc, s = cfg.launcher, cfg.launcher.slurm
    torchrun = s.launch == "torchrun"
    lines = ["#!/bin/bash", f"# Written by `python -m hcp.launch.sbatch {shlex.join(overrides)}`",
             f"#SBATCH --job-name={job_name}", f"#SBATCH --nodes={lc.nnodes}",
             f"#SBATCH --ntasks-per-node={1 if torchrun else lc.nproc_per_node}",
             f"#SBATCH --time={s.time_min}", f"#SBATCH --signal={s.signal}@{s.signal_lead_s}",
             "#SBATCH --requeue", "#SBATCH --open-mode=append",
             f"#SBATCH --output={log}"]
    if torchrun and s.cpus_per_task is None:
        lines.append(f"#SBATCH --cpus-per-task={lc.nproc_per_node}")
    for key in ("partition", "account", "qos", "cpus_per_task"):
        if s[key] is not None:
            lines.append(f"#SBATCH --{key.replace('_', '-')}={s[key]}")
    if s.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={s.gpus_per_node}")
    script = os.path.join(REPO, "train.py")
    program = ([shlex.quote(script)] if os.path.isfile(script)  # a source tree, else the package
               else ["-c", shlex.quote("from hcp.entry import main; main()")])
    args = f'{shlex.join(overrides)} "hydra.run.dir={run_dir}" resume=auto'
    run = f"{shlex.quote(python)} {' '.join(program)} {args}"
    lines += ["", *s.setup,
              'echo "hcp: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on '
              '$SLURM_JOB_NODELIST"']
    if torchrun:
        lines += [f"export HCP_RDZV_HOST=$({shlex.quote(python)} -c 'import os; from "
                  f"hcp.launch.slurm import first_host; "
                  f"print(first_host(os.environ[\"SLURM_JOB_NODELIST\"]))')",
                  "export HCP_RDZV_PORT=$((20000 + SLURM_JOB_ID % 20000))"]
        worker = (" ".join(program) if program[0] != "-c"
                  else f"--no-python {shlex.quote(python)} {' '.join(program)}")
        inner = (f"trap '' {s.signal}; exec {shlex.quote(python)} -m torch.distributed.run "
                 f"--nnodes={lc.nnodes} --nproc-per-node={lc.nproc_per_node} --rdzv-backend=c10d "
                 f"--rdzv-endpoint=$HCP_RDZV_HOST:$HCP_RDZV_PORT --rdzv-id=$SLURM_JOB_ID {worker} "
                 f"{args}")
        lines.append(f"srun --kill-on-bad-exit=1 bash -c {shlex.quote(inner)}")
    else:
        lines.append(f"srun --kill-on-bad-exit=1 --label {run}")
    lines += ["rc=$?", 'echo "hcp: job $SLURM_JOB_ID step exited with $rc"', "exit $rc", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    """CLI: compose, check, then print (`--dry-run`) or write and submit; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m hcp.launch.sbatch",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="print the script, submit nothing")
    parser.add_argument("--run-dir", default=None, help="run directory (default: "
                        "outputs/slurm-$SLURM_JOB_ID, expanded in the job)")
    parser.add_argument("--job-name", default="hcp")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for train.py")
    args = parser.parse_args(argv)
    from hcp.config.compose import compose_config
    from hcp.launch.slurm import check_job

    try:
        cfg = compose_config(args.overrides)
        lc = cfg.launcher
        check_job(cfg, lc.nnodes, lc.nproc_per_node, lc.slurm.gpus_per_node)
    except ConfigError as e:
        print(f"hcp: error: {e}", file=sys.stderr)
        return 2
    outputs = os.path.join(REPO, "outputs")
    if args.run_dir:
        run_dir = os.path.abspath(args.run_dir)
        log = os.path.join(run_dir, "slurm-%j.out")
    else:
        run_dir, log = (os.path.join(outputs, "slurm-$SLURM_JOB_ID"),
                        os.path.join(outputs, "slurm-%j.out"))
    script = render(cfg, args.overrides, run_dir, log, args.job_name)
    if args.dry_run:
        print(script)
        return 0
    folder = os.path.join(outputs, "sbatch")
    os.makedirs(folder, exist_ok=True)
    os.makedirs(os.path.dirname(log), exist_ok=True)  # sbatch does not create it
    path = os.path.join(folder, f"{args.job_name}-{time.strftime('%Y%m%d-%H%M%S')}.sh")
    with open(path, "w") as f:
        f.write(script)
    out = subprocess.run(["sbatch", "--parsable", path], capture_output=True, text=True)
    if out.returncode:
        print(f"hcp: error: sbatch {path} failed: {out.stderr.strip()}", file=sys.stderr)
        return out.returncode
    job = out.stdout.strip().split(";")[0]
    print(f"hcp: submitted job {job} ({path}); run directory "
          f"{run_dir.replace('$SLURM_JOB_ID', job)}, log {log.replace('%j', job)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
