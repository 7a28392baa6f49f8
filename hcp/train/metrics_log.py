"""Run outputs of the logging rank: metrics.jsonl, metrics.png, summary.json, console progress,
wandb.

Only the logging rank (the lowest rank on the LLM's last pipeline stage) builds a
`RunLogger`; every other rank stays quiet. A wandb failure (missing, offline error, timeout)
disables wandb with a warning and never stops or hangs training.
"""
from __future__ import annotations

import json
import os
import sys
import warnings

from tqdm import tqdm

from hcp.config.schema import LoggerConfig, TrainerConfig

CONSOLE = (("loss", "loss", "{:.4f}"), ("lr", "lr", "{:.3e}"), ("grad_norm", "grad_norm", "{:.3f}"),
           ("tokens_per_s", "tokens/s", "{:,.0f}"), ("step_time_s", "step_time", "{:.3f}s"),
           ("peak_memory_gib", "mem", "{:.2f}GiB"))
"""Per-step console fields: metrics key, label, format."""


def step_line(step: int, max_steps: int, metrics: dict) -> str:
    """One plain console line of a logged step: `step 10/300 | loss 2.3456 | lr 5.000e-04 | ...`,
    then any evaluation metrics of that step."""
    parts = [f"step {step}/{max_steps}"]
    parts += [f"{label} {fmt.format(metrics[k])}" for k, label, fmt in CONSOLE if k in metrics]
    parts += [f"{k} {v:.4g}" for k, v in metrics.items() if k.startswith("eval/")]
    return " | ".join(parts)


def terminal_size() -> tuple[int, int]:
    """(columns, lines) of the terminal on stdout; (0, 0) when it reports none (a pseudo-terminal
    whose size was never set, as some container and CI shells give) or is not a terminal."""
    try:
        return tuple(os.get_terminal_size(sys.stdout.fileno()))
    except (OSError, ValueError, AttributeError):
        return 0, 0


class RunLogger:
    """Writes `metrics.jsonl` (one JSON object per logged step), `summary.json` and the console
    progress, and mirrors them to wandb when `logger.name=wandb`.

    Console: a tqdm bar when stdout is a terminal and `trainer.progress_bar` is true (100
    characters wide when the terminal reports no size, `terminal_size`); otherwise
    (a SLURM `.out` file, a pipe) one plain line per logged step (`step_line`), every
    `trainer.log_every` steps. An offline wandb run says so at the start, and `finish` prints
    its `wandb sync` command.

    Args:
        logger: the `logger` block (`hcp.config.schema.LoggerConfig`).
        trainer: the `trainer` block (`hcp.config.schema.TrainerConfig`: max_steps, progress_bar).
        start_step: the step the run starts at (a resumed run continues its metrics.jsonl).
        config: the run's resolved config as a dict, recorded as the wandb run's config.
    """

    def __init__(self, run_dir: str, logger: LoggerConfig, trainer: TrainerConfig,
                 start_step: int = 0, config: dict | None = None):
        self.run_dir, self.max_steps = run_dir, trainer.max_steps
        os.makedirs(run_dir, exist_ok=True)
        # A resumed run continues its metrics.jsonl; a fresh run in the same folder replaces it.
        self._metrics = open(os.path.join(run_dir, "metrics.jsonl"), "a" if start_step else "w")
        self.plain = not (trainer.progress_bar and sys.stdout.isatty())
        sized = min(terminal_size()) > 0  # a terminal that reports no size: tqdm would draw nothing
        self._bar = tqdm(total=self.max_steps, initial=start_step, desc="train",
                         dynamic_ncols=sized, ncols=None if sized else 100,
                         nrows=None if sized else 24, disable=self.plain, file=sys.stdout,
                         mininterval=0.1)
        self._wandb = self._init_wandb(logger, config) if logger.name == "wandb" else None
        self.sync_dir = None
        if self._wandb is not None and (logger.mode == "offline"
                                        or getattr(self._wandb.settings, "_offline", False)):
            self.sync_dir = (getattr(self._wandb.settings, "sync_dir", None)  # wandb/offline-run-*
                             or os.path.dirname(self._wandb.dir.rstrip(os.sep)))
            self.write(f"wandb: offline (logger.mode=offline; WANDB_MODE=online to stream); "
                       f"the run is stored in {self.sync_dir}")

    def _init_wandb(self, logger: LoggerConfig, config: dict | None):
        try:
            import wandb

            return wandb.init(project=logger.project, entity=logger.entity, mode=logger.mode,
                              dir=self.run_dir, config=config,
                              settings=wandb.Settings(init_timeout=60, silent=True))
        except Exception as e:  # noqa: BLE001 - logging must never stop training
            warnings.warn(f"wandb disabled: {type(e).__name__}: {e} (logger=none silences this)")
            return None

    def log(self, step: int, metrics: dict) -> None:
        """Record the metrics of `step` (1-based, after the optimizer step)."""
        record = {"step": step, **metrics}
        self._metrics.write(json.dumps(record) + "\n")
        self._metrics.flush()
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
        if step < self.max_steps and any(k.startswith("eval/") for k in metrics):
            self.plot()  # each evaluation's figures land in metrics.png; `finish` draws the end
        if self.plain:
            if metrics:
                print(step_line(step, self.max_steps, metrics), flush=True)
        else:
            self._bar.set_postfix({k: f"{v:.4g}" for k, v in metrics.items()
                                   if k in ("loss", "lr", "tokens_per_s", "eval/answer_accuracy")})

    def plot(self) -> None:
        """Redraw `metrics.png` from `metrics.jsonl` (`hcp.train.run_plot`); a failure warns and
        training goes on."""
        try:
            from hcp.train.run_plot import plot_run

            plot_run(self.run_dir)
        except Exception as e:  # noqa: BLE001 - a picture must never stop training
            warnings.warn(f"metrics.png not drawn: {type(e).__name__}: {e}")

    def advance(self, steps: int = 1) -> None:
        self._bar.update(steps)

    def write(self, text: str) -> None:
        """Print a line without breaking the progress bar."""
        if self.plain:
            print(text, flush=True)
        else:
            self._bar.write(text)

    def finish(self, summary: dict) -> None:
        """Write summary.json and metrics.png, print the summary, close wandb (an offline run:
        print its sync command)."""
        with open(os.path.join(self.run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        self._bar.close()
        self._metrics.close()
        self.plot()
        print("summary: " + json.dumps(summary))
        if self._wandb is not None:
            try:
                self._wandb.summary.update(summary)
                self._wandb.finish()
            except Exception as e:  # noqa: BLE001
                warnings.warn(f"wandb finish failed: {e}")
        if self.sync_dir is not None:
            print(f"wandb: offline run; upload it with: wandb sync {self.sync_dir}", flush=True)
