"""LLaVA projector from vision width to LLM width (Liu et al. 2023, LLaVA-1.5):
`mlp2x_gelu` = Linear(Dv -> H), GELU, Linear(H -> H) (`fc1`, `fc2`); `linear` = Linear(Dv -> H)
(`fc`). x: [..., Dv] -> [..., H]."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hcp.config.schema import ProjectorConfig


class Projector(nn.Module):
    def __init__(self, cfg: ProjectorConfig, in_size: int, out_size: int):
        """Raises ValueError for an unknown `cfg.type`."""
        super().__init__()
        self.type = cfg.type
        if cfg.type == "mlp2x_gelu":
            self.fc1 = nn.Linear(in_size, out_size)
            self.fc2 = nn.Linear(out_size, out_size)
        elif cfg.type == "linear":
            self.fc = nn.Linear(in_size, out_size)
        else:
            raise ValueError(f"projector.type={cfg.type!r} is unknown: use 'mlp2x_gelu' or 'linear'")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.type == "linear":
            return self.fc(x)
        return self.fc2(F.gelu(self.fc1(x)))
