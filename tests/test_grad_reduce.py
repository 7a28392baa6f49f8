"""The bucketed gradient sum (`hcp.train.grad_reduce`, issue 10): every rank issues the same
all-reduces in the same order whatever its data, although backward makes gradients ready in a
different order on each (NCCL runs collectives in issue order; a different order is a hang or
silently swapped sums), and the sums equal the sum of every rank's own gradients."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from dist_utils import run_ranks
from hcp.train.grad_reduce import GradReducer, bucket_params


def test_buckets_are_the_parameters_in_reverse_order_within_the_caps_and_one_dtype_each():
    p = [torch.zeros(n, dtype=d) for n, d in
         [(4, torch.float32), (2, torch.float32), (2, torch.float32), (8, torch.float64),
          (1, torch.float32), (30, torch.float32)]]
    buckets = bucket_params(p, first_bytes=8, bytes_each=24)
    # the first bucket holds at most 8 bytes (a larger tensor alone), the others 24, one dtype each
    assert [[next(i for i, r in enumerate(p) if r is q) for q in b] for b in buckets] == \
        [[5], [4], [3], [2, 1], [0]]


def _record_all_reduces(log: list, phase: list) -> None:
    """Log (elements, phase) of every all_reduce this process issues."""
    import torch.distributed as dist

    real = dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        log.append((tensor.numel(), phase[0]))
        return real(tensor, *args, **kwargs)
    dist.all_reduce = all_reduce


class Branches(nn.Module):
    """Three parameters of 3, 5 and 7 elements; a micro-batch uses some of them."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (nn.Parameter(torch.arange(n, dtype=torch.float32) / n)
                                  for n in (3, 5, 7))

    def forward(self, uses: str, x: float):
        return sum((getattr(self, name) ** 2).sum() * x for name in uses)


# per rank, its micro-batches (parameters used, input): on the last micro-batch backward makes
# a then c ready on rank 0 (b only at the end, as zeros) but c then b on rank 1 (a accumulated
# in its first micro-batch): an all-reduce launched per bucket as soon as it is complete would
# issue c, a, b on rank 0 and c, b, a on rank 1
DATA = [[("c", 1.0), ("ac", 2.0)], [("a", 3.0), ("bc", 4.0)]]


def _reduce(rank, world):
    import torch.distributed as dist

    model = Branches()
    reducer = GradReducer(model.parameters(), dist.group.WORLD, first_bytes=1, bytes_each=1)
    log, phase = [], ["backward"]
    _record_all_reduces(log, phase)
    for step in range(2):  # the hooks stay on: a second step issues the same again
        for i, (uses, x) in enumerate(DATA[rank]):
            reducer.sync_in_backward(i == len(DATA[rank]) - 1)
            model(uses, x).backward()
        phase[0] = "finish"
        reducer.finish()
        phase[0] = "backward"
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
    return log, grads


@pytest.mark.timeout(60)
def test_ranks_with_different_data_issue_the_same_all_reduces_in_the_same_order():
    logs = run_ranks(_reduce, 2, timeout=50)
    (log0, grads), (log1, grads1) = logs
    assert [n for n, _ in log0] == [n for n, _ in log1] == [7, 5, 3] * 2  # buckets c, b, a
    # the hooks did fire in different orders: rank 1 launched b during backward, rank 0 could
    # not (its b got no gradient), so rank 0's a, ready early, waited for b
    assert [ph for _, ph in log0[:3]] == ["backward", "finish", "finish"]
    assert [ph for _, ph in log1[:3]] == ["backward", "backward", "finish"]
    p = Branches()
    want = {"a": 2 * p.a * (2.0 + 3.0), "b": 2 * p.b * 4.0, "c": 2 * p.c * (1.0 + 2.0 + 4.0)}
    for g in (grads, grads1):
        for name, value in want.items():
            torch.testing.assert_close(g[name], value.detach(), rtol=1e-6, atol=0)


def _step_collectives(rank, world, lanes):
    """Every all_reduce of one `StepRunner` step (small buckets) and the gradients."""
    import torch.distributed as dist
    from test_pipeline_parity import build, layout

    from hcp.parallel.groups import ProcessGroupRegistry
    from hcp.train.step import StepRunner

    from test_tp_cp_parity import LLM

    groups = ProcessGroupRegistry({"llm": layout(dp=2)})
    model = build(LLM)
    runner = StepRunner(model, groups, torch.device("cpu"))
    runner.reducer = GradReducer(model.parameters(), runner.grad_group, 1, 4096)
    log = []
    _record_all_reduces(log, ["step"])
    loss = runner.forward_backward(lanes[rank])[0]
    assert len(runner.reducer.buckets) > 10 and dist.get_world_size() == 2
    return log, loss, {n: None if p.grad is None else p.grad for n, p in model.named_parameters()}


@pytest.mark.timeout(90)
def test_a_text_only_lane_beside_an_image_lane_issues_the_same_collectives():
    """The image lane's encoder and projector get gradients, the text-only lane's none (they
    join with zeros). Same all-reduces on both ranks, and
    the gradients of one process."""
    from test_pipeline_parity import TEXT_ONLY, reference
    from test_tp_cp_parity import LLM, TOL

    lanes = TEXT_ONLY[0]
    (log0, loss, grads), (log1, _, _) = run_ranks(_step_collectives, 2, lanes, timeout=80)
    assert log0 == log1 and len(log0) > 10
    ref_loss, ref_grads, _ = reference(LLM, [lanes])[0]
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, **TOL, msg=lambda m, name=name: f"{name}: {m}")
