"""Several encoders under placement=non_colocated (issue 14), each on its own island, through the
trainer, equal the single-process model (FP32, rtol 1e-5 / atol 1e-6): one step's loss, token
counts, every module's gradients (made whole over TP, gathered over islands and stages), the
global gradient norm and the weights after one AdamW step. The graph is the two-encoder recipe
with a branch on top: `vision` feeds `projector` and a pooled `pooled` projector (a branch on
its island: the tower runs once, its gradient is the sum of both), `vision2` feeds `projector2`
(a join: two islands into the LLM's first stage). Islands: vision dp2 sharded with FSDP
(`dp_shard`) on ranks 0-1, vision2 on rank 2, LLM tp2 on ranks 3-4; vision pp2 with
`recompute=full` (each ViT block runs its forward again in its backward) on ranks 0-1, vision2
dp2 on ranks 2-3 (fan-in), LLM pp2 x cp2 on ranks 4-7. Each island reads only its own
encoder's inputs, the LLM only text; every stream's
rows cross the islands once forward and once backward (the minimum)."""
import pytest

from cfg_utils import compose_cfg, compose_container
from dist_utils import run_ranks
from parity_utils import assert_all_close, assert_island_ranks, merged
from test_island_parity import _island_step
from test_hetero_parity import TOL, TWO_ENCODERS
from hcp.config.specs import resolve_modules

ISLANDS = ["placement=non_colocated", "vision.layout.tp=1", "encoders.vision2.layout.tp=1"]
CASES = {
    "vision_dp2_fsdp__vision2_1__llm_tp2": (5, [
        "vision.layout.num_ranks=2", "vision.layout.dp_shard=true", "encoders.vision2.layout.num_ranks=1",
        "llm.layout.tp=2", "launcher.nproc_per_node=5"]),
    "vision_pp2_recompute__vision2_dp2__llm_pp2_cp2": (8, [
        "vision.layout.num_ranks=2", "vision.layout.pp=2", "vision.layout.recompute=full",
        "encoders.vision2.layout.num_ranks=2", "llm.layout.cp=2", "llm.layout.pp=2",
        "launcher.nproc_per_node=8"]),
}


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", CASES)
def test_join_and_branch_on_islands_equal_the_single_process_model(name, two_encoder_reference, tmp_path):
    world, extra = CASES[name]
    results = run_ranks(_island_step, world, compose_container([*TWO_ENCODERS, *ISLANDS, *extra], tmp_path),
                        str(tmp_path), timeout=220)
    grads, weights = merged(results, "grads"), merged(results, "weights")
    assert {n.split(".")[0] for n in grads} == {"vision", "vision2", "projector", "projector2", "pooled", "llm"}
    assert set(grads) == set(two_encoder_reference["grads"])
    assert len({r["n_micro"] for r in results}) == 1 and results[0]["n_micro"] > 1
    recompute = "vision.layout.recompute=full" in extra
    sharded = "vision.layout.dp_shard=true" in extra
    assert all(r["sharded"] == (sharded and r["head"] == "vision") for r in results)
    for r in results:  # the recomputing island runs each block's forward again in its backward
        assert r["forwards"] == (0 if not r["encoder"] else
                                 r["n_micro"] * (2 if recompute and r["head"] == "vision" else 1))
    # every stream's rows (projector 16 + pooled 4 per vision input, projector2 4 per vision2 input)
    assert_island_ranks(results, two_encoder_reference)
    assert_all_close(grads, two_encoder_reference["grads"], "grad", **TOL)
    assert_all_close(weights, two_encoder_reference["weights"], "weight", **TOL)


@pytest.mark.parametrize("name", CASES)
def test_join_and_branch_on_islands_pass_the_training_checks(name):
    from hcp.config.validate import validate
    from hcp.train.support import check_trainable

    world, extra = CASES[name]
    cfg = compose_cfg([*TWO_ENCODERS, *ISLANDS, *extra])
    layouts = validate(cfg, world)
    check_trainable(cfg, resolve_modules(cfg, layouts))
    assert layouts["llm"].rank_offset == world - layouts["llm"].num_ranks
