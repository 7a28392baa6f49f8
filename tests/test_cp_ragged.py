"""CP calls on a ragged kernel (CUDA's varlen flash): the documents of every chunk size share
one call per role (`cp_attention.Segments`) instead of one call per chunk size. The ragged
plumbing (rows, block bounds, merge, gradients) is checked on the CPU against the uniform calls
of the CPU kernel with `RAGGED_MATH` (the math kernel block by block), every rank and both
strategies; the CUDA kernel's dispatch and shapes on fake CUDA tensors."""
import numpy as np
import pytest
import torch
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from dispatch_utils import OpNames

from hcp.model.cp_attention import Partial, Segments, build_cp_plan, cp_calls, grads
from hcp.model.cp_kernels import KERNELS, RAGGED_MATH

LENGTHS, C = [200, 7, 3, 40, 41, 1], 4


def _run(q, kvs, dout, sources, kernel, order):
    """Forward (fold over the key sources in `order`) and backward of one rank's calls."""
    state = Partial.empty(q)
    for s in order:
        state.fold(q, kvs[s], sources[s], kernel)
    out = state.result(q.dtype)
    dq = torch.empty(q.shape, dtype=torch.float64)
    dkvs = [torch.zeros(kv.shape, dtype=torch.float64) for kv in kvs]
    for s in order:
        grads(q, kvs[s], dout, out, state.lse, sources[s], kernel, dq, dkvs[s])
    return out, dq, dkvs


@pytest.mark.parametrize("comm", ["allgather", "p2p"])
def test_ragged_calls_match_the_uniform_calls(comm):
    t_loc = int(sum(2 * -(-n // (2 * C)) for n in LENGTHS))
    g = torch.Generator().manual_seed(0)
    for r in range(C):
        q = torch.randn(t_loc, 4, 8, generator=g, dtype=torch.float64)
        dout = torch.randn(t_loc, 4, 8, generator=g, dtype=torch.float64)
        rows = C * t_loc if comm == "allgather" else t_loc
        kvs = [torch.randn(rows, 2, 2, 8, generator=g, dtype=torch.float64)
               for _ in range(1 if comm == "allgather" else C)]
        order = [0] if comm == "allgather" else [(r - step) % C for step in range(C)]
        uniform = cp_calls(LENGTHS, C, r, comm, masked=False)
        ragged = cp_calls(LENGTHS, C, r, comm, masked=False, ragged=True)
        assert sum(map(len, ragged)) < sum(map(len, uniform))          # fewer, ragged calls
        assert all(isinstance(call.q, Segments) for calls in ragged for call in calls)
        want = _run(q, kvs, dout, uniform, KERNELS["cpu"], order)
        got = _run(q, kvs, dout, ragged, RAGGED_MATH, order)
        for a, b in zip((want[0], want[1], *want[2]), (got[0], got[1], *got[2])):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_cuda_plan_is_one_varlen_call_per_role(monkeypatch):
    """Rank 1 of 4 under allgather: its diagonal, its blocks against chunk 0 and its tail against
    ranks 2..3: three flash calls for documents of four chunk sizes (twelve before)."""
    monkeypatch.setattr(fake_tensor, "CONSTANT_NUMEL_LIMIT", 0)  # no real 1-element constants
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: t)  # the CPU wheel pins nothing
    cu = np.concatenate([[0], np.cumsum(LENGTHS)])
    t_loc = int(sum(2 * -(-n // (2 * C)) for n in LENGTHS))
    with FakeTensorMode():
        monkeypatch.setattr("hcp.model.cp_attention.group_size", lambda group: C)
        monkeypatch.setattr("hcp.model.cp_attention.group_rank", lambda group: 1)
        plan = build_cp_plan(cu, object(), "allgather", "cuda")
        q = torch.randn(t_loc, 4, 8, device="cuda", dtype=torch.bfloat16)
        kv = torch.randn(C * t_loc, 2, 2, 8, device="cuda", dtype=torch.bfloat16)
        # the kernel calls themselves (the merge's in-place ops do not run on fake CUDA tensors
        # of a CPU build; the merge is checked on the CPU above)
        ops, back = OpNames(), OpNames()
        for call in plan.calls[0]:
            k_rows = call.k.take(kv)
            args = (call.q.take(q), k_rows.select(-3, 0), k_rows.select(-3, 1))
            with ops:
                out, lse = plan.kernel.forward(*args, call.causal, call.q, call.k)
            assert out.shape == args[0].shape and lse.shape == args[0].shape[:2]
            assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
            with back:
                dq, dk, dv = plan.kernel.backward(torch.randn_like(out), *args, out, lse,
                                                  call.causal, call.q, call.k)
            assert (dq.shape, dk.shape, dv.shape) == tuple(a.shape for a in args)
    assert ops.names.count("aten._flash_attention_forward") == len(plan.calls[0]) == 3
    assert back.names.count("aten._flash_attention_backward") == 3
    assert len(cp_calls(LENGTHS, C, 1, "allgather", masked=False)[0]) > 3 * 3
