"""The CP group of a micro-batch is an argument of the model (issue 28): under `packing=dynamic_cp`
the trainer resolves the plan's group of each micro-batch and passes it to `LlavaModel.forward` /
`residual_shape`; the model never reads a group off the batch. Two gloo ranks: a model built
without CP, given a CP group of both ranks per call, sums to the single-process loss; an
attribute on the batch changes nothing."""
import pytest
import torch
import torch.distributed as dist

from dist_utils import run_ranks
from test_model import make_batch
from test_tp_cp_parity import LLM, build

LENGTHS = [9, 14, 5]


def _loss_over_cp2(rank, world):
    batch = make_batch(LENGTHS, vocab=LLM.vocab_size)
    model = build()  # no CP group of its own
    pair = dist.new_group([0, 1])
    batch.cp_group = "not a process group"  # a stray attribute: the model must not read it
    loss, count = model(batch, cp_group=pair)
    rows = model.residual_shape(batch, cp_group=pair)[0]
    own = model.residual_shape(batch)[0]
    out = torch.stack([loss.detach().double(), torch.as_tensor(count).double()])
    dist.all_reduce(out)
    return out.tolist(), rows, own


@pytest.mark.timeout(120)
def test_the_model_runs_the_cp_group_it_is_given():
    batch = make_batch(LENGTHS, vocab=LLM.vocab_size)
    loss, count = build()(batch)
    results = run_ranks(_loss_over_cp2, 2, timeout=100)
    total = sum(LENGTHS)
    for (loss2, count2), rows, own in results:
        assert count2 == pytest.approx(float(count))
        assert loss2 == pytest.approx(loss.item(), rel=1e-5)
        assert own == total and rows == sum(2 * -(-n // 4) for n in LENGTHS)  # head-tail slots at c = 2
