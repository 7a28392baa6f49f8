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


def _ops_on_a_mesh_of_ranks_0_1(rank=0, world_size=2):
    """Shard(0) DTensors of 8 rows per rank on a CPU mesh over ranks 0, 1 (this rank's pair of a
    world of 4, or the whole fake world of 2), the ops FSDP's gradients go through, gathered."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    pairs = [dist.new_group(r) for r in ([0, 1], [2, 3])] if world_size == 4 else [None]
    group = pairs[rank // 2] if world_size == 4 else dist.group.WORLD
    mesh = DeviceMesh.from_group(group, device_type="cpu")
    x = DTensor.from_local(torch.ones(8), mesh, [Shard(0)], run_check=False)
    return tuple((x.detach() + x).full_tensor().shape)


def test_a_forked_rank_ignores_the_test_process_dtensor_caches():
    """DTensor's sharding caches compare meshes by ranks, not groups: a fake world's mesh over
    ranks 0, 1 used in this process must not lend its group (the fake world, '0', which is the
    forked world of 4) to the ranks' mesh over their pair 0, 1 (16 rows gathered, not 32)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        _ops_on_a_mesh_of_ranks_0_1()
    finally:
        dist.destroy_process_group()
    assert run_ranks(_ops_on_a_mesh_of_ranks_0_1, 4, timeout=60) == [(16,)] * 4
