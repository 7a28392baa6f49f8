"""The paths a GPU takes where a CPU test sees no difference (issue 39 section 3): checked by
their mechanism, on torch's fake process group where a collective is involved."""
from __future__ import annotations

import torch
import torch.distributed as dist

from hcp.preflight.rehearse.record import Recorder


def _fake_world(rank: int = 0, world: int = 2) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())


def test_sequence_reduce_scatter_posts_one_flat_tensor():
    """`reduce_scatter_rows` (sequence parallelism's backward, CP attention's dK/dV) off gloo
    issues the tensor form (one flat [n * S, H] input: `_reduce_scatter_base_`), not the list
    form (`reduce_scatter_`, n parts: a copy into NCCL's flat buffer per call)."""
    from hcp.model.collectives import reduce_scatter_rows

    _fake_world()
    rec = Recorder()
    try:
        with rec:
            out = reduce_scatter_rows(torch.randn(6, 4), dist.group.WORLD)
    finally:
        dist.destroy_process_group()
    assert out.shape == (3, 4)
    assert [(op.op, op.shapes) for op in rec.ops] == [("_reduce_scatter_base_", ((3, 4), (6, 4)))]
