"""8 gloo ranks build the process-group registry; an all-reduce of rank ids inside every group
equals the sum of the group's ranks (hcp.parallel.groups). A group of one rank is the `hcp_self`
stand-in: no communicator, and every collective the code uses (FSDP's too) is exact."""
import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from dist_utils import run_ranks
from hcp.config.layouts import resolve_layouts
from hcp.config.schema import HCPConfig
from hcp.parallel.grid import KINDS, Grid
from hcp.parallel.groups import DYNAMIC_CP, ProcessGroupRegistry

pytestmark = pytest.mark.timeout(120)


def layouts_of(*dotlist, world=8):
    cfg = OmegaConf.merge(OmegaConf.structured(HCPConfig), OmegaConf.from_dotlist(list(dotlist)))
    return resolve_layouts(cfg, world)


def _reduce_every_group(rank, world_size, layouts, dynamic):
    registry = ProcessGroupRegistry(layouts, dynamic)
    out = []
    for module, kind, size, ranks in registry.entries():
        x = torch.tensor([float(rank)])
        dist.all_reduce(x, group=registry.group(module, kind, size))
        out.append((module, kind, size, ranks, x.item()))
    return out


def check(layouts, dynamic=()):
    results = run_ranks(_reduce_every_group, 8, layouts, dynamic, timeout=90)
    for rank, entries in enumerate(results):
        expected = set()
        for module, layout in layouts.items():
            grid = Grid.of(layout)
            if grid.contains(rank):
                expected |= {(module, kind, None) for kind in KINDS}
                if module in dynamic:
                    expected |= {(module, DYNAMIC_CP, s) for s in grid.dynamic_cp_sizes()}
        assert {(m, k, s) for m, k, s, _, _ in entries} == expected
        for module, kind, size, ranks, total in entries:
            grid = Grid.of(layouts[module])
            row = (grid.dynamic_cp_groups(size)[grid.dynamic_cp_index(size, rank)] if kind == DYNAMIC_CP
                   else grid.group_of(kind, rank))
            assert ranks == tuple(row.tolist()) and rank in ranks
            assert total == sum(ranks), (rank, module, kind, size)
    return results


def test_colocated_groups_reduce_rank_ids():
    layouts = layouts_of("llm.layout.tp=2", "llm.layout.cp=2", "llm.layout.pp=2")
    results = check(layouts)
    assert all(len(entries) == 3 * len(KINDS) for entries in results)


def test_non_colocated_groups_reduce_rank_ids():
    layouts = layouts_of("placement=non_colocated", "vision.layout.num_ranks=4", "llm.layout.tp=2",
                         "llm.layout.cp=2")
    results = check(layouts, dynamic=("llm",))
    assert {m for m, *_ in results[0]} == {"vision", "projector"}
    assert {m for m, *_ in results[7]} == {"llm"}


def test_dynamic_cp_groups_reduce_rank_ids():
    layouts = layouts_of("vision=null", "projector=null", "graph.edges=[]", "llm.layout.cp=2",
                         "llm.layout.pp=2")
    results = check(layouts, dynamic=("llm",))
    blocks = {(s, ranks) for m, k, s, ranks, _ in results[0] + results[3] if k == DYNAMIC_CP}
    assert blocks == {(1, (0,)), (2, (0, 1)), (4, (0, 1, 2, 3)), (1, (3,)), (2, (2, 3))}


def _one_rank_groups(rank, world_size):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    registry = ProcessGroupRegistry(layouts_of("vision=null", "projector=null", "graph.edges=[]",
                                               "llm.layout.tp=2", world=2))
    g = registry.group("llm", "dp")  # dp = 1 at tp 2 on 2 ranks
    x = torch.arange(6.0) + rank
    checks = {"backend": dist.get_backend(g), "size": dist.get_world_size(g), "rank": dist.get_rank(g)}
    y = x.clone()
    dist.all_reduce(y, group=g)
    checks["all_reduce"] = torch.equal(y, x)
    out = torch.zeros(6)
    dist.all_gather_into_tensor(out, x, group=g)
    checks["all_gather"] = torch.equal(out, x)
    out = torch.zeros(6)
    dist.reduce_scatter_tensor(out, x, group=g)
    checks["reduce_scatter"] = torch.equal(out, x)
    out = torch.zeros(6)
    dist.all_to_all_single(out, x, [6], [6], group=g)
    checks["all_to_all"] = torch.equal(out, x)
    y = x.clone()
    dist.broadcast(y, rank, group=g)
    checks["broadcast"] = torch.equal(y, x)
    torch.manual_seed(0)
    net, ref = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    ref.load_state_dict(net.state_dict())
    fully_shard(net, mesh=DeviceMesh.from_group(g, device_type="cpu"))
    inp = torch.randn(5, 4)
    net(inp).sum().backward()
    ref(inp).sum().backward()
    checks["fsdp"] = all(torch.equal(a.grad.full_tensor(), b.grad) for a, b in zip(net.parameters(), ref.parameters()))
    dist.all_reduce(torch.ones(1), group=registry.group("llm", "tp"))  # the real group still works
    return checks


def test_a_group_of_one_rank_is_a_stand_in_with_exact_collectives():
    for checks in run_ranks(_one_rank_groups, 2, timeout=90):
        assert checks.pop("backend") == "hcp_self"  # no communicator
        assert (checks.pop("size"), checks.pop("rank")) == (1, 0)
        assert all(checks.values()), checks
