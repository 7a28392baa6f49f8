"""Each rank's CUDA device (hcp.launch.distributed.init_distributed) from what the task sees:
under `srun --gpus-per-task=1` (or `--gpu-bind`) a task sees one GPU, renumbered 0, whatever its
LOCAL_RANK; `cuda:LOCAL_RANK` would not exist. CUDA and the process group are faked."""
import pytest
import torch
from omegaconf import OmegaConf

import hcp.launch.distributed as distributed


@pytest.fixture
def node(monkeypatch):
    """A CUDA node; returns the devices passed to torch.cuda.set_device."""
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: True)
    return chosen


def _device(monkeypatch, local_rank, visible, env):
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    if env is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env)
    return distributed.init_distributed(OmegaConf.create({"backend": "nccl", "timeout_s": 60}))


def test_a_task_bound_to_one_gpu_uses_it(node, monkeypatch):
    assert _device(monkeypatch, 3, 1, "3") == torch.device("cuda", 0)     # --gpus-per-task=1
    assert node == [torch.device("cuda", 0)]
    assert _device(monkeypatch, 6, 4, "4,5,6,7") == torch.device("cuda", 2)  # socket-wide bind
    assert _device(monkeypatch, 5, 8, None) == torch.device("cuda", 5)    # torchrun: all visible


def test_more_ranks_than_gpus_without_binding_is_a_clear_error(node, monkeypatch):
    with pytest.raises(ValueError, match="LOCAL_RANK=4: this node shows 4 GPU.*nproc_per_node"):
        _device(monkeypatch, 4, 4, None)
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        _device(monkeypatch, 0, 0, "")
