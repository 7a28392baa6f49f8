"""hcp on a real one-node SLURM (tests/slurm_cluster.py), 4 gloo tasks of llama_tiny per job:
sbatch to completion, a submitit sweep, preemption with checkpoint-requeue-resume equal to an
uninterrupted run, a killed rank failing the job in bounded time, a NaN stopping the run
without harming the latest checkpoint. Skipped, with the reason, where SLURM cannot be installed.
"""
from __future__ import annotations

import glob
import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from slurm_cluster import Cluster, ensure_slurm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
WAIT = 600  # s for one job; a few dozen s on an idle 2-core machine, far more on a loaded one

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 24  # long enough that a signal after step 2 lands mid-run
TINY = ["+recipe=llama_tiny", "launcher=slurm_cpu", f"trainer.max_steps={STEPS}", "trainer.eval_every=0",
        "trainer.eval_samples=4", "trainer.log_every=1", "trainer.progress_bar=false",
        "trainer.global_batch_size=8", "trainer.micro_batch_tokens=256", "data.max_seq_len=256",
        "logger=none"]
JOB_ENV = {"PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true"}


@pytest.fixture(scope="module")
def cluster():
    why = ensure_slurm()
    if why:
        pytest.skip(f"no SLURM: {why}")
    c = Cluster()
    try:
        yield c.start()
    finally:
        c.stop()


def submit(cluster, run_dir, overrides, env=None) -> str:
    out = cluster.run([sys.executable, "-m", "hcp.launch.sbatch", "--run-dir", str(run_dir), *overrides],
                      env={**JOB_ENV, **(env or {})})
    return re.search(r"submitted job (\d+)", out.stdout).group(1)


def log_of(run_dir, job) -> str:
    with open(os.path.join(run_dir, f"slurm-{job}.out"), errors="replace") as f:
        return f.read()


def losses(run_dir) -> dict[int, float]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def wait_for_step(run_dir, step: int, timeout: float, cluster, job) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(losses(run_dir)) >= step:
            return
        if cluster.job(job).get("JobState") not in ("PENDING", "RUNNING", "CONFIGURING"):
            break
        time.sleep(0.1)
    raise AssertionError(f"job {job} did not log step {step}: {cluster.job(job).get('JobState')}\n"
                         + (log_of(run_dir, job)[-3000:] if os.path.exists(os.path.join(run_dir, f"slurm-{job}.out")) else ""))


@pytest.fixture(scope="module")
def reference(cluster, tmp_path_factory):
    """An uninterrupted sbatch run of TINY: (run dir, job id, per-step losses)."""
    run_dir = tmp_path_factory.mktemp("reference")
    job = submit(cluster, run_dir, TINY)
    info = cluster.wait_state(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, WAIT)
    assert info["JobState"] == "COMPLETED", log_of(run_dir, job)[-4000:]
    return run_dir, job, losses(run_dir)


def test_sbatch_four_task_llama_tiny_completes_with_summary(reference):
    run_dir, job, per_step = reference
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    assert summary["steps"] == STEPS and summary["world_size"] == 4
    assert math.isfinite(summary["final_loss"]) and sorted(per_step) == list(range(1, STEPS + 1))
    assert os.path.isdir(os.path.join(run_dir, "checkpoints", f"step_{STEPS:08d}"))
    text = log_of(run_dir, job)
    assert "hcp: job" in text and "step exited with 0" in text


def test_preemption_checkpoints_requeues_and_resumes_with_the_same_losses(cluster, reference, tmp_path):
    """A real preemption: a job in the higher-priority partition takes every CPU; SLURM sends
    SIGUSR2 (preempt_send_user_signal) to every process of the step; hcp saves at the next step
    boundary, requeues, exits; the requeued job resumes at that step with the same wandb run id.
    Launched with torchrun per node (which must neither die of the signal nor kill its workers
    mid-save); the reference ran under srun, so this also checks that both launches agree."""
    ref_dir, _, ref_losses = reference
    run_dir = tmp_path / "run"
    job = submit(cluster, run_dir, [*TINY, "logger=wandb", "launcher.slurm.launch=torchrun"])
    wait_for_step(run_dir, 2, WAIT, cluster, job)
    cluster.run(["sbatch", "-p", "urgent", "-n", "8", "-o", "/dev/null", "--wrap", "sleep 1"])
    info = cluster.wait_state(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, WAIT)
    text = log_of(run_dir, job)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", text[-4000:]
    stopped = int(re.search(r"hcp: SIGUSR2 at step (\d+): checkpoint saved", text).group(1))
    assert 2 <= stopped < STEPS and "requeued job" in text
    assert re.search(rf"resumed from step {stopped} .*{run_dir}/checkpoints/step_{stopped:08d}", text)
    got = losses(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert got == ref_losses  # bit for bit: the same batches, RNG, optimizer and LR state
    with open(run_dir / "wandb_run_id") as f:
        run_id = f.read().strip()
    runs = glob.glob(str(run_dir / "wandb" / "offline-run-*"))
    assert len(runs) == 2 and all(r.endswith(run_id) for r in runs), runs


def test_killed_rank_fails_the_job_in_bounded_time_naming_it(cluster, tmp_path):
    run_dir = tmp_path / "run"
    job = submit(cluster, run_dir, [*TINY, "launcher.nproc_per_node=2", "trainer.max_steps=500"])
    wait_for_step(run_dir, 1, WAIT, cluster, job)
    victims = [p for p in _job_tasks(job) if p[1] == "1"]
    assert victims, f"no task 1 of job {job} found"
    t0 = time.monotonic()
    os.kill(victims[0][0], signal.SIGKILL)
    info = cluster.wait_state(job, {"FAILED", "COMPLETED", "CANCELLED"}, 90)
    elapsed = time.monotonic() - t0
    text = log_of(run_dir, job)
    assert info["JobState"] == "FAILED", text[-3000:]
    assert elapsed < 60, f"the job took {elapsed:.0f} s to fail"
    assert re.search(r"task 1: Killed", text), text[-3000:]


def _job_tasks(job: str) -> list[tuple[int, str]]:
    """(pid, SLURM_PROCID) of the python train.py tasks of `job`."""
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                if b"train.py" not in f.read():
                    continue
            with open(f"/proc/{d}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if env.get(b"SLURM_JOB_ID") == job.encode() and b"SLURM_PROCID" in env:
            found.append((int(d), env[b"SLURM_PROCID"].decode()))
    return found


def test_nan_stops_naming_the_step_and_the_latest_checkpoint_still_loads(cluster, tmp_path):
    run_dir = tmp_path / "run"
    nan = {"HCP_TEST_NONFINITE_STEP": "5"}
    common = [*TINY, "launcher.nproc_per_node=2", "trainer.max_steps=7", "trainer.save_every=2"]
    job = submit(cluster, run_dir, common, env=nan)
    info = cluster.wait_state(job, {"FAILED", "COMPLETED", "CANCELLED"}, WAIT)
    text = log_of(run_dir, job)
    assert info["JobState"] == "FAILED", text[-3000:]
    assert "step 5: loss=nan grad_norm=nan is not finite" in text and "hcp: rank 0/2" in text
    ckpts = sorted(os.listdir(run_dir / "checkpoints"))
    assert ckpts[-1] == "step_00000004" and not any("step_00000005" in c or "tmp" in c for c in ckpts)
    # The same job again with on_nonfinite=skip: it loads step 4, drops step 5's update, finishes.
    job2 = submit(cluster, run_dir, [*common, "trainer.on_nonfinite=skip"], env=nan)
    info = cluster.wait_state(job2, {"FAILED", "COMPLETED", "CANCELLED"}, WAIT)
    text = log_of(run_dir, job2)
    assert info["JobState"] == "COMPLETED", text[-3000:]
    assert re.search(rf"resumed from step 4 .*{run_dir}/checkpoints/step_00000004", text)
    with open(run_dir / "summary.json") as f:
        summary = json.load(f)
    assert summary["nonfinite_skipped_steps"] == [5] and math.isfinite(summary["final_loss"])
    assert all(math.isfinite(v) for s, v in losses(run_dir).items() if s != 5)


def test_submitit_sweep_two_points_with_a_signalled_job_resuming(cluster, tmp_path):
    """`-m` through hydra/launcher=submitit_slurm: two jobs, two run directories. One job gets
    SIGUSR2 mid-run: hcp's handler (not submitit's immediate requeue) saves, requeues, and the
    job resumes in the same run directory (resume=auto on a restart) to the same losses."""
    sweep = tmp_path / "multirun"
    cmd = [sys.executable, "train.py", "-m", *TINY, "launcher.nproc_per_node=2",
           "hydra/launcher=submitit_slurm", f"hydra.sweep.dir={sweep}", "optim.lr=1e-3,2e-3"]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**cluster.env, **JOB_ENV}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + WAIT
        while len(losses(sweep / "0")) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        jobs = cluster.run(["squeue", "-h", "-o", "%i"]).stdout.split()
        first = [j for j in jobs if j.endswith("_0")]
        assert first, f"no running sweep job 0: {jobs}"
        cluster.run(["scancel", "--signal=USR2", first[0]])
        out, _ = proc.communicate(timeout=WAIT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out[-4000:]
    for point in ("0", "1"):
        with open(sweep / point / "summary.json") as f:
            assert json.load(f)["steps"] == STEPS
    logs = "".join(open(p, errors="replace").read() for p in glob.glob(str(sweep / ".submitit" / "*" / "*_log.*")))
    stopped = int(re.search(r"hcp: SIGUSR2 at step (\d+): checkpoint saved", logs).group(1))
    assert re.search(rf"resumed from step {stopped} .*{sweep}/0/checkpoints/step_{stopped:08d}", logs)
    got = losses(sweep / "0")
    assert sorted(got) == list(range(1, STEPS + 1)) and "Bypassing signal SIGUSR2" not in logs


def test_scancel_saves_and_cancels_without_requeueing(cluster, tmp_path):
    """`scancel JOB` sends SIGTERM: the ranks save at the next step boundary (within SLURM's
    KillWait) and exit; the job stays CANCELLED (no `scontrol requeue`, no restart)."""
    run_dir = tmp_path / "run"
    job = submit(cluster, run_dir, [*TINY, "launcher.nproc_per_node=2", "trainer.max_steps=500"])
    wait_for_step(run_dir, 2, WAIT, cluster, job)
    cluster.run(["scancel", job])
    cluster.wait_state(job, {"CANCELLED", "COMPLETED", "FAILED"}, 90)
    time.sleep(20)  # a requeue by rank 0 would have shown by now
    info, text = cluster.job(job), log_of(run_dir, job)
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", (info, text[-3000:])
    assert "requeued job" not in text, text[-3000:]
    saved = sorted(os.listdir(run_dir / "checkpoints"))  # save_every=0: only the SIGTERM save
    assert saved and saved[-1].startswith("step_") and int(saved[-1][5:]) >= 2, text[-3000:]
