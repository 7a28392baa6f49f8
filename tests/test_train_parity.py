"""Data parallelism equals one process, and resume equals an uninterrupted run (FP32)."""
import json
import os

import pytest
import torch
from omegaconf import OmegaConf

from cfg_utils import compose_cfg
from dist_utils import run_ranks

SMALL = ["trainer.micro_batch_tokens=150", "trainer.global_batch_size=8", "trainer.progress_bar=false",
         "trainer.log_every=1", "trainer.eval_every=0", "trainer.eval_samples=8"]


def _cfg(tmp_path, extra=()):
    cfg = compose_cfg([*SMALL, *extra], run_dir=str(tmp_path))
    return OmegaConf.to_container(cfg, resolve=True)


def _loss_and_grads(rank, world, container, run_dir):
    from hcp.train.trainer import Trainer

    tr = Trainer(OmegaConf.create(container), run_dir)
    loss, counts, n_micro = tr.forward_backward(tr.sampler.batch(0))
    return float(loss), n_micro, {n: p.grad.clone() for n, p in tr.modules.named_parameters()}


@pytest.mark.timeout(120)
def test_four_rank_data_parallel_equals_one_process(tmp_path):
    container = _cfg(tmp_path)
    (ref_loss, ref_micro, ref), = run_ranks(_loss_and_grads, 1, container, str(tmp_path / "ref"))
    results = run_ranks(_loss_and_grads, 4, container, str(tmp_path / "dp4"))
    assert ref_micro == 4 and all(r[1] == 1 for r in results)  # different packing, same answer
    for loss, _, grads in results:
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert grads.keys() == ref.keys()
        for name, g in grads.items():
            torch.testing.assert_close(g, ref[name], rtol=1e-5, atol=1e-6, msg=name)


def _train(rank, world, container, run_dir, stop_after=None):
    from hcp.train.trainer import Trainer

    tr = Trainer(OmegaConf.create(container), run_dir)
    if stop_after is None:
        return tr.fit()
    for _ in range(stop_after):  # an interrupted run: its last save happened at `stop_after`
        tr.train_step()
    tr.save()
    return None


def _losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


TP2 = [f"{m}.layout.tp=2" for m in ("vision", "projector", "llm")]
PP2 = ["llm.layout.pp=2"]
FSDP_TP2 = [*TP2, "llm.layout.dp_shard=true"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout", [[], TP2, PP2, ["llm.layout.dp_shard=true"], FSDP_TP2],
                         ids=["dp2", "tp2", "pp2", "dp2_fsdp", "tp2_fsdp"])
def test_resume_auto_continues_with_the_same_losses(tmp_path, layout):
    whole = _cfg(tmp_path / "whole", ["trainer.max_steps=6", *layout])
    run_ranks(_train, 2, whole, str(tmp_path / "whole"))
    resumed = _cfg(tmp_path / "resumed", ["trainer.max_steps=6", "resume=auto", *layout])
    run_ranks(_train, 2, resumed, str(tmp_path / "resumed"), 3)
    ckpts = sorted(os.listdir(tmp_path / "resumed" / "checkpoints"))
    assert ckpts == ["step_00000003"]
    run_ranks(_train, 2, resumed, str(tmp_path / "resumed"))
    a, b = _losses(tmp_path / "whole"), _losses(tmp_path / "resumed")
    assert sorted(b) == [4, 5, 6]
    for step in (4, 5, 6):
        assert b[step] == pytest.approx(a[step], rel=1e-6)
    assert a[6] < a[1]
    with open(tmp_path / "whole" / "metrics.jsonl") as f:
        first = json.loads(f.readline())
    assert first["tflops_per_gpu"] > 0 and first["peak_memory_gib"] > 0
    assert 0 <= first["bubble_fraction"] < 1


@pytest.mark.timeout(300)
def test_resume_under_tp2_pp2_dp_shard_continues_with_the_same_losses(tmp_path):
    """8 ranks: dp2 x pp2 x tp2 with FSDP; optimizer state of both stages keyed by FQN."""
    layout = [*TP2, *PP2, "llm.layout.dp_shard=true"]
    whole = _cfg(tmp_path / "whole", ["trainer.max_steps=6", *layout])
    run_ranks(_train, 8, whole, str(tmp_path / "whole"), timeout=280)
    resumed = _cfg(tmp_path / "resumed", ["trainer.max_steps=6", "resume=auto", *layout])
    run_ranks(_train, 8, resumed, str(tmp_path / "resumed"), 3, timeout=280)
    assert sorted(os.listdir(tmp_path / "resumed" / "checkpoints")) == ["step_00000003"]
    run_ranks(_train, 8, resumed, str(tmp_path / "resumed"), timeout=280)
    a, b = _losses(tmp_path / "whole"), _losses(tmp_path / "resumed")
    assert sorted(b) == [4, 5, 6]
    for step in (4, 5, 6):
        assert b[step] == pytest.approx(a[step], rel=1e-6)


def test_checkpoints_are_pruned_to_keep(tmp_path):
    container = _cfg(tmp_path, ["trainer.max_steps=4", "trainer.save_every=1", "checkpoint.keep=2"])
    run_ranks(_train, 2, container, str(tmp_path))
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_00000003", "step_00000004"]


def test_a_half_deleted_checkpoint_never_counts_as_complete(tmp_path):
    from hcp.train import checkpoint

    for step in (1, 2):
        (tmp_path / f"step_0000000{step}").mkdir()
        (tmp_path / f"step_0000000{step}" / "trainer.json").write_text("{}")
    checkpoint._remove(str(tmp_path / "step_00000002"))
    assert checkpoint.step_dirs(str(tmp_path)) == [(1, str(tmp_path / "step_00000001"))]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]
