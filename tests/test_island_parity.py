"""placement=non_colocated through the trainer equals the single-process LLaVA (FP32): one
step's loss, every module's gradients (made whole over TP, gathered over the islands and
pipeline stages), the global gradient norm and the weights after one AdamW step; rtol 1e-5 /
atol 1e-6. Islands: encoder dp2 (ranks 0-1) + LLM tp2 (ranks 2-3); encoder dp2 + LLM pp2 x cp2
sharded with FSDP over its CP group (`llm.layout.dp_shard`);
an encoder with PP 2 (blocks split, projector on the last stage) + an LLM with TP 2. Only the
encoder's first stage reads images, only the LLM's first stage reads text."""
import pytest
from omegaconf import OmegaConf
from torch.distributed.tensor import DTensor

from cfg_utils import compose_cfg, compose_container
from dist_utils import run_ranks
from parity_utils import assert_all_close, assert_island_ranks, merged, whole
from test_hetero_parity import SMALL, TOL
from hcp.config.specs import resolve_modules

NON_COLOCATED = ["placement=non_colocated", "vision.layout.tp=1"]


def _island_step(rank, world, container, run_dir):
    import hcp.train.rank_data as rank_data  # where the trainer collates its text
    from hcp.train.trainer import Trainer

    tr = Trainer(OmegaConf.create(container), run_dir)
    tr.record_encoder_grad_sq = True
    reads = {"images": 0, "text": 0}
    pixel_values, collate = tr.train_set.pixel_values, rank_data.collate

    def count_images(sample, *encoder):
        reads["images"] += 1
        return pixel_values(sample, *encoder)

    def count_text(samples, *args):
        reads["text"] += len(samples)
        return collate(samples, *args)

    tr.train_set.pixel_values, rank_data.collate = count_images, count_text
    forwards = []  # forwards of the stage's first ViT block (recompute: two per micro-batch;
    if tr.encoder is not None:  # a module hook would not see checkpoint's recompute)
        blocks = tr.encoder.encoder.blocks
        block = next(iter(blocks.values() if hasattr(blocks, "values") else blocks))
        block.forward = lambda x, *a, forward=block.forward: forwards.append(1) or forward(x, *a)
    loss, counts, n_micro = tr.forward_backward(tr.sampler.batch(0))
    rank_data.collate = collate
    group = tr.encoder.tp_group if tr.encoder is not None else tr.tp_group
    named = list(tr.modules.named_parameters())
    grads = {n: whole(p.grad, p, group) for n, p in named}
    norm = tr.clip(tr.cfg.trainer.grad_clip)
    tr.optimizer.step()
    weights = {n: whole(p.data, p, group) for n, p in named}
    first = (tr.encoder.stage if tr.encoder is not None else tr.stage).first
    sent = getattr(tr, "route_bytes", None)
    image_rows = tr.plan(tr.sampler.batch(0)).counts.image_rows
    return dict(loss=float(loss), counts=counts, norm=float(norm), grads=grads, weights=weights, n_micro=n_micro,
                encoder=tr.encoder is not None, first=first, head=getattr(tr, "head", None),
                forwards=len(forwards), sharded=any(isinstance(p, DTensor) for _, p in named), reads=reads, image_rows=image_rows,
                route_bytes=(sent.forward, sent.backward) if sent is not None else (0, 0), encoder_grad_sq=getattr(tr, "encoder_grad_sq", None))


CASES = {
    "enc_dp2__llm_tp2": (4, ["vision.layout.num_ranks=2", "llm.layout.tp=2"]),
    "enc_dp2__llm_pp2_cp2_dp_shard": (6, ["vision.layout.num_ranks=2", "llm.layout.pp=2", "llm.layout.cp=2",
                                          "llm.layout.dp_shard=true"]),
    "enc_pp2__llm_tp2": (4, ["vision.layout.num_ranks=2", "vision.layout.pp=2", "llm.layout.tp=2",
                             "trainer.global_batch_size=8"]),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    from test_hetero_parity import _step

    run = tmp_path_factory.mktemp("ref")
    container = compose_container(SMALL, run)
    return run_ranks(_step, 1, container, str(run))[0]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", CASES)
def test_non_colocated_step_equals_single_process(name, reference, tmp_path):
    world, extra = CASES[name]
    container = compose_container([*SMALL, *NON_COLOCATED, *extra], tmp_path)
    results = run_ranks(_island_step, world, container, str(tmp_path), timeout=220)
    grads, weights = merged(results, "grads"), merged(results, "weights")
    assert set(grads) == set(reference["grads"])
    assert len({r["n_micro"] for r in results}) == 1 and results[0]["n_micro"] > 1
    assert all(r["sharded"] == ("llm.layout.dp_shard=true" in extra and not r["encoder"]) for r in results)
    assert_island_ranks(results, reference)  # leader route: one LLM TP rank per shard receives
    assert all(r["encoder_grad_sq"] > 0 for r in results if r["encoder"] and "vision.patch_embed.weight" in r["grads"])
    assert_all_close(grads, reference["grads"], "grad", **TOL)
    assert_all_close(weights, reference["weights"], "weight", **TOL)


def test_non_colocated_trains_encoder_pp_and_refuses_what_it_cannot_run_with_a_fix():
    from hcp.config.errors import ConfigError
    from hcp.config.validate import validate
    from hcp.train.support import check_trainable

    base = ["placement=non_colocated", "vision.layout.num_ranks=2", "vision.layout.tp=1"]
    cfg = compose_cfg([*base, "vision.layout.pp=2", "vision.layout.recompute=full", "vision.layout.dp_shard=true"])
    check_trainable(cfg, resolve_modules(cfg, validate(cfg, world_size=4)))   # encoder PP, recompute and FSDP on its island
    for extra, field in [(["projector.layout.tp=2"], "projector.layout.tp"),
                         (["projector.layout.recompute=full"], "projector.layout.recompute"),
                         (["projector.layout.dp_shard=true"], "projector.layout.dp_shard"),
                         (["vision.freeze=true", "projector.freeze=true"], "vision.freeze"),
                         (["llm.freeze=true"], "llm.freeze")]:
        cfg = compose_cfg([*base, *extra])
        with pytest.raises(ConfigError) as e:
            check_trainable(cfg, resolve_modules(cfg, validate(cfg, world_size=4)))
        assert e.value.field == field and "Fix:" in str(e.value)
    cfg = compose_cfg(["+recipe=llama_tiny", "placement=non_colocated"])     # text only: no island
    with pytest.raises(ConfigError, match="no encoder island"):
        check_trainable(cfg, resolve_modules(cfg, validate(cfg, world_size=4)))
