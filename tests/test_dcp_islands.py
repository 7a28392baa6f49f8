"""`packing=dynamic_cp` on the LLM island of `placement=non_colocated`: the step plan packs each
micro-batch and picks its CP group inside the LLM island's pool; the encoder island's rows go,
per micro-batch, straight to the ranks of the CP group holding their sample, in that group's
head-tail layout. Data: `digits_tiles` (2-5 images of 16 rows per sample, so the visual tokens
per sample vary). One step + AdamW through the trainer equals one process's `first_fit` step
(FP32, rtol 1e-5 / atol 1e-6), while the step ran the CP sizes the plan chose (checked, so the test cannot hold by
construction). Cases: encoder dp2 + LLM pool 4 (dp4); the same with the LLM pp2 x dp2 (pool 2,
every stage on its plan's groups); the two-encoder recipe with a branch (vision -> projector and
a pooled projector, vision2 -> projector2: a join of two islands) + LLM pool 4 at CP 2, where
every stream's rows reach the CP rank holding its own placeholders (digits_pair: 76 tokens per
sample). About 40-100 s each on the loaded 2-core machine (6 forked ranks), the one-process
references about 20 s."""
import pytest

from cfg_utils import compose_container
from dist_utils import run_ranks
from parity_utils import assert_all_close, assert_island_ranks, merged
from test_hetero_parity import SMALL, TOL, TWO_ENCODERS
from hcp.config.specs import resolve_modules

TILES = [*SMALL, "data=digits_tiles", "trainer.global_batch_size=16"]
DYNAMIC = ["placement=non_colocated", "vision.layout.tp=1", "packing=dynamic_cp", "trainer.check_plan=true"]
# name: (base, world, overrides, CP sizes the plan runs). At 128 tokens per rank the 84-133-token
# tiled samples run at CP 1 and 2; at 40 the 76-token pairs at CP 2 (two groups of 2 per micro-batch).
CASES = {"enc_dp2__llm_pool4": ("tiles", 6, ["vision.layout.num_ranks=2", "trainer.micro_batch_tokens=128"], {1, 2}),
         "enc_dp2__llm_pp2_pool2": ("tiles", 6, ["vision.layout.num_ranks=2", "llm.layout.pp=2",
                                                 "trainer.micro_batch_tokens=128"], {1, 2}),
         "two_branch__llm_pool4": ("two", 6, ["vision.layout.num_ranks=1", "encoders.vision2.layout.num_ranks=1",
                                              "encoders.vision2.layout.tp=1", "trainer.micro_batch_tokens=40"], {2})}
BASES = {"tiles": TILES, "two": TWO_ENCODERS}


@pytest.fixture(scope="module")
def tiles_reference(tmp_path_factory):
    from test_hetero_parity import _step

    run = tmp_path_factory.mktemp("ref")
    return run_ranks(_step, 1, compose_container([*TILES, "trainer.micro_batch_tokens=160"], run),
                     str(run), timeout=220)[0]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", CASES)
def test_dynamic_cp_on_the_llm_island_equals_one_process(name, request, tmp_path):
    base, world, extra, want = CASES[name]
    reference = request.getfixturevalue("tiles_reference" if base == "tiles" else "two_encoder_reference")
    container = compose_container([*BASES[base], *DYNAMIC, *extra], tmp_path)
    results = run_ranks(_island_step_sizes, world, container, str(tmp_path), timeout=280)
    assert_island_ranks(results, reference)  # each routed row crosses once, to its CP holder
    assert {c for r in results for c in r["cp_sizes"]} == want
    assert len({r["n_micro"] for r in results}) == 1
    assert set(merged(results, "grads")) == set(reference["grads"])
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

    base, world, extra, _ = CASES[name]
    cfg = compose_cfg([*BASES[base], *DYNAMIC, *extra, f"launcher.nproc_per_node={world}"])
    check_trainable(cfg, resolve_modules(cfg, validate(cfg, world_size=world)))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ten_cli_steps_on_islands_log_the_colocated_first_fit_losses(tmp_path):
    """`+recipe=internvl_tiles_tiny` (tiles, encoder CP 2) colocated with first_fit, against the
    same recipe on islands: vision cp2 on ranks 0-1, the LLM pool of 4 with dynamic CP on ranks
    2-5 (CP 1 and 2 chosen per micro-batch). Losses of 10 steps and the final held-out
    evaluation within 1e-4. Two CLI runs of 10 steps of 8 samples (about 150 s together on the
    loaded machine)."""
    from cfg_utils import cli_metrics, run_summary

    small = ["trainer.global_batch_size=8", "trainer.check_plan=true"]
    ref = cli_metrics(tmp_path / "colocated", "internvl_tiles_tiny", small)
    got = cli_metrics(tmp_path / "islands", "internvl_tiles_tiny", [
        *small, "placement=non_colocated", "vision.layout.num_ranks=2", "llm.layout.tp=1",
        "packing=dynamic_cp", "trainer.micro_batch_tokens=128", "launcher.nproc_per_node=6"])
    a, b = [r["loss"] for r in ref], [r["loss"] for r in got]
    assert len(a) == 10 and a[-1] < a[0]
    assert b == pytest.approx(a, abs=1e-4)
    assert [r["loss_tokens"] for r in got] == [r["loss_tokens"] for r in ref]
    sizes = {int(k.removeprefix("micro_batches_cp")) for r in got for k in r if k.startswith("micro_batches_cp")}
    assert sizes == {1, 2}, sizes
    summary, ref_summary = run_summary(tmp_path / "islands"), run_summary(tmp_path / "colocated")
    assert summary["eval/samples"] == ref_summary["eval/samples"] > 0
    assert summary["eval/loss"] == pytest.approx(ref_summary["eval/loss"], abs=1e-4)


def test_plan_mode_at_full_size_shows_encoder_cp_and_dynamic_cp(tmp_path, capsys):
    """`internvl_tiles_cp` on islands with dynamic CP (128 ranks, no process): the table and the
    picture (`plan.png`'s figure) say how each module runs CP. A few seconds."""
    from cfg_utils import compose_cfg
    from hcp.config.layouts import check_layouts
    from hcp.preflight.plan_mode import cp_notes, run_plan
    from hcp.preflight.plan_figure import plan_figure

    cfg = compose_cfg(["+recipe=internvl_tiles_cp", "mode=plan", "placement=non_colocated",
                       "vision.layout.num_ranks=64", "packing=dynamic_cp"])
    plan = run_plan(cfg, tmp_path)
    encoder = "encoder CP 4: every input's tokens split over 4 ranks"
    dynamic = "dynamic CP: pool dp*cp = 4 ranks per stage, CP 1/2/4 chosen per micro-batch"
    assert plan["modules"]["vision"]["cp"] == encoder and plan["modules"]["llm"]["cp"] == dynamic
    assert "cp" not in plan["modules"]["projector"]
    out = capsys.readouterr().out
    assert encoder in out and dynamic in out and (tmp_path / "plan.png").exists()
    fig = plan_figure(check_layouts(cfg, 128), 128, 8, cp_notes=cp_notes(cfg, check_layouts(cfg, 128)))
    texts = {t.get_text() for t in fig.axes[0].texts}
    assert {encoder, dynamic} <= texts
