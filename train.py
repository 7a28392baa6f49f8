"""hcp entry point.

    python train.py                                   # tiny LLaVA on digits, 4 local ranks
    python train.py +recipe=llava_hetero mode=plan    # plan a full-size run, no GPU needed
    python train.py -m optim.lr=1e-3,3e-3             # a sweep: one run directory per job
    torchrun --nproc-per-node 8 train.py ...          # joins the ranks torchrun started
"""
import os
import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from hcp.config.schema import register
from hcp.train.launch import run_name
from hcp.train.slurm import slurm_tasks

register()
OmegaConf.register_new_resolver("hcp_run_name", lambda: run_name(os.environ), use_cache=True)
OmegaConf.register_new_resolver("hcp_slurm_tasks", slurm_tasks)  # hydra/launcher=submitit_slurm


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig):
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from hcp.config.errors import ConfigError
    from hcp.data.llava import DataError
    from hcp.train.entry import run

    try:
        return run(cfg)
    except (ConfigError, DataError) as e:  # a user error: its message says what to fix
        print(f"hcp: error: {e}", file=sys.stderr)
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            raise  # Hydra records the failed job and the sweep goes on
        sys.exit(2)
    except KeyboardInterrupt:
        print("hcp: interrupted (resume=auto continues from the last complete checkpoint)",
              file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
