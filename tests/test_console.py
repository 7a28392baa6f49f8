"""What the logging rank prints: plain per-step lines off a terminal, a bar on one, wandb's
offline note and sync command, and step timing that covers the metrics' own collectives."""
import os
import sys
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from cfg_utils import compose_cfg
from hcp.config.schema import LoggerConfig, TrainerConfig
from hcp.train.metrics_log import RunLogger, whole_step_metrics

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


def test_step_time_covers_the_metrics_own_collectives(monkeypatch):
    from hcp.launch.launch import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        real = dist.all_gather

        def slow(*a, **k):
            time.sleep(0.2)
            return real(*a, **k)

        monkeypatch.setattr(dist, "all_gather", slow)
        t0 = time.perf_counter()
        m = whole_step_metrics(compose_cfg().llm, [10.0, 1000.0, 1e4], t0,
                               SimpleNamespace(busy_s=1.0, wall_s=1.0), torch.device("cpu"))
        assert m["step_time_s"] >= 0.2  # the metrics' collective (peak memory, bubble) is inside
        assert m["tokens_per_s"] == pytest.approx(1000.0 / m["step_time_s"])
    finally:
        dist.destroy_process_group()
