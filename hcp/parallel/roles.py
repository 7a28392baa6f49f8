"""Rank roles: which modules and pipeline stages each rank runs, and which rank logs.

Pure functions of the resolved layouts (`hcp.config.layouts.resolve_layouts`): no process group.
Under `colocated` placement every rank runs every module; under `non_colocated` a rank runs the
modules of its island.
"""
from __future__ import annotations

from dataclasses import dataclass

from hcp.parallel.grid import Grid


@dataclass(frozen=True)
class RankRole:
    """One rank's part in the run."""

    rank: int
    coords: dict[str, dict[str, int]]
    """module -> {tp, cp, dp, pp} of this rank in that module's grid (only modules it runs)."""

    @property
    def modules(self) -> tuple[str, ...]:
        """Modules this rank runs, in graph order."""
        return tuple(self.coords)

    def stage(self, module: str) -> int:
        """This rank's pipeline stage of `module`. Raises KeyError when it does not run it."""
        return self.coords[module]["pp"]


def role_of(layouts: dict, rank: int) -> RankRole:
    """The role of one rank (ranks outside every grid get no modules)."""
    coords = {}
    for module, layout in layouts.items():
        grid = Grid.of(layout)
        if grid.contains(rank):
            coords[module] = grid.coords(rank)
    return RankRole(rank, coords)


def role_table(layouts: dict, world_size: int) -> list[RankRole]:
    """Roles of ranks 0..world_size-1, by rank."""
    return [role_of(layouts, r) for r in range(world_size)]


def logging_rank(layouts: dict) -> int:
    """The rank that logs and writes run outputs: the lowest rank on the LLM's last PP stage."""
    grid = Grid.of(layouts["llm"])
    return int(grid.ranks[grid.pp - 1].min())
