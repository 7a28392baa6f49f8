"""LLaVA projector from vision width to LLM width (Liu et al. 2023, LLaVA-1.5):
`mlp2x_gelu` = Linear(Dv -> H), GELU, Linear(H -> H) (`fc1`, `fc2`); `linear` = Linear(Dv -> H)
(`fc`). x: [..., Dv] -> [..., H]. With `pool` > 1 the input is an encoder's patch features
[I, P, Dv] on a square sqrt(P) x sqrt(P) grid, averaged over pool x pool windows first (row-major
windows, like the patches): [I, P / pool^2, H] (a pooled summary stream; SlowFast-LLaVA and
LLaVA-OneVision pool patch tokens this way).

Tensor parallelism over `tp_group` (None = TP size 1): `mlp2x_gelu` runs fc1 column-parallel
and fc2 row-parallel (Megatron's MLP split: one all-reduce), `linear` runs fc column-parallel
and all-gathers its output columns; either way the output is whole on every TP rank, and
parameter names and whole shapes do not depend on the TP size.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hcp.config.specs import ProjectorArch
from hcp.model.collectives import gather_from_group
from hcp.model.tp import ColumnParallelLinear, RowParallelLinear


class Projector(nn.Module):
    def __init__(self, cfg: ProjectorArch, in_size: int, out_size: int, tp_group=None):
        """Raises ValueError for an unknown `cfg.type` or an out_size the TP size does not split."""
        super().__init__()
        self.type, self.tp_group = cfg.type, tp_group
        self.pool = int(getattr(cfg, "pool", 1))
        if cfg.type == "mlp2x_gelu":
            self.fc1 = ColumnParallelLinear(in_size, out_size, bias=True, tp_group=tp_group)
            self.fc2 = RowParallelLinear(out_size, out_size, bias=True, tp_group=tp_group)
        elif cfg.type == "linear":
            self.fc = ColumnParallelLinear(in_size, out_size, bias=True, tp_group=tp_group)
        else:
            raise ValueError(f"projector.type={cfg.type!r} is unknown: use 'mlp2x_gelu' or "
                             f"'linear'")

    def _pooled(self, x: torch.Tensor) -> torch.Tensor:
        """[I, P, D] -> [I, P / pool^2, D]: mean over pool x pool windows of the patch grid.
        Raises ValueError when P is not a square whose side `pool` divides."""
        i, p, d = x.shape
        side = int(round(p ** 0.5))
        if side * side != p or side % self.pool:
            raise ValueError(f"projector pool={self.pool} needs a square patch grid whose side it "
                             f"divides; got {p} patches")
        grid = x.transpose(1, 2).reshape(i, d, side, side)
        return F.avg_pool2d(grid, self.pool).flatten(2).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pool > 1:
            x = self._pooled(x)
        if self.type == "linear":
            return gather_from_group(self.fc(x), self.tp_group)
        return self.fc2(F.gelu(self.fc1(x)))
