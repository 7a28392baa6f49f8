"""`packing=dynamic_cp` on the LLM island of `placement=non_colocated`: the step plan packs each
micro-batch and picks its CP group inside the LLM island's pool; the encoder island's rows go,
per micro-batch, straight to the ranks of the CP group holding their sample, in that group's
head-tail layout. Data: `digits_tiles` (2-5 images of 16 rows per sample, so the visual tokens
per sample vary). One step + AdamW through the trainer equals one process's `first_fit` step
(FP32, rtol 1e-5 / atol 1e-6), while the step really ran CP groups of several sizes."""
import pytest

from cfg_utils import compose_container
from dist_utils import run_ranks
from parity_utils import assert_all_close, assert_island_ranks, merged
from test_hetero_parity import SMALL, TOL

TILES = [*SMALL, "data=digits_tiles", "trainer.global_batch_size=16"]
DYNAMIC = ["placement=non_colocated", "vision.layout.tp=1", "packing=dynamic_cp", "trainer.check_plan=true"]
# name: (world, overrides). At 128 tokens per rank the 84-133-token samples run at CP 1 and 2.
CASES = {"enc_dp2__llm_pool4": (6, ["vision.layout.num_ranks=2", "trainer.micro_batch_tokens=128"])}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    from test_hetero_parity import _step

    run = tmp_path_factory.mktemp("ref")
    return run_ranks(_step, 1, compose_container([*TILES, "trainer.micro_batch_tokens=160"], run),
                     str(run), timeout=220)[0]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", CASES)
def test_dynamic_cp_on_the_llm_island_equals_one_process(name, reference, tmp_path):
    world, extra = CASES[name]
    container = compose_container([*TILES, *DYNAMIC, *extra], tmp_path)
    results = run_ranks(_island_step_sizes, world, container, str(tmp_path), timeout=280)
    assert_island_ranks(results, reference)  # each routed row crosses once, to its CP holder
    sizes = {c for r in results for c in r["cp_sizes"]}
    assert len(sizes) > 1 and max(sizes) > 1, sizes   # several CP sizes really ran
    assert len({r["n_micro"] for r in results}) == 1
    assert_all_close(merged(results, "grads"), reference["grads"], "grad", **TOL)
    assert_all_close(merged(results, "weights"), reference["weights"], "weight", **TOL)


def _island_step_sizes(rank, world, container, run_dir):
    """`test_island_parity._island_step`, plus the CP sizes of the non-empty micro-batches this
    rank ran (from its step plan)."""
    from hcp.train.trainer import Trainer
    from test_island_parity import _island_step

    built = []
    init = Trainer.__init__
    Trainer.__init__ = lambda tr, *a: built.append(tr) or init(tr, *a)
    out = _island_step(rank, world, container, run_dir)
    tr = built[0]
    mine = tr.plan(tr.sampler.batch(0)).rank(rank)
    out["cp_sizes"] = sorted({mb.cp_size for mb in mine.micro_batches if not mb.empty})
    return out


@pytest.mark.parametrize("name", CASES)
def test_dynamic_cp_on_islands_passes_the_launch_checks(name):
    """Before ranks start (`hcp.train.support.check_trainable`): no longer refused."""
    from cfg_utils import compose_cfg
    from hcp.config.validate import validate
    from hcp.train.support import check_trainable

    world, extra = CASES[name]
    cfg = compose_cfg([*TILES, *DYNAMIC, *extra, f"launcher.nproc_per_node={world}"])
    check_trainable(cfg, validate(cfg, world_size=world))
