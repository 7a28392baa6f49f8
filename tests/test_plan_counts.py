"""The step takes its global counts (loss tokens, tokens, sum of squared lengths, image rows)
from the step plan, with no collective, also under PP and FSDP; `trainer.check_counts=true`
counts them with the collective instead and checks the plan against them."""
import pytest
from omegaconf import OmegaConf

from cfg_utils import compose_cfg
from dist_utils import run_ranks
from test_hetero_parity import SMALL


def _two_ways(rank, world, container):
    from hcp.train.step import StepRunner
    from hcp.train.trainer import Trainer

    tr = Trainer(OmegaConf.create(container), "/tmp/unused")
    counted = []
    original = StepRunner._counts

    def refuse(self, batches):
        raise AssertionError("the step counted with a collective although the plan has the counts")

    def count(self, batches):
        counted.append(rank)
        return original(self, batches)

    batch = tr.sampler.batch(0)
    StepRunner._counts = refuse
    planned = tr.forward_backward(batch)
    tr.settings.check_counts = True
    StepRunner._counts = count
    checked = tr.forward_backward(batch)
    return planned, checked, counted


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_counts_come_from_the_plan_under_pp_and_fsdp_and_check_counts_counts_them_again(tmp_path):
    overrides = [*SMALL, "llm.layout.pp=2", "llm.layout.dp_shard=true", "vision.layout.tp=1"]
    container = OmegaConf.to_container(compose_cfg(overrides, run_dir=str(tmp_path)), resolve=True)
    results = run_ranks(_two_ways, 4, container, timeout=110)
    for (loss, counts, n_micro), (loss2, counts2, n_micro2), counted in results:
        assert counts == counts2 and counts[0] > 0 and n_micro == n_micro2
        assert float(loss) == pytest.approx(float(loss2), rel=1e-12)
        assert counted == [counted[0]]  # once, under trainer.check_counts only
