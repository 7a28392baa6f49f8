"""One precision policy (`hcp.config.precision.Precision`, issue 22 section 3): under
`precision=bf16` both placements run the encoder in bf16 and move bf16 rows over their routes
(colocated `all_to_all_single`, island P2P) and P2P links, and their losses agree with the fp32
run of the same step within 1e-3 relative (measured: 5.599203 fp32, 5.599872 bf16 in both
placements, 1.2e-4 apart; 5.599713 with the encoder in two pipeline stages, whose link carries
bf16 too)."""
import pytest
import torch
from omegaconf import OmegaConf

from cfg_utils import compose_container
from dist_utils import run_ranks
from test_hetero_parity import SMALL

BF16_LOSS_RTOL = 1e-3
PLACEMENTS = {
    "colocated": (2, ["vision.layout.tp=1"]),
    "non_colocated": (2, ["placement=non_colocated", "vision.layout.tp=1", "vision.layout.num_ranks=1"]),
    "non_colocated_encoder_pp2": (3, ["placement=non_colocated", "vision.layout.tp=1", "vision.layout.num_ranks=2",
                                      "vision.layout.pp=2"]),
}


def _routed_dtypes(rank, world, container, run_dir):
    """One training step; returns the loss and the dtypes of every route's rows (forward:
    what each rank sends; backward: the gradients it returns) and of the encoder's matrix
    multiplies (its column-parallel linears' outputs)."""
    import hcp.schedule.colocated as colocated
    import hcp.schedule.links as island
    from hcp.train.trainer import Trainer

    seen = {"forward": set(), "backward": set(), "encoder": set(), "link": set()}

    def spy(module, name, kind):
        original = getattr(module, name)

        def wrapped(tensor, *args, **kwargs):
            seen[kind].add(str(tensor.dtype))
            return original(tensor, *args, **kwargs)
        setattr(module, name, wrapped)

    spy(colocated, "route_forward", "forward")   # colocated routes
    spy(colocated, "route_backward", "backward")
    spy(island, "forward_ops", "forward")        # island routes (a receiver posts 0-row buffers)
    spy(island, "backward_ops", "backward")
    ops = island.PipeLink.ops                    # pipeline links between encoder stages
    island.PipeLink.ops = lambda self, kind, micro, tensor: (
        tensor is None or seen["link"].add(str(tensor.dtype)), ops(self, kind, micro, tensor))[1]
    tr = Trainer(OmegaConf.create(container), run_dir)
    from hcp.model.tp import ColumnParallelLinear

    for m in tr.encoder.modules() if tr.encoder is not None else ():
        if isinstance(m, ColumnParallelLinear):
            m.register_forward_hook(lambda m, i, out: seen["encoder"].add(str(out.dtype)))
    loss, _, _ = tr.forward_backward(tr.sampler.batch(0))
    return dict(loss=float(loss), seen={k: sorted(v) for k, v in seen.items()})


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_bf16_routes_bf16_rows_and_its_loss_agrees_with_fp32(placement, tmp_path):
    world, extra = PLACEMENTS[placement]
    out = {}
    for precision in ("fp32", "bf16"):
        container = compose_container([*SMALL, *extra, f"precision={precision}"], tmp_path / precision)
        out[precision] = run_ranks(_routed_dtypes, world, container, str(tmp_path / precision), timeout=280)
    for precision, dtype in (("fp32", "torch.float32"), ("bf16", "torch.bfloat16")):
        results = out[precision]
        encoders = [r["seen"]["encoder"] for r in results if r["seen"]["encoder"]]
        assert encoders and all(e == [dtype] for e in encoders), (precision, encoders)
        sent = [r["seen"]["forward"] for r in results if r["seen"]["forward"]]
        back = [r["seen"]["backward"] for r in results if r["seen"]["backward"]]
        assert sent and all(s == [dtype] for s in sent), (precision, "rows", sent)
        assert back and all(b == [dtype] for b in back), (precision, "row gradients", back)
        links = [r["seen"]["link"] for r in results if r["seen"]["link"]]
        assert all(s == [dtype] for s in links) and (bool(links) == ("pp2" in placement)), (precision, links)
    fp32, bf16 = out["fp32"][0]["loss"], out["bf16"][0]["loss"]
    assert all(r["loss"] == fp32 for r in out["fp32"]) and all(r["loss"] == bf16 for r in out["bf16"])
    print(f"{placement}: loss fp32 {fp32:.6f}, bf16 {bf16:.6f}")
    assert bf16 != fp32  # bf16 really computed in bf16
    assert bf16 == pytest.approx(fp32, rel=BF16_LOSS_RTOL)


def test_the_policy_of_each_precision():
    from hcp.config.errors import ConfigError
    from hcp.config.precision import Precision

    bf16, fp32 = Precision.of("bf16"), Precision.of("fp32")
    assert Precision.of(bf16) is bf16
    assert (bf16.compute, bf16.params, fp32.compute) == (torch.bfloat16, torch.float32, torch.float32)
    with bf16.autocast("cpu"):
        assert torch.nn.functional.linear(torch.ones(2, 3), torch.ones(4, 3)).dtype == torch.bfloat16
    with fp32.autocast("cpu"):
        assert not torch.is_autocast_enabled("cpu")
    x = torch.ones(3, requires_grad=True)
    wire = bf16.to_wire(x)
    assert wire.dtype == torch.bfloat16 and bf16.from_wire(wire).dtype == torch.float32
    wire.sum().backward()
    assert x.grad.dtype == torch.float32
    assert bf16.state_bytes == fp32.state_bytes == {"weights": 4, "grads": 4, "optimizer": 8}  # fp32 master params
    with pytest.raises(ConfigError, match="precision='fp8'"):
        Precision.of("fp8")


def test_auto_backend_resolves_once_at_build_from_the_runs_compute_dtype(monkeypatch):
    """A CUDA bf16 run with flash installed resolves `auto` to flash once, at build time, and
    the decoder runs it under autocast although its residual stream is fp32 (resolving from the
    stream's dtype picked torch). CP > 1 (the static group, or the pool under dynamic CP)
    falls back to torch."""
    from types import SimpleNamespace

    import hcp.model.backends as backends
    import hcp.model.llama as llama
    from cfg_utils import compose_cfg
    from hcp.config.precision import Precision
    from hcp.config.specs import resolve_modules
    from hcp.config.validate import validate
    from hcp.model.attention import thd_attention
    from hcp.train.trainer import Trainer

    monkeypatch.setattr(backends, "_importable", lambda name: name == "flash")
    calls = []

    def recording(name):
        def attend(q, k, v, cu_seqlens, max_seqlen, seqlens=None):
            calls.append((name, q.dtype))
            return thd_attention(q, k, v, cu_seqlens, max_seqlen, seqlens)
        return attend
    monkeypatch.setattr(llama, "attention_fn", recording)

    cfg = compose_cfg(["+recipe=llama_tiny", "precision=bf16"])
    run = SimpleNamespace(cfg=cfg, device=torch.device("cuda"), precision=Precision.of("bf16"),
                          layouts=validate(cfg, 1), dynamic_cp=False, specs=resolve_modules(cfg))
    assert Trainer.attention_backend(run) == "flash"
    assert Trainer.attention_backend(SimpleNamespace(**{**vars(run), "precision": Precision.of("fp32")})) == "torch"
    for lay in (dict(cp=2), dict(dp=4)):  # a static CP group; a dynamic-CP pool of 4 at cp 1
        cfg_cp = compose_cfg(["+recipe=llama_tiny", "precision=bf16", *(f"llm.layout.{k}={v}" for k, v in lay.items()),
                              *(["packing=dynamic_cp"] if "dp" in lay else [])])
        cp_run = SimpleNamespace(**{**vars(run), "cfg": cfg_cp, "layouts": validate(cfg_cp, 4),
                                    "dynamic_cp": "dp" in lay})
        assert Trainer.attention_backend(cp_run) == "torch", lay

    torch.manual_seed(0)
    decoder = llama.LlamaDecoder(cfg.llm, attention_backend=Trainer.attention_backend(run))
    lengths = [5, 3]
    x = torch.randn(sum(lengths), cfg.llm.hidden_size)
    with Precision.of("bf16").autocast("cpu"):
        decoder(x, torch.cat([torch.arange(n) for n in lengths]), torch.tensor([0, 5, 8], dtype=torch.int32), 5)
    assert calls and set(calls) == {("flash", torch.bfloat16)}, calls


def test_gpu_backend_with_cp_is_one_rule_checked_before_any_rank_starts(monkeypatch):
    """flash with CP > 1 fails validation, also under dynamic CP where the solver may give a
    micro-batch up to the whole CP pool (llm.layout.cp=1); the model's build applies the same
    rule (`check_cp_backend`), not a per-micro-batch check. te runs CP (TE's THD CP, each
    micro-batch's group): it passes the rule and fails only where TE is not installed."""
    import hcp.model.backends as backends
    from cfg_utils import compose_cfg
    from hcp.config.errors import ConfigError
    from hcp.config.validate import validate

    cfg = compose_cfg(["+recipe=llama_tiny", "llm.attention_backend=flash", "packing=dynamic_cp"])
    with pytest.raises(ConfigError, match="whole CP pool of 4 ranks") as e:
        validate(cfg, world_size=4)
    assert e.value.field == "llm.attention_backend" and "packing=first_fit" in e.value.fix
    cfg = compose_cfg(["+recipe=llama_tiny", "llm.attention_backend=te", "packing=dynamic_cp"])
    with pytest.raises(ConfigError, match="transformer_engine"):  # not installed here
        validate(cfg, world_size=4)
    monkeypatch.setattr(backends, "_importable", lambda name: True)
    with pytest.raises(ConfigError, match="whole CP pool of 4 ranks"):
        backends.resolve_backend("flash", "cuda", torch.bfloat16, cp=4, dynamic=True)
    assert backends.resolve_backend("flash", "cuda", torch.bfloat16, cp=1) == "flash"


def test_memory_estimate_charges_the_dtypes_a_bf16_run_stores():
    """Plan mode's activation bytes follow the run's policy: measured on a real bf16 forward,
    the decoder's residual stream (each layer's input: what full recompute keeps, and the norms'
    inputs) is fp32 while q/k/v come out in bf16, and `hcp.preflight.memory.layer_bytes` charges
    exactly those element sizes (it charged 2 B for the stream)."""
    from cfg_utils import compose_cfg
    from hcp.config.layouts import resolve_layouts
    from hcp.config.precision import Precision
    from hcp.model.llama import LlamaDecoder
    from hcp.preflight.memory import layer_bytes

    cfg = compose_cfg(["+recipe=llama_tiny", "precision=bf16"])
    policy, llm = Precision.of(cfg.precision), cfg.llm
    decoder = LlamaDecoder(llm)
    stream, qkv = set(), set()
    for layer in decoder.layers:
        layer.register_forward_pre_hook(lambda m, args: stream.add(args[0].element_size()))
        for proj in (layer.attn.q_proj, layer.attn.k_proj, layer.attn.v_proj):
            proj.register_forward_hook(lambda m, i, out: qkv.add(out.element_size()))
    with policy.autocast("cpu"):
        decoder(torch.randn(8, llm.hidden_size), torch.arange(8), torch.tensor([0, 8], dtype=torch.int32), 8)
    assert stream == {4} and qkv == {2}
    h = llm.hidden_size
    h_kv = h * llm.num_kv_heads // llm.num_heads
    per_token = layer_bytes(h, h_kv, llm.ffn_hidden_size, True, resolve_layouts(cfg, 1)["llm"], policy)
    assert per_token["full"] == h * 4                                  # the fp32 layer input
    # fp32: 2 norm inputs and their normalized outputs; bf16: the 5 q/k/v/gate/up input casts, q,
    # k, v, the attention output and SwiGLU's 4 ffn-wide tensors
    assert per_token["none"] == 4 * h * 4 + (5 * h + 2 * h + 2 * h_kv + 4 * llm.ffn_hidden_size) * 2
