import pytest
import torch
import torch.distributed as dist

from dist_utils import run_ranks


def _sum_ranks(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def _fail_on_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom")
    return rank


def test_all_reduce_of_rank_ids_equals_expected_sum():
    assert run_ranks(_sum_ranks, 4) == [6.0] * 4


def test_child_failure_is_reraised_with_rank():
    with pytest.raises(RuntimeError, match=r"rank 1 failed(.|\n)*boom"):
        run_ranks(_fail_on_one, 2, timeout=30)
