"""`packing=dynamic_cp` trains through the CLI (text-only LLM, tp = 1, pp = 1, no dp_shard):
the per-step token-level losses equal `packing=first_fit` on the same global batches, while the
micro-batches really ran on CP groups of more than one size; every other layout is refused
before ranks start, naming the field and a fix."""
import json
import subprocess
import sys

import numpy as np
import pytest

from cfg_utils import REPO, compose_cfg
from hcp.config.errors import ConfigError
from hcp.config.validate import validate
from hcp.train.support import check_trainable

RUN = ["+recipe=llama_tiny", "trainer.max_steps=3", "logger=none", "trainer.log_every=1",
       "trainer.eval_every=0", "trainer.eval_samples=8", "trainer.progress_bar=false",
       "trainer.global_batch_size=16", "data.max_seq_len=512", "launcher.nproc_per_node=4"]


def _corpus(root):
    """96 source files: mostly short (8-100 bytes), every eighth long (300-500), so a step
    mixes documents that fit one rank at 128 tokens with ones that need CP 4."""
    rng = np.random.default_rng(0)
    for i in range(96):
        n = int(rng.integers(300, 500) if i % 8 == 0 else rng.integers(8, 100))
        (root / f"f{i:03d}.py").write_text("".join(rng.choice(list("abcdef ghij=()\n"), n)))
    return root


def _records(run_dir, extra):
    proc = subprocess.run([sys.executable, "train.py", *RUN, *extra, f"hydra.run.dir={run_dir}"],
                          cwd=REPO, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(run_dir / "metrics.jsonl") as f:
        return [r for r in map(json.loads, f) if "loss" in r]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dynamic_cp_trains_with_the_losses_of_first_fit(tmp_path):
    (tmp_path / "src").mkdir()
    data = f"data.path={_corpus(tmp_path / 'src')}"
    ff = _records(tmp_path / "ff", [data, "trainer.micro_batch_tokens=512"])
    dyn = _records(tmp_path / "dyn", [data, "packing=dynamic_cp", "trainer.micro_batch_tokens=128"])
    dyn22 = _records(tmp_path / "dyn22", [data, "packing=dynamic_cp", "trainer.micro_batch_tokens=128",
                                         "llm.layout.cp=2"])
    losses = [r["loss"] for r in ff]
    assert len(losses) == 3 and losses[-1] < losses[0]
    for run in (dyn, dyn22):
        assert [r["loss"] for r in run] == pytest.approx(losses, rel=1e-4, abs=1e-4)
        assert [r["loss_tokens"] for r in run] == [r["loss_tokens"] for r in ff]
        used = {k for r in run for k in r if k.startswith("micro_batches_cp")}
        assert "micro_batches_cp1" in used and len(used) > 1, used  # CP 1 and CP > 1 both ran
    assert not any(k.startswith("micro_batches_cp") for r in ff for k in r)


@pytest.mark.parametrize("overrides, field", [
    (["llm.layout.tp=2"], "llm.layout.tp"),
    (["llm.layout.pp=2"], "llm.layout.pp"),
    (["llm.layout.dp_shard=true"], "llm.layout.dp_shard"),
    (["packing_profile=nowhere.yaml"], "packing_profile"),
])
def test_dynamic_cp_training_refuses_what_it_does_not_run(overrides, field):
    cfg = compose_cfg(["+recipe=llama_tiny", "packing=dynamic_cp", *overrides])
    with pytest.raises(ConfigError) as e:
        check_trainable(cfg, validate(cfg, world_size=4))
    assert e.value.field == field and "Fix:" in str(e.value)


def test_dynamic_cp_training_refuses_an_encoder_side_and_accepts_a_text_only_pool():
    cfg = compose_cfg(["packing=dynamic_cp"])                      # LLaVA: vision + projector
    with pytest.raises(ConfigError) as e:
        check_trainable(cfg, validate(cfg, world_size=4))
    assert e.value.field == "packing" and "first_fit" in str(e.value) and "vision" in str(e.value)
    for cp in (1, 2):
        cfg = compose_cfg(["+recipe=llama_tiny", "packing=dynamic_cp", f"llm.layout.cp={cp}"])
        check_trainable(cfg, validate(cfg, world_size=4))
