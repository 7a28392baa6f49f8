"""Fake tensors (torch's `FakeTensorMode`, under which the rehearsal runs full-size recipes:
`hcp.preflight.rehearse`): shapes, dtypes and devices without values, so no host read."""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor


def is_fake(t: torch.Tensor) -> bool:
    """`t` has no values to read on the host (a `FakeTensor`): a value read only for logging
    or for a check is skipped."""
    return isinstance(t, FakeTensor)


def host_values(t: torch.Tensor) -> list | None:
    """`t.tolist()`: the one host read of values needed only for logging or a check, done
    once per step after its collectives; None for a fake tensor (nothing to read)."""
    return None if is_fake(t) else t.tolist()
