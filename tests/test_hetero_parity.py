"""Heterogeneous layouts through the trainer equal the single-process model (FP32): one step's
loss, token counts, every module's gradients (made whole over TP and FSDP, gathered over PP
stages), the global gradient norm and the weights after one AdamW step; rtol 1e-5 / atol 1e-6.
Two models: the tiny LLaVA (one encoder) and the two-encoder recipe with a branch on top
(vision -> projector and a pooled projector; vision2 -> projector2; all into the LLM), each
module at its own layout. The single-rank run itself equals the plain `LlavaModel`."""
import pytest
import torch
from omegaconf import OmegaConf
from torch.distributed.tensor import DTensor

from cfg_utils import compose_container
from dist_utils import run_ranks
from parity_utils import assert_all_close, merged, whole

TOL = dict(rtol=1e-5, atol=1e-6)
SMALL = ["trainer.micro_batch_tokens=160", "trainer.global_batch_size=8", "trainer.progress_bar=false",
         "trainer.eval_every=0", "optim.warmup_ratio=0", "trainer.grad_clip=1.0", "optim.eps=1e-4"]
# eps 1e-4: Adam's first update is about lr * g / (|g| + eps), so fp32 noise on a near-zero
# gradient would move a weight by up to lr * noise / eps (tests/test_tp_cp_parity.py::adamw_step)
TWO_ENCODERS = ["+recipe=llava_tiny_two_encoders", *SMALL,
                "+projectors={pooled:{pool:2,layout:{tp:${vision.layout.tp}}}}",
                "graph.edges=[[vision,projector],[vision,pooled],[projector,llm],[pooled,llm],"
                "[vision2,projector2],[projector2,llm]]"]
BASES = {"one": (SMALL, {"vision", "projector", "llm"}),
         "two": (TWO_ENCODERS, {"vision", "vision2", "projector", "projector2", "pooled", "llm"})}


def _step(rank, world, container, run_dir):
    from hcp.train.trainer import Trainer

    tr = Trainer(OmegaConf.create(container), run_dir)
    tr.record_encoder_grad_sq = True
    loss, counts, _ = tr.forward_backward(tr.sampler.batch(0))
    groups = tr._tp_groups() or {}
    named = list(tr.modules.named_parameters())
    grads = {n: whole(p.grad, p, groups.get(n.split(".")[0])) for n, p in named}
    norm = tr.clip(tr.cfg.trainer.grad_clip)
    tr.optimizer.step()
    weights = {n: whole(p.data if not isinstance(p, DTensor) else p, p, groups.get(n.split(".")[0]))
               for n, p in named}
    return dict(loss=float(loss), counts=counts, norm=float(norm), grads=grads, weights=weights,
                encoder_grad_sq=getattr(tr, "encoder_grad_sq", None),
                groups={g["name"]: (g["lr"], g["weight_decay"]) for g in tr.optimizer.param_groups},
                sharded=sorted({n.split(".")[0] for n, p in named if isinstance(p, DTensor)}))


CASES = {  # name: (base, layout overrides on 4 ranks)
    "enc_dp4__llm_tp2_dp2": ("one", ["llm.layout.tp=2", "vision.layout.tp=1"]),
    "enc_tp2_dp2__llm_dp4_fan_out": ("one", ["vision.layout.tp=2"]),
    "enc_dp4__llm_pp2_cp2": ("one", ["llm.layout.pp=2", "llm.layout.cp=2", "vision.layout.tp=1"]),
    "enc_tp2_dp2__llm_cp4": ("one", ["llm.layout.cp=4", "vision.layout.tp=2"]),
    "enc_dp4__llm_tp2_dp2_dp_shard": ("one", ["llm.layout.tp=2", "vision.layout.tp=1",
                                              "llm.layout.dp_shard=true"]),
    "two__vision_tp2_dp2__vision2_dp4__llm_tp2_cp2": ("two", ["llm.layout.tp=2", "llm.layout.cp=2",
                                                              "encoders.vision2.layout.tp=1"]),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The single-rank run of the one-encoder base (the two-encoder one: conftest's
    `two_encoder_reference`, shared with the island tests)."""
    run = tmp_path_factory.mktemp("ref")
    return run_ranks(_step, 1, compose_container(SMALL, run), str(run))[0]


def _reference(request, base):
    return request.getfixturevalue("reference" if base == "one" else "two_encoder_reference")


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", CASES)
def test_heterogeneous_layout_step_equals_single_process(name, request, tmp_path):
    base, layout = CASES[name]
    overrides, modules = BASES[base]
    ref = _reference(request, base)
    results = run_ranks(_step, 4, compose_container([*overrides, *layout], tmp_path), str(tmp_path),
                        timeout=220)
    grads, weights = merged(results, "grads"), merged(results, "weights")
    assert {n.split(".")[0] for n in grads} == modules
    assert set(grads) == set(ref["grads"])
    for r in results:
        assert r["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        assert r["counts"] == ref["counts"]
        assert r["norm"] == pytest.approx(ref["norm"], rel=1e-5)
        assert r["encoder_grad_sq"] > 0, "an encoder rank got no gradient of its own"
    assert_all_close(grads, ref["grads"], "grad", **TOL)
    assert_all_close(weights, ref["weights"], "weight", **TOL)


def _plain(rank, world, container):
    """The plain single-process LlavaModel with every encoder (inputs encoded inside), one
    micro-batch per sample of global batch 0: loss and gradients, without trainer, plan or routes."""
    from hcp.data.build import build_datasets
    from hcp.data.loader import GlobalBatchSampler
    from hcp.model import LlavaModel, init_parameters
    from hcp.config.specs import resolve_modules
    from hcp.model.encoder_side import llava_kwargs

    cfg = OmegaConf.create(container)
    specs = resolve_modules(cfg)
    _, ds, _ = build_datasets(cfg, specs)
    model = LlavaModel(**llava_kwargs(specs))
    init_parameters(model, cfg.seed)
    batches = [ds.collate([ds[i]]) for i in GlobalBatchSampler(len(ds), 8, cfg.seed).batch(0)]
    total = sum(int((b.labels != -100).sum()) for b in batches)
    loss = sum(model(b)[0] for b in batches) / total
    loss.backward()
    return float(loss), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("base", BASES)
def test_the_single_rank_run_equals_the_plain_model(base, request, tmp_path):
    ref = _reference(request, base)
    loss, grads = run_ranks(_plain, 1, compose_container(BASES[base][0], tmp_path))[0]
    assert loss == pytest.approx(ref["loss"], rel=1e-6)
    assert set(grads) == set(ref["grads"])
    for key, g in grads.items():
        assert g.abs().sum() > 0, f"{key}: no gradient"
        torch.testing.assert_close(ref["grads"][key], g, **TOL, msg=lambda m, key=key: f"{key}: {m}")
