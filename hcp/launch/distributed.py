"""Process-group start-up for one rank: backend, device, collective timeout."""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def cuda_index(local_rank: int, visible: int, visible_env: str | None) -> int:
    """This rank's CUDA device among the `visible` ones (`torch.cuda.device_count()`, which
    CUDA_VISIBLE_DEVICES, `visible_env`, narrows). `cuda:LOCAL_RANK` when the node's GPUs are
    all visible to every rank (torchrun, plain srun); else the task was bound to some GPUs
    (`srun --gpus-per-task=1`, `--gpu-bind`: Slurm sets CUDA_VISIBLE_DEVICES per task and the
    task sees 1 or a few, renumbered from 0): `LOCAL_RANK mod visible` (its only GPU, or the
    one of a socket-wide set that its place on the node points to).

    Raises:
        ValueError: no GPU visible, or more local ranks than visible GPUs with no binding
            (CUDA_VISIBLE_DEVICES unset): two ranks would share a GPU.
    """
    if visible < 1:
        raise ValueError(f"LOCAL_RANK={local_rank}: no CUDA device is visible to this rank "
                         f"(CUDA_VISIBLE_DEVICES={visible_env!r}); give each task a GPU "
                         "(srun --gpus-per-task=1) or use launcher.backend=gloo")
    if local_rank < visible:
        return local_rank
    if not visible_env:
        raise ValueError(f"LOCAL_RANK={local_rank}: this node shows {visible} GPU(s) to every rank "
                         "and no binding (CUDA_VISIBLE_DEVICES unset), so ranks would share one; "
                         f"start at most {visible} ranks per node (launcher.nproc_per_node, srun "
                         "--ntasks-per-node) or bind one GPU per task (srun --gpus-per-task=1)")
    return local_rank % visible


def init_distributed(launcher_cfg) -> torch.device:
    """Join the process group described by the torchrun environment variables and return this
    rank's device (the CUDA device of `cuda_index` with NCCL, else CPU with gloo and one
    intra-op thread per rank when several ranks share the CPU, unless OMP_NUM_THREADS is set).

    Raises:
        ValueError: `launcher.backend=nccl` on a machine without CUDA; no GPU for this rank
            (`cuda_index`).
    """
    backend = launcher_cfg.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("launcher.backend=nccl needs CUDA; use launcher.backend=gloo (or auto)")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "nccl":
        device = torch.device("cuda", cuda_index(local_rank, torch.cuda.device_count(),
                                                 os.environ.get("CUDA_VISIBLE_DEVICES")))
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
