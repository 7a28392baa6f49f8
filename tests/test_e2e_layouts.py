"""Through the CLI: the same llama_tiny run under different layouts logs the same losses as its
dp4 run (one per module)."""
import json
import subprocess
import sys

import pytest

from cfg_utils import REPO

STEPS = 20
RUN = ["+recipe=llama_tiny", f"trainer.max_steps={STEPS}", "logger=none", "trainer.log_every=1",
       "trainer.eval_every=0", "trainer.eval_samples=16", "trainer.progress_bar=false",
       "trainer.global_batch_size=8", "data.max_seq_len=256", "trainer.micro_batch_tokens=512",
       "launcher.nproc_per_node=4"]


def _losses(run_dir, layout):
    proc = subprocess.run([sys.executable, "train.py", *RUN, *layout, f"hydra.run.dir={run_dir}"],
                          cwd=REPO, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(run_dir / "metrics.jsonl") as f:
        return [r["loss"] for r in map(json.loads, f) if "loss" in r]


@pytest.fixture(scope="module")
def dp4(tmp_path_factory):
    """The dp4 run's losses: the reference of every layout here."""
    losses = _losses(tmp_path_factory.mktemp("dp4"), [])
    assert len(losses) == STEPS and losses[-1] < losses[0]
    return losses


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_llama_tiny_dp4_and_tp2_cp2_log_the_same_losses(dp4, tmp_path):
    tp2cp2 = _losses(tmp_path / "tp2cp2", ["llm.layout.tp=2", "llm.layout.cp=2"])
    ring = _losses(tmp_path / "cp2p2p", ["llm.layout.cp=2", "llm.layout.cp_comm=p2p"])
    assert tp2cp2 == pytest.approx(dp4, rel=1e-4)
    assert ring == pytest.approx(dp4, rel=1e-4)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_llama_tiny_dp4_and_pp2_cp2_log_the_same_losses(dp4, tmp_path):
    pp2cp2 = _losses(tmp_path / "pp2cp2", ["llm.layout.pp=2", "llm.layout.cp=2"])
    assert pp2cp2 == pytest.approx(dp4, rel=1e-4)
