"""Plan mode's memory model (`hcp.preflight.memory`): the LLM's CP attention backward buffers."""
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
