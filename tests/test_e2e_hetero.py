"""Through the CLI: llava_tiny and llava_tiny_hetero (encoder dp4, LLM tp2 x cp2) log the same
losses, and the plan-ahead time is reported."""
import pytest

from cfg_utils import cli_metrics, logged_steps


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_llava_tiny_and_llava_tiny_hetero_log_the_same_losses(llava_tiny_cli, tmp_path):
    homogeneous = logged_steps(llava_tiny_cli)
    hetero = cli_metrics(tmp_path / "hetero", "llava_tiny_hetero", ["trainer.check_plan=true"])
    a, b = [r["loss"] for r in homogeneous], [r["loss"] for r in hetero]
    assert len(a) == 10 and a[-1] < a[0]
    assert b == pytest.approx(a, abs=1e-4)
    assert all(r["plan_s"] > 0 and 0 <= r["plan_hidden_s"] <= r["plan_s"] for r in hetero)
    assert all(r["plan_hidden_s"] > 0 for r in hetero[1:])        # planned behind the step before
