"""Heterogeneous layouts through the trainer equal the single-process LLaVA (FP32): one step's
loss, every module's gradients (made whole over TP and FSDP, gathered over PP stages), the global
gradient norm and the weights after one AdamW step; rtol 1e-5 / atol 1e-6."""
import pytest
import torch
from omegaconf import OmegaConf
from torch.distributed.tensor import DTensor

from cfg_utils import compose_cfg
from dist_utils import run_ranks
from parity_utils import assert_all_close, merged, whole

TOL = dict(rtol=1e-5, atol=1e-6)
SMALL = ["trainer.micro_batch_tokens=160", "trainer.global_batch_size=8", "trainer.progress_bar=false",
         "trainer.eval_every=0", "optim.warmup_ratio=0", "trainer.grad_clip=1.0", "optim.eps=1e-4"]
# eps 1e-4: Adam's first update is about lr * g / (|g| + eps), so fp32 noise on a near-zero
# gradient would move a weight by up to lr * noise / eps (tests/test_tp_cp_parity.py::adamw_step)


def _step(rank, world, container, run_dir):
    from hcp.train.trainer import Trainer

    tr = Trainer(OmegaConf.create(container), run_dir)
    tr.record_encoder_grad_sq = True
    loss, counts, _ = tr.forward_backward(tr.sampler.batch(0))
    groups = {"vision": tr.encoder.tp_group, "projector": tr.encoder.tp_group, "llm": tr.tp_group}
    named = list(tr.modules.named_parameters())
    grads = {n: whole(p.grad, p, groups[n.split(".")[0]]) for n, p in named}
    norm = tr.clip(tr.cfg.trainer.grad_clip)
    tr.optimizer.step()
    weights = {n: whole(p.data if not isinstance(p, DTensor) else p, p, groups[n.split(".")[0]])
               for n, p in named}
    return dict(loss=loss, counts=counts, norm=norm, grads=grads, weights=weights,
                encoder_grad_sq=getattr(tr, "encoder_grad_sq", None),
                groups={g["name"]: (g["lr"], g["weight_decay"]) for g in tr.optimizer.param_groups},
                sharded=sorted({n.split(".")[0] for n, p in named if isinstance(p, DTensor)}))



CASES = {
    "enc_dp4__llm_tp2_dp2": ["llm.layout.tp=2", "vision.layout.tp=1"],
    "enc_tp2_dp2__llm_dp4_fan_out": ["vision.layout.tp=2"],
    "enc_dp4__llm_pp2_cp2": ["llm.layout.pp=2", "llm.layout.cp=2", "vision.layout.tp=1"],
    "enc_tp2_dp2__llm_cp4": ["llm.layout.cp=4", "vision.layout.tp=2"],
    "enc_dp4__llm_tp2_dp2_dp_shard": ["llm.layout.tp=2", "vision.layout.tp=1", "llm.layout.dp_shard=true"],
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("ref")
    container = OmegaConf.to_container(compose_cfg(SMALL, run_dir=str(run)), resolve=True)
    return run_ranks(_step, 1, container, str(run))[0]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", CASES)
def test_heterogeneous_layout_step_equals_single_process(name, reference, tmp_path):
    container = OmegaConf.to_container(compose_cfg([*SMALL, *CASES[name]], run_dir=str(tmp_path)),
                                       resolve=True)
    results = run_ranks(_step, 4, container, str(tmp_path), timeout=220)
    grads, weights = merged(results, "grads"), merged(results, "weights")
    assert set(grads) == set(reference["grads"])
    for r in results:
        assert r["loss"] == pytest.approx(reference["loss"], rel=1e-5)
        assert r["counts"] == reference["counts"]
        assert r["norm"] == pytest.approx(reference["norm"], rel=1e-5)
        assert r["encoder_grad_sq"] > 0, "an encoder rank got no gradient of its own"
    assert_all_close(grads, reference["grads"], "grad", **TOL)
    assert_all_close(weights, reference["weights"], "weight", **TOL)


def _plain_llava(rank, world, container):
    """The plain single-process LlavaModel (encoder inside, every sample one micro-batch): the
    loss and gradients of global batch 0, without the trainer, plan or routes."""
    from hcp.data.build import build_datasets
    from hcp.data.loader import GlobalBatchSampler
    from hcp.data.packing import collate
    from hcp.model import LlavaModel, init_parameters

    cfg = OmegaConf.create(container)
    tok, ds, _ = build_datasets(cfg)
    model = LlavaModel(cfg.vision, cfg.projector, cfg.llm)
    init_parameters(model, cfg.seed)
    samples = [ds[i] for i in GlobalBatchSampler(len(ds), 8, cfg.seed).batch(0)]
    batches = [collate([s], [ds.pixel_values(s)], tok.image_token_id) for s in samples]
    total = sum(int((b.labels != -100).sum()) for b in batches)
    loss = sum(model(b)[0] for b in batches) / total
    loss.backward()
    return float(loss), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_the_single_rank_reference_equals_the_plain_llava_model(reference, tmp_path):
    container = OmegaConf.to_container(compose_cfg(SMALL, run_dir=str(tmp_path)), resolve=True)
    loss, grads = run_ranks(_plain_llava, 1, container)[0]
    assert loss == pytest.approx(reference["loss"], rel=1e-6)
    assert set(grads) == set(reference["grads"])
    for key, g in grads.items():
        torch.testing.assert_close(reference["grads"][key], g, **TOL, msg=lambda m, key=key: f"{key}: {m}")
