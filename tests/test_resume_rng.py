"""A resumed run continues the saved run's random streams: right after `Trainer` resumes from a
checkpoint, torch's and Python's generators draw what the saved run drew right after its save
(the same dropout masks and random numbers as the uninterrupted run), at the same layout.
Through the public path only (`Trainer.save`, then `resume=auto`), so it holds whatever format
the checkpoint is written in."""
import random

import pytest
import torch
from omegaconf import OmegaConf

from cfg_utils import compose_container
from dist_utils import run_ranks
from test_hetero_parity import SMALL

RUN = [*SMALL, "trainer.global_batch_size=2", "trainer.eval_samples=2", "trainer.max_steps=4"]


def _draws() -> dict:
    """What a step's random work would draw next: a dropout mask, torch and Python numbers."""
    return dict(mask=torch.nn.functional.dropout(torch.ones(64), p=0.5), torch=torch.rand(4),
                python=[random.random() for _ in range(3)])


def _save_then_draw(rank, world, container, run_dir):
    from hcp.train.trainer import Trainer

    tr = Trainer(OmegaConf.create(container), run_dir)
    try:
        torch.rand(13), random.random()  # the run's random work before the save moves the streams
        tr.train_step()
        tr.save()
        return _draws()
    finally:
        tr.ahead.close()


def _resume_then_draw(rank, world, container, run_dir):
    from hcp.train.trainer import Trainer

    tr = Trainer(OmegaConf.create(container), run_dir)
    try:
        assert tr.step == 1, tr.step
        return _draws()
    finally:
        tr.ahead.close()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_resumed_run_draws_what_the_saved_run_drew_after_its_save(tmp_path):
    ckpt = f"checkpoint.dir={tmp_path / 'ckpt'}"
    saved, = run_ranks(_save_then_draw, 1, compose_container([*RUN, ckpt], tmp_path / "a"),
                       str(tmp_path / "a"), timeout=220)
    container = compose_container([*RUN, ckpt, "resume=auto"], tmp_path / "b")
    resumed, = run_ranks(_resume_then_draw, 1, container, str(tmp_path / "b"), timeout=220)
    assert torch.equal(resumed["mask"], saved["mask"])
    assert torch.equal(resumed["torch"], saved["torch"])
    assert resumed["python"] == saved["python"]
