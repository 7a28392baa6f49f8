"""Several encoders through the trainer, colocated (issue 14 part 3): the two-encoder recipe with
a branch on top (vision -> projector and a pooled projector; vision2 -> projector2; all into
the LLM) on 4 forked gloo ranks, every module at its own layout (vision tp2 x dp2, vision2 dp4,
LLM tp2 x cp2), equals the single-rank run (FP32, rtol 1e-5 / atol 1e-6): loss, token counts,
every module's gradients made whole over TP, the global gradient norm and the weights after
one AdamW step. The single-rank run itself equals the plain `LlavaModel` with every encoder."""
import pytest
import torch
from omegaconf import OmegaConf

from cfg_utils import compose_container
from dist_utils import run_ranks
from parity_utils import assert_all_close, merged, whole

TOL = dict(rtol=1e-5, atol=1e-6)
SMALL = ["+recipe=llava_tiny_two_encoders", "trainer.micro_batch_tokens=160", "trainer.global_batch_size=8",
         "trainer.progress_bar=false", "trainer.eval_every=0", "optim.warmup_ratio=0", "trainer.grad_clip=1.0",
         "optim.eps=1e-4",  # Adam's first step ~ lr * g / (|g| + eps): fp32 noise on tiny g (test_hetero_parity)
         "+projectors={pooled:{pool:2,layout:{tp:${vision.layout.tp}}}}",
         "graph.edges=[[vision,projector],[vision,pooled],[projector,llm],[pooled,llm],[vision2,projector2],"
         "[projector2,llm]]"]
LAYOUT = ["llm.layout.tp=2", "llm.layout.cp=2", "encoders.vision2.layout.tp=1"]


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
    weights = {n: whole(p.data, p, groups.get(n.split(".")[0])) for n, p in named}
    return dict(loss=loss, counts=counts, norm=norm, grads=grads, weights=weights,
                encoder_grad_sq=tr.encoder_grad_sq)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_join_and_branch_at_their_own_layouts_equal_the_single_rank_run(two_encoder_reference, tmp_path):
    results = run_ranks(_step, 4, compose_container([*SMALL, *LAYOUT], tmp_path), str(tmp_path), timeout=220)
    grads, weights = merged(results, "grads"), merged(results, "weights")
    assert {n.split(".")[0] for n in grads} == {"vision", "vision2", "projector", "projector2", "pooled", "llm"}
    assert set(grads) == set(two_encoder_reference["grads"])
    for r in results:
        assert r["loss"] == pytest.approx(two_encoder_reference["loss"], rel=1e-5)
        assert r["counts"] == two_encoder_reference["counts"]
        assert r["norm"] == pytest.approx(two_encoder_reference["norm"], rel=1e-5)
        assert r["encoder_grad_sq"] > 0, "an encoder rank got no gradient of its own"
    assert_all_close(grads, two_encoder_reference["grads"], "grad", **TOL)
    assert_all_close(weights, two_encoder_reference["weights"], "weight", **TOL)


def _plain(rank, world, container):
    """The plain single-process LlavaModel with every encoder (inputs encoded inside), one
    micro-batch per sample of global batch 0: loss and gradients, without trainer, plan or routes."""
    from hcp.data.build import build_datasets
    from hcp.data.loader import GlobalBatchSampler
    from hcp.model import LlavaModel, init_parameters
    from hcp.model.encoder_side import graph_kwargs

    cfg = OmegaConf.create(container)
    _, ds, _ = build_datasets(cfg)
    model = LlavaModel(cfg.vision, cfg.projector, cfg.llm, **graph_kwargs(cfg))
    init_parameters(model, cfg.seed)
    batches = [ds.collate([ds[i]]) for i in GlobalBatchSampler(len(ds), 8, cfg.seed).batch(0)]
    total = sum(int((b.labels != -100).sum()) for b in batches)
    loss = sum(model(b)[0] for b in batches) / total
    loss.backward()
    return float(loss), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.slow
def test_the_single_rank_run_equals_the_plain_model_with_every_encoder(two_encoder_reference, tmp_path):
    loss, grads = run_ranks(_plain, 1, compose_container(SMALL, tmp_path))[0]
    assert loss == pytest.approx(two_encoder_reference["loss"], rel=1e-6)
    assert set(grads) == set(two_encoder_reference["grads"])
    for key, g in grads.items():
        assert g.abs().sum() > 0, f"{key}: no gradient"
        torch.testing.assert_close(two_encoder_reference["grads"][key], g, **TOL, msg=lambda m, key=key: f"{key}: {m}")
