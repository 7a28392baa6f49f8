"""LLaVA's two stages end to end on the tiny LLaVA: stage 1 (`+stage=pretrain`, projector only),
then stage 2 (`+stage=finetune init_from_checkpoint=PATH`: weights only, fresh optimizer and
schedule at step 0), and `resume` refusing a checkpoint whose trainable parameters differ."""
import json
import os

import pytest
import torch
from omegaconf import OmegaConf

from cfg_utils import compose_cfg
from dist_utils import run_ranks

from hcp.config.errors import ConfigError
from cfg_utils import resume_check

SMALL = ["trainer.micro_batch_tokens=150", "trainer.global_batch_size=8", "trainer.progress_bar=false",
         "trainer.log_every=1", "trainer.eval_every=0", "trainer.eval_samples=8", "trainer.max_steps=2"]


def _cfg(run_dir, *extra):
    return compose_cfg([*SMALL, *extra], run_dir=str(run_dir))


def _run(rank, world, container, run_dir):
    from hcp.train.trainer import Trainer

    tr = Trainer(OmegaConf.create(container), run_dir)
    start = {n: p.detach().clone() for n, p in tr.modules.named_parameters()}
    info = {"step": tr.step, "optim_state": len(tr.optimizer.state), "note": tr.resume_note,
            "lr": tr.scheduler.get_last_lr()[0]}
    tr.fit()
    end = {n: p.detach().clone() for n, p in tr.modules.named_parameters()}
    return start, end, info


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_stage1_then_stage2_from_its_weights_with_a_fresh_optimizer(tmp_path):
    s1 = _cfg(tmp_path / "s1", "+stage=pretrain")
    (start1, end1, _), _ = run_ranks(_run, 2, OmegaConf.to_container(s1), str(tmp_path / "s1"))
    changed = {n.split(".")[0] for n in start1 if not torch.equal(start1[n], end1[n])}
    assert changed == {"projector"}  # stage 1 trains only the projector
    ckpt = str(tmp_path / "s1" / "checkpoints" / "step_00000002")

    s2 = _cfg(tmp_path / "s2", "+stage=finetune", "llm.layout.tp=2", "vision.layout.tp=1",
              f"init_from_checkpoint={ckpt}")  # the encoder side stays whole (pure DP)
    resume_check(s2)
    (start2, end2, info), _ = run_ranks(_run, 2, OmegaConf.to_container(s2), str(tmp_path / "s2"))
    assert info["step"] == 0 and info["optim_state"] == 0  # fresh optimizer and schedule
    assert info["lr"] == pytest.approx(2e-5) and "model weights of step 2" in info["note"]
    assert info["note"].endswith("optimizer, schedule and data start fresh at step 0")
    for n in start2:
        if not n.startswith("llm."):  # under tp2 the LLM holds slices; the rest is whole
            assert torch.equal(start2[n], end1[n]), n   # starts from stage 1's weights
    changed = {n.split(".")[0] for n in start2 if not torch.equal(start2[n], end2[n])}
    assert changed == {"llm", "projector"}  # stage 2 trains the LLM and the projector
    saved = json.load(open(tmp_path / "s2" / "checkpoints" / "step_00000002" / "trainer.json"))
    assert saved["layout"] == "llm tp2 | projector dp2 | vision dp2" and "llm.embed_tokens.weight" in saved["trainable"]

    with pytest.raises(ConfigError) as e:  # continuing "the same run" with other trainables
        resume_check(_cfg(tmp_path / "s2b", "+stage=finetune", f"resume={ckpt}"))
    msg = str(e.value)
    assert "frozen there, trained now" in msg and "llm.embed_tokens.weight" in msg
    assert f"use init_from_checkpoint={ckpt}" in msg
    resume_check(_cfg(tmp_path / "s1b", "+stage=pretrain", f"resume={ckpt}"))  # same run: fine
    with pytest.raises(ConfigError, match="init_from_checkpoint="):
        resume_check(_cfg(tmp_path / "x", f"init_from_checkpoint={tmp_path}"))
    assert os.path.isdir(ckpt)


def _save_then_load_weights(rank, world, root):
    from hcp.train import checkpoint

    model = torch.nn.Linear(2, 2)
    path = checkpoint.save(root, 3, model, torch.optim.AdamW(model.parameters()), {"step": 3}, keep=1)
    return path, checkpoint.load_weights(path, model)


@pytest.mark.timeout(60)
def test_load_weights_says_what_it_loaded_and_nothing_about_a_training_start(tmp_path):
    """`mode=export ... resume=auto` prints this line: an export has no optimizer or schedule
    that could "start fresh at step 0" (that is the trainer's note for init_from_checkpoint)."""
    (path, note), = run_ranks(_save_then_load_weights, 1, str(tmp_path))
    assert note.startswith(f"model weights of step 3 from {path} (saved at ") and "fresh" not in note
