"""The encoder side as its own module (issue 12 section 2): `LlavaEncoder` (vision + projector,
TP-sharded) and the LLM stage reading routed `image_rows` reproduce the single-process LLaVA;
encoder tp2 equals tp1 in forward and backward (rtol 1e-5)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from test_model import make_batch

from hcp.config.schema import LayoutConfig, LLMConfig, ProjectorConfig, VisionConfig
from hcp.model import init_parameters
from hcp.model.llava import LlavaEncoder, LlavaModel

SEED = 4
TOL = dict(rtol=1e-5, atol=1e-6)
VISION = VisionConfig(image_size=4, patch_size=2, hidden_size=16, num_layers=2, num_heads=2,
                      ffn_hidden_size=32)
LLM = LLMConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                ffn_hidden_size=64)


def _encoder_tp_worker(rank, world, projector_type, pixels, grad_out):
    group = dist.new_group(list(range(world)))
    proj = ProjectorConfig(type=projector_type)
    ref = LlavaEncoder(VISION, proj, LLM.hidden_size)
    tp = LlavaEncoder(VISION, proj, LLM.hidden_size, tp_group=group)
    init_parameters(ref, SEED)
    init_parameters(tp, SEED)
    out_ref, out_tp = ref(pixels), tp(pixels)
    out_ref.backward(grad_out)
    # as a boundary route does: each replica gets the gradient of its own (disjoint) rows only
    mine = torch.zeros_like(grad_out)
    rows = grad_out.shape[0] // world
    mine[rank * rows:(rank + 1) * rows] = grad_out[rank * rows:(rank + 1) * rows]
    out_tp.backward(mine)
    torch.testing.assert_close(out_tp, out_ref, **TOL)
    sharded = 0
    refs = dict(ref.named_parameters())
    for name, p in tp.named_parameters():
        spec = getattr(p, "shard_spec", None)
        want = refs[name].grad if spec is None else spec.narrow(refs[name].grad)
        sharded += spec is not None
        torch.testing.assert_close(p.grad, want, **TOL, msg=lambda m, name=name: f"{name}: {m}")
        if spec is not None:
            torch.testing.assert_close(p.detach(), spec.narrow(refs[name].detach()), rtol=0, atol=0)
    return sharded


@pytest.mark.parametrize("projector_type", ["mlp2x_gelu", "linear"])
def test_encoder_tp2_equals_tp1_forward_and_backward(projector_type):
    g = torch.Generator().manual_seed(0)
    pixels = torch.randn(3, 1, 4, 4, generator=g)
    # scaled like a token-mean loss's gradient (atol 1e-6 is meant for gradients of that size)
    grad_out = torch.randn(3 * 4, LLM.hidden_size, generator=g) / (3 * 4)
    sharded = run_ranks(_encoder_tp_worker, 2, projector_type, pixels, grad_out, timeout=60)
    # q, k, v, fc1 (weight + bias) and o, fc2 (weight) per block, plus the projector's
    assert sharded[0] == 2 * 10 + (3 if projector_type == "mlp2x_gelu" else 2)


def test_encoder_refuses_pp():
    with pytest.raises(ValueError, match=r"vision.layout.pp=2"):
        LlavaEncoder(replace(VISION, layout=LayoutConfig(pp=2)), ProjectorConfig(), 32)
    with pytest.raises(ValueError, match=r"projector.layout.pp=2"):
        LlavaEncoder(VISION, ProjectorConfig(layout=LayoutConfig(pp=2)), 32)


def test_routed_image_rows_equal_the_whole_model():
    """LLM stage (encoder=False) + LlavaEncoder, rows handed over by hand, equals LlavaModel."""
    batch = make_batch([13, 7, 9], vocab=LLM.vocab_size, images_per_doc=1, num_patches=4,
                       image_size=4, seed=2)
    whole = LlavaModel(VISION, ProjectorConfig(), LLM)
    encoder = LlavaEncoder(VISION, ProjectorConfig(), LLM.hidden_size)
    stage = LlavaModel(VISION, ProjectorConfig(), LLM, encoder=False)
    for m in (whole, encoder, stage):
        init_parameters(m, SEED)
    loss_ref, n_ref = whole(batch)
    loss_ref.backward()
    rows = encoder(batch.pixel_values)
    leaf = rows.detach().requires_grad_()
    batch.image_rows = leaf
    loss, n = stage(batch)
    loss.backward()
    rows.backward(leaf.grad)
    assert n == n_ref
    torch.testing.assert_close(loss, loss_ref, rtol=0, atol=0)
    grads = {**dict(encoder.named_parameters()), **dict(stage.named_parameters())}
    assert set(grads) == {k for k, _ in whole.named_parameters()}
    for name, p in whole.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, **TOL)
    batch.image_rows = leaf[:-1]
    # checked on the device without a host read (`torch._assert_async`: RuntimeError on CPU)
    with pytest.raises(RuntimeError, match="image_rows has 11 rows but this rank's tokens hold another"):
        stage(batch)
    batch.image_rows = None
    with pytest.raises(ValueError, match="encoder=False"):
        stage(batch)


def test_encoder_without_images_gives_zero_rows_and_zero_gradients():
    encoder = LlavaEncoder(VISION, ProjectorConfig(), LLM.hidden_size)
    init_parameters(encoder, SEED)
    out = encoder(torch.zeros(0, 1, 4, 4))
    assert out.shape == (0, LLM.hidden_size)
    out.backward(torch.zeros_like(out))
    assert all(p.grad is not None and not p.grad.any() for p in encoder.parameters())
