"""Gradient clipping scales by min(1, max_norm / norm): gradients whose global norm is below
`max_norm` stay exactly as they are (never scaled up), those above are scaled to `max_norm`.
Through `hcp.train.modules.clip_`, `Trainer.clip` (colocated, one rank) and `Islands.clip`
(placement=non_colocated, an encoder island and an LLM island of one rank each)."""
import pytest
import torch
from omegaconf import OmegaConf

from cfg_utils import compose_container
from dist_utils import run_ranks
from test_hetero_parity import SMALL

from hcp.train.modules import clip_


def test_clip_keeps_gradients_below_max_norm_and_scales_those_above():
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))]
    params[0].grad, params[1].grad = torch.tensor([3.0, 0.0, 0.0]), torch.full((2, 2), 2.0)
    norm = torch.tensor(5.0)  # sqrt(9 + 4 * 4)
    clip_(params, norm, max_norm=10.0)
    assert torch.equal(params[0].grad, torch.tensor([3.0, 0.0, 0.0]))  # not scaled up to norm 10
    assert torch.equal(params[1].grad, torch.full((2, 2), 2.0))
    clip_(params, norm, max_norm=1.0)
    torch.testing.assert_close(params[0].grad, torch.tensor([0.6, 0.0, 0.0]))
    torch.testing.assert_close(params[1].grad, torch.full((2, 2), 0.4))


def _clip_twice(rank, world, container, run_dir):
    """Local gradients before clipping, after `clip(100 x norm)` and after `clip(norm / 2)`."""
    from hcp.train.trainer import Trainer

    tr = Trainer(OmegaConf.create(container), run_dir)
    tr.forward_backward(tr.sampler.batch(0))
    params = [p for p in tr.modules.parameters() if p.grad is not None]

    def local():
        return [p.grad.detach().clone() for p in params]

    before = local()
    norm = float(tr.clip(1e6))  # far above any norm here
    loose = local()
    tr.clip(norm / 2)
    return dict(norm=norm, before=before, loose=loose, tight=local())


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world, layout", [(1, []), (2, ["placement=non_colocated",
                                                           "vision.layout.tp=1",
                                                           "vision.layout.num_ranks=1"])],
                         ids=["trainer_clip", "islands_clip"])
def test_the_trainers_clip_never_scales_gradients_up(world, layout, tmp_path):
    overrides = [*SMALL, *layout, "launcher.nproc_per_node=2", "trainer.global_batch_size=2",
                 "trainer.eval_samples=2"]
    container = compose_container(overrides, tmp_path)
    for r in run_ranks(_clip_twice, world, container, str(tmp_path), timeout=220):
        assert 0 < r["norm"] < 1e6 and r["before"]
        for before, loose, tight in zip(r["before"], r["loose"], r["tight"]):
            assert torch.equal(loose, before)  # below max_norm: untouched
            torch.testing.assert_close(tight, before * (r["norm"] / 2) / (r["norm"] + 1e-6))
