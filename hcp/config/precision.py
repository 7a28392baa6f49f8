"""The run's precision policy (`precision`): the one place that says which dtype each kind of
tensor has, used by both placements' schedules, the routes and P2P links, the attention
backend's resolution and plan mode's memory estimate (`hcp.preflight.memory`).

- compute dtype: matrix multiplies and attention run in it (autocast), and every activation
  that crosses a module or stage boundary travels in it, forward and backward (colocated
  routes, island routes, pipeline P2P links). The attention backend is resolved from it once,
  at build time (`hcp.model.backends.resolve_backend`).
- parameter dtype (fp32 always): parameters, their gradients and the gradient reduction, the
  optimizer state, and the residual stream (the embeddings, norms and residual adds run outside
  autocast's cast list, so the stream stays fp32 between the bf16 matrix multiplies; a stage
  widens a received activation back to it, so PP > 1 keeps the precision of PP = 1).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from hcp.config.errors import check_choice

PRECISIONS = ("fp32", "bf16")
"""`precision` values."""
_COMPUTE = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Precision:
    """One run's precision policy (module docstring); build it with
    `Precision.of(cfg.precision)`."""

    name: str
    compute: torch.dtype
    params: torch.dtype = torch.float32

    @classmethod
    def of(cls, precision: "str | Precision") -> "Precision":
        """The policy of a `precision` value (a policy is returned as is).
        Raises ConfigError for an unknown name."""
        if isinstance(precision, Precision):
            return precision
        check_choice("precision", precision, PRECISIONS)
        return cls(precision, _COMPUTE[precision])

    @property
    def mixed(self) -> bool:
        """Whether compute runs in a narrower dtype than the parameters (autocast on)."""
        return self.compute != self.params

    def autocast(self, device_type: str):
        """Context manager of the compute: autocast to the compute dtype, or nothing (fp32)."""
        if self.mixed:
            return torch.autocast(device_type, dtype=self.compute)
        return contextlib.nullcontext()

    def stage_forward(self, device_type: str, fn, received=None, out_to_wire: bool = True):
        """`fn(x)` as every stage and encoder computes: `x` the received activation widened
        (`from_wire`; None when nothing was received), `fn` under `autocast`, its output
        narrowed to the compute dtype (`to_wire`) when it leaves over a link or route."""
        with self.autocast(device_type):
            out = fn(None if received is None else self.from_wire(received))
        return self.to_wire(out) if out_to_wire else out

    def to_wire(self, x: torch.Tensor) -> torch.Tensor:
        """An activation leaving a module or stage: in the compute dtype (differentiable, so
        its gradient comes back in the compute dtype too)."""
        return x.to(self.compute)

    def from_wire(self, x: torch.Tensor) -> torch.Tensor:
        """A received residual stream: widened back to the parameter dtype."""
        return x.to(self.params)

    @property
    def act_bytes(self) -> int:
        """Bytes per stored activation element computed under autocast (matrix-multiply
        inputs and outputs, attention)."""
        return self.compute.itemsize

    @property
    def residual_bytes(self) -> int:
        """Bytes per element of the residual stream (norm inputs, a recomputed layer's input)."""
        return self.params.itemsize

    @property
    def fsdp_param_bytes(self) -> int:
        """Bytes per element of a `dp_shard` layer's all-gathered parameters: FSDP gathers them
        in the compute dtype (`fsdp_policy`)."""
        return self.compute.itemsize

    @property
    def fsdp_reduce_bytes(self) -> int:
        """Bytes per element of FSDP's gradient reduction and accumulation (the parameter dtype)."""
        return self.params.itemsize

    def fsdp_policy(self, root: bool):
        """torch's `MixedPrecisionPolicy` of an FSDP unit (`hcp.train.fsdp`): a layer gathers
        its parameters in the compute dtype (no per-op autocast copy of each weight) and
        reduce-scatters in the parameter dtype; the root (embeddings, final norm, output layer)
        keeps the parameter dtype, so the residual stream keeps it too. Inputs are not cast
        (the stream enters each layer in the parameter dtype, as without FSDP). Under `fp32`
        nothing changes."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=self.params if root else self.compute,
                                    reduce_dtype=self.params, cast_forward_inputs=False)

    @property
    def state_bytes(self) -> dict[str, int]:
        """Bytes per trained parameter, all in the parameter dtype: `weights`, `grads` and
        `optimizer` (Adam's two moments): 4 + 4 + 8 = 16 B under either policy. The parameters
        are the master copy; autocast's compute-dtype casts are per op, not kept (a frozen
        module holds `weights` only)."""
        size = self.params.itemsize
        return {"weights": size, "grads": size, "optimizer": 2 * size}
