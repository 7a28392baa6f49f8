"""What `python train.py` does in the launching process: resolve the config once, validate it,
then plan, or start (or join) the ranks that train."""
from __future__ import annotations

import os

from omegaconf import DictConfig, OmegaConf

from hcp.config.layouts import world_size_of
from hcp.config.validate import validate
from hcp.data.build import prepare_data
from hcp.train.checkpoint import check_resume
from hcp.train.launch import export_rank_env, launched_rank_env, local_world_size, start_local_ranks
from hcp.train.preempt import resume_after_requeue
from hcp.train.slurm import check_slurm
from hcp.train.support import check_trainable


def _rank_entry(payload) -> None:
    from hcp.train.failures import report_rank_failure
    from hcp.train.trainer import run_rank

    container, run_dir = payload
    with report_rank_failure():  # names the failing rank in the log (hcp.train.failures)
        run_rank(OmegaConf.create(container), run_dir)


def run(cfg: DictConfig):
    """Resolve `cfg` (Hydra's run directory included) once, validate, and run `mode`."""
    from hydra.core.hydra_config import HydraConfig

    run_dir = HydraConfig.get().runtime.output_dir
    OmegaConf.resolve(cfg)
    if cfg.mode == "plan":
        from hcp.train.plan import run_plan

        validate(cfg, world_size_of(cfg))
        return run_plan(cfg, run_dir)
    joined = launched_rank_env(os.environ)
    world = local_world_size(cfg, joined)
    check_trainable(cfg, validate(cfg, world))
    check_slurm(cfg)
    resume_after_requeue(cfg)
    check_resume(cfg)
    container = OmegaConf.to_container(cfg, resolve=True)
    if not joined or joined["rank"] == 0:
        with open(os.path.join(run_dir, "config_resolved.yaml"), "w") as f:
            f.write(OmegaConf.to_yaml(container))
    for line in prepare_data(cfg):
        if not joined or joined["rank"] == 0:
            print(line)
    if joined:
        export_rank_env(joined)
        _rank_entry((container, run_dir))
    else:
        start_local_ranks(_rank_entry, world, (container, run_dir), cfg.launcher.start_method)
    return None
