"""Starting ranks: join an existing launch (torchrun, an srun step) or start local ranks.

`launched_rank_env(env)` decides from the environment alone whether this process is already one
of several launched ranks: torchrun (`TORCHELASTIC_RUN_ID`, or all of RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT) or an `srun` step with more than one task
(`SLURM_STEP_ID`, `SLURM_STEP_NUM_TASKS` > 1; a plain sbatch script is neither). Otherwise
`train.py` starts `launcher.nproc_per_node` local ranks (`local_start_method`: fork on a CPU
machine, much faster to start, docs/design.md section 8; spawn when CUDA devices are visible).
The launching process never initialises CUDA (`cuda_device_count` via NVML, `machine_memory_gib`
in a child process)."""
from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
from typing import Callable, Mapping, Optional

from hcp.config.errors import ConfigError
from hcp.launch.supervise import (KILL_GRACE_S, default_sigint, join_board, join_ranks,
                                  run_in_process, step_board)


def launched_rank_env(env: Mapping[str, str]) -> Optional[dict]:
    """If `env` is one of several launched ranks, return its {rank, world_size, local_rank,
    master_addr, master_port}; else None (this process must start the ranks itself)."""
    if "TORCHELASTIC_RUN_ID" in env or all(
            k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")):
        return {"rank": int(env["RANK"]), "world_size": int(env["WORLD_SIZE"]),
                "local_rank": int(env["LOCAL_RANK"]), "master_addr": env.get("MASTER_ADDR"),
                "master_port": env.get("MASTER_PORT")}
    if "SLURM_STEP_ID" in env and int(env.get("SLURM_STEP_NUM_TASKS", "1")) > 1:
        # Rendezvous every task derives alike: the first host of the node list, a port from the
        # job id (hcp.launch.slurm).
        from hcp.launch.slurm import rendezvous_host, rendezvous_port

        return {"rank": int(env["SLURM_PROCID"]), "world_size": int(env["SLURM_STEP_NUM_TASKS"]),
                "local_rank": int(env.get("SLURM_LOCALID", "0")),
                "master_addr": env.get("MASTER_ADDR", rendezvous_host(env) or "127.0.0.1"),
                "master_port": env.get("MASTER_PORT", str(rendezvous_port(env)))}
    return None


def export_rank_env(joined: dict) -> None:
    """Set the torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) from
    `launched_rank_env`'s answer, so that `init_process_group("env://")` works in an srun step."""
    os.environ.update(RANK=str(joined["rank"]), WORLD_SIZE=str(joined["world_size"]),
                      LOCAL_RANK=str(joined["local_rank"]), MASTER_ADDR=str(joined["master_addr"]),
                      MASTER_PORT=str(joined["master_port"]))


def run_name(env: Mapping[str, str]) -> str:
    """The run directory's name below `outputs/`, the same in every rank of one launch:
    `slurm-JOB.STEP` in an srun step, `torchrun-RUN_ID` under torchrun, else `DATE/TIME` of this
    (the launching) process. Registered as the `hcp_run_name` resolver used by `hydra.run.dir`."""
    if launched_rank_env(env) is not None:
        if "SLURM_STEP_ID" in env:
            return f"slurm-{env.get('SLURM_JOB_ID', 'job')}.{env['SLURM_STEP_ID']}"
        return f"torchrun-{env.get('TORCHELASTIC_RUN_ID', env.get('MASTER_PORT', 'run'))}"
    import datetime

    return datetime.datetime.now().strftime("%Y-%m-%d/%H-%M-%S")


def cuda_device_count() -> int:
    """CUDA devices visible to this process, counted through NVML (`torch.cuda.device_count`
    before any CUDA call): the launching process must not initialise CUDA (module docstring)."""
    import torch

    return torch.cuda.device_count()


def resolve_nproc(nproc_per_node) -> int:
    """`auto` -> one rank per CUDA device, or 4 on a CPU-only machine; else the int given.

    Raises:
        ConfigError: neither `auto` nor an integer >= 1.
    """
    if nproc_per_node == "auto":
        return cuda_device_count() or 4
    try:
        n = int(nproc_per_node)
    except (TypeError, ValueError):
        n = 0
    if n < 1:
        raise ConfigError("launcher.nproc_per_node", nproc_per_node, "not a rank count",
                          "use `auto` or an integer >= 1")
    return n


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def local_start_method(launcher) -> str:
    """How `start_local_ranks` starts ranks: `launcher.start_method`, where `auto` means spawn
    when CUDA devices are visible, else fork.

    Raises:
        ConfigError: `fork` with CUDA devices visible and a backend other than gloo (forked
            ranks cannot initialise CUDA reliably), before any rank starts.
    """
    method = launcher.start_method
    cuda = cuda_device_count() > 0
    if method == "auto":
        return "spawn" if cuda else "fork"
    if method == "fork" and cuda and launcher.backend != "gloo":
        raise ConfigError("launcher.start_method", method,
                          "forked ranks cannot use CUDA (\"Cannot re-initialize CUDA in forked "
                          "subprocess\")",
                          "use launcher.start_method=auto (spawn with CUDA, fork on CPU) or spawn")
    return method


def _command(overrides, *extra: str) -> str:
    """`python train.py` with `overrides` and then `extra` (which replace the overrides of the same
    keys, and any `mode=`), each quoted for a POSIX shell."""
    replaced = {"mode", *map(_key, extra)}
    kept = [o for o in overrides if _key(o) not in replaced]
    return " ".join(["python train.py", *map(shlex.quote, [*kept, *extra])])


def resume_command(overrides, checkpoint_dir: str) -> str:
    """The command that continues a run started with `overrides` from its newest checkpoint:
    `resume=auto` with `checkpoint.dir` named, since the default one lies inside the run
    directory and a new run gets a new one."""
    return _command(overrides, "resume=auto", f"checkpoint.dir={os.path.abspath(checkpoint_dir)}")


def _on_cpu(launcher_cfg) -> bool:
    backend = launcher_cfg.backend
    return not (backend == "nccl" or (backend == "auto" and cuda_device_count() > 0))


def oversubscribed(world: int, launcher_cfg, cores: Optional[int] = None) -> Optional[str]:
    """A warning when `world` local ranks compute on the CPU (gloo) and outnumber the cores this
    process may run on (`cores`, default its CPU affinity); else None. Not an error: the run is
    correct, only slower than with fewer ranks. None under `nproc_per_node=auto` (hcp's own
    choice of 4 CPU ranks, which the default layouts need, on any machine: nothing to fix)."""
    if not _on_cpu(launcher_cfg) or launcher_cfg.nproc_per_node == "auto":
        return None
    cores = cores or len(os.sched_getaffinity(0))
    if world <= cores:
        return None
    return (f"launcher.nproc_per_node={launcher_cfg.nproc_per_node} starts {world} CPU ranks on "
            f"{cores} core{'s' * (cores > 1)}: they take turns on the cores, so each step is "
            f"slower than with at most {cores} rank{'s' * (cores > 1)} (the results are the same)")


def slow_precision(precision: str, launcher_cfg) -> Optional[str]:
    """A warning when CPU ranks train in bf16 (CPUs without native bf16 matrix units emulate
    it: each step is several times slower than in fp32); else None."""
    if precision != "bf16" or not _on_cpu(launcher_cfg):
        return None
    return ("precision=bf16 on CPU ranks: most CPUs emulate bf16 matrix products, so each step is "
            "several times slower than with precision=fp32 (the recipes' bf16 is for GPUs)")


def cluster_fix(cfg, overrides) -> str:
    """The fix of a config sized for a cluster: plan it here, or run `overrides` on a SLURM
    cluster with the sbatch helper (`hcp.launch.sbatch`) or `srun` inside an allocation with one
    process per rank (per GPU), each joining the launch."""
    sbatch = " ".join(["python -m hcp.launch.sbatch",
                       *[o for o in overrides if not o.startswith("mode=")]])
    lc = cfg.launcher
    per_node = cfg.cluster.gpus_per_node if lc.nproc_per_node == "auto" else lc.nproc_per_node
    return (f"plan it here with `{_command(overrides, 'mode=plan')}`, or "
            f"submit it with the sbatch helper `{sbatch}` (`--dry-run` prints the script), or "
            f"inside an allocation start one process per rank (per GPU), {per_node} per node: "
            f"`srun --nodes {lc.nnodes} --ntasks-per-node {per_node} {_command(overrides)}` "
            "(docs/launching.md)")


def local_world_size(cfg, joined: Optional[dict], overrides=()) -> int:
    """Ranks of this launch: the joined launch's world, or the local ranks to start.

    Raises:
        ConfigError: `launcher.nnodes` > 1 for a plain `python train.py`, which can start ranks
            on this machine only (checked before any rank starts); the message offers plan mode
            and the multi-node launch.
    """
    if joined:
        return joined["world_size"]
    if cfg.launcher.nnodes > 1:
        c = cfg.cluster
        raise ConfigError("launcher.nnodes", cfg.launcher.nnodes,
                          f"this config is sized for a cluster ({cfg.launcher.nnodes} nodes x "
                          f"{cfg.launcher.nproc_per_node} ranks; cluster.* {c.num_nodes} x "
                          f"{c.gpus_per_node} GPUs of {c.device_memory_gib:g} GiB) and a plain "
                          "`python train.py` starts ranks on this machine only",
                          cluster_fix(cfg, overrides))
    return resolve_nproc(cfg.launcher.nproc_per_node)


def machine_memory_gib() -> tuple[float, str, bool]:
    """(GiB available to ONE rank's model state, what it is, whether ranks share it): the first
    CUDA device's memory, read in a child process (`gpu_memory_gib`), else this machine's
    physical memory (shared by all local ranks)."""
    if cuda_device_count() > 0:
        return gpu_memory_gib(), "GPU memory", False
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, "memory", True


def gpu_memory_gib() -> float:
    """Total memory of CUDA device 0 in GiB, read by a child Python process so that the
    launching process never initialises CUDA. Raises RuntimeError with the child's error."""
    code = "import torch; print(torch.cuda.get_device_properties(0).total_memory)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"reading the GPU's memory in a child process failed: "
                           f"{out.stderr.strip()[-800:]}")
    return int(out.stdout.split()[-1]) / 2**30


def free_port() -> int:
    """A TCP port that was free on localhost a moment ago (local rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(local_rank: int, fn: Callable, nproc: int, port: int, payload, board=None) -> None:
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(nproc),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    default_sigint()
    if board is not None:
        join_board(board, local_rank)
    fn(payload)


def start_local_ranks(fn: Callable, nproc: int, payload, start_method: str = "fork",
                      save_signal: str = "USR2", save_grace_s: float = KILL_GRACE_S) -> None:
    """Run `fn(payload)` in `nproc` local processes with torch's multiprocessing, each with the
    torchrun environment variables set, and watch them (`hcp.launch.supervise`): SIGINT to this
    process reaches every rank as SIGINT (stop now), SIGTERM as `SIG<save_signal>` (the
    preemption signal, `launcher.slurm.signal`: save at the next step boundary, then stop).
    `start_method` comes from `local_start_method` (spawn: `fn` and `payload` must pickle).
    Ranks still alive `save_grace_s` seconds after the save signal (`KILL_GRACE_S` after SIGINT)
    get SIGTERM, then SIGKILL. One rank runs in this process, with the same signal semantics
    (`run_in_process`). A failing rank is reported here and the other ranks are terminated
    (never a hang).

    Raises:
        Interrupted: after a forwarded signal, once every rank has stopped.
        RankDied: a rank ended without a Python exception (killed), named with its step.
        RankRaised: a rank raised: the first that did, with its traceback.
    """
    import torch.multiprocessing as mp

    port = free_port()
    if nproc == 1:  # the rank runs here, so a signal to the launcher is the rank's own
        run_in_process(lambda: _rank_main(0, fn, 1, port, payload),
                       getattr(signal, "SIG" + save_signal))
        return
    board = step_board(start_method, nproc)
    context = mp.start_processes(_rank_main, args=(fn, nproc, port, payload, board), nprocs=nproc,
                                 start_method=start_method, join=False)
    join_ranks(context, board, {signal.SIGINT: signal.SIGINT,
                                signal.SIGTERM: getattr(signal, "SIG" + save_signal)},
               {signal.SIGTERM: save_grace_s})
