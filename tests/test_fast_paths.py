"""The paths a GPU takes where a CPU test sees no difference (issue 39 section 3): checked by
their mechanism, on torch's fake process group where a collective is involved."""
from __future__ import annotations

import torch
import torch.distributed as dist

from hcp.preflight.rehearse.record import Recorder


def _fake_world(rank: int = 0, world: int = 2) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())


def test_sequence_reduce_scatter_posts_one_flat_tensor():
    """`reduce_scatter_rows` (sequence parallelism's backward, CP attention's dK/dV) off gloo
    issues the tensor form (one flat [n * S, H] input: `_reduce_scatter_base_`), not the list
    form (`reduce_scatter_`, n parts: a copy into NCCL's flat buffer per call)."""
    from hcp.model.collectives import reduce_scatter_rows

    _fake_world()
    rec = Recorder()
    try:
        with rec:
            out = reduce_scatter_rows(torch.randn(6, 4), dist.group.WORLD)
    finally:
        dist.destroy_process_group()
    assert out.shape == (3, 4)
    assert [(op.op, op.shapes) for op in rec.ops] == [("_reduce_scatter_base_", ((3, 4), (6, 4)))]


class _Groups:
    """A `ProcessGroupRegistry` stand-in: every group is the (fake) world."""

    def group(self, module, kind):
        return dist.group.WORLD


def _sharded_gathers(precision: str) -> set[tuple[str, str]]:
    """(what, dtype) of every all-gather of one forward of a toy LLM (root: embedding and
    output layer; two layer units) sharded by `shard_model` under `precision`."""
    from torch import nn

    from hcp.config.precision import Precision
    from hcp.train.fsdp import shard_model

    class Toy(nn.Module):
        def __init__(self):
            super().__init__()
            self.llm = nn.Module()
            self.llm.embed = nn.Embedding(16, 8)
            self.llm.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
            self.llm.out = nn.Linear(8, 16)

        def forward(self, ids):
            x = self.llm.embed(ids)
            for layer in self.llm.layers:
                x = x + layer(x)
            return self.llm.out(x)

    _fake_world()
    rec = Recorder()
    try:
        model = Toy()
        shard_model(model, _Groups(), precision=precision)
        with rec, Precision.of(precision).autocast("cpu"):  # as every hcp forward runs
            model(torch.zeros(4, dtype=torch.long))
    finally:
        dist.destroy_process_group()
    llm = model.llm
    root = sum(p.numel() for p in (llm.embed.weight, llm.out.weight, llm.out.bias))
    return {("root" if sum(s[0] for s in op.shapes[1:]) == root // 2 else "layer", op.dtype)
            for op in rec.ops if "allgather" in op.op}


def test_fsdp_gathers_layers_in_the_compute_dtype_and_reduces_in_fp32():
    """Under bf16 every layer unit all-gathers its parameters in bf16 (half the bytes, and no
    per-op autocast copy of each weight); the root keeps fp32 (embeddings, residual stream);
    under fp32 nothing changes (fp32 parity)."""
    assert _sharded_gathers("bf16") == {("layer", "torch.bfloat16"), ("root", "torch.float32")}
    assert _sharded_gathers("fp32") == {("layer", "torch.float32"), ("root", "torch.float32")}
    from hcp.config.precision import Precision

    policy = Precision.of("bf16").fsdp_policy(root=False)
    assert policy.reduce_dtype == torch.float32 and not policy.cast_forward_inputs


def test_clip_scales_in_the_gradients_dtype_and_never_up():
    """`clip_` multiplies fp32 gradients by an fp32 scale (the foreach kernel's fast path; a
    float64 scale against fp32 tensors is not), computed from the float64 global norm; a norm
    under `max_norm` leaves the gradients as they are (never scaled up)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hcp.train.modules import clip_

    class Muls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.scales = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket is torch.ops.aten._foreach_mul_:
                self.scales.append((args[1].dtype, {t.dtype for t in args[0]}))
            return func(*args, **(kwargs or {}))

    params = [torch.nn.Parameter(torch.zeros(3)) for _ in range(2)]
    for p, g in zip(params, ([3.0, 0.0, 0.0], [0.0, 4.0, 0.0])):
        p.grad = torch.tensor(g)
    norm = torch.tensor(5.0, dtype=torch.float64)
    with Muls() as muls:
        clip_(params, norm, 1.0)
    assert muls.scales == [(torch.float32, {torch.float32})]
    torch.testing.assert_close(params[0].grad, torch.tensor([0.6, 0.0, 0.0]), rtol=1e-6, atol=0)
    before = params[1].grad.clone()
    clip_(params, torch.tensor(0.5, dtype=torch.float64), 1.0)  # under max_norm: unchanged
    assert torch.equal(params[1].grad, before)


def test_cp_loss_scores_at_most_the_micro_batchs_loss_tokens():
    """Under CP (rank 0 of 2) the loss computes fp32 logits for at most the micro-batch's
    `loss_tokens` rows (its shard's loss positions, the rest masked), not for every position
    of the shard; the loss sum and count equal scoring every position."""
    from hcp.config.schema import LLMConfig
    from hcp.model import LlavaModel, init_parameters
    from tests.test_model import make_batch

    model = LlavaModel(None, None, LLMConfig())
    init_parameters(model, seed=0)
    batch = make_batch([40, 24])
    batch.labels[batch.labels.numel() // 8:] = -100  # a sparse answer: at most 8 loss tokens of 64
    total = batch.loss_tokens = int((batch.labels != -100).sum())
    rows, logits = [], model.llm.logits
    model.llm.logits = lambda h: rows.append(h.shape[0]) or logits(h)
    _fake_world()
    try:
        hidden = torch.randn(32, LLMConfig().hidden_size)  # this CP rank's 32 of 64 tokens
        got = model.loss(batch, hidden, cp_group=dist.group.WORLD)
        batch.loss_tokens = None  # unknown on the host: every position of the shard
        want = model.loss(batch, hidden, cp_group=dist.group.WORLD)
    finally:
        dist.destroy_process_group()
    assert 0 < total < 32 and rows == [total, 32]  # the micro-batch's loss tokens, then the shard
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    assert int(got[1]) == int(want[1]) > 0


def test_weights_that_init_from_loads_are_never_drawn(monkeypatch):
    """`materialize(skip=...)` allocates the modules `init_from` will overwrite
    (`loaded_modules`: `llm.init_from` set, no checkpoint replacing it) without drawing their
    random values; the other modules are drawn as before."""
    from hcp.config.schema import LLMConfig, ProjectorConfig, VisionConfig
    from hcp.model import LlavaModel
    from hcp.model import init as init_mod
    from hcp.model.hf_load import loaded_modules
    from hcp.model.init import materialize, meta_build
    from tests.cfg_utils import compose_cfg

    cfg = compose_cfg(["+recipe=llava_tiny", "llm.init_from=/some/llama"])
    assert loaded_modules(cfg) == ("llm",)
    assert loaded_modules(compose_cfg(["+recipe=llava_tiny", "llm.init_from=/some/llama",
                                       "init_from_checkpoint=/a/checkpoint"])) == ()
    drawn, draw = [], init_mod._normal_rows
    monkeypatch.setattr(init_mod, "_normal_rows",
                        lambda out, *a: drawn.append(out) or draw(out, *a))
    with meta_build():
        model = LlavaModel(VisionConfig(), ProjectorConfig(), LLMConfig())
    materialize(model, "cpu", seed=0, skip=[getattr(model, m) for m in loaded_modules(cfg)])
    ids = {id(t) for t in drawn}
    assert not any(id(p) in ids for p in model.llm.parameters())
    assert any(id(p) in ids for p in model.vision.parameters())
    assert all(not p.is_meta for p in model.parameters())
