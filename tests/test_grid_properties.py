"""Property tests of grids, islands and rank roles at up to 4,096 ranks (no process group)."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from hcp.config.layouts import resolve_layouts
from hcp.config.schema import HCPConfig
from hcp.parallel.grid import AXES, KINDS, Grid
from hcp.parallel.roles import logging_rank, role_table

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True)


@st.composite
def grids(draw):
    sizes = [draw(st.sampled_from([1, 2, 3, 4, 8, 16])) for _ in range(4)]
    while np.prod(sizes) > 4096:
        sizes[int(np.argmax(sizes))] //= 2
    return Grid(*sizes, rank_offset=draw(st.integers(0, 100)))


@SETTINGS
@given(grids(), st.data())
def test_each_rank_is_in_exactly_one_group_of_each_kind(grid, data):
    everything = np.arange(grid.rank_offset, grid.rank_offset + grid.size)
    for kind, axes in KINDS.items():
        groups = grid.groups(kind)
        assert groups.shape[1] == np.prod([getattr(grid, a) for a in axes])
        assert np.array_equal(np.sort(groups.ravel()), everything)
        rank = int(data.draw(st.sampled_from(everything)))
        row = grid.group_of(kind, rank)
        assert rank in row
        coords = [grid.coords(int(r)) for r in row]
        for axis in AXES:
            values = {c[axis] for c in coords}
            assert len(values) == (getattr(grid, axis) if axis in axes else 1)


@SETTINGS
@given(grids(), st.data())
def test_dynamic_cp_blocks_are_aligned_contiguous_pieces_of_a_pool(grid, data):
    pools = grid.groups("dp_cp")
    largest = grid.dynamic_cp_sizes()[-1]
    assert grid.cp_pool % largest == 0 and grid.cp_pool % (2 * largest) != 0
    for size in grid.dynamic_cp_sizes():
        blocks = grid.dynamic_cp_groups(size)
        assert blocks.shape == (grid.size // size, size)
        assert np.array_equal(blocks.reshape(pools.shape[0], -1, size), pools.reshape(pools.shape[0], -1, size))
        rank = int(data.draw(st.integers(grid.rank_offset, grid.rank_offset + grid.size - 1)))
        c = grid.coords(rank)
        pos = c["dp"] * grid.cp + c["cp"]
        block = blocks[grid.dynamic_cp_index(size, rank)]
        assert rank in block and block[0] == grid.rank_at(tp=c["tp"], pp=c["pp"], dp=(pos - pos % size) // grid.cp,
                                                          cp=(pos - pos % size) % grid.cp)


def test_pool_order_is_cp_fastest_then_dp():
    grid = Grid(tp=2, cp=2, dp=2, pp=1)
    assert grid.groups("dp_cp").tolist() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert grid.dynamic_cp_groups(2).tolist() == [[0, 2], [4, 6], [1, 3], [5, 7]]


def test_4096_rank_grid_is_fast():
    import time

    start = time.perf_counter()
    grid = Grid(tp=8, cp=8, dp=8, pp=8)
    for kind in KINDS:
        grid.groups(kind)
    for size in grid.dynamic_cp_sizes():
        grid.dynamic_cp_groups(size)
    assert time.perf_counter() - start < 0.5


@st.composite
def island_configs(draw):
    vision = draw(st.integers(1, 2048))
    projector = draw(st.one_of(st.none(), st.integers(1, 1024)))
    llm = draw(st.integers(1, 4096 - vision - (projector or 0)))
    dotlist = ["placement=non_colocated", f"vision.layout.num_ranks={vision}", "llm.layout.tp=1"]
    if projector is not None:
        dotlist.append(f"projector.layout.num_ranks={projector}")
    if draw(st.booleans()):  # the LLM first, by explicit offset
        dotlist.append("llm.layout.rank_offset=0")
    return OmegaConf.merge(OmegaConf.structured(HCPConfig), OmegaConf.from_dotlist(dotlist)), \
        vision + (projector or 0) + llm, projector


@settings(max_examples=25, deadline=None, derandomize=True)
@given(island_configs())
def test_islands_are_disjoint_and_cover_the_world(args):
    cfg, world, projector = args
    layouts = resolve_layouts(cfg, world)
    islands = {(lay.rank_offset, lay.num_ranks) for lay in layouts.values()}
    covered = np.zeros(world, dtype=int)
    for offset, count in islands:
        covered[offset:offset + count] += 1
    assert (covered == 1).all()
    if projector is None:
        assert layouts["projector"].ranks == layouts["vision"].ranks
    roles = role_table(layouts, world)
    for role in roles[:: max(1, world // 64)]:
        assert set(role.modules) == {m for m, lay in layouts.items() if role.rank in lay.ranks}
    assert logging_rank(layouts) == layouts["llm"].rank_offset


@SETTINGS
@given(grids())
def test_logging_rank_is_the_lowest_rank_of_the_llms_last_stage(grid):
    from hcp.config.layouts import ResolvedLayout

    lay = ResolvedLayout("llm", grid.tp, grid.cp, grid.pp, grid.dp, grid.rank_offset, grid.size,
                         (1,) * grid.pp, "allgather", False, "none", False)
    rank = logging_rank({"llm": lay})
    assert grid.coords(rank) == {"pp": grid.pp - 1, "dp": 0, "cp": 0, "tp": 0}
    last_stage = [r for r in lay.ranks if grid.coords(r)["pp"] == grid.pp - 1]
    assert rank == min(last_stage)


def test_colocated_roles_run_every_module():
    cfg = OmegaConf.merge(OmegaConf.structured(HCPConfig),
                          OmegaConf.from_dotlist(["llm.layout.tp=2", "llm.layout.pp=2"]))
    roles = role_table(resolve_layouts(cfg, 8), 8)
    assert all(role.modules == ("vision", "projector", "llm") for role in roles)
    assert [role.stage("llm") for role in roles] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert roles[5].coords["llm"] == {"pp": 1, "dp": 0, "cp": 0, "tp": 1}
    assert roles[5].coords["vision"] == {"pp": 0, "dp": 5, "cp": 0, "tp": 0}
