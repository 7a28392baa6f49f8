"""LLaVA projector from vision width to LLM width (Liu et al. 2023, LLaVA-1.5):
`mlp2x_gelu` = Linear(Dv -> H), GELU, Linear(H -> H) (`fc1`, `fc2`); `linear` = Linear(Dv -> H)
(`fc`). x: [..., Dv] -> [..., H].

Tensor parallelism over `tp_group` (None = TP size 1): `mlp2x_gelu` runs fc1 column-parallel
and fc2 row-parallel (Megatron's MLP split: one all-reduce), `linear` runs fc column-parallel
and all-gathers its output columns; either way the output is whole on every TP rank, and
parameter names and whole shapes do not depend on the TP size.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hcp.config.schema import ProjectorConfig
from hcp.model.collectives import gather_from_group
from hcp.model.tp import ColumnParallelLinear, RowParallelLinear


class Projector(nn.Module):
    def __init__(self, cfg: ProjectorConfig, in_size: int, out_size: int, tp_group=None):
        """Raises ValueError for an unknown `cfg.type` or an out_size the TP size does not split."""
        super().__init__()
        self.type, self.tp_group = cfg.type, tp_group
        if cfg.type == "mlp2x_gelu":
            self.fc1 = ColumnParallelLinear(in_size, out_size, bias=True, tp_group=tp_group)
            self.fc2 = RowParallelLinear(out_size, out_size, bias=True, tp_group=tp_group)
        elif cfg.type == "linear":
            self.fc = ColumnParallelLinear(in_size, out_size, bias=True, tp_group=tp_group)
        else:
            raise ValueError(f"projector.type={cfg.type!r} is unknown: use 'mlp2x_gelu' or 'linear'")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.type == "linear":
            return gather_from_group(self.fc(x), self.tp_group)
        return self.fc2(F.gelu(self.fc1(x)))
