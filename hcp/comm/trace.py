"""Named ranges of hcp's actions in a `torch.profiler` trace (`profile.steps`, hcp.train.profile).

`span("hcp.forward")` is `torch.autograd.profiler.record_function` while a profiler records and
a shared no-op context otherwise: a `record_function` enters torch's dispatcher even when nothing
records (tens of microseconds on a busy CPU), and the executor opens several per micro-batch.
"""
from __future__ import annotations

import contextlib
import functools

from torch.autograd import profiler

_OFF = contextlib.nullcontext()


def span(name, *args):
    """A context naming what runs inside it `name` in the profiler's trace (Perfetto shows it
    as a slice on the rank's thread); a no-op when no profiler records. `name`: a string, or a
    function of `args` returning it, called only while a profiler records."""
    if not profiler._is_profiler_enabled:
        return _OFF
    return profiler.record_function(name(*args) if callable(name) else name)


def traced(name: str):
    """Decorator: the function runs inside `span(name)` (e.g. an autograd Function's forward
    and backward, whose backward autograd calls outside any span of the caller)."""
    def wrap(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            with span(name):
                return fn(*args, **kwargs)
        return run
    return wrap
