"""Fake CUDA tensors with autograd on a CPU-only torch build (`rehearse.device=cuda`).

torch's `FakeTensorMode` makes CUDA tensors on the CPU wheel (`torch.randn(..., device="cuda")`,
flash attention's forward), but three parts of torch 2.13 stop a training step on them:

1. Autograd needs a CUDA device guard: `InputMetadata` (torch/csrc/autograd/input_metadata.cpp,
   declared in torch/include/torch/csrc/autograd/input_metadata.h) asks
   `c10::impl::getDeviceGuardImpl(CUDA)` for the tensor's stream, which raises "PyTorch is not
   linked with support for cuda devices" (torch/include/c10/core/impl/
   DeviceGuardImplInterface.h:417) and, inside a grad accumulator's constructor, aborts the
   process. `FakeTensorMode.__enter__` calls `torch._C._ensureCUDADeviceGuardSet()`
   (torch/_subclasses/fake_tensor.py:1624) for this, but torch 2.13's
   `c10::impl::ensureCUDADeviceGuardSet` (c10/core/impl/DeviceGuardImplInterface.cpp) only
   replaces a guard that is there with no device (a CUDA build without a GPU): on the CPU wheel
   the slot is empty and stays empty. The same guard is what `Tensor.copy_`'s Python binding and
   `.to("cuda")` without an index (`ensure_has_index`) ask for.
2. The backward needs a CUDA accelerator: `InputBuffer::add` calls
   `at::accelerator::getCurrentStream`, whose `getAccelerator(true)` raises "Cannot access
   accelerator device when none is available" unless `at::detail::getCUDAHooks().isBuilt()`
   (ATen/DeviceAccelerator.cpp); the hooks are created once, at the first call (during
   `import torch`), from the `CUDAHooksRegistry`.
3. Autocast on "cuda" turns itself off ("CUDA is not available ... Disabling autocast",
   torch/amp/autocast_mode.py:285-292: `amp_definitely_not_available()` and
   `torch.cuda.is_bf16_supported()` are Python checks); the C++ autocast kernels themselves
   run on fake CUDA tensors once 1 and 2 are fixed (the "first try failed inside `_to_copy`"
   was 1: the cast's autograd node).

`SHIM` fixes 1 and 2: a 30-line C++ library, built once with the system's g++ against torch's
own headers (`library()`), that installs c10's `FakeGuardImpl<CUDA>` (8 fake devices; streams
and events no-ops) and registers CUDA hooks whose `isBuilt()` is true. The hooks must be
registered before `import torch` creates them, so the library is loaded with `LD_PRELOAD`:
`ensure()` re-runs the command under it. `patched()` fixes 3 and stands in for the `torch.cuda`
calls hcp and torch.distributed make on a CUDA device (timing events, peak memory,
`synchronize`, the lazy initialisation that `.to("cuda")` calls before it dispatches, the
device capability: an H100's).
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import tempfile

SHIM = r"""
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>

namespace {
c10::impl::FakeGuardImpl<c10::DeviceType::CUDA> guard;

struct FakeCUDAHooks final : at::CUDAHooksInterface {
  FakeCUDAHooks(at::CUDAHooksArgs) {}
  bool isBuilt() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return guard.deviceCount(); }
  c10::DeviceIndex getCurrentDevice() const override { return guard.getDevice().index(); }
  void init() const override {}
};

struct Install {
  Install() {
    auto& slot = c10::impl::device_guard_impl_registry[static_cast<size_t>(c10::DeviceType::CUDA)];
    const c10::impl::DeviceGuardImplInterface* none = nullptr;
    slot.compare_exchange_strong(none, &guard);
  }
} install;
}  // namespace

namespace at {
C10_REGISTER_TYPED_CLASS(CUDAHooksRegistry, "CUDAHooks", FakeCUDAHooks)
}
"""
ENV = "HCP_FAKE_CUDA"
"""Set (to the library's path) in a process re-run under `LD_PRELOAD` by `ensure()`."""


def needed() -> bool:
    """Whether this torch lacks CUDA (the CPU wheel): a CUDA build traces fake CUDA tensors
    itself (`ensureCUDADeviceGuardSet`), and would refuse a second set of CUDA hooks."""
    import torch

    return torch.version.cuda is None and torch.version.hip is None


def active() -> bool:
    """Whether fake CUDA tensors can run a training step in this process."""
    import torch

    if not needed():
        return True
    acc = torch.accelerator.current_accelerator()
    return acc is not None and acc.type == "cuda"


def library() -> str:
    """Path of the built `SHIM` (built on first use into the temp directory, keyed by the
    source and torch's version; a few seconds of g++).

    Raises:
        RuntimeError: no C++ compiler, or the build failed (its last lines)."""
    import torch

    key = hashlib.sha1((SHIM + torch.__version__).encode()).hexdigest()[:12]
    path = os.path.join(tempfile.gettempdir(), f"hcp_fake_cuda_{key}.so")
    if os.path.exists(path):
        return path
    root = os.path.dirname(torch.__file__)
    src = path[:-3] + f".{os.getpid()}.cpp"
    with open(src, "w") as f:
        f.write(SHIM)
    abi = int(torch.compiled_with_cxx11_abi())
    cmd = [os.environ.get("CXX", "g++"), "-O1", "-std=c++17", "-shared", "-fPIC",
           f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{root}/include", src, f"-L{root}/lib", "-lc10",
           "-ltorch_cpu", f"-Wl,-rpath,{root}/lib", "-o", path + f".{os.getpid()}"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except FileNotFoundError:
        raise RuntimeError(f"rehearse.device=cuda on a CPU-only torch builds a small C++ library "
                           f"and needs a C++ compiler ({cmd[0]}, or set CXX): install g++, or use "
                           "rehearse.device=cpu") from None
    finally:
        os.remove(src)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.splitlines()[-8:])
        raise RuntimeError("building the fake-CUDA library failed:\n" + tail)
    os.replace(path + f".{os.getpid()}", path)
    return path


def ensure(extra_args: list[str] = ()) -> None:
    """Make fake CUDA tensors work in this command: nothing when `active()`, else re-run this
    process (`sys.argv`, each `key=value` of `extra_args` replacing the same key's) with the
    `SHIM` preloaded; does not return then.

    Raises:
        RuntimeError: the library cannot be built, or it was preloaded and is still not active."""
    if active():
        if os.environ.get(ENV):  # loaded: the commands this one starts need no preload
            os.environ.pop("LD_PRELOAD", None)
        return
    if os.environ.get(ENV):
        raise RuntimeError("the fake-CUDA library was preloaded but torch sees no CUDA accelerator")
    lib = library()
    env = dict(os.environ, LD_PRELOAD=lib, **{ENV: lib})
    sys.stdout.flush()
    keys = tuple(a.split("=", 1)[0] + "=" for a in extra_args)
    argv = [a for a in sys.argv if not a.startswith(keys)] + list(extra_args)
    os.execve(sys.executable, [sys.executable, *argv], env)


def preloaded_env(env: dict | None = None) -> dict:
    """`env` (default this process's) with the `SHIM` preloaded: for a subprocess."""
    lib = library()
    return dict(os.environ if env is None else env, LD_PRELOAD=lib, **{ENV: lib})


class _Event:
    """`torch.cuda.Event` on fake CUDA: `synchronize` is a device read (`reads(kind)`)."""

    def __init__(self, reads, enable_timing: bool = False, **kwargs):
        self.reads = reads

    def record(self, stream=None):
        pass

    def synchronize(self):
        self.reads("cuda.Event.synchronize")

    def elapsed_time(self, end) -> float:
        return 0.0

    def query(self) -> bool:
        return True


@contextlib.contextmanager
def patched(reads):
    """The `torch.cuda` calls hcp makes on a CUDA device, on fake CUDA: autocast's availability
    checks pass, `Event` and `synchronize` stand in (each wait a device read, reported through
    `reads(kind)`), peak memory is 0 (the rehearsal tracks its own). Restored on exit."""
    import torch
    import torch.cuda.amp.common as amp_common

    saved = [(amp_common, "amp_definitely_not_available"), (torch.cuda, "is_bf16_supported"),
             (torch.cuda, "Event"), (torch.cuda, "synchronize"),
             (torch.cuda, "max_memory_allocated"),
             (torch.cuda, "reset_peak_memory_stats"), (torch.cuda, "_lazy_init"),
             (torch.cuda, "get_device_capability")]
    saved = [(owner, name, getattr(owner, name)) for owner, name in saved]
    amp_common.amp_definitely_not_available = lambda: False
    torch.cuda.is_bf16_supported = lambda *a, **k: True
    torch.cuda.Event = lambda *a, **k: _Event(reads, *a, **k)
    torch.cuda.synchronize = lambda *a, **k: reads("cuda.synchronize")
    torch.cuda.max_memory_allocated = lambda *a, **k: 0
    torch.cuda.reset_peak_memory_stats = lambda *a, **k: None
    torch.cuda._lazy_init = lambda: None  # `.to("cuda")`, `torch.tensor(.., device="cuda")` call it
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)  # an H100 (c10d's broadcast asks)
    try:
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
