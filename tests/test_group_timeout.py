"""Subgroups keep the world's collective timeout (`launcher.timeout_s`): torch's `new_group`
without `timeout` gives every subgroup its own default (30 min on gloo, 10 on NCCL), so a
collective stuck on a CP or TP group would wait past the time the user set
(hcp.parallel.groups.new_group). Two gloo ranks, the world started by hcp's own start-up."""
import os

import torch
import torch.distributed as dist

from dist_utils import run_ranks
from hcp.launch.launch import free_port


def _timeouts(rank, world, port, layouts):
    from omegaconf import OmegaConf

    from hcp.launch.distributed import init_distributed
    from hcp.parallel.groups import ProcessGroupRegistry

    dist.destroy_process_group()  # the harness's world: start hcp's own, with launcher.timeout_s
    os.environ["MASTER_PORT"] = str(port)
    init_distributed(OmegaConf.create({"backend": "gloo", "timeout_s": 77}))
    registry = ProcessGroupRegistry(layouts)
    cp = registry.group("llm", "cp")
    seconds = lambda g: g._get_backend(torch.device("cpu")).options._timeout.total_seconds()  # noqa: E731
    return seconds(dist.group.WORLD), seconds(cp), dist.get_world_size(cp)


def test_subgroups_get_launcher_timeout():
    from cfg_utils import compose_cfg
    from hcp.config.validate import validate

    layouts = validate(compose_cfg(["+recipe=llama_tiny", "llm.layout.cp=2"]), 2)
    assert run_ranks(_timeouts, 2, free_port(), layouts) == [(77.0, 77.0, 2)] * 2
