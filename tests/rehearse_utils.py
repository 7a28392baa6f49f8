"""Helpers of the rehearsal tests (tests/test_rehearse.py): run `mode=rehearse` in-process, and
`local_only_init`, the process-group registry as it was before the cluster-readiness fix (each
rank creating only its own groups with `use_local_synchronization=True`): a fault seed that the
rehearsal must keep catching.
"""
from __future__ import annotations

import torch.distributed as dist

from hcp.parallel.grid import KINDS, Grid
from hcp.parallel.groups import DYNAMIC_CP, ProcessGroupRegistry
from tests.cfg_utils import compose_cfg
from tests.cfg_utils import with_specs

FAST = ("rehearse.steps=1", "rehearse.jobs=2", "trainer.global_batch_size=8")
"""One step of a small global batch: what a test rehearsal needs to see every collective kind."""


def _rows(module, grid, dynamic_cp_modules):
    rows = [(kind, None, grid.groups(kind).reshape(-1, grid.groups(kind).shape[-1])) for kind in KINDS]
    if module in dynamic_cp_modules:
        rows += [(DYNAMIC_CP, s, grid.dynamic_cp_groups(s)) for s in grid.dynamic_cp_sizes()]
    return rows


def local_only_init(self, layouts, dynamic_cp_modules=()):
    self.rank = dist.get_rank()
    self.grids = {m: Grid.of(lay) for m, lay in layouts.items()}
    self._groups, created = {}, {}
    for module, grid in self.grids.items():
        if not grid.contains(self.rank):
            continue
        for kind, size, rows in _rows(module, grid, dynamic_cp_modules):
            ranks = next(tuple(int(r) for r in row) for row in rows if self.rank in row)
            if ranks not in created:
                created[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
            self._groups[module, kind, size] = (created[ranks], ranks)
    self.num_created = len(created)


def rehearse(monkeypatch, tmp_path, overrides, registry=None):
    """`mode=rehearse` of `overrides` (plus `FAST`) in this process, the ranks forked from it
    (with `registry` as `ProcessGroupRegistry.__init__` when given); returns its mismatches."""
    from hcp.config.layouts import world_size_of
    from hcp.config.validate import validate
    from hcp.data.build import prepare_data
    from hcp.preflight.rehearse import run_rehearsal

    if registry is not None:
        monkeypatch.setattr(ProcessGroupRegistry, "__init__", registry)
    cfg = compose_cfg(["mode=rehearse", "logger=none", *FAST, *overrides], run_dir=str(tmp_path))
    world = world_size_of(cfg, 4)
    validate(cfg, world)
    list(prepare_data(*with_specs(cfg)))
    return run_rehearsal(cfg, str(tmp_path), world, progress=False)
