"""Parameter groups (per module, weight decay on weight matrices only, a module's own lr and weight
decay) and the learning-rate schedule across a resume with a changed config."""
import json

import pytest
import torch

from cfg_utils import compose_cfg
from hcp.train.optim import build_optimizer, build_scheduler, cosine_with_warmup, module_overrides
from hcp.config.specs import resolve_modules


def test_weight_decay_applies_to_weight_matrices_only():
    from hcp.model import LlavaModel

    cfg = compose_cfg(["optim.weight_decay=0.1"])
    model = LlavaModel(cfg.vision, cfg.projector, cfg.llm)
    opt = build_optimizer(model, cfg.optim)
    names = {id(p): n for n, p in model.named_parameters()}
    decay, no_decay = set(), set()
    for g in opt.param_groups:
        kind = g["name"].split(".")[1]
        assert g["weight_decay"] == (0.1 if kind == "decay" else 0.0), g["name"]
        (decay if kind == "decay" else no_decay).update(names[id(p)] for p in g["params"])
    assert len(decay) + len(no_decay) == len(names)
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


def _llava_opt(overrides, max_steps=100, freeze_llm=False):
    from hcp.model import LlavaModel

    cfg = compose_cfg(["optim.lr=1e-3", "optim.weight_decay=0.1", "optim.warmup_ratio=0.1",
                       "optim.min_lr_ratio=0.1", *overrides])
    model = LlavaModel(cfg.vision, cfg.projector, cfg.llm)
    if freeze_llm:
        model.llm.requires_grad_(False)  # what the trainer does for llm.freeze=true
    opt = build_optimizer(model, cfg.optim, module_overrides(resolve_modules(cfg)))
    return opt, build_scheduler(opt, cfg.optim, max_steps), model


def _groups(opt):
    return {g["name"]: (g["lr"], g["weight_decay"], len(g["params"])) for g in opt.param_groups}


def _factor(step):
    return cosine_with_warmup(step, 100, 0.1, 0.1)


def test_each_module_has_its_own_groups_with_its_own_lr_and_weight_decay_under_one_schedule():
    """LLaVA's lower vision-tower lr and a projector without weight decay (`<module>.optim`)."""
    opt, sched, model = _llava_opt(["vision.optim.lr=2e-4", "projector.optim.weight_decay=0.0"],
                                   freeze_llm=True)
    groups = _groups(opt)
    assert set(groups) == {"vision.decay", "vision.no_decay", "projector.decay", "projector.no_decay"}
    fqn = {id(p): n for n, p in model.named_parameters()}
    for g in opt.param_groups:  # each group holds its module's parameters only
        assert {fqn[id(p)].split(".")[0] for p in g["params"]} == {g["name"].split(".")[0]}
    assert sum(n for *_, n in groups.values()) == len(fqn) - len(list(model.llm.parameters()))
    want = {"vision.decay": (2e-4, 0.1), "vision.no_decay": (2e-4, 0.0),
            "projector.decay": (1e-3, 0.0), "projector.no_decay": (1e-3, 0.0)}
    for step in range(15):  # warmup, then cosine: every group scales by the same factor
        for name, (lr, wd) in want.items():
            assert _groups(opt)[name][:2] == (pytest.approx(lr * _factor(step)), wd), (name, step)
        assert sched.lr == pytest.approx(1e-3 * _factor(step))
        opt.step()
        sched.step()


def test_a_resume_follows_this_runs_module_settings_and_says_what_changed():
    opt, sched, _ = _llava_opt(["vision.optim.lr=2e-4"])
    for _ in range(5):
        opt.step()
        sched.step()
    saved_opt, saved_sched = opt.state_dict(), json.loads(json.dumps(sched.state_dict()))
    opt2, sched2, _ = _llava_opt(["vision.optim.lr=5e-4", "llm.optim.weight_decay=0.01"])
    opt2.load_state_dict(saved_opt)  # what loading the checkpoint does: the saved lr / decay
    assert _groups(opt2)["vision.decay"][0] == pytest.approx(2e-4 * _factor(5))
    sched2.load_state_dict(saved_sched)
    groups = _groups(opt2)
    assert groups["vision.decay"][:2] == (pytest.approx(5e-4 * _factor(5)), 0.1)
    assert groups["llm.decay"][:2] == (pytest.approx(1e-3 * _factor(5)), 0.01)
    assert groups["llm.no_decay"][:2] == (pytest.approx(1e-3 * _factor(5)), 0.0)
    note = sched2.change_note
    assert "vision.decay [lr, weight_decay] [0.0002, 0.1] -> [0.0005, 0.1]" in note
    assert "llm.decay [lr, weight_decay] [0.001, 0.1] -> [0.001, 0.01]" in note
    assert "max_steps" not in note and "vision.no_decay [lr, weight_decay] [0.0002, 0.0] -> [0.0005, 0.0]" in note


def _resume_old_groups(rank, world, root):
    """Save a checkpoint whose optimizer has the earlier two groups (decay / no_decay over all
    modules), load it into per-module groups; return both optimizers' state by FQN."""
    from hcp.model import LlavaModel, init_parameters
    from hcp.train import checkpoint
    from hcp.train.optim import decays

    cfg = compose_cfg(["optim.lr=1e-3", "optim.weight_decay=0.1", "vision.optim.lr=2e-4"])

    def model():
        m = LlavaModel(cfg.vision, cfg.projector, cfg.llm)
        init_parameters(m, cfg.seed)
        return m

    old = model()
    kinds = {"decay": [], "no_decay": []}
    for _, module in old.named_modules():
        for name, p in module.named_parameters(recurse=False):
            kinds["decay" if decays(module, name, p) else "no_decay"].append(p)
    opt = torch.optim.AdamW([{"name": k, "params": v, "weight_decay": 0.1 if k == "decay" else 0.0}
                             for k, v in kinds.items()], lr=1e-3)
    sched = build_scheduler(opt, cfg.optim, 10)
    g = torch.Generator().manual_seed(0)
    for p in old.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()
    sched.step()
    path = checkpoint.save(root, 1, old, opt, {"step": 1}, keep=1)
    new = model()
    opt2 = build_optimizer(new, cfg.optim, module_overrides(resolve_modules(cfg)))
    sched2 = build_scheduler(opt2, cfg.optim, 10)
    checkpoint.load(path, new, opt2)
    sched2.load_state_dict(json.loads(json.dumps(sched.state_dict())))
    by_fqn = [{n: {k: v.clone() for k, v in o.state[p].items()} for n, p in m.named_parameters()}
              for m, o in ((old, opt), (new, opt2))]
    weights = [{n: p.detach().clone() for n, p in m.named_parameters()} for m in (old, new)]
    return by_fqn, weights, _groups(opt2), sched2.lr


@pytest.mark.slow
def test_an_optimizer_checkpoint_of_two_groups_resumes_into_groups_per_module(tmp_path):
    """Optimizer state and group settings are keyed by parameter FQN in the checkpoint, so the
    earlier grouping (decay / no_decay over all modules) resumes into per-module groups."""
    from dist_utils import run_ranks

    (saved, loaded), (w_saved, w_loaded), groups, lr = run_ranks(_resume_old_groups, 1, str(tmp_path))[0]
    assert set(saved) == set(loaded)
    for fqn, state in saved.items():
        assert set(state) == {"step", "exp_avg", "exp_avg_sq"}, fqn
        for key, value in state.items():
            assert torch.equal(loaded[fqn][key], value), (fqn, key)
        assert torch.equal(w_loaded[fqn], w_saved[fqn])
    factor = cosine_with_warmup(1, 10, compose_cfg([]).optim.warmup_ratio, compose_cfg([]).optim.min_lr_ratio)
    assert groups["vision.decay"][:2] == (pytest.approx(2e-4 * factor), 0.1)
    assert groups["llm.no_decay"][:2] == (pytest.approx(1e-3 * factor), 0.0)
    assert lr == pytest.approx(1e-3 * factor)
