"""What a rank's step does with the device (`rehearse.device=cuda`), recorded on fake CUDA tensors.

`DeviceEvents` is a `TorchDispatchMode` (plus a few Python-level patches) that records, with the
`file:line` of the hcp code that caused it (`site`), every

- device read (`READ`): an op that returns host data or a data-dependent shape
  (`_local_scalar_dense`: `.item()`, `int()`, `float()`, `bool()` of a tensor; `nonzero`,
  `masked_select`, indexing by a bool mask, `equal`, `unique`, `repeat_interleave` without
  `output_size`), a copy from the device to the host (`.cpu()`, `.to("cpu")`, `copy_`),
  `.tolist()` / `.numpy()`, `torch.cuda.synchronize` or an event wait, and a read that hcp
  skips on fake tensors (`hcp.train.fake.is_fake` answering True for a CUDA tensor): on a GPU
  each stalls the host until the device has caught up;
- host-to-device copy (`H2D`) from pageable memory, blocking or `non_blocking` (a pageable
  source makes the copy synchronous either way: the CUDA driver stages it), or from pinned
  memory (`pin_memory()` marks a tensor pinned here: the CPU wheel has no pinned allocator);
- device mismatch (`MISMATCH`): an op given CUDA tensors and a CPU tensor of more than one
  element (FakeTensor then raises; recorded first);
- attention call (`ATTENTION`), by the kernel it runs and its dtype: aten's flash / efficient /
  cuDNN ops as dispatched; `F.scaled_dot_product_attention`, whose CUDA kernel choice
  (`sdp::select_sdp_backend`, aten/src/ATen/native/transformers/cuda/sdp_utils.cpp) is not in
  the CPU wheel, by `sdpa_kernel`'s condensed form of those rules; CP attention's math
  fallback (`hcp.model.cp_kernels`, fp32 on CUDA), which materialises `[n, Hq, Lq, Lk]`.

Each event is counted under (step, micro-batch or None, kind, detail, site): the micro-batch is
the one whose forward or backward (`hcp.schedule.executor.Executor`) ran it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import threading
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

READ, H2D, MISMATCH = "device read", "H2D copy", "device mismatch"
ATTENTION, WIRE = "attention", "wire dtype"
KINDS = (READ, H2D, MISMATCH, ATTENTION, WIRE)
CHECKS = (
    ("device mismatch", "checked",
     "an op on CUDA and CPU tensors (FakeTensor raises: the rank fails)"),
    ("attention kernel", "checked",
     "aten flash/efficient/cuDNN ops as dispatched; CP's math fallback"),
    ("  F.sdpa's choice", "modelled", "sdp_utils.cpp's rules (sdpa_kernel): torch's CUDA chooser "
     "is not in the CPU wheel; on fake CUDA the call runs the math decomposition (its FLOPs, "
     "memory)"),
    ("autocast on cuda", "checked",
     "torch's C++ autocast kernels run (its Python availability check patched)"),
    ("dtypes on the wire", "checked", "every collective's payload dtype (the recorded c10d ops)"),
    ("H2D copies", "checked",
     "_to_copy/copy_ from a CPU tensor to CUDA: pageable or pinned, blocking or not"),
    ("device reads", "checked", "item/bool/nonzero/equal/unique/bool-mask index/tolist/D2H copy/"
     "cuda sync/event wait/reads hcp skips on fake tensors; zero per micro-batch after step 1"),
    ("reads in C++ kernels", "cannot", "a sync inside an aten kernel dispatches nothing to see"),
    ("TE, flash-attn", "cannot",
     "not installed here; their kernels and internal syncs are not run"),
    ("streams, overlap, NCCL", "cannot",
     "fake tensors have no time: no stream order, no comm overlap"),
    ("allocator", "cannot", "MemTracker counts tensor bytes, not the caching allocator's blocks"),
)
"""What `rehearse.device=cuda` checks and what it cannot (printed with the report)."""

_aten = torch.ops.aten
_READ_OPS = {_aten._local_scalar_dense.default: "item/bool/int/float",
             _aten.nonzero.default: "nonzero",
             _aten.masked_select.default: "masked_select", _aten.equal.default: "equal",
             _aten._unique2.default: "unique", _aten.unique_dim.default: "unique",
             _aten.unique_consecutive.default: "unique",
             _aten.repeat_interleave.Tensor: "repeat_interleave"}
_BOOL_INDEX = {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default}
_COPIES = {_aten._to_copy.default, _aten.copy_.default}
_KERNEL_OPS = {"_flash_attention_forward": "flash", "_scaled_dot_product_flash_attention": "flash",
               "_efficient_attention_forward": "efficient",
               "_scaled_dot_product_efficient_attention": "efficient",
               "_scaled_dot_product_cudnn_attention": "cudnn",
               "_scaled_dot_product_flash_attention_for_cpu": "cpu flash"}
_HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_HCP = os.path.dirname(os.path.dirname(os.path.dirname(_HERE))) + os.sep
_SKIPPED = (_HERE, os.path.join(_HCP, "train", "fake.py"))
"""Frames `site()` looks through: the rehearsal's own, and `hcp.train.fake` (its caller reads)."""


def sdpa_kernel(q: torch.Tensor, k: torch.Tensor, attn_mask, dropout_p: float = 0.0) -> str:
    """The kernel torch 2.13 picks for `F.scaled_dot_product_attention` on an sm80+ GPU (H100),
    from the rules of `sdp::select_sdp_backend` (priority flash, efficient, math; cuDNN is off
    by default): flash for fp16/bf16, no mask, head dim <= 256 and a multiple of 8; efficient
    for fp32/fp16/bf16 with a head dim that is a multiple of 8 (4 for fp32); else math.
    q, k: `[..., L, H or L, D]` (the last dimension is the head dim)."""
    d, dtype = q.shape[-1], q.dtype
    flash_ok = torch.backends.cuda.flash_sdp_enabled() and dtype in (torch.float16, torch.bfloat16)
    if flash_ok and attn_mask is None and d <= 256 and d % 8 == 0 and k.shape[-1] == d:
        return "flash"
    align = 4 if dtype == torch.float32 else 8
    efficient_dtypes = (torch.float32, torch.float16, torch.bfloat16)
    efficient = torch.backends.cuda.mem_efficient_sdp_enabled() and dtype in efficient_dtypes
    if efficient and d % align == 0:
        return "efficient"
    return "math"


def site() -> str:
    """`file:line` of the innermost hcp frame outside the rehearsal (`<torch>` when torch's own
    code, e.g. an optimizer or FSDP, made the call)."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_HCP) and not name.startswith(_SKIPPED):
            return f"{os.path.relpath(name, os.path.dirname(_HCP.rstrip(os.sep)))}:{frame.f_lineno}"
        frame = frame.f_back
    return "<torch>"


def _cuda(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "cuda"


def _tensors(args):
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from _tensors(a)


class DeviceEvents(TorchDispatchMode):
    """Records a rank's device events (module docstring) while `recording()`; `counts` is a
    Counter of (step, micro-batch or None, kind, detail, site) -> events. Set `step` before
    each step. Entered alone (`with events:`), it is the dispatch mode only."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()
        self.step = 0
        self.micro: int | None = None
        self._pinned: set[int] = set()   # id() of tensors `pin_memory()` returned
        self._saved: list = []
        self._quiet = threading.local()

    def add(self, kind: str, detail: str, where: str | None = None) -> None:
        """Count one event of `kind` (`detail`: what it was) at `where` (default: `site()`)."""
        self.counts[self.step, self.micro, kind, detail, where or site()] += 1

    def read(self, detail: str) -> None:
        """A device read made outside the dispatcher (a `torch.cuda` wait, a skipped read)."""
        if not getattr(self._quiet, "on", False):
            self.add(READ, detail)

    # -- the dispatcher -------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not getattr(self._quiet, "on", False):
            self._see(func, args, kwargs)
        if kwargs.get("pin_memory"):  # a pinned factory: the CPU wheel has no pinned allocator
            out = func(*args, **{**kwargs, "pin_memory": False})
            self._pinned.add(id(out))
            return out
        return func(*args, **kwargs)

    def _see(self, func, args, kwargs) -> None:
        name = func._opname
        if func in _READ_OPS and any(map(_cuda, _tensors(args))):
            sized = func is _aten.repeat_interleave.Tensor and kwargs.get("output_size") is not None
            if not sized:
                self.add(READ, _READ_OPS[func])
        elif func in _BOOL_INDEX and _cuda(args[0]) and any(
                i is not None and i.dtype == torch.bool for i in args[1]):
            self.add(READ, f"{name} by a bool mask")
        elif func in _COPIES:
            self._copy(func, args, kwargs)
        elif name in _KERNEL_OPS and any(map(_cuda, _tensors(args))):
            self.add(ATTENTION, f"{_KERNEL_OPS[name]} {str(args[0].dtype).replace('torch.', '')}")
        tensors = list(_tensors(args))
        if func not in _COPIES and any(map(_cuda, tensors)) and any(
                t.device.type == "cpu" and t.numel() > 1 for t in tensors):
            self.add(MISMATCH, f"{func.__name__} on cuda and cpu tensors")

    def _copy(self, func, args, kwargs) -> None:
        if func is _aten._to_copy.default:
            src, dst_device = args[0], kwargs.get("device")
            non_blocking = kwargs.get("non_blocking", False)
            dst_type = src.device.type if dst_device is None else torch.device(dst_device).type
        else:
            dst, src = args[0], args[1]
            dst_type = dst.device.type
            non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        if src.device.type == "cuda" and dst_type == "cpu":
            self.add(READ, "copy to the host")
        elif src.device.type == "cpu" and dst_type == "cuda":
            pinned = id(src) in self._pinned
            how = "non_blocking" if non_blocking else "blocking"
            self.add(H2D, "pinned" if pinned else f"pageable, {how}")

    # -- Python-level patches -------------------------------------------------------------
    @contextlib.contextmanager
    def recording(self):
        """The dispatch mode, the Python-level patches (reads, pinning, attention calls) and the
        micro-batch attribution, restored on exit."""
        with self._patches(), self, self._micro_batches():
            yield self

    @contextlib.contextmanager
    def _patches(self):
        import torch.nn.functional as F

        import hcp.model.cp_kernels as cp_kernels
        import hcp.train.fake as fake
        import hcp.train.plan_check as plan_check

        events = self
        saved = [(torch.Tensor, "tolist"), (torch.Tensor, "numpy"), (torch.Tensor, "pin_memory"),
                 (torch.Tensor, "is_pinned"), (F, "scaled_dot_product_attention"),
                 (fake, "is_fake"),
                 (plan_check, "is_fake"), (cp_kernels, "KERNELS")]
        self._saved = [(owner, name, getattr(owner, name)) for owner, name in saved]
        tolist, numpy = torch.Tensor.tolist, torch.Tensor.numpy
        sdpa, is_fake = F.scaled_dot_product_attention, fake.is_fake

        def reading(fn, what):
            def wrapped(t, *a, **k):
                if _cuda(t):
                    events.read(what)
                return fn(t, *a, **k)
            return wrapped

        def pin_memory(t, *a, **k):
            out = t.clone()
            events._pinned.add(id(out))
            return out

        def scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, *a, **kw):
            if _cuda(q):
                events.add(ATTENTION, f"{sdpa_kernel(q, k, attn_mask, dropout_p)} "
                                      f"{str(q.dtype).replace('torch.', '')} (F.sdpa, predicted)")
                with events.quiet():
                    return sdpa(q, k, v, attn_mask, dropout_p, *a, **kw)
            return sdpa(q, k, v, attn_mask, dropout_p, *a, **kw)

        def skipped_read(t):
            out = is_fake(t)
            if out and _cuda(t):
                events.read("read skipped on a fake tensor")
            return out

        torch.Tensor.tolist, torch.Tensor.numpy = reading(tolist, "tolist"), reading(numpy, "numpy")
        torch.Tensor.pin_memory = pin_memory
        torch.Tensor.is_pinned = lambda t, *a, **k: id(t) in events._pinned
        F.scaled_dot_product_attention = scaled_dot_product_attention
        fake.is_fake = plan_check.is_fake = skipped_read
        cp_kernels.KERNELS = {**cp_kernels.KERNELS, "cuda": self._recorded_cuda_kernel(cp_kernels)}
        try:
            yield
        finally:
            for owner, name, fn in self._saved:
                setattr(owner, name, fn)
            self._saved = []

    @contextlib.contextmanager
    def quiet(self):
        """Nothing inside is recorded (an attention call already recorded as one event)."""
        self._quiet.on = True
        try:
            yield
        finally:
            self._quiet.on = False

    def _recorded_cuda_kernel(self, cp_kernels):
        """CP attention's CUDA kernel with its math fallback (fp32) recorded as an attention
        call (its flash path is seen as `_flash_attention_forward` in the dispatcher)."""
        kernel, events = cp_kernels.KERNELS["cuda"], self

        def forward(q, *args):
            if q.dtype not in (torch.float16, torch.bfloat16):
                dtype = str(q.dtype).replace("torch.", "")
                events.add(ATTENTION, f"math {dtype} (CP kernel fallback)")
            return kernel.forward(q, *args)
        return dataclasses.replace(kernel, forward=forward)

    @contextlib.contextmanager
    def _micro_batches(self):
        """While active, events inside an `Executor`'s forward or backward of micro-batch i are
        attributed to i."""
        from hcp.schedule.executor import Executor

        init, backward, events = Executor.__init__, Executor._backward, self

        def within(fn, i, *args):
            outer, events.micro = events.micro, i
            try:
                return fn(*args)
            finally:
                events.micro = outer

        def counted_init(ex, forward, *args, **kwargs):
            init(ex, lambda i, x: within(forward, i, i, x), *args, **kwargs)

        Executor.__init__ = counted_init
        Executor._backward = lambda ex, i: within(backward, i, ex, i)
        try:
            yield
        finally:
            Executor.__init__, Executor._backward = init, backward


class FakeUploads(TorchDispatchMode):
    """Host data put on fake CUDA: outside the fake mode (the host work reads its values), an op
    that makes or copies a tensor onto CUDA, or takes a fake tensor, runs under `fake` (torch's
    `FakeTensorMode`), so a real CPU tensor copied to "cuda" becomes a fake CUDA tensor (with
    `torch._C._set_only_lift_cpu_tensors(True)`, `torch.tensor(data, device="cuda")` is built
    on the host and then copied, as under the fake mode)."""

    def __init__(self, fake):
        super().__init__()
        self.fake = fake

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import FakeTensor

        kwargs = kwargs or {}
        device = kwargs.get("device")
        if (device is not None and torch.device(device).type == "cuda") or any(
                isinstance(t, FakeTensor) for t in _tensors([*args, *kwargs.values()])):
            with self.fake:
                return func(*args, **kwargs)
        return func(*args, **kwargs)

    @contextlib.contextmanager
    def around(self, events):
        """Run the host work with no other mode but this one and `events` (the rank's memory
        and op trackers see only the step's device work, as when the work runs on the
        plan-ahead thread)."""
        from torch.utils._python_dispatch import _disable_current_modes

        lift = torch._C._only_lift_cpu_tensors()
        with _disable_current_modes():
            torch._C._set_only_lift_cpu_tensors(True)
            try:
                with self, events:
                    yield
            finally:
                torch._C._set_only_lift_cpu_tensors(lift)


def summary(counts: Counter) -> list[tuple]:
    """(kind, detail, events in set-up (step 0), in the steps' micro-batches, elsewhere in the
    steps, sites by events) per kind and detail, sorted."""
    rows: dict[tuple, list] = {}
    for (step, micro, kind, detail, where), n in counts.items():
        row = rows.setdefault((kind, detail), [0, 0, 0, Counter()])
        row[0 if step == 0 else 1 if micro is not None else 2] += n
        row[3][where] += n
    order = sorted(rows.items(), key=lambda kv: (KINDS.index(kv[0][0]), kv[0][1]))
    return [(k, d, *row) for (k, d), row in order]


def wire_counts(ops) -> Counter:
    """The events of `WIRE`: collectives of the training steps by (op, payload dtype), from a
    rank's recorded `hcp.preflight.rehearse.record.Op`s, as `DeviceEvents.counts` keys."""
    out: Counter = Counter()
    for op in ops:
        if op.kind == "collective" and op.step > 0:
            out[op.step, None, WIRE, f"{op.op} {op.dtype.replace('torch.', '')}", "-"] += 1
    return out


def format_device(results: dict, steps: int) -> list[str]:
    """The report's device lines: the `CHECKS` table, then every event kind and detail with
    its events per step (the largest rank's; set-up, inside micro-batches, elsewhere) and its
    most frequent sites. `results`: rank -> `RankResult` with `device_events`."""
    lines = ["hcp rehearsal on fake CUDA: what it checks", f"{'check':<24} {'status':<9} how"]
    lines += [f"{name:<24} {status:<9} {how}" for name, status, how in CHECKS]
    per: dict[tuple, list] = {}
    for res in results.values():
        counts = Counter(res.device_events) + wire_counts(res.ops)
        for kind, detail, setup, micro, other, sites in summary(counts):
            row = per.setdefault((kind, detail), [0, 0.0, 0.0, Counter()])
            row[0] = max(row[0], setup)
            row[1], row[2] = max(row[1], micro / steps), max(row[2], other / steps)
            row[3] |= sites
    lines += ["device events per rank (largest rank; per step: in micro-batches / elsewhere "
              "in the step)",
              f"{'kind':<16} {'what':<44} {'set-up':>6} {'in mb':>6} {'other':>6}  sites"]
    order = sorted(per.items(), key=lambda kv: KINDS.index(kv[0][0]))
    for (kind, detail), (setup, micro, other, sites) in order:
        top = ", ".join(f"{w} x{n}" for w, n in sites.most_common(3) if w != "-")
        lines.append(f"{kind:<16} {detail:<44} {setup:>6} {micro:>6.1f} {other:>6.1f}  {top}")
    return lines


def reads_after_warmup(counts: Counter) -> Counter:
    """site -> device reads inside a micro-batch's forward or backward after the first step."""
    out: Counter = Counter()
    for (step, micro, kind, detail, where), n in counts.items():
        if kind == READ and step > 1 and micro is not None:
            out[f"{where} {detail}"] += n
    return out
