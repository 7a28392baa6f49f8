"""Launching on a GPU node without a GPU (hcp.launch.launch): `python train.py` on a node whose
NVML sees 8 GPUs must never initialise CUDA in the launching process (its forked ranks could
not use CUDA then) and must start its ranks with spawn. CUDA initialisation in this process
raises (monkeypatched) while the whole launch path of `train.py` runs, up to starting ranks."""
import os
import sys

import pytest
import torch

import hcp.entry as entry
import hcp.launch.launch as launch


def _boom(*args, **kwargs):
    raise AssertionError("CUDA was initialised in the launching process")


@pytest.fixture
def gpu_node(monkeypatch, tmp_path):
    """This process on an 8-GPU node as NVML sees it; any CUDA initialisation raises. Returns
    the calls to `start_local_ranks` (which starts nothing here)."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)  # NVML's count: no CUDA init
    for name in ("_lazy_init", "init", "is_available", "get_device_properties", "mem_get_info",
                 "set_device", "current_device"):
        monkeypatch.setattr(torch.cuda, name, _boom)
    monkeypatch.setattr(launch, "gpu_memory_gib", lambda: 80.0, raising=False)  # the child's answer
    started = []
    monkeypatch.setattr(entry, "start_local_ranks",
                        lambda fn, nproc, payload, method, *_: started.append((nproc, method)))
    monkeypatch.chdir(tmp_path)
    return started


def train(monkeypatch, *overrides):
    monkeypatch.setattr(sys, "argv", ["train.py", "trainer.max_steps=1", "logger=none",
                                      "hydra.run.dir=run", *overrides])
    entry.main()


def test_train_py_on_a_gpu_node_spawns_one_rank_per_gpu_without_initialising_cuda(gpu_node, monkeypatch):
    train(monkeypatch)
    assert gpu_node == [(8, "spawn")]


def test_fork_on_a_gpu_node_is_refused_before_any_rank_starts(gpu_node, monkeypatch, capsys):
    with pytest.raises(SystemExit) as e:
        train(monkeypatch, "launcher.start_method=fork")
    assert e.value.code == 2 and gpu_node == []
    assert "launcher.start_method" in capsys.readouterr().err


def test_fork_stays_the_default_on_a_cpu_machine(monkeypatch):
    from omegaconf import OmegaConf

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)  # a CPU machine, wherever it runs
    launcher = OmegaConf.create({"start_method": "auto", "backend": "auto"})
    assert launch.local_start_method(launcher) == "fork"


def _write_rank(payload):
    with open(os.path.join(payload, os.environ["RANK"]), "w") as f:
        f.write(os.environ["WORLD_SIZE"])


def test_spawned_local_ranks_run(tmp_path):
    launch.start_local_ranks(_write_rank, 2, str(tmp_path), "spawn")
    assert sorted(os.listdir(tmp_path)) == ["0", "1"]
