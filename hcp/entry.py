"""What `python train.py` (and the `hcp-train` console command) does in the launching process:
check the command line's keys, compose and resolve the config once, validate it, then plan, or
start (or join) the ranks that train.

A user error (`ConfigError`, `DataError`) prints one line `hcp: error: ...` (under torchrun or
srun only from rank 0), exits with status 2 and removes the run directory Hydra made for the run
when nothing but Hydra's own `.hydra/` went into it. In a sweep (`-m`) the point's error goes
into its job folder instead and the sweep goes on; its table (`hcp.preflight.sweep_table`,
`hcp.preflight.plan_table`) lists it.
"""
from __future__ import annotations

import copy
import os
import shutil
import signal
import sys

from hcp import torch_problem

if torch_problem():  # before anything imports torch: one line
    print(f"hcp: error: {torch_problem()}", file=sys.stderr)
    sys.exit(2)

from omegaconf import DictConfig, OmegaConf

from hcp.config.compose import CONF_DIR, config_groups
from hcp.config.errors import ConfigError
from hcp.config.layouts import world_size_of
from hcp.launch.launch import (export_rank_env, launched_rank_env, local_start_method,
                              local_world_size, oversubscribed, resolve_nproc, resume_command,
                              slow_precision, start_local_ranks)
from hcp.launch.slurm import check_slurm
from hcp.train.export import start_export
from hcp.preflight.sweep_table import ERROR_FILE
from hcp.model.hf_load import apply_hf_configs, check_hf_weights, cli_keys


def _rank_entry(payload) -> None:
    from hcp.train.failures import report_rank_failure
    from hcp.train.trainer import run_rank

    container, run_dir = payload
    try:
        with report_rank_failure():  # names the failing rank in the log (hcp.train.failures)
            run_rank(OmegaConf.create(container), run_dir)
    except KeyboardInterrupt:  # Ctrl-C reaches every rank: the launcher alone says what to do next
        sys.exit(130)


def _is_first(joined) -> bool:
    return not joined or joined["rank"] == 0


def run(cfg: DictConfig, overrides: list[str] = ()):
    """Resolve `cfg` (Hydra's run directory included) once, validate, and run `mode`.

    `overrides` are the command line's (for the commands error messages suggest)."""
    from hydra.core.hydra_config import HydraConfig

    from hcp.config.paths import check_writable
    from hcp.config.settings import CheckpointSpec
    from hcp.config.specs import resolve_modules
    from hcp.config.validate import validate
    from hcp.data.build import prepare_data
    from hcp.train.checkpoint import check_resume
    from hcp.preflight.plan_mode import check_fits_here
    from hcp.launch.preempt import resume_after_requeue
    from hcp.train.support import check_profile, check_trainable

    run_dir = HydraConfig.get().runtime.output_dir
    unresolved = copy.deepcopy(cfg)  # which keys follow which (a fix tries its values on both)
    OmegaConf.resolve(cfg)
    joined = launched_rank_env(os.environ)
    for line in apply_hf_configs(cfg, cli_keys(HydraConfig.get().overrides.task)):
        print(f"hcp: {line}")
    if cfg.layout == "auto":  # the searched layout goes into cfg before anything starts
        from hcp.preflight.auto_layout import choose_layout

        world = (local_world_size(cfg, joined, overrides) if cfg.mode == "train"
                 else world_size_of(cfg, resolve_nproc("auto")))
        choose_layout(cfg, overrides, world, run_dir if _is_first(joined) else None,
                      _is_first(joined))
        unresolved = copy.deepcopy(cfg)
    if cfg.mode == "plan":
        from hcp.preflight.plan_mode import run_plan

        layouts = validate(cfg, world_size_of(cfg, resolve_nproc("auto")), unresolved)
        check_profile(cfg)  # an error here too: a missing profile is not a layout to plan
        # the run it plans would refuse it:
        check_resume(CheckpointSpec.of(cfg), resolve_modules(cfg, layouts), cfg.trainer.max_steps)
        print(f"hcp: run directory {run_dir}")
        plan = run_plan(cfg, run_dir)
        print(f"hcp: plan written to {run_dir}")
        return plan
    if cfg.mode == "calibrate":  # dynamic-CP cost-model profile: hcp/preflight/calibrate.py
        from hcp.preflight.calibrate import run_calibrate

        validate(cfg, world_size_of(cfg, resolve_nproc("auto")), unresolved)
        return run_calibrate(cfg, run_dir)
    if cfg.mode == "rehearse":  # every rank of the full world on a fake process group
        from hcp.preflight.rehearse import check_rehearse, run_rehearsal

        world = world_size_of(cfg, resolve_nproc("auto"))
        specs = resolve_modules(cfg, validate(cfg, world))
        check_rehearse(cfg, world)
        if cfg.rehearse.device == "cuda":  # re-runs this command with fake CUDA preloaded
            from hcp.preflight.rehearse import fake_cuda

            fake_cuda.ensure([f"hydra.run.dir={run_dir}"])
        for line in prepare_data(cfg, specs):
            print(line)
        print(f"hcp: run directory {run_dir}", flush=True)
        if run_rehearsal(cfg, run_dir, world):  # mismatches: exit status 1
            sys.exit(1)
        return None
    world = local_world_size(cfg, joined, overrides)
    layouts = validate(cfg, world, unresolved)
    specs = resolve_modules(cfg, layouts)  # once: the typed modules the checks below read
    if not joined:
        check_fits_here(cfg, layouts, world, overrides)
        # spawn with CUDA; checked before any rank starts
        start_method = local_start_method(cfg.launcher)
    check_trainable(cfg, specs)
    check_slurm(cfg)
    resume_after_requeue(cfg)
    check_resume(CheckpointSpec.of(cfg), specs, cfg.trainer.max_steps,
                 weights_only=cfg.mode == "export")
    if cfg.mode == "train":  # else the first save would find out, after training up to it
        check_writable("checkpoint.dir", cfg.checkpoint.dir)
        check_writable("hydra.run.dir", run_dir)
    for line in check_hf_weights(cfg):
        print(f"hcp: {line}")
    if cfg.mode == "export":
        return start_export(cfg, specs, run_dir, joined, world)
    container = OmegaConf.to_container(cfg, resolve=True)
    first = _is_first(joined)
    for line in prepare_data(cfg, specs):
        if first:
            print(line)
    if first:
        warning = slow_precision(cfg.precision, cfg.launcher)
        if warning:
            print(f"hcp: warning: {warning}", file=sys.stderr, flush=True)
        print(f"hcp: run directory {run_dir}", flush=True)
        with open(os.path.join(run_dir, "config_resolved.yaml"), "w") as f:
            f.write(OmegaConf.to_yaml(container))
    if joined:
        export_rank_env(joined)
        _rank_entry((container, run_dir))
    else:
        warning = oversubscribed(world, cfg.launcher)
        if warning:
            print(f"hcp: warning: {warning}", file=sys.stderr, flush=True)
        start_local_ranks(_rank_entry, world, (container, run_dir), start_method,
                          cfg.launcher.slurm.signal, cfg.launcher.slurm.signal_lead_s)
    if first:
        print(f"hcp: run finished; outputs in {run_dir}", flush=True)
    return None


def discard_run_dir(run_dir: str) -> None:
    """Remove `run_dir` if it holds nothing but Hydra's `.hydra/` (a run that failed before it
    wrote anything), and then its parents below the working directory that became empty."""
    try:
        if not os.path.isdir(run_dir) or set(os.listdir(run_dir)) - {".hydra"}:
            return
        shutil.rmtree(run_dir, ignore_errors=True)
        cwd, parent = os.path.realpath(os.getcwd()), os.path.dirname(os.path.realpath(run_dir))
        while parent.startswith(cwd + os.sep) and not os.listdir(parent):
            os.rmdir(parent)
            parent = os.path.dirname(parent)
    except OSError:  # another rank of the launch removed it first
        pass


def _task(cfg: DictConfig):
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from hcp.data.llava import DataError
    from hcp.launch.supervise import RankDied, RankRaised

    hydra_cfg = HydraConfig.get()
    overrides = list(hydra_cfg.overrides.task)
    try:
        return run(cfg, overrides)
    except (ConfigError, DataError) as e:  # a user error: its message says what to fix
        joined = launched_rank_env(os.environ)
        if _is_first(joined):
            print(f"hcp: error: {e}", file=sys.stderr, flush=True)
        run_dir = hydra_cfg.runtime.output_dir
        if hydra_cfg.mode == RunMode.MULTIRUN:
            # the sweep goes on; its table (hcp.preflight.plan_table, hcp.preflight.sweep_table)
            # shows this point's error, and a training sweep then exits with status 2
            if not os.path.isfile(os.path.join(run_dir, "plan.json")):
                name = "plan_error.txt" if cfg.mode == "plan" else ERROR_FILE
                with open(os.path.join(run_dir, name), "w") as f:
                    f.write(f"{e}\n")
            return None
        discard_run_dir(run_dir)
        sys.exit(2)
    except (KeyboardInterrupt, RankDied, RankRaised) as e:  # Ctrl-C, a signal, a failed rank
        died, signum = isinstance(e, (RankDied, RankRaised)), getattr(e, "signum", signal.SIGINT)
        what = str(e) if died else f"interrupted by {signal.Signals(signum).name}"
        if isinstance(e, RankRaised):  # its first line, then its traceback (hcp.launch.supervise)
            print(f"hcp: {e}\n{e.traceback.rstrip()}", file=sys.stderr, flush=True)
            what = "the other ranks were stopped"
        if cfg.mode == "train":  # looked up once every rank has stopped: what is on disk
            what += "; " + resume_hint(cfg.checkpoint.dir, overrides)
        print(f"hcp: {what}", file=sys.stderr, flush=True)
        sys.exit(1 if died else 128 + signum)


def resume_hint(checkpoint_dir: str, overrides=()) -> str:
    """What a user can do once the ranks of a run started with `overrides` have stopped: the
    command that resumes from the newest complete checkpoint under `checkpoint_dir` (looked up
    now: what is on disk), else that a new run starts at step 0 (none was saved)."""
    from hcp.train.checkpoint import latest

    path = latest(checkpoint_dir)
    if path is None:
        return (f"no checkpoint was saved in checkpoint.dir={checkpoint_dir} (trainer.save_every "
                "saves during training), so a new run starts at step 0")
    return (f"the last complete checkpoint is {path}; resume with "
            f"`{resume_command(overrides, checkpoint_dir)}`")


def command_line_overrides(argv: list[str]) -> list[str]:
    """The `key=value` overrides among Hydra's command-line arguments (flags left out)."""
    return [a for a in argv if "=" in a and not a.startswith("-")]


def check_run_dir(argv: list[str]) -> None:
    """The directory Hydra will create for this run (`hydra.run.dir`, or `hydra.sweep.dir` under
    `-m`) when the command line names one without interpolations: checked writable here
    (`hcp.config.paths.check_writable`), so a bad path is one line before Hydra starts (not
    Hydra's traceback).

    Raises:
        ConfigError: naming the key, the path and why.
    """
    key = "hydra.sweep.dir" if {"-m", "--multirun"} & set(argv) else "hydra.run.dir"
    for override in command_line_overrides(argv):
        name, _, value = override.partition("=")
        if name.lstrip("+") == key and "${" not in value:
            from hcp.config.paths import check_writable

            check_writable(key, value)


def main() -> None:
    """`python train.py ...` and the `hcp-train` console command: the same Hydra app, its configs
    found from the package (`hcp.config.compose.CONF_DIR`) wherever it runs from."""
    import hydra

    from hcp.config.compose import check_module_names
    from hcp.config.keys import check_overrides
    from hcp.config.schema import register
    from hcp.launch.launch import run_name

    try:
        check_overrides(command_line_overrides(sys.argv[1:]), config_groups(), CONF_DIR)
        check_module_names(command_line_overrides(sys.argv[1:]))
        check_run_dir(sys.argv[1:])
    except ConfigError as e:
        if _is_first(launched_rank_env(os.environ)):
            print(f"hcp: error: {e}", file=sys.stderr)
        sys.exit(2)
    register()
    if not OmegaConf.has_resolver("hcp_run_name"):
        OmegaConf.register_new_resolver("hcp_run_name", lambda: run_name(os.environ),
                                        use_cache=True)
    # hydra/launcher=submitit_slurm's tasks_per_node
    if not OmegaConf.has_resolver("hcp_slurm_tasks"):
        from hcp.launch.slurm import slurm_tasks

        OmegaConf.register_new_resolver("hcp_slurm_tasks", slurm_tasks)
    hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")(_task)()
