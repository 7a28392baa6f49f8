"""SLURM facts hcp derives and checks: the rendezvous host from the node list, and the launch
inputs (tasks per node, GPUs per node, world size against the layouts, signal, requeue settings)
checked before anything is submitted (`python -m hcp.launch.sbatch`, and the Hydra callback
`LaunchCheck` before `hydra/launcher=submitit_slurm` submits a sweep).
"""
from __future__ import annotations

import re
import sys
from typing import Mapping, Optional

from hydra.experimental.callback import Callback

from hcp.config.errors import ConfigError, check_choice

SIGNALS = ("USR2",)
"""`launcher.slurm.signal`: the time-limit warning, which means save and requeue. SIGTERM is no
choice: it is what `scancel` sends, and means save and stop (`hcp.launch.preempt`); USR1 can
collide with NCCL."""
LAUNCHES = ("srun", "torchrun")


def first_host(nodelist: str) -> str:
    """The first host of a SLURM hostlist: `gpu-[003-010,012],cpu1` -> `gpu-003`,
    `rack[1-2]-n[07,09]` -> `rack1-n07` (each bracket group's first entry, padding kept).

    Raises:
        ValueError: an empty list or unbalanced brackets.
    """
    head = re.split(r",(?![^\[]*\])", nodelist.strip())[0]  # the first comma outside brackets
    if not head or head.count("[") != head.count("]"):
        raise ValueError(f"not a SLURM node list: {nodelist!r}")
    return re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[-,]", m.group(1))[0], head)


def rendezvous_host(env: Mapping[str, str]) -> Optional[str]:
    """MASTER_ADDR for an srun step: the first host of the step's (else the job's) node list,
    else the node srun ran on (`SLURM_LAUNCH_NODE_IPADDR`); None outside SLURM."""
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if nodelist:
        return first_host(nodelist)
    return env.get("SLURM_LAUNCH_NODE_IPADDR")


def rendezvous_port(env: Mapping[str, str]) -> int:
    """A port every task of one job derives alike: 20000 + job id mod 20000 (a requeued job
    keeps its id and port; two jobs sharing a node collide only 20000 ids apart)."""
    return 20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000


def slurm_tasks(nproc_per_node) -> int:
    """`launcher.nproc_per_node` as SLURM tasks per node (the `hcp_slurm_tasks` resolver of
    conf/hydra/launcher/submitit_slurm.yaml).

    Raises:
        ConfigError: not a positive int (`auto` is for local runs).
    """
    if (isinstance(nproc_per_node, int)
        and not isinstance(nproc_per_node, bool) and nproc_per_node >= 1):
        return nproc_per_node
    raise ConfigError("launcher.nproc_per_node", nproc_per_node, "a SLURM job needs a fixed number "
                      "of tasks per node",
                      "set it to the GPUs per node (e.g. 8), or use launcher=slurm_h100")


def check_slurm(cfg) -> None:
    """The SLURM and failure-policy settings, valid for any launch (also a local run).

    Raises:
        ConfigError: an unknown (or TERM) `launcher.slurm.signal`, an unknown `launch` /
            `trainer.on_nonfinite`, or a
            negative lead time or requeue count.
    """
    s = cfg.launcher.slurm
    if s.signal == "TERM":
        raise ConfigError("launcher.slurm.signal", s.signal,
                          "SIGTERM is what scancel sends, so hcp takes it as cancel (save, then "
                          "stop without requeueing) and cannot tell it from a time-limit warning",
                          "use USR2 (save and requeue)")
    check_choice("launcher.slurm.signal", s.signal, SIGNALS)
    check_choice("launcher.slurm.launch", s.launch, LAUNCHES)
    check_choice("trainer.on_nonfinite", cfg.trainer.on_nonfinite, ("stop", "skip"))
    for key in ("signal_lead_s", "max_requeues", "time_min"):
        if s[key] < 0:
            raise ConfigError(f"launcher.slurm.{key}", s[key], "must be >= 0",
                              "use a non-negative value")
    if s.signal_lead_s >= s.time_min * 60 > 0:
        raise ConfigError("launcher.slurm.signal_lead_s", s.signal_lead_s, f"is not below the time "
                          f"limit launcher.slurm.time_min={s.time_min} min",
                          "lower it, or raise time_min")


def check_job(cfg, nodes: int, tasks_per_node, gpus_per_node, where: str = "launcher") -> int:
    """Launch inputs of a SLURM job against the config; returns the world size.

    `where` prefixes the field names in errors (`launcher` for hcp's own keys, `hydra.launcher`
    for the submitit launcher's).

    Raises:
        ConfigError: tasks per node not a positive int (e.g. `auto`); GPUs per node > 0 that
            differ from tasks per node (one task per GPU; with more GPUs than tasks a task would
            see several, hydra#2231); a world size (nodes x tasks) the layouts cannot use.
    """
    from hcp.config.validate import validate

    tasks_key = f"{where}.{'nproc_per_node' if where == 'launcher' else 'tasks_per_node'}"
    slurm_tasks(tasks_per_node)
    if gpus_per_node and gpus_per_node != tasks_per_node:
        gkey = "launcher.slurm.gpus_per_node" if where == "launcher" else f"{where}.gpus_per_node"
        raise ConfigError(tasks_key, tasks_per_node,
                          f"differs from {gkey}={gpus_per_node}: hcp runs "
                          "one task per GPU", f"set both to the GPUs per node ({gpus_per_node})")
    check_slurm(cfg)
    world = nodes * tasks_per_node
    validate(cfg, world)
    return world


class LaunchCheck(Callback):
    """Hydra callback (conf/config.yaml `hydra.callbacks`): before a multirun with the submitit
    SLURM launcher submits anything, check its nodes / tasks / GPUs against the config; other
    launchers pass through. Sweep points are checked again in their jobs. A bad shape exits
    with code 2 and hcp's message (Hydra would only warn about a callback's exception)."""

    def on_multirun_start(self, config, **kwargs) -> None:
        launcher = config.hydra.launcher
        if "SlurmLauncher" not in str(launcher.get("_target_", "")):
            return
        from omegaconf import OmegaConf

        cfg = OmegaConf.masked_copy(config, [k for k in config if k != "hydra"])
        cfg.checkpoint.dir = "/tmp/hcp-launch-check"  # a runtime resolver, not resolvable here
        OmegaConf.resolve(cfg)
        try:
            check_job(cfg, launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node,
                      where="hydra.launcher")
        except ConfigError as e:  # Hydra turns a callback's exception into a warning: exit instead
            print(f"hcp: error: {e}", file=sys.stderr)
            raise SystemExit(2) from e
