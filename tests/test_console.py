"""What the logging rank prints: plain per-step lines off a terminal, a bar on one, wandb's
offline note and sync command."""
import os
import subprocess
import sys

import pytest

from hcp.config.schema import LoggerConfig, TrainerConfig
from hcp.train.metrics_log import RunLogger

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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


BAR = """
import sys, tempfile
from hcp.config.schema import LoggerConfig, TrainerConfig
from hcp.train.metrics_log import RunLogger
trainer, logger = TrainerConfig(), LoggerConfig()
trainer.max_steps, trainer.progress_bar, logger.name = 3, True, "none"
run = RunLogger(tempfile.mkdtemp(), logger, trainer)
for step in (1, 2, 3):
    run.log(step, {"loss": 1.0 / step})
    run.advance()
run.finish({"steps": 3})
"""


def test_a_terminal_that_reports_no_size_still_shows_the_progress_bar():
    """A pseudo-terminal of 0 x 0 (some container and CI shells): tqdm alone draws nothing."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 0, 0, 0, 0))
    proc = subprocess.Popen([sys.executable, "-c", BAR], stdout=slave, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": REPO}, cwd=REPO)
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert proc.wait(timeout=60) == 0, proc.stderr.read()
    assert b"train: 100%" in out and b"3/3" in out, out
