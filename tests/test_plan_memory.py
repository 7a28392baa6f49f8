"""Plan mode's memory model (`hcp.preflight.memory`): the LLM's CP attention backward buffers, a
layer's saved tensors as the code keeps them, the micro-batches a step holds in flight."""
import pytest
from cfg_utils import compose_cfg

from hcp.config.layouts import resolve_layouts
from hcp.config.precision import Precision
from hcp.config.specs import resolve_modules
from hcp.preflight.memory import GIB, _activations, cp_attention_bytes, layer_bytes, weight_copy_bytes


def test_cp_attention_backward_buffers_at_the_pools_largest_cp_size():
    """llama13b_dynamic_cp (PP 8 x CP pool 8, 8192 tokens per rank, bf16, h_kv 5120): one layer's
    backward gathers 8 x 8192 rows and holds per row the gathered K/V, its index copy, the bf16
    dK/dV cast (2 B each) and the fp32 accumulator (4 B) over 2 x 5120 elements: 6.25 GiB,
    charged on top of the recompute's activations; ring (p2p) holds two shards' worth."""
    cfg = compose_cfg(["+recipe=llama13b_dynamic_cp"])
    lay = resolve_layouts(cfg, 64)["llm"]
    bf16 = Precision.of("bf16")
    assert cp_attention_bytes(5120, 8192, 8, lay, bf16) / GIB == 6.25
    assert cp_attention_bytes(5120, 8192, 1, lay, bf16) == 0
    ring = lay.__class__(**{**lay.__dict__, "cp_comm": "p2p"})
    assert cp_attention_bytes(5120, 8192, 8, ring, bf16) / GIB == 6.25 / 4
    per_token = layer_bytes(5120, 5120, 13824, True, lay, bf16)
    copies = weight_copy_bytes(5120, 5120, 13824, lay, bf16)  # the recomputed layer's bf16 weights
    recompute = 8 * 5 * 8192 * per_token["full"] + 8192 * per_token["none"] + copies
    assert _activations(cfg, resolve_modules(cfg), lay, 0) == recompute + 6.25 * GIB
    # dynamic CP: a micro-batch may span the whole pool dp*cp = 8 whatever the layout's cp
    cfg = compose_cfg(["+recipe=llama13b_dynamic_cp", "llm.layout.cp=4", "llm.layout.dp=2"])
    assert _activations(cfg, resolve_modules(cfg), resolve_layouts(cfg, 64)["llm"], 0) == recompute + 6.25 * GIB


def test_layer_bytes_are_what_a_bf16_decoder_layer_saves_for_backward():
    """`layer_bytes` + `weight_copy_bytes` against the tensors one real LLaMA layer (selective,
    bf16 autocast, t=1, 256 tokens) saves for its backward: each RMSNorm's fp32 input and
    normalized output, each of q/k/v/gate/up's own bf16 cast of its input, q, k, v, the attention
    output, SwiGLU's gate/up/silu/product, and every matrix's bf16 copy. Left out: the norms'
    per-token rsqrt and RoPE's tables (under 2%). The estimate charged half before."""
    import torch

    from hcp.config.schema import LLMConfig
    from hcp.model.layers import rope_tables
    from hcp.model.llama import DecoderLayer

    h, f, tokens = 512, 1536, 256
    layer = DecoderLayer(LLMConfig(vocab_size=1000, hidden_size=h, num_layers=1, num_heads=8, num_kv_heads=8,
                                   ffn_hidden_size=f), recompute="selective")
    x = torch.randn(tokens, h, requires_grad=True)
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    def attend(q, k, v):  # the core is recomputed (selective): what it saves inside is not kept
        return torch.nn.functional.scaled_dot_product_attention(*(a.transpose(0, 1) for a in (q, k, v))).transpose(0, 1)

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        layer(x, rope_tables(torch.arange(tokens), h // 8, 10000.0, torch.bfloat16), attend)
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    measured = sum(n for ptr, n in saved.items() if ptr not in params)
    lay = resolve_layouts(compose_cfg(["+recipe=llama_tiny"]), 1)["llm"]
    bf16 = Precision.of("bf16")
    estimate = tokens * layer_bytes(h, h, f, True, lay, bf16)["selective"] + weight_copy_bytes(h, h, f, lay, bf16)
    assert estimate == pytest.approx(measured, rel=0.02)


@pytest.mark.parametrize("arch", ["vit", "clip"])
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_layer_bytes_are_what_a_vit_block_saves_for_backward(arch, precision):
    """`layer_bytes` + `weight_copy_bytes` against the tensors one real ViT block (t=1, 128
    tokens) saves for its backward: its input and the second LayerNorm's (fp32), under autocast
    q/k/v/fc1's own bf16 cast of their input (without: the two norm outputs), q, k, v, the
    attention output, fc1's output, the activation's output (quick-GELU also its sigmoid), and
    every matrix's bf16 copy. Left out: the norms' mean and rstd, the attention's logsumexp."""
    import torch

    from hcp.config.schema import VisionConfig
    from hcp.model.encoder_types import ENCODERS

    h, f, tokens = 256, 1024, 128
    vit = ENCODERS[arch](VisionConfig(image_size=16, patch_size=8, hidden_size=h, num_layers=1, num_heads=4,
                                      ffn_hidden_size=f))
    x = torch.randn(1, tokens, h, requires_grad=True)
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    prec = Precision.of(precision)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), prec.autocast("cpu"):
        vit.blocks[0](x)
    params = {p.untyped_storage().data_ptr() for p in vit.parameters()}
    measured = sum(n for ptr, n in saved.items() if ptr not in params)
    lay = resolve_layouts(compose_cfg(["+recipe=llava_tiny"]), 1)["vision"]
    estimate = (tokens * layer_bytes(h, h, f, False, lay, prec, quick_gelu=arch == "clip")["none"]
                + weight_copy_bytes(h, h, f, lay, prec, gated=False))
    assert estimate == pytest.approx(measured, rel=0.02)


def test_in_flight_micro_batches_are_capped_by_the_steps_count():
    """1F1B's warm-up holds pp - s micro-batches on stage s only when the step fills that many:
    llama13b_dynamic_cp's stage 0 of PP 8 in a step of 3 micro-batches' worth of tokens (a
    rehearsal's small batch) holds 3, not 8."""
    cfg = compose_cfg(["+recipe=llama13b_dynamic_cp"])
    lay, specs = resolve_layouts(cfg, 64)["llm"], resolve_modules(cfg)
    full = _activations(cfg, specs, lay, 0)
    layer_input = 5 * 8192 * 5120 * 4  # what full recompute keeps of a micro-batch's 5 layers
    assert _activations(cfg, specs, lay, 0, micro_batches=3) == full - 5 * layer_input
    assert _activations(cfg, specs, lay, 6, micro_batches=3) == _activations(cfg, specs, lay, 6)  # pp - 6 = 2
