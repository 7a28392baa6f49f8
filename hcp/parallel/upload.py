"""Host data to the device: the one way hcp uploads what the host computed (index lists,
document boundaries, plan metadata, samples).

On CUDA, `torch.tensor(values, device="cuda")` builds the tensor in pageable memory and copies it
with a stream synchronisation, and `.to("cuda", non_blocking=True)` from pageable memory is
staged by the driver and may block as well: `upload` builds the tensor on the host, pins it
(`pin_memory`, torch's caching host allocator, which keeps the block until the copy is done)
and copies it with `non_blocking=True`, so the host never waits for the device. Elsewhere
(CPU ranks) it is a plain `torch.as_tensor(...).to(device)`: no copy for a CPU tensor.

The CUDA copy is the op `Tensor.to` dispatches to, `aten._to_copy`, called directly: `Tensor.to`
first takes a device guard of the target device, which a CPU-only torch build does not have,
so under `FakeTensorMode` (fake CUDA tensors on this CPU build: the rehearsal) only the op runs.
"""
from __future__ import annotations

import torch


def upload(values, device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`values` (a list, numpy array or CPU tensor) as a tensor of `dtype` (default: the
    values') on `device`, without a host wait on CUDA (module docstring)."""
    host = torch.as_tensor(values, dtype=dtype)
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return torch.ops.aten._to_copy(host.pin_memory(), device=device, non_blocking=True)
