"""Weight decay groups and the learning-rate schedule across a resume with a changed schedule."""
import json

import pytest
import torch

from cfg_utils import compose_cfg
from hcp.train.optim import build_optimizer, build_scheduler, cosine_with_warmup


def test_weight_decay_applies_to_weight_matrices_only():
    from hcp.model import LlavaModel

    cfg = compose_cfg(["optim.weight_decay=0.1"])
    model = LlavaModel(cfg.vision, cfg.projector, cfg.llm)
    opt = build_optimizer(model, cfg.optim)
    names = {id(p): n for n, p in model.named_parameters()}
    groups = {g["name"]: (g["weight_decay"], {names[id(p)] for p in g["params"]}) for g in opt.param_groups}
    (wd, decay), (wd0, no_decay) = groups["decay"], groups["no_decay"]
    assert wd == 0.1 and wd0 == 0.0 and len(decay) + len(no_decay) == len(names)
    assert {"llm.layers.0.attn.q_proj.weight", "llm.layers.1.mlp.down_proj.weight", "llm.lm_head.weight",
            "projector.fc1.weight", "vision.blocks.0.fc1.weight", "vision.patch_embed.weight"} <= decay
    assert {"llm.embed_tokens.weight", "vision.position_embedding", "vision.class_embedding",
            "llm.layers.0.attn_norm.weight", "llm.norm.weight", "vision.pre_norm.bias",
            "vision.blocks.0.q_proj.bias", "projector.fc1.bias"} <= no_decay
    assert all(p.ndim >= 2 for n, p in model.named_parameters() if n in decay)


def _opt(max_steps, lr=5e-4):
    cfg = compose_cfg([f"optim.lr={lr}", "optim.min_lr_ratio=0.1", "optim.warmup_ratio=0.03"]).optim
    opt = build_optimizer(torch.nn.Linear(2, 2), cfg)
    return opt, build_scheduler(opt, cfg, max_steps), cfg


def test_resume_with_changed_max_steps_follows_the_new_schedule_from_the_first_step():
    opt, sched, cfg = _opt(200)
    for _ in range(200):
        opt.step()
        sched.step()
    saved = json.loads(json.dumps({"opt_lr": [g["lr"] for g in opt.param_groups], "sched": sched.state_dict()}))
    assert saved["opt_lr"][0] == pytest.approx(5e-5)  # the old schedule's floor

    opt2, sched2, _ = _opt(400)
    for g, lr in zip(opt2.param_groups, saved["opt_lr"]):
        g["lr"] = lr  # what loading the optimizer's checkpoint does
    sched2.load_state_dict(saved["sched"])
    note = sched2.change_note
    assert "max_steps 200 -> 400" in note and "5e-05" in note
    for step in range(200, 205):  # every resumed step, the first one included
        want = 5e-4 * cosine_with_warmup(step, 400, cfg.warmup_ratio, cfg.min_lr_ratio)
        assert sched2.get_last_lr()[0] == pytest.approx(want)
        assert all(g["lr"] == pytest.approx(want) for g in opt2.param_groups)
        opt2.step()
        sched2.step()
    assert 5e-4 * cosine_with_warmup(200, 400, 0.03, 0.1) > 2.5e-4  # far from the old floor


def test_resume_with_the_same_schedule_says_nothing():
    opt, sched, _ = _opt(100)
    for _ in range(10):
        opt.step()
        sched.step()
    opt2, sched2, _ = _opt(100)
    sched2.load_state_dict(json.loads(json.dumps(sched.state_dict())))
    assert sched2.change_note is None and sched2.get_last_lr() == sched.get_last_lr()
