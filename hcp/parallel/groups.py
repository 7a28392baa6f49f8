"""Process-group registry: every module's torch.distributed groups, created once, looked up in O(1).

NCCL-safe creation: with the default group bound to a device, every `new_group` is an
`ncclCommSplit` that every rank must call in the same order, so every rank creates every group
of the world in one order (`creation_order`: modules in graph order, the kinds of
`hcp.parallel.grid.KINDS`, then dynamic-CP block sizes 1, 2, 4, ...; a rank list met again is
shared) and keeps its own, as Megatron-LM's `initialize_model_parallel` does. The order depends
on the layouts only (tests/test_group_creation.py). A group of one rank gets no communicator but
a local stand-in of the `hcp_self` backend (torch's `FakeProcessGroup`), usable like any group.
Every group hcp creates goes through `new_group`, which gives it the world's collective timeout
(`launcher.timeout_s`): torch's `new_group` without `timeout` takes its own default (10 min for
NCCL, 30 for gloo), whatever the world was given."""
from __future__ import annotations

import datetime

import torch.distributed as dist

from hcp.parallel.grid import DYNAMIC_CP, KINDS, Grid

SELF_BACKEND = "hcp_self"
"""Backend of the stand-in group of one rank (module docstring)."""
SELF_GROUP_DESC = "hcp_self"
"""`group_desc` of a stand-in group of one rank: created by its member alone, with no world-wide
step (a rehearsal does not count it among the creations every rank must make)."""


def world_timeout() -> datetime.timedelta | None:
    """The default group's collective timeout (what `dist.init_process_group` was given), read
    from its backend's options; None where the backend keeps none (torch's fake backend)."""
    world = dist.group.WORLD
    for device in getattr(world, "_device_types", ()):
        timeout = getattr(getattr(world._get_backend(device), "options", None), "_timeout", None)
        if timeout is not None:
            return timeout
    return None


def new_group(ranks, **kwargs) -> dist.ProcessGroup:
    """`dist.new_group(ranks, **kwargs)` with the world's timeout (`world_timeout`): a
    collective stuck on a subgroup fails when one on the world would. The same calling rules
    as torch's (every rank, in one order, unless `use_local_synchronization`)."""
    return dist.new_group(list(ranks), timeout=world_timeout(), **kwargs)


def _self_backend(common_opts, backend_opts):
    from torch._C._distributed_c10d import FakeProcessGroup

    if common_opts.group_size != 1:
        raise ValueError(f"the {SELF_BACKEND} backend is for groups of one rank, not "
                         f"{common_opts.group_size}")
    return FakeProcessGroup._create_internal(common_opts.group_rank, common_opts.group_size,
                                             backend_opts)


def self_group(rank: int) -> dist.ProcessGroup:
    """The calling rank's group of one rank (`rank` = its global rank): no communicator and no
    world-wide step (only the caller runs it), every collective exact for one rank."""
    if not hasattr(dist.Backend, SELF_BACKEND.upper()):
        dist.Backend.register_backend(SELF_BACKEND, _self_backend, extended_api=True,
                                      devices=["cpu", "cuda"])
    return new_group([rank], backend=SELF_BACKEND, use_local_synchronization=True,
                     group_desc=SELF_GROUP_DESC)


def _blocks(grid: Grid, dynamic: bool):
    """(kind, size, [num_groups, group_size] rank array) of a module's groups, in creation order."""
    out = [(kind, None, grid.groups(kind)) for kind in KINDS]
    if dynamic:
        out += [(DYNAMIC_CP, s, grid.dynamic_cp_groups(s)) for s in grid.dynamic_cp_sizes()]
    return out


def creation_order(layouts: dict,
                   dynamic_cp_modules: tuple[str, ...] = ()) -> list[tuple[tuple[int, ...], str]]:
    """Every distinct rank list of >= 2 ranks among the world's groups, with a description
    (`module.kind`, the first to use it), in the one order every rank creates them. Pure."""
    seen: dict[tuple[int, ...], str] = {}
    for module, lay in layouts.items():
        for kind, size, rows in _blocks(Grid.of(lay), module in dynamic_cp_modules):
            if rows.shape[1] < 2:
                continue
            desc = f"{module}.{kind}" + (f"{size}" if size else "")
            for row in rows.tolist():
                seen.setdefault(tuple(row), desc)
    return list(seen.items())


class ProcessGroupRegistry:
    """The calling rank's groups of every module it runs.

    Args:
        layouts: module -> `ResolvedLayout` (from `hcp.config.layouts.check_layouts`), graph order.
        dynamic_cp_modules: modules whose CP pool gets dynamic-CP groups, e.g. `("llm",)` under
            `packing=dynamic_cp`.

    Must be built collectively: every rank of the world constructs the registry with the same
    layouts after `dist.init_process_group`, before any other `new_group` that not every rank
    makes (module docstring).
    """

    def __init__(self, layouts: dict, dynamic_cp_modules: tuple[str, ...] = ()):
        self.rank = dist.get_rank()
        self.grids = {m: Grid.of(lay) for m, lay in layouts.items()}
        mine: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for ranks, desc in creation_order(layouts, dynamic_cp_modules):
            group = new_group(ranks, group_desc=desc)  # every rank, members or not
            if self.rank in ranks:
                mine[ranks] = group
        self._groups: dict[tuple[str, str, int | None],
                           tuple[dist.ProcessGroup, tuple[int, ...]]] = {}
        for module, grid in self.grids.items():
            if not grid.contains(self.rank):
                continue
            for kind, size, rows in _blocks(grid, module in dynamic_cp_modules):
                row = (rows[grid.dynamic_cp_index(size, self.rank)] if kind == DYNAMIC_CP
                       else rows[grid.group_index(kind, self.rank)])
                ranks = tuple(int(r) for r in row)
                if ranks not in mine:  # one rank: the stand-in (module docstring)
                    mine[ranks] = self_group(self.rank)
                self._groups[module, kind, size] = (mine[ranks], ranks)

    def _entry(self, module: str, kind: str, size: int | None):
        try:
            return self._groups[module, kind, size]
        except KeyError:
            raise KeyError(f"rank {self.rank} has no {kind} group (size={size}) of module "
                           f"{module!r}: it runs "
                           f"{sorted({m for m, _, _ in self._groups})}") from None

    def group(self, module: str, kind: str, size: int | None = None) -> dist.ProcessGroup:
        """The calling rank's `kind` group of `module` (`size` only for `dynamic_cp`); a group of
        one rank is the stand-in of `self_group`. Raises KeyError when the rank is not in the
        module or the kind/size is unknown."""
        return self._entry(module, kind, size)[0]

    def ranks(self, module: str, kind: str, size: int | None = None) -> tuple[int, ...]:
        """Global ranks of that group, ascending (the group's rank i is ranks[i])."""
        return self._entry(module, kind, size)[1]

    def entries(self) -> list[tuple[str, str, int | None, tuple[int, ...]]]:
        """(module, kind, size, ranks) of every group of the calling rank, in a fixed order (the
        same relative order on every member, so collectives issued in this order cannot cross)."""
        return [(m, k, s, ranks) for (m, k, s), (_, ranks) in self._groups.items()]

    def runs(self, module: str) -> bool:
        """Whether the calling rank is in `module`'s grid."""
        return self.grids[module].contains(self.rank)
