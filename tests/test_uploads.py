"""Host data reaches a CUDA device through one helper (hcp.parallel.upload): built on the host,
pinned, copied with non_blocking=True; never `torch.tensor(values, device=cuda)` (a pageable
copy with a stream sync) nor a non-blocking copy from pageable memory. Checked on fake CUDA
tensors (FakeTensorMode on this CPU build) with `torch.cuda.is_available` and `pin_memory`
stubbed: every host-to-device copy that the boundary routes, the CP shard, the CP attention
calls and a batch upload issue is recorded with its source's pinning."""
import numpy as np
import pytest
import torch
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode


class _Copies(TorchDispatchMode):
    """Host-to-device copies: (non_blocking, source pinned) per copy."""

    def __init__(self, pinned):
        super().__init__()
        self.pinned, self.copies = pinned, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and args[0].device.type == "cpu" \
                and torch.device(kwargs.get("device") or "cpu").type == "cuda":
            self.copies.append((bool(kwargs.get("non_blocking")), id(args[0]) in self.pinned))
        return func(*args, **kwargs)


@pytest.fixture
def cuda_copies(monkeypatch):
    pinned = set()

    def pin_memory(t):
        pinned.add(id(t))
        return t

    # FakeTensorMode keeps a 1-element host tensor as a real constant and runs its ops for real
    # (torch/_subclasses/fake_tensor.py, `may_turn_const`): a real copy to CUDA fails here
    monkeypatch.setattr(fake_tensor, "CONSTANT_NUMEL_LIMIT", 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    with FakeTensorMode(allow_non_fake_inputs=True), _Copies(pinned) as copies:
        yield copies


def test_uploads_on_cuda_are_pinned_and_non_blocking(cuda_copies):
    from hcp.comm.boundary import grads_to_send, place_rows, rows_to_send, sum_grads
    from hcp.data.packing import empty_batch
    from hcp.model.cp_attention import cp_calls
    from hcp.parallel.cp_sharding import cp_shard
    from hcp.parallel.routing import RankRoute

    route = RankRoute(send_index=(0, 2), send_splits=(1, 1), recv_index=(1, 0), recv_splits=(1, 1),
                      dst_rows=3, grad_owner=(True, False), grad_returns=(True, True),
                      grad_send_splits=(1, 0), grad_recv_splits=(1, 1))
    src = torch.randn(3, 4, device="cuda")
    assert rows_to_send(src, route, "test").shape == (2, 4)
    assert place_rows(torch.randn(2, 4, device="cuda"), route).device.type == "cuda"
    grads_to_send(torch.randn(3, 4, device="cuda"), route)
    sum_grads(torch.randn(2, 4, device="cuda"), route, 3)
    shard = cp_shard(np.array([0, 5, 12]), 2, 1, "cuda")
    assert shard.token_index.device.type == "cuda" and shard.cu_seqlens.dtype == torch.int32
    calls = cp_calls([5, 7, 40], 2, 0, "allgather", "cuda")
    assert calls and all(call.q.index is None or call.q.index.device.type == "cuda" for call in calls[0])
    batch = empty_batch().to("cuda")
    assert batch.input_ids.device.type == "cuda"
    copies = cuda_copies.copies
    assert len(copies) >= 12 and all(copies), copies    # each non-blocking from pinned memory


def test_upload_on_cpu_is_a_plain_tensor(monkeypatch):
    from hcp.parallel.upload import upload

    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: pytest.fail("pinned on CPU"))
    host = torch.arange(4)
    assert upload(host, "cpu") is host
    assert upload([1, 2], torch.device("cpu"), torch.int32).dtype == torch.int32
