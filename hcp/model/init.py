"""Layout-invariant parameter initialization (docs/design.md section 3).

Every parameter is first made *whole* from `(seed, fully qualified name)` with its own
`torch.Generator`, then narrowed to this rank's shard (tensor-parallel layers mark their
parameters with a `ShardSpec`). So a dp4 run and a tp2 x cp2 run start from the same weights.

Scheme: norm weights 1, biases 0, every other tensor (linear weights, embeddings, class and
position embeddings) normal(0, `std`). The seed of a parameter is `zlib.crc32` of
`f"{seed}:{fqn}"` (stable across processes and Python versions, unlike `hash()`).
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ShardSpec:
    """How a parameter is cut from its whole tensor: `world` equal slices along `dim`; this
    rank holds slice `rank`."""

    dim: int
    rank: int
    world: int

    def whole_shape(self, shard_shape: torch.Size) -> list[int]:
        shape = list(shard_shape)
        shape[self.dim] *= self.world
        return shape

    def narrow(self, whole: torch.Tensor) -> torch.Tensor:
        """Return this rank's slice of `whole`."""
        size = whole.shape[self.dim] // self.world
        return whole.narrow(self.dim, self.rank * size, size)


def param_seed(seed: int, fqn: str) -> int:
    """Stable 32-bit seed of one parameter."""
    return zlib.crc32(f"{seed}:{fqn}".encode())


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, nn.LayerNorm) or type(module).__name__ == "RMSNorm"


@torch.no_grad()
def init_parameters(model: nn.Module, seed: int, std: float = 0.02, prefix: str = "") -> None:
    """Initialize every parameter of `model` in place from `(seed, prefix + its name)`.

    `prefix` lets a module built on its own (e.g. only `llm` on a rank) get the same weights as
    inside the full model: pass `prefix="llm."`. Parameters on the meta device are skipped.
    """
    for mod_name, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if param.is_meta:
                continue
            fqn = f"{prefix}{mod_name}.{name}" if mod_name else f"{prefix}{name}"
            spec: ShardSpec | None = getattr(param, "shard_spec", None)
            shape = spec.whole_shape(param.shape) if spec else list(param.shape)
            if name == "bias":
                whole = torch.zeros(shape)
            elif _is_norm(module):
                whole = torch.ones(shape)
            else:
                gen = torch.Generator().manual_seed(param_seed(seed, fqn))
                whole = torch.randn(shape, generator=gen) * std
            param.copy_(spec.narrow(whole) if spec else whole)
