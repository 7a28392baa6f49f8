"""The "am I already one of several launched ranks?" predicate (hcp.launch.launch)."""
from hcp.launch.launch import launched_rank_env, resolve_nproc

SBATCH_SCRIPT_ENV = {  # what a batch script sees: job variables, no step of several tasks
    "SLURM_JOB_ID": "42", "SLURM_NTASKS": "8", "SLURM_NNODES": "2", "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_TASKS_PER_NODE": "4(x2)",
}


def test_plain_python_is_not_a_launched_rank():
    assert launched_rank_env({}) is None


def test_python_inside_an_sbatch_script_starts_its_own_ranks():
    assert launched_rank_env(SBATCH_SCRIPT_ENV) is None


def test_srun_step_with_one_task_starts_its_own_ranks():
    env = {**SBATCH_SCRIPT_ENV, "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "1"}
    assert launched_rank_env(env) is None


def test_srun_step_with_several_tasks_joins_them():
    env = {**SBATCH_SCRIPT_ENV, "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "8",
           "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.7"}
    got = launched_rank_env(env)
    assert (got["rank"], got["world_size"], got["local_rank"]) == (5, 8, 1)
    # every task derives the same rendezvous point without extra exports
    assert (got["master_addr"], got["master_port"]) == ("10.0.0.7", str(20000 + 42))


def test_torchrun_environment_joins():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "MASTER_ADDR": "h", "MASTER_PORT": "1",
           "TORCHELASTIC_RUN_ID": "x"}
    got = launched_rank_env(env)
    assert (got["rank"], got["world_size"], got["local_rank"]) == (3, 4, 3)


def test_a_stray_world_size_alone_does_not_join():
    assert launched_rank_env({"WORLD_SIZE": "4"}) is None


def test_nproc_auto_is_four_on_cpu():
    assert resolve_nproc("auto") == 4 and resolve_nproc(2) == 2


def test_run_directory_name_is_shared_by_every_rank_of_one_launch():
    from hcp.launch.launch import run_name

    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "9",
                "TORCHELASTIC_RUN_ID": "abc"}
    assert run_name(torchrun) == run_name({**torchrun, "RANK": "0"}) == "torchrun-abc"
    srun = {**SBATCH_SCRIPT_ENV, "SLURM_STEP_ID": "3", "SLURM_STEP_NUM_TASKS": "8"}
    assert run_name(srun) == "slurm-42.3"
    assert run_name({}).count("/") == 1  # DATE/TIME of the launching process
