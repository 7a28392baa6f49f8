"""Through the CLI: llava_tiny_hetero with placement=non_colocated (a vision island of 2 ranks,
the LLM's tp2 x cp2 on ranks 2-5) logs the same losses as llava_tiny for 10 steps, and a run
resumed from its step-5 checkpoint (each island saved its own modules) with the encoder split
into two pipeline stages of encoder CP 2 instead of two DP lanes continues with them; the
final held-out evaluation (encoder weights sent to the LLM island) gives llava_tiny's. Several
encoders: 10 steps of llava_tiny_two_encoders with a branch on top, each encoder on its own
island (vision + projector + pooled on rank 0, vision2 + projector2 on rank 1, the LLM dp2 on
ranks 2-3, sharded with FSDP), log the colocated run's losses and held-out evaluation, and
resumed from step 5 with the vision island sharded over two ranks, vision2 on encoder CP 2 and
the LLM whole on one rank continue them."""
import pytest

from cfg_utils import cli_metrics, logged_steps, run_summary

ISLANDS = ["placement=non_colocated", "vision.layout.num_ranks=2", "launcher.nproc_per_node=6",
           "trainer.check_plan=true"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_non_colocated_llava_tiny_hetero_logs_llava_tiny_losses_and_resumes(llava_tiny_cli, tmp_path):
    homogeneous = logged_steps(llava_tiny_cli)
    islands = cli_metrics(tmp_path / "islands", "llava_tiny_hetero", [*ISLANDS, "trainer.save_every=5"])
    a, b = [r["loss"] for r in homogeneous], [r["loss"] for r in islands]
    assert len(a) == 10 and a[-1] < a[0]
    assert b == pytest.approx(a, abs=1e-4)
    # the final held-out evaluation re-encodes images on the LLM island with the island's weights
    ref, got = run_summary(llava_tiny_cli), run_summary(tmp_path / "islands")
    assert got["eval/samples"] == ref["eval/samples"] == 16
    assert got["eval/loss"] == pytest.approx(ref["eval/loss"], abs=1e-4)
    step5 = tmp_path / "islands" / "checkpoints" / "step_00000005"
    # resumed with the encoder split into two pipeline stages of encoder CP 2 (4 ranks) instead
    # of two DP lanes
    resumed = cli_metrics(tmp_path / "resumed", "llava_tiny_hetero", [
        *[o for o in ISLANDS if not o.startswith(("vision.layout.num_ranks", "launcher."))],
        "vision.layout.num_ranks=4", "launcher.nproc_per_node=8", "vision.layout.pp=2", "vision.layout.cp=2",
        f"resume={step5}"])
    assert [r["step"] for r in resumed] == list(range(6, 11))
    assert [r["loss"] for r in resumed] == pytest.approx(b[5:], abs=1e-4)


TWO_ENCODERS_BRANCH = ["+projectors={pooled:{pool:2,layout:{tp:${vision.layout.tp}}}}",
                       "graph.edges=[[vision,projector],[vision,pooled],[projector,llm],[pooled,llm],"
                       "[vision2,projector2],[projector2,llm]]"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_encoders_on_their_own_islands_log_the_colocated_losses(tmp_path):
    colocated = cli_metrics(tmp_path / "colocated", "llava_tiny_two_encoders", TWO_ENCODERS_BRANCH)
    base = [*TWO_ENCODERS_BRANCH, "placement=non_colocated", "vision.layout.tp=1", "encoders.vision2.layout.tp=1",
            "encoders.vision2.layout.num_ranks=1", "trainer.check_plan=true"]
    islands = cli_metrics(tmp_path / "islands", "llava_tiny_two_encoders",
                          [*base, "vision.layout.num_ranks=1", "llm.layout.dp_shard=true", "trainer.save_every=5"])
    a, b = [r["loss"] for r in colocated], [r["loss"] for r in islands]
    assert len(a) == 10 and a[-1] < a[0]
    assert b == pytest.approx(a, abs=1e-4)
    ref, got = run_summary(tmp_path / "colocated"), run_summary(tmp_path / "islands")
    assert got["eval/samples"] == ref["eval/samples"] > 0
    assert got["eval/loss"] == pytest.approx(ref["eval/loss"], abs=1e-4)
    # resumed from step 5 with the vision island sharded (FSDP over dp2 on ranks 0-1), vision2
    # split over encoder CP 2 (ranks 2-3: each holds a chunk of every scan's tokens) and the
    # LLM whole on one rank instead of sharded over dp2: every island loads its modules and
    # continues the same run
    step5 = tmp_path / "islands" / "checkpoints" / "step_00000005"
    resumed = cli_metrics(tmp_path / "resumed", "llava_tiny_two_encoders", [
        *[o for o in base if not o.startswith("encoders.vision2.layout.num_ranks")],
        "encoders.vision2.layout.num_ranks=2", "encoders.vision2.layout.cp=2", "launcher.nproc_per_node=5",
        "vision.layout.num_ranks=2", "vision.layout.dp_shard=true", f"resume={step5}"])
    assert [r["step"] for r in resumed] == list(range(6, 11))
    assert [r["loss"] for r in resumed] == pytest.approx(b[5:], abs=1e-4)
