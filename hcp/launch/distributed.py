"""Process-group start-up for one rank: backend, device, collective timeout."""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def init_distributed(launcher_cfg) -> torch.device:
    """Join the process group described by the torchrun environment variables and return this
    rank's device (`cuda:LOCAL_RANK` with NCCL, else CPU with gloo and one intra-op thread per
    rank when several ranks share the CPU, unless OMP_NUM_THREADS is set).

    Raises:
        ValueError: `launcher.backend=nccl` on a machine without CUDA.
    """
    backend = launcher_cfg.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("launcher.backend=nccl needs CUDA; use launcher.backend=gloo (or auto)")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        if "OMP_NUM_THREADS" not in os.environ:  # the user's choice wins; else share the cores
            world = int(os.environ.get("WORLD_SIZE", "1"))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, world)))
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=launcher_cfg.timeout_s),
                                device_id=device if backend == "nccl" else None)
    return device
