"""Process-group registry: every module's torch.distributed groups, created once, looked up in O(1).

Creation order is the same on every rank: modules in graph order, then the kinds of
`hcp.parallel.grid.KINDS`, then (for modules with dynamic CP) the block sizes 1, 2, 4, ... of
their CP pool. Each rank computes only the groups it belongs to (one per module, kind and size)
and creates them with `use_local_synchronization=True`: only the members call `new_group` and
the barrier at the end is local to them, so at thousands of ranks no rank walks every group of
the world and there is no world-wide barrier per group. This cannot deadlock: at every step of
the common order, the members of one group all stand at that step. Groups are named by a hash of
their ranks, so the same rank list is created once and shared (e.g. `mp` equals `tp` when pp=1, and
colocated modules with the same grid share every group).
Checked on gloo at 8 ranks (tests/test_groups_gloo.py).
"""
from __future__ import annotations

import torch.distributed as dist

from hcp.parallel.grid import KINDS, Grid

DYNAMIC_CP = "dynamic_cp"
"""Kind of the dynamic-CP block groups; looked up with a `size`."""


class ProcessGroupRegistry:
    """The calling rank's groups of every module it runs.

    Args:
        layouts: module -> `ResolvedLayout` (from `hcp.config.layouts.check_layouts`), graph order.
        dynamic_cp_modules: modules whose CP pool gets dynamic-CP groups, e.g. `("llm",)` under
            `packing=dynamic_cp`.

    Must be built collectively: every rank constructs the registry with the same layouts after
    `dist.init_process_group`.
    """

    def __init__(self, layouts: dict, dynamic_cp_modules: tuple[str, ...] = ()):
        self.rank = dist.get_rank()
        self.grids = {m: Grid.of(lay) for m, lay in layouts.items()}
        self._groups: dict[tuple[str, str, int | None], tuple[dist.ProcessGroup, tuple[int, ...]]] = {}
        created: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for module, grid in self.grids.items():
            if not grid.contains(self.rank):
                continue
            wanted = [(kind, None, grid.group_of(kind, self.rank)) for kind in KINDS]
            if module in dynamic_cp_modules:
                wanted += [(DYNAMIC_CP, s, grid.dynamic_cp_groups(s)[grid.dynamic_cp_index(s, self.rank)])
                           for s in grid.dynamic_cp_sizes()]
            for kind, size, row in wanted:
                ranks = tuple(int(r) for r in row)
                if ranks not in created:
                    created[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
                self._groups[module, kind, size] = (created[ranks], ranks)
        self.num_created = len(created)
        """Distinct groups this rank created (each shared rank list counted once)."""

    def _entry(self, module: str, kind: str, size: int | None):
        try:
            return self._groups[module, kind, size]
        except KeyError:
            raise KeyError(f"rank {self.rank} has no {kind} group (size={size}) of module {module!r}: "
                           f"it runs {sorted({m for m, _, _ in self._groups})}") from None

    def group(self, module: str, kind: str, size: int | None = None) -> dist.ProcessGroup:
        """The calling rank's `kind` group of `module` (`size` only for `dynamic_cp`).
        Raises KeyError when the rank is not in the module or the kind/size is unknown."""
        return self._entry(module, kind, size)[0]

    def ranks(self, module: str, kind: str, size: int | None = None) -> tuple[int, ...]:
        """Global ranks of that group, ascending (the group's rank i is ranks[i])."""
        return self._entry(module, kind, size)[1]

    def entries(self) -> list[tuple[str, str, int | None, tuple[int, ...]]]:
        """(module, kind, size, ranks) of every group of the calling rank, in creation order (the
        same relative order on every member, so collectives issued in this order cannot cross)."""
        return [(m, k, s, ranks) for (m, k, s), (_, ranks) in self._groups.items()]

    def runs(self, module: str) -> bool:
        """Whether the calling rank is in `module`'s grid."""
        return self.grids[module].contains(self.rank)
