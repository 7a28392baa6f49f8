"""What the logging rank prints: plain per-step lines off a terminal, a bar on one, wandb's
offline note and sync command."""
import os
import sys

import pytest

from hcp.config.schema import LoggerConfig, TrainerConfig
from hcp.train.metrics_log import RunLogger

STEP = {"loss": 2.34567, "lr": 5e-4, "grad_norm": 1.25, "tokens_per_s": 12345.6, "step_time_s": 0.125,
        "peak_memory_gib": 0.34, "tflops_per_gpu": 0.01}


def test_plain_step_lines_when_stdout_is_not_a_terminal(tmp_path, capsys):
    log = RunLogger(str(tmp_path), LoggerConfig(name="none"), TrainerConfig(max_steps=300))
    log.log(10, STEP)
    log.log(300, {"eval/answer_accuracy": 0.95})
    out = capsys.readouterr().out.splitlines()
    assert log.plain and out == [
        "step 10/300 | loss 2.3457 | lr 5.000e-04 | grad_norm 1.250 | tokens/s 12,346 | step_time 0.125s "
        "| mem 0.34GiB", "step 300/300 | eval/answer_accuracy 0.95"]
    assert "\r" not in capsys.readouterr().out


def test_a_terminal_gets_the_bar_instead(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    log = RunLogger(str(tmp_path), LoggerConfig(name="none"), TrainerConfig(max_steps=300))
    log.log(10, STEP)
    assert not log.plain and "step 10/300 |" not in capsys.readouterr().out


@pytest.mark.slow
def test_offline_wandb_says_so_and_prints_the_sync_command(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    log = RunLogger(str(tmp_path), LoggerConfig(name="wandb", mode="offline"), TrainerConfig(max_steps=2),
                    config={"trainer": {"max_steps": 2}})
    log.log(1, STEP)
    log.finish({"steps": 1})
    out = capsys.readouterr().out
    assert "wandb: offline" in out and log.sync_dir.startswith(str(tmp_path))
    assert f"wandb sync {log.sync_dir}" in out.splitlines()[-1] and os.path.isdir(log.sync_dir)
