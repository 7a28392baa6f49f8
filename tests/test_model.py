"""Model layer (issue 2): shapes, THD attention against a per-document reference, document
isolation, layout-invariant init, and the parameter counts of LLaMA-13B and CLIP ViT-L/14-336."""
from __future__ import annotations

import math

import pytest
import torch

from hcp.config.schema import LLMConfig, ProjectorConfig, VisionConfig
from hcp.data.packing import Batch
from hcp.model import LlamaDecoder, LlavaModel, ViTEncoder, init_parameters
from hcp.model.attention import thd_attention
from hcp.model.layers import apply_rope


def make_batch(lengths, vocab=264, images_per_doc=0, num_patches=16, image_size=8, seed=0):
    """Packed batch; each doc starts with `images_per_doc * num_patches` image positions."""
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    total = int(cu[-1])
    ids = torch.randint(0, vocab, (total,), generator=g)
    labels = torch.randint(0, vocab, (total,), generator=g)
    labels[::3] = -100
    pos = torch.cat([torch.arange(n) for n in lengths])
    mask = torch.zeros(total, dtype=torch.bool)
    for start in cu[:-1].tolist():
        mask[start:start + images_per_doc * num_patches] = True
    mask_or_none = mask if images_per_doc else None
    labels[mask] = -100
    pixels = (torch.randn(images_per_doc * len(lengths), 1, image_size, image_size, generator=g)
              if images_per_doc else None)
    return Batch(ids, labels, pos, cu, max(lengths), pixels, mask_or_none)


def reference_attention(q, k, v, cu):
    """Loop over documents, full causal softmax per document."""
    outs = []
    rep = q.shape[1] // k.shape[1]
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qd, kd, vd = q[s:e], k[s:e].repeat_interleave(rep, 1), v[s:e].repeat_interleave(rep, 1)
        scores = torch.einsum("qhd,khd->hqk", qd, kd) / math.sqrt(q.shape[-1])
        causal = torch.ones(e - s, e - s, dtype=torch.bool).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, vd))
    return torch.cat(outs)


@pytest.mark.parametrize("lengths", [[5], [1, 2, 3], [7, 1, 4, 9], [1]])
def test_thd_attention_equals_per_document_reference_in_values_and_gradients(lengths):
    torch.manual_seed(0)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    t = int(cu[-1])
    q = torch.randn(t, 4, 8, requires_grad=True)
    k = torch.randn(t, 2, 8, requires_grad=True)
    v = torch.randn(t, 2, 8, requires_grad=True)
    out = thd_attention(q, k, v, cu, max(lengths))
    ref = reference_attention(q, k, v, cu)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    w = torch.randn_like(out)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_documents_never_attend_across_boundaries():
    torch.manual_seed(0)
    lengths = [4, 6, 3]
    cu = torch.tensor([0, 4, 10, 13], dtype=torch.int32)
    q, k, v = torch.randn(13, 2, 4), torch.randn(13, 2, 4), torch.randn(13, 2, 4)
    out = thd_attention(q, k, v, cu, max(lengths))
    k2, v2 = k.clone(), v.clone()
    k2[4:10] += 5.0
    v2[4:10] -= 3.0
    out2 = thd_attention(q, k2, v2, cu, max(lengths))
    torch.testing.assert_close(out[:4], out2[:4], rtol=0, atol=0)
    torch.testing.assert_close(out[10:], out2[10:], rtol=0, atol=0)
    assert not torch.allclose(out[4:10], out2[4:10])


def test_rope_preserves_norm_and_is_relative():
    torch.manual_seed(0)
    q, k = torch.randn(1, 2, 16), torch.randn(1, 2, 16)
    rq = apply_rope(q, torch.tensor([3]), 10000.0)
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))
    dot = lambda a, b: (apply_rope(q, torch.tensor([a]), 1e4) * apply_rope(k, torch.tensor([b]), 1e4)).sum()
    torch.testing.assert_close(dot(5, 2), dot(13, 10))


def test_decoder_and_llava_shapes_and_loss_is_a_token_sum():
    llm = LLMConfig()
    model = LlavaModel(VisionConfig(), ProjectorConfig(), llm)
    init_parameters(model, seed=1)
    batch = make_batch([40, 25], images_per_doc=1)
    loss_sum, n = model(batch)
    assert loss_sum.dim() == 0 and n == int((batch.labels != -100).sum())
    logits = model.logits(batch)
    assert logits.shape == (65, llm.vocab_size)
    keep = batch.labels != -100
    mean = torch.nn.functional.cross_entropy(logits[keep], batch.labels[keep])
    torch.testing.assert_close(loss_sum / n, mean, rtol=1e-5, atol=1e-6)
    loss_sum.backward()
    assert all(p.grad is not None for p in model.parameters())
    assert ViTEncoder(VisionConfig())(batch.pixel_values).shape == (2, 16, 64)


def test_every_encoder_type_is_built_from_the_registry_wherever_an_encoder_is_built():
    """`arch` picks the builder (`ENCODERS`) in the LLaVA model, the encoder side of several
    encoders and an encoder pipeline stage alike; the types compute different things."""
    from hcp.config.choices import ENCODER_ARCHS
    from hcp.config.modules import streams
    from hcp.model.encoder_side import EncoderSide
    from hcp.model.encoder_stage import EncoderStage
    from hcp.model.encoder_types import ENCODERS, build_encoder
    from hcp.model.stage import StageSpec

    assert set(ENCODERS) == set(ENCODER_ARCHS)
    pixels = torch.randn(2, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    outs = {}
    for arch in ENCODER_ARCHS:
        cfg = VisionConfig(arch=arch)
        reference = build_encoder(cfg)
        init_parameters(reference, 0)
        outs[arch] = reference(pixels)
        built = [LlavaModel(cfg, ProjectorConfig(), LLMConfig()).vision,
                 EncoderSide({"vision": cfg}, {"projector": ProjectorConfig()}, streams(
                     [["vision", "projector"], ["projector", "llm"]]), 32).vision,
                 EncoderStage("vision", cfg, {}, 32, StageSpec(0, 1, 0, cfg.num_layers)).encoder]
        for enc in built:
            enc.load_state_dict(reference.state_dict())
            torch.testing.assert_close(enc(pixels), outs[arch], rtol=0, atol=0)
    assert not torch.allclose(outs["vit"], outs["clip"], atol=1e-4)
    with pytest.raises(ValueError, match="arch='siglip' is not an encoder type"):
        build_encoder(VisionConfig(arch="siglip"))


def test_image_count_mismatch_raises_a_clear_error():
    model = LlavaModel(VisionConfig(), ProjectorConfig(), LLMConfig())
    batch = make_batch([40], images_per_doc=1)
    batch.image_mask[20] = True
    with pytest.raises(ValueError, match="image_mask marks 17 positions"):
        model(batch)


def test_text_only_model_and_tied_embeddings():
    cfg = LLMConfig(tie_embeddings=True)
    model = LlavaModel(None, None, cfg)
    assert model.llm.lm_head is None and model.vision is None
    init_parameters(model, seed=0)
    loss_sum, n = model(make_batch([9, 3, 1]))
    assert torch.isfinite(loss_sum) and n > 0


def test_init_depends_only_on_seed_and_name():
    a = LlavaModel(VisionConfig(), ProjectorConfig(), LLMConfig())
    b = LlavaModel(VisionConfig(), ProjectorConfig(), LLMConfig())
    init_parameters(a, seed=7)
    torch.manual_seed(123)  # the global RNG must not matter
    init_parameters(b, seed=7)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    # the same parameter built alone, named with its prefix, gets the same values
    llm = LlamaDecoder(LLMConfig())
    init_parameters(llm, seed=7, prefix="llm.")
    torch.testing.assert_close(llm.layers[1].attn.q_proj.weight, a.llm.layers[1].attn.q_proj.weight,
                               rtol=0, atol=0)
    init_parameters(b, seed=8)
    assert not torch.equal(a.llm.embed_tokens.weight, b.llm.embed_tokens.weight)
    assert torch.equal(a.llm.norm.weight, torch.ones_like(a.llm.norm.weight))
    assert torch.equal(a.vision.blocks[0].fc1.bias, torch.zeros_like(a.vision.blocks[0].fc1.bias))
    # different names draw different values
    assert not torch.equal(a.llm.layers[0].attn.q_proj.weight, a.llm.layers[1].attn.q_proj.weight)


def test_llama_13b_parameter_count_on_meta():
    cfg = LLMConfig(vocab_size=32000, hidden_size=5120, num_layers=40, num_heads=40,
                    num_kv_heads=40, ffn_hidden_size=13824)
    with torch.device("meta"):
        model = LlamaDecoder(cfg)
    assert sum(p.numel() for p in model.parameters()) == 13_015_864_320


def test_clip_vit_l14_336_parameter_count_on_meta():
    cfg = VisionConfig(image_size=336, patch_size=14, num_channels=3, hidden_size=1024,
                       num_layers=24, num_heads=16, ffn_hidden_size=4096, select_layer=-1)
    with torch.device("meta"):
        model = ViTEncoder(cfg)
    d, f, patches = 1024, 4096, (336 // 14) ** 2
    assert patches == 576 and model.num_patches == 576
    per_block = 4 * (d * d + d) + 2 * 2 * d + (d * f + f) + (f * d + d)
    expected = 3 * 14 * 14 * d + d + (patches + 1) * d + 2 * d + 24 * per_block
    assert expected == 303_505_408
    assert sum(p.numel() for p in model.parameters()) == expected
    with torch.device("meta"):
        penultimate = ViTEncoder(VisionConfig(**{**cfg.__dict__, "select_layer": -2}))
    assert len(penultimate.blocks) == 23
