"""Layout-invariant parameter initialization (docs/design.md section 3), of this rank's shards only.

Every parameter's values are those of its whole tensor drawn from `(seed, fully qualified name)`
with its own `torch.Generator` (seed `zlib.crc32(f"{seed}:{fqn}")`), cut to this rank's TP slice
(`ShardSpec`) and FSDP chunk, so a dp4 run and a tp2 x cp2 run start from the same weights. The
whole tensor is never made: it is drawn in blocks of rows (`_normal_rows`), sized in multiples of
16 elements so the values equal `torch.randn(whole)`'s (tests/test_init_shards.py); a meta-device
model (`materialize`) holds only its shards. Scheme: norm weights 1, biases 0, everything else
normal(0, `std`)."""
from __future__ import annotations

import contextlib
import math
import zlib
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

_BLOCK = 1 << 22
"""Elements drawn at once (16 MiB in fp32): the host memory init needs besides the shards."""


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


def local_box(param: torch.Tensor) -> tuple[torch.Tensor, list[int], list[int]]:
    """(this rank's tensor of `param`, the whole tensor's shape, the offset of that tensor in
    the whole one per dim): the TP slice of the `shard_spec`, then FSDP's dim-0 chunk of it
    when `param` is a `DTensor`."""
    spec: ShardSpec | None = getattr(param, "shard_spec", None)
    tp_shape = list(param.shape)  # a DTensor's shape is the whole TP slice it shards
    whole = spec.whole_shape(tp_shape) if spec else tp_shape
    offset = [0] * len(whole)
    if spec:
        offset[spec.dim] = spec.rank * tp_shape[spec.dim]
    local = param
    if isinstance(param, DTensor):
        local = param.to_local()
        _, chunk = compute_local_shape_and_global_offset(param.shape, param.device_mesh,
                                                         param.placements)
        offset = [o + c for o, c in zip(offset, chunk)]
    return local, whole, offset


@torch.no_grad()
def _normal_rows(out: torch.Tensor, whole: list[int], offset: list[int], generator,
                 std: float) -> None:
    """Fill `out` with its box (at `offset`) of `torch.randn(whole, generator) * std`, drawing
    the whole tensor's rows in blocks up to the box's last row (module docstring)."""
    rows = whole[0] if whole else 1
    row = math.prod(whole[1:])
    if out.numel() == 0:  # an FSDP rank past the last row: nothing of this tensor
        return
    if rows * row <= _BLOCK:
        block = torch.randn(whole, generator=generator) * std
        out.copy_(block[tuple(slice(o, o + n) for o, n in zip(offset, out.shape))])
        return
    align = 16 // math.gcd(row, 16)  # rows per 16-element group boundary
    step = max(align, _BLOCK // row // align * align)
    stop = offset[0] + out.shape[0]
    inner = tuple(slice(o, o + n) for o, n in zip(offset[1:], out.shape[1:]))
    start = 0
    while start < stop:
        end = min(start + step, rows)
        if 0 < (rows - end) * row < 16:  # a last block under 16 elements: draw it with this one
            end = rows
        block = torch.randn([end - start, *whole[1:]], generator=generator)
        lo, hi = max(start, offset[0]), min(end, stop)
        if lo < hi:
            out[lo - offset[0]:hi
                - offset[0]].copy_(block[(slice(lo - start, hi - start), *inner)] * std)
        start = end


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, nn.LayerNorm) or type(module).__name__ == "RMSNorm"


@torch.no_grad()
def init_parameters(model: nn.Module, seed: int, std: float = 0.02, prefix: str = "",
                    skip: frozenset | set = frozenset()) -> None:
    """Initialize this rank's shard of every parameter of `model` in place from
    `(seed, prefix + its name)` (module docstring).

    `prefix` lets a module built on its own (e.g. only `llm` on a rank) get the same weights as
    inside the full model: pass `prefix="llm."`. Parameters on the meta device are skipped, and
    those whose `id` is in `skip` (weights about to be loaded).
    """
    for mod_name, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if param.is_meta or id(param) in skip:
                continue
            fqn = f"{prefix}{mod_name}.{name}" if mod_name else f"{prefix}{name}"
            local, whole, offset = local_box(param)
            if name == "bias":
                local.zero_()
            elif _is_norm(module):
                local.fill_(1.0)
            else:
                _normal_rows(local, whole, offset,
                             torch.Generator().manual_seed(param_seed(seed, fqn)), std)


@contextlib.contextmanager
def meta_build():
    """Build modules on the meta device (no storage), also under a `FakeTensorMode` (the
    rehearsal, `hcp.preflight.rehearse`): their parameters stay plain meta tensors, which
    `materialize` can replace (torch cannot swap a fake parameter out of a module)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), torch.device("meta"):
        yield


def materialize(model: nn.Module, device, seed: int, std: float = 0.02, skip=()) -> nn.Module:
    """`model` built on the meta device (and possibly FSDP-sharded there) -> its storage on
    `device`, each parameter's shard initialized by `init_parameters`; returns `model`. Only
    this rank's shards are ever allocated, on `device` (host memory: one drawing block).
    `skip`: submodules whose weights will be loaded (`hcp.model.hf_load.loaded_modules`):
    allocated, never drawn.

    Raises ValueError when `model` has buffers (their values would be lost by the meta build).
    """
    buffers = [n for n, _ in model.named_buffers()]
    if buffers:
        raise ValueError(f"materialize: {type(model).__name__} has buffers {buffers[:3]}, which a "
                         "meta-device build leaves empty: compute them in forward instead")
    specs = {n: p.shard_spec for n, p in model.named_parameters() if getattr(p, "shard_spec", None)}
    model.to_empty(device=device)  # new Parameter objects: the TP marks are put back
    for n, p in model.named_parameters():
        if n in specs:
            p.shard_spec = specs[n]
    loaded = {id(p) for module in skip for p in module.parameters()}
    init_parameters(model, seed, std, skip=loaded)
    return model
