"""The `torch` backend without CP on CUDA: one varlen flash call per micro-batch for ragged
documents (aten's flash-attention varlen kernels), not one SDPA per document in a Python loop. Checked on
fake CUDA tensors (FakeTensorMode on this CPU build): the kernels each call dispatches to, and
the shapes and dtypes of the output and of the gradients. What stays unchecked here: the
kernel's numbers (no CUDA kernel runs on this build) and the autograd engine on fake CUDA
tensors (it aborts on a CPU build), so the backward is called directly. The CPU path (one SDPA per document)
is the parity reference, unchanged (tests/test_model.py and the parity tests)."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from dispatch_utils import OpNames

from hcp.model.attention import thd_attention


def _attention_ops(names):
    return [n for n in names if "attention" in n]


class _Ctx:
    """What autograd gives `_VarlenFlash.forward` / `.backward` (called directly: autograd on
    fake CUDA tensors aborts on a CPU build, in the engine's device guard)."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


@pytest.mark.parametrize("hkv", [4, 2])  # grouped-query heads go in as they are
def test_ragged_documents_are_one_varlen_call_on_cuda(hkv):
    from hcp.model.attention import _VarlenFlash

    lengths = (5, 17, 1, 9)
    with FakeTensorMode():
        q = torch.randn(sum(lengths), 4, 16, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(sum(lengths), hkv, 16, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(sum(lengths), hkv, 16, device="cuda", dtype=torch.bfloat16)
        cu = torch.tensor([0, 5, 22, 23, 32], dtype=torch.int32, device="cuda")
        with OpNames() as forward:
            out = thd_attention(q, k, v, cu, max(lengths), seqlens=lengths)
        assert out.shape == q.shape and out.dtype == torch.bfloat16 and out.device.type == "cuda"
        ctx = _Ctx()
        _VarlenFlash.forward(ctx, q, k, v, cu, max(lengths))
        with OpNames() as backward:
            dq, dk, dv, *_ = _VarlenFlash.backward(ctx, torch.randn_like(out))
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert _attention_ops(forward.names) == ["aten._flash_attention_forward"], forward.names
    assert _attention_ops(backward.names) == ["aten._flash_attention_backward"], backward.names


def test_cpu_keeps_one_sdpa_per_document(monkeypatch):
    """The CPU path (the parity reference) does not take the varlen kernel."""
    from hcp.model import attention

    monkeypatch.setattr(attention._VarlenFlash, "apply", lambda *a: pytest.fail("varlen on CPU"))
    lengths = (5, 17, 9)
    q = torch.randn(sum(lengths), 4, 16)
    out = thd_attention(q, q, q, torch.tensor([0, 5, 22, 31], dtype=torch.int32), 17)
    doc = q[5:22].transpose(0, 1)
    second = torch.nn.functional.scaled_dot_product_attention(doc, doc, doc, is_causal=True)
    torch.testing.assert_close(out[5:22], second.transpose(0, 1))


def test_a_document_longer_than_max_seqlen_is_refused_on_the_varlen_path():
    with FakeTensorMode():
        q = torch.randn(12, 4, 16, device="cuda", dtype=torch.bfloat16)
        cu = torch.tensor([0, 12], dtype=torch.int32, device="cuda")
        with pytest.raises(ValueError, match="more than max_seqlen=8"):
            thd_attention(q, q, q, cu, 8, seqlens=(12,))
