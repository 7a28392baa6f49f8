"""Count device-to-host reads on the calling thread (issue 22, section 4).

On a GPU each of these stalls the host until the device has caught up; on CPU they are free,
so gloo runs cannot see them. `HostReads` makes them visible on CPU: inside `with HostReads()
as reads:` it counts, on the thread that entered it only (the plan-ahead thread's data loading
is not the hot path), every

- Python-level read: `Tensor.item`, `tolist`, `cpu`, `numpy` (on CPU `tolist`, `cpu` and
  `numpy` dispatch no operator, so only a patch sees them);
- operator that returns host data or a data-dependent shape, seen by a `TorchDispatchMode`:
  `_local_scalar_dense` (`item`, `int()`, `float()`, `bool()` of a tensor), `nonzero`,
  `masked_select`, indexing by a bool mask, `equal`, `unique`, `repeat_interleave` without
  `output_size`.

A read counts when the Python code that made it is not torch's own: reads inside torch's Python
code (AdamW's step counters, kept on the host by design) and synchronisations inside torch's C++
kernels are not seen. `reads.sites` maps each read to the `file:line` of the code that made it.
"""
from __future__ import annotations

import collections
import os
import sys
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_PY = ("item", "tolist", "cpu", "numpy")
_OPS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
        torch.ops.aten.masked_select.default, torch.ops.aten.equal.default,
        torch.ops.aten._unique2.default, torch.ops.aten.unique_dim.default,
        torch.ops.aten.unique_consecutive.default, torch.ops.aten.repeat_interleave.Tensor}
_BOOL_INDEX = {torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default,
               torch.ops.aten.index_put_.default}  # a bool index is a nonzero inside
_TORCH = os.path.dirname(torch.__file__) + os.sep
_MACHINERY = tuple(_TORCH + p for p in ("_dynamo", "_compile.py", "_ops.py", "overrides.py",
                                        os.path.join("utils", "_python_dispatch.py")))
_HCP = os.sep + "hcp" + os.sep


def _caller() -> str | None:
    """`file:line` of the code that made the read (the first frame outside this file and
    torch's dispatch machinery), or None when that is torch's own code."""
    frame = sys._getframe(1)
    while frame.f_code.co_filename == __file__ or frame.f_code.co_filename.startswith(_MACHINERY):
        frame = frame.f_back
    name = frame.f_code.co_filename
    if name.startswith(_TORCH):
        return None
    return f"{name.split(_HCP)[-1] if _HCP in name else os.path.basename(name)}:{frame.f_lineno}"


class HostReads(TorchDispatchMode):
    """Context manager counting device-to-host reads (module docstring); `count` is their
    total, `sites` a Counter of `file:line -> reads`."""

    def __init__(self):
        super().__init__()
        self.sites: collections.Counter = collections.Counter()
        self._thread = threading.get_ident()
        self._saved: dict = {}
        self._inside = False

    @property
    def count(self) -> int:
        return sum(self.sites.values())

    def _record(self, what: str) -> None:
        site = _caller() if threading.get_ident() == self._thread and not self._inside else None
        if site is not None:
            self.sites[f"{site} {what}"] += 1

    def __enter__(self):
        for name in _PY:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original

            def patched(t, *args, _name=name, _original=original, **kwargs):
                self._record(_name)
                self._inside = True  # item() also dispatches _local_scalar_dense: count once
                try:
                    return _original(t, *args, **kwargs)
                finally:
                    self._inside = False
            setattr(torch.Tensor, name, patched)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _OPS and not (func is torch.ops.aten.repeat_interleave.Tensor
                                 and (kwargs or {}).get("output_size") is not None):
            self._record(func.__name__)
        elif func in _BOOL_INDEX and any(i is not None and i.dtype == torch.bool for i in args[1]):
            self._record(f"{func.__name__} by a bool mask")
        return func(*args, **(kwargs or {}))
