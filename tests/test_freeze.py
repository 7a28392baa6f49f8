"""Per-module `freeze`: LLaVA's two stages are configs."""
import pytest
import torch
from omegaconf import OmegaConf

from cfg_utils import compose_cfg
from dist_utils import run_ranks


def _changed_modules(rank, world, container, run_dir):
    from hcp.train.trainer import Trainer

    tr = Trainer(OmegaConf.create(container), run_dir)
    before = {n: p.detach().clone() for n, p in tr.modules.named_parameters()}
    tr.train_step()
    changed = {n.split(".")[0] for n, p in tr.modules.named_parameters() if not torch.equal(p, before[n])}
    trainable = {n.split(".")[0] for n, p in tr.modules.named_parameters() if p.requires_grad}
    return changed, trainable


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage, expected", [("pretrain", {"projector"}), ("finetune", {"projector", "llm"})])
def test_stage_trains_only_its_modules(tmp_path, stage, expected):
    cfg = compose_cfg([f"+stage={stage}", "trainer.global_batch_size=4", "trainer.progress_bar=false"],
                      run_dir=str(tmp_path))
    (changed, trainable), = run_ranks(_changed_modules, 1, OmegaConf.to_container(cfg), str(tmp_path))
    assert changed == trainable == expected
