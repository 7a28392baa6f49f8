"""The SLURM pieces without a cluster: node lists, launch-input checks, the sbatch script, the
signal flag and its agreement over ranks, requeue decisions, the NaN/Inf guard."""
from __future__ import annotations

import os
import signal
import types

import pytest
import torch
from omegaconf import OmegaConf

from cfg_utils import compose_cfg as compose
from dist_utils import run_ranks
from hcp.config.errors import ConfigError
from hcp.config.schema import LoggerConfig
from hcp.train.failures import NonFiniteError, NonFiniteGuard
from hcp.launch.launch import launched_rank_env
from hcp.launch.preempt import Preemption, continue_wandb_run, resume_after_requeue
from hcp.launch.sbatch import main as sbatch_main
from hcp.launch.slurm import LaunchCheck, check_job, first_host

TINY = ["+recipe=llama_tiny", "launcher=slurm_cpu"]


@pytest.mark.parametrize("nodelist, host", [
    ("node7", "node7"), ("gpu-[003-010,012],cpu1", "gpu-003"), ("a,b", "a"),
    ("rack[1-2]-n[07,09]", "rack1-n07"), ("h100-[0012]", "h100-0012"),
])
def test_first_host_of_a_slurm_node_list(nodelist, host):
    assert first_host(nodelist) == host


def test_unbalanced_node_list_is_an_error():
    with pytest.raises(ValueError, match="not a SLURM node list"):
        first_host("gpu-[1-3")


def test_srun_task_rendezvous_is_the_first_node_and_a_port_from_the_job_id():
    env = {"SLURM_JOB_ID": "1234", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "16", "SLURM_PROCID": "9",
           "SLURM_LOCALID": "1", "SLURM_STEP_NODELIST": "dgx-[07-08]", "SLURM_LAUNCH_NODE_IPADDR": "10.1.1.1"}
    got = launched_rank_env(env)
    assert (got["rank"], got["world_size"], got["local_rank"]) == (9, 16, 1)
    assert (got["master_addr"], got["master_port"]) == ("dgx-07", str(20000 + 1234))


def test_launch_inputs_fail_before_submission_with_the_fix():
    cfg = compose(TINY)
    assert check_job(cfg, 1, 4, None) == 4
    with pytest.raises(ConfigError, match=r"launcher.nproc_per_node='auto'.*fixed number of tasks"):
        check_job(cfg, 1, "auto", None)
    with pytest.raises(ConfigError, match=r"differs from launcher.slurm.gpus_per_node=8.*one task per GPU"):
        check_job(cfg, 1, 4, 8)  # hydra#2231: fewer tasks than GPUs
    with pytest.raises(ConfigError, match=r"global_batch_size.*dp=3"):
        check_job(compose([*TINY, "launcher.nproc_per_node=3"]), 1, 3, None)  # layouts cannot use 3
    with pytest.raises(ConfigError, match=r"1\*4 differs from the 8 ranks"):
        check_job(cfg, 2, 4, None)  # the job's shape against launcher.*
    bad = compose([*TINY, "launcher.slurm.signal=USR1"])
    with pytest.raises(ConfigError, match=r"launcher.slurm.signal='USR1'"):
        check_job(bad, 1, 4, None)


def test_submitit_sweep_shape_is_checked_before_submission(capsys):
    cfg = compose(TINY, resolve=False)
    hydra = {"launcher": {"_target_": "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher",
                          "nodes": 1, "tasks_per_node": 4, "gpus_per_node": 2}}
    config = OmegaConf.create({**OmegaConf.to_container(cfg), "hydra": hydra})
    with pytest.raises(SystemExit, match="2"):
        LaunchCheck().on_multirun_start(config)
    assert "hydra.launcher.tasks_per_node=4: differs from hydra.launcher.gpus_per_node=2" in capsys.readouterr().err
    config.hydra.launcher.gpus_per_node = None
    LaunchCheck().on_multirun_start(config)  # passes
    config.hydra.launcher._target_ = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"
    config.hydra.launcher.tasks_per_node = 3
    LaunchCheck().on_multirun_start(config)  # not SLURM: not checked here


def test_sbatch_dry_run_prints_a_requeueable_clock_free_script(capsys):
    assert sbatch_main(["--dry-run", *TINY, "trainer.max_steps=5"]) == 0
    script = capsys.readouterr().out
    for line in ("#SBATCH --ntasks-per-node=4", "#SBATCH --signal=USR2@60", "#SBATCH --requeue",
                 "#SBATCH --open-mode=append", "srun --kill-on-bad-exit=1"):
        assert line in script
    assert '"hydra.run.dir=' in script and "slurm-$SLURM_JOB_ID" in script and "resume=auto" in script
    assert "${now" not in script and "%Y" not in script


def test_sbatch_torchrun_script_keeps_torchrun_away_from_the_signal(capsys):
    assert sbatch_main(["--dry-run", "+recipe=llama13b_dynamic_cp", "launcher=slurm_h100",
                        "launcher.slurm.launch=torchrun"]) == 0
    script = capsys.readouterr().out
    assert "#SBATCH --nodes=8" in script and "#SBATCH --ntasks-per-node=1" in script
    assert "#SBATCH --gpus-per-node=8" in script and "--nproc-per-node=8" in script
    assert "trap '\"'\"''\"'\"' USR2; exec" in script and "--rdzv-backend=c10d" in script


def test_sbatch_rejects_bad_inputs_without_submitting(capsys):
    assert sbatch_main(["--dry-run", *TINY, "launcher.slurm.gpus_per_node=2"]) == 2
    assert "one task per GPU" in capsys.readouterr().err


def _agree(rank, world, flag_rank: int):
    """Three step boundaries of `WorldStats`: rank r's peak memory at step k is (r + 1) k GiB and
    its bubble (r + k) / 10; `flag_rank` gets the signal during step 2. The flag rides in each
    step's metrics collective (no collective of its own: `dist.all_reduce` is never called)."""
    import torch.distributed as dist

    import hcp.train.throughput as throughput

    dist.all_reduce = None  # calling it fails the test
    p = Preemption(types.SimpleNamespace(signal="USR2"), torch.device("cpu"), env={})
    stats, steps, stopping = throughput.WorldStats(torch.device("cpu"), p), [], []
    for k in (1, 2, 3):
        if k == 2 and rank == flag_rank:
            os.kill(os.getpid(), signal.SIGUSR2)  # the handler only sets the flag
        throughput.peak_memory_bytes = lambda device, k=k: (rank + 1) * k * 2**30
        steps.append({})
        stats.issue(steps[-1], types.SimpleNamespace(busy_s=10.0 - rank - k, wall_s=10.0))
        assert "bubble_fraction" not in steps[-1]  # it lands at the next boundary
        stopping.append(p.stopping)
    stats.settle()
    return steps, stopping, p.received


def test_step_figures_land_one_boundary_late_and_a_signal_stops_every_rank_together():
    """Each step's figures are its own (max peak, mean bubble over ranks), and a signal on one
    rank during step 2 stops every rank at the same boundary: step 3's, where step 2's collective
    is read."""
    for steps, stopping, received in run_ranks(_agree, 3, 2):
        assert [s["peak_memory_gib"] for s in steps] == [3.0, 6.0, 9.0]
        assert [s["bubble_fraction"] for s in steps] == pytest.approx([0.2, 0.3, 0.4])
        assert stopping == [False, False, True]
        assert received == signal.SIGUSR2  # every rank exits under that signal


def _requeue(rank, world, env, path, signum=signal.SIGUSR2):
    os.environ["PATH"] = path
    cfg = types.SimpleNamespace(signal="USR2", max_requeues=2, requeue_exit_code=85)
    p = Preemption(cfg, torch.device("cpu"), env=env)
    p.received = signum
    try:
        p.requeue_and_exit(7, "/ckpt")
    except SystemExit as e:
        return e.code


def test_requeue_decisions(tmp_path, capfd):
    job = {"SLURM_JOB_ID": "77"}
    # no scontrol (a container): exit with the RequeueExit code, and say so
    assert run_ranks(_requeue, 1, job, str(tmp_path)) == [85]
    assert "scontrol not found: exiting with code 85" in capfd.readouterr().err
    # restarted too often: stop for good
    assert run_ranks(_requeue, 1, {**job, "SLURM_RESTART_COUNT": "2"}, str(tmp_path)) == [128 + signal.SIGUSR2]
    assert "max_requeues=2" in capfd.readouterr().err
    # scontrol present: it is called with the job id
    fake = tmp_path / "scontrol"
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/called\n")
    fake.chmod(0o755)
    assert run_ranks(_requeue, 1, job, f"{tmp_path}:/usr/bin:/bin") == [0]
    assert (tmp_path / "called").read_text().strip() == "requeue 77"
    # SIGTERM (scancel, or a preemption SLURM requeues itself): saved, never requeued by hcp
    (tmp_path / "called").unlink()
    path = f"{tmp_path}:/usr/bin:/bin"
    assert run_ranks(_requeue, 1, job, path, signal.SIGTERM) == [128 + signal.SIGTERM]
    assert not (tmp_path / "called").exists()
    assert "hcp: SIGTERM at step 7: checkpoint saved in /ckpt; not requeued" in capfd.readouterr().err
    # not SLURM at all
    assert run_ranks(_requeue, 1, {}, str(tmp_path)) == [128 + signal.SIGUSR2]
    # the default checkpoint.dir lies in the run directory, which a new run does not reuse
    assert "the same command with `resume=auto checkpoint.dir=/ckpt`" in capfd.readouterr().err


def test_nonfinite_guard_stops_or_skips_naming_the_step(tmp_path, monkeypatch):
    model = torch.nn.Linear(2, 2)
    model(torch.ones(1, 2)).sum().backward()
    stop = NonFiniteGuard("stop", model, str(tmp_path))
    assert stop.update_ok(3, 1.5, 0.7)
    with pytest.raises(NonFiniteError, match=r"step 4: loss=inf .*untouched: None"):
        stop.update_ok(4, float("inf"), 0.7)
    skip = NonFiniteGuard("skip", model, str(tmp_path))
    assert not skip.update_ok(9, 1.0, float("nan")) and skip.skipped == [9]
    monkeypatch.setenv("HCP_TEST_NONFINITE_STEP", "2")
    hooked = NonFiniteGuard("skip", model, str(tmp_path))
    assert hooked.update_ok(1, 1.0, 1.0) and not hooked.update_ok(2, 1.0, 1.0)
    assert all(torch.isnan(p.grad).all() for p in model.parameters())


def test_wandb_run_id_is_kept_across_a_resume_and_new_for_a_fresh_run(tmp_path, monkeypatch):
    cfg = LoggerConfig(name="wandb")
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    continue_wandb_run(cfg, str(tmp_path), resumed=False)
    first = os.environ["WANDB_RUN_ID"]
    assert (tmp_path / "wandb_run_id").read_text().strip() == first
    continue_wandb_run(cfg, str(tmp_path), resumed=True)
    assert os.environ["WANDB_RUN_ID"] == first and os.environ["WANDB_RESUME"] == "allow"
    continue_wandb_run(cfg, str(tmp_path), resumed=False)
    assert os.environ["WANDB_RUN_ID"] != first


def test_a_requeued_job_resumes_unless_told_otherwise():
    cfg = OmegaConf.create({"resume": None})
    resume_after_requeue(cfg, {"SLURM_RESTART_COUNT": "0"})
    assert cfg.resume is None
    resume_after_requeue(cfg, {"SLURM_RESTART_COUNT": "1"})
    assert cfg.resume == "auto"
    cfg.resume = "/ckpt/step_00000010"
    resume_after_requeue(cfg, {"SLURM_RESTART_COUNT": "2"})
    assert cfg.resume == "/ckpt/step_00000010"


def test_a_sweep_directory_is_fixed_at_submission():
    """A requeued submitit job unpickles the launcher's config: its `${now:}` sweep directory
    is the one resolved at submission (OmegaConf pickles the resolver cache), not a new time."""
    import pickle
    import time

    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.utils import setup_globals

    from hcp.config.compose import CONF_DIR
    from hcp.config.schema import register

    register()
    with initialize_config_dir(version_base="1.3", config_dir=CONF_DIR):
        cfg = hydra_compose("config", return_hydra_config=True)
    setup_globals()
    at_submission = str(cfg.hydra.sweep.dir)
    blob = pickle.dumps(cfg)
    time.sleep(1.1)
    assert str(pickle.loads(blob).hydra.sweep.dir) == at_submission


def test_sigterm_is_cancel_not_a_time_limit_signal_and_torchrun_workers_catch_it():
    """launcher.slurm.signal=TERM cannot be told from scancel: refused with the fix. Workers of
    torchrun (which forwards the SIGTERM it gets) and of SLURM save on SIGTERM; ranks of hcp's
    own local launch keep the default (torch terminates them when a peer fails)."""
    from hcp.config.errors import ConfigError
    from hcp.launch.slurm import check_slurm

    slurm = types.SimpleNamespace(signal="TERM")
    cfg = types.SimpleNamespace(launcher=types.SimpleNamespace(slurm=slurm))
    with pytest.raises(ConfigError, match=r"launcher.slurm.signal.*scancel.*use USR2"):
        check_slurm(cfg)
    before = signal.getsignal(signal.SIGTERM)
    try:
        cases = (({"TORCHELASTIC_RUN_ID": "x"}, True), ({"SLURM_JOB_ID": "7"}, True), ({}, False))
        for env, caught in cases:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            p = Preemption(types.SimpleNamespace(signal="USR2"), torch.device("cpu"), env=env)
            assert (signal.getsignal(signal.SIGTERM) == p._flag) == caught, env
    finally:
        signal.signal(signal.SIGTERM, before)
