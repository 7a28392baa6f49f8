"""What a new user meets first: command-line typos, a world size that does not match under
torchrun, a cluster-sized recipe on a small machine (subprocesses, as a user runs them)."""
import os
import subprocess
import sys

import pytest

from cfg_utils import REPO, compose_cfg
from hcp.config.errors import ConfigError

TRAIN = os.path.join(REPO, "train.py")


def _train(args, cwd, env=None):
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": REPO, **(env or {})}
    return subprocess.run([sys.executable, TRAIN, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.slow
def test_a_typo_fails_in_one_line_naming_the_closest_key(tmp_path):
    proc = _train(["+trainer.max_step=10"], tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "hcp: error: trainer.max_step='10': no such config key (a `+` does not make it one). "
        "Fix: did you mean `trainer.max_steps`?"]
    assert os.listdir(tmp_path) == []


def test_a_wrong_type_is_one_line_with_exit_2_not_hydras_merge_error(tmp_path):
    proc = _train(["llm.layout=[2,2]"], tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "hcp: error: llm.layout=[2, 2]: expects a mapping of LayoutConfig's keys (tp, cp, pp, dp, "
        "num_ranks, rank_offset, cp_comm, sequence_parallel, pp_layers, dp_shard, recompute). Fix: "
        "set one of its keys, e.g. llm.layout.tp=1, or give a mapping, e.g. 'llm.layout={tp: 1}'"]
    assert os.listdir(tmp_path) == []


def test_a_run_directory_that_cannot_be_created_is_one_line_not_a_traceback(tmp_path):
    (tmp_path / "file").write_text("")  # a path through a file cannot become a directory
    proc = _train([f"hydra.run.dir={tmp_path}/file/run", "trainer.max_steps=1"], tmp_path)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        f"hcp: error: hydra.run.dir='{tmp_path}/file/run': {tmp_path}/file is a file, not a "
        "folder, so nothing can be saved there. Fix: set hydra.run.dir to a folder this user can "
        "write (it is created if missing)"]


@pytest.mark.slow
def test_torchrun_world_size_mismatch_is_one_line_and_leaves_no_run_directory(tmp_path):
    torchrun = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "29999", "TORCHELASTIC_RUN_ID": "abc"}
    proc = _train(["launcher.nproc_per_node=4", "logger=none"], tmp_path, torchrun)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(
        "hcp: error: launcher.nproc_per_node=4: launcher.nnodes*nproc_per_node = 1*4 differs from the 3 ranks")
    assert os.listdir(tmp_path) == []  # not even outputs/torchrun-abc/.hydra
    quiet = _train(["launcher.nproc_per_node=4", "logger=none"], tmp_path, {**torchrun, "RANK": "1"})
    assert quiet.returncode == 2 and quiet.stderr == ""  # one line per launch, from rank 0


def test_a_cluster_recipe_here_says_so_once_and_offers_plan_mode_and_srun():
    from hcp.launch.launch import local_world_size

    with pytest.raises(ConfigError) as e:
        local_world_size(compose_cfg(["+recipe=llava_hetero"]), None, ["+recipe=llava_hetero"])
    msg = str(e.value)
    assert "sized for a cluster" in msg and "`python train.py +recipe=llava_hetero mode=plan`" in msg
    assert "srun --nodes 8 --ntasks-per-node 8 python train.py +recipe=llava_hetero" in msg
    # it says how many processes (one per rank, not one per node) and names the sbatch helper
    assert "one process per node" not in msg and "one process per rank (per GPU), 8 per node" in msg
    assert "`python -m hcp.launch.sbatch +recipe=llava_hetero`" in msg
    assert "launcher.nnodes=1" not in msg


def test_local_ranks_that_cannot_fit_this_machine_fail_before_they_start():
    from hcp.config.validate import validate
    from hcp.preflight.plan_mode import check_fits_here

    overrides = ["+recipe=llava_hetero", "launcher.nnodes=1", "llm.layout.pp=1", "llm.layout.cp=1"]
    cfg = compose_cfg(overrides)
    layouts = validate(cfg, 8)
    with pytest.raises(ConfigError) as e:
        check_fits_here(cfg, layouts, 8, overrides, memory=(64.0, "memory", True))
    assert "more than this machine's 64.0 GiB" in str(e.value) and "mode=plan" in str(e.value)
    assert "one process per node" not in str(e.value) and "python -m hcp.launch.sbatch" in str(e.value)
    tiny = compose_cfg()
    check_fits_here(tiny, validate(tiny, 4), 4, [], memory=(64.0, "memory", True))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ctrl_c_while_saving_prints_one_hint_and_no_rank_tracebacks(tmp_path):
    """Ctrl-C (SIGINT to the whole foreground process group, as a terminal sends it) while two
    ranks train and save every step: exit 130, the launcher's one hint line, no per-rank
    traceback, every process gone."""
    import signal
    import time

    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, TRAIN, "+recipe=llama_tiny", "launcher.nproc_per_node=2", "logger=none",
         "trainer.save_every=1", "trainer.max_steps=400", f"hydra.run.dir={run_dir}"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True)
    ckpt = run_dir / "checkpoints" / "step_00000002"
    deadline = time.time() + 200
    while not ckpt.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.5)
    assert ckpt.exists(), "no checkpoint within 200 s"
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-3000:]
    assert "hcp: interrupted by SIGINT; the last complete checkpoint is" in err, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]


def test_a_named_module_the_config_lacks_names_the_modules_there_are():
    """`encoders.vison2.layout.tp=1` (a typo) and a module no override adds: one ConfigError
    naming the closest module or the override that adds one (Hydra's `+` hint fails on the type)."""
    from hcp.config.compose import check_module_names

    two = ["+recipe=llava_tiny_two_encoders"]
    check_module_names([*two, "encoders.vision2.layout.tp=1", "projectors.projector2.layout.tp=1"])
    with pytest.raises(ConfigError) as e:
        check_module_names([*two, "encoders.vison2.layout.tp=1"])
    assert e.value.field == "encoders.vison2.layout.tp" and "did you mean `encoders.vision2`?" in str(e.value)
    with pytest.raises(ConfigError) as e:
        check_module_names(["+recipe=llava_tiny", "encoders.vision2.layout.tp=1"])
    assert "+encoder@encoders.vision2=vit_tiny" in str(e.value) and "encoders: none" in str(e.value)
    check_module_names(["+recipe=llava_tiny", "+encoder@encoders.vision2=vit_tiny", "encoders.vision2.layout.tp=1"])
    with pytest.raises(ConfigError) as e:  # Hydra's own: an AssertionError traceback
        check_module_names(["+recipe=llama_tiny", "vision.layout.cp=2"])
    assert e.value.field == "vision.layout.cp" and "no `vision` (it is null" in str(e.value)


def test_help_opens_with_hcps_usage_not_hydras(tmp_path):
    proc = _train(["--help"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("hcp: declarative training")
    assert "powered by Hydra" not in proc.stdout
    assert "Usage: python train.py" in proc.stdout and "== Configuration groups" in proc.stdout
