"""`checkpoint.async=true` (hcp.train.async_checkpoint): a checkpoint written in the background
while the next step updates the weights resumes bit for bit as a synchronous one does, and a
write that fails never leaves a folder that `resume=auto` takes for complete."""
import json
import os

import pytest
import torch
from omegaconf import OmegaConf

from cfg_utils import compose_cfg
from dist_utils import run_ranks

SMALL = ["trainer.micro_batch_tokens=150", "trainer.global_batch_size=8", "trainer.progress_bar=false",
         "trainer.log_every=1", "trainer.eval_every=0", "trainer.eval_samples=8", "trainer.max_steps=5",
         "llm.layout.dp_shard=true"]


def _cfg(run_dir, *extra):
    return OmegaConf.to_container(compose_cfg([*SMALL, *extra], run_dir=str(run_dir)), resolve=True)


def _interrupted(rank, world, container, run_dir, fail_write=False):
    """Three steps, a save, then one more step while the save may still be writing (its
    updates must not reach the checkpoint); the run then stops."""
    from hcp.train.trainer import Trainer

    tr = Trainer(OmegaConf.create(container), run_dir)
    if fail_write and rank == 1:
        from torch.distributed.checkpoint import FileSystemWriter

        def broken(*args, **kwargs):
            raise OSError("disk full")
        FileSystemWriter.write_data = broken
    for _ in range(3):
        tr.train_step()
    tr.save()
    tr.train_step()
    if tr.writer is None:
        return None
    try:
        tr.writer.wait()
    except RuntimeError as e:
        return str(e)
    return None


def _resumed(rank, world, container, run_dir):
    """Resume with resume=auto and train to the end; this rank's parameters."""
    from hcp.train.trainer import Trainer

    tr = Trainer(OmegaConf.create(container), run_dir)
    tr.fit()
    return {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
            for n, p in tr.modules.named_parameters()}


def _losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


@pytest.mark.timeout(300)
def test_a_resume_after_an_asynchronous_save_equals_the_one_after_a_synchronous_save(tmp_path):
    params = {}
    for mode in ("sync", "async"):
        run_dir = tmp_path / mode
        container = _cfg(run_dir, "resume=auto", f"checkpoint.async={mode == 'async'}")
        run_ranks(_interrupted, 2, container, str(run_dir), timeout=200)
        assert sorted(os.listdir(run_dir / "checkpoints")) == ["step_00000003"]
        params[mode] = run_ranks(_resumed, 2, container, str(run_dir), timeout=200)
    assert _losses(tmp_path / "async") == _losses(tmp_path / "sync")  # steps 4 and 5, bit for bit
    assert sorted(_losses(tmp_path / "async")) == [4, 5]
    for sync, asynchronous in zip(params["sync"], params["async"]):
        assert sync.keys() == asynchronous.keys()
        for name in sync:
            assert torch.equal(sync[name], asynchronous[name]), name


@pytest.mark.timeout(200)
def test_a_failed_background_write_leaves_no_complete_checkpoint(tmp_path):
    """Rank 1's write fails: every rank's `wait` raises, and only the `.tmp-` folder is left."""
    from hcp.train.checkpoint import latest

    container = _cfg(tmp_path, "checkpoint.async=true")
    errors = run_ranks(_interrupted, 2, container, str(tmp_path), True, timeout=180)
    assert all(e and e.startswith("checkpoint.async: writing ") for e in errors), errors
    assert latest(str(tmp_path / "checkpoints")) is None
    assert os.listdir(tmp_path / "checkpoints") == [".tmp-step_00000003"]
