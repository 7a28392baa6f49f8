"""Run outputs of the logging rank: metrics.jsonl, summary.json, console progress, wandb.

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


class RunLogger:
    """Writes `metrics.jsonl` (one JSON object per logged step), `summary.json`, a tqdm bar,
    and mirrors both to wandb when `logger.name=wandb`."""

    def __init__(self, run_dir: str, cfg, max_steps: int, start_step: int = 0):
        self.run_dir = run_dir
        os.makedirs(run_dir, exist_ok=True)
        # A resumed run continues its metrics.jsonl; a fresh run in the same folder replaces it.
        self._metrics = open(os.path.join(run_dir, "metrics.jsonl"), "a" if start_step else "w")
        # Not a terminal (a SLURM log): redraw rarely instead of a carriage return per step.
        self._bar = tqdm(total=max_steps, initial=start_step, desc="train", dynamic_ncols=True,
                         disable=not cfg.trainer.progress_bar, file=sys.stdout,
                         mininterval=0.1 if sys.stdout.isatty() else 30.0)
        self._wandb = self._init_wandb(cfg) if cfg.logger.name == "wandb" else None

    def _init_wandb(self, cfg):
        try:
            import wandb

            from omegaconf import OmegaConf

            return wandb.init(project=cfg.logger.project, entity=cfg.logger.entity,
                              mode=cfg.logger.mode, dir=self.run_dir,
                              config=OmegaConf.to_container(cfg, resolve=True),
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
        self._bar.set_postfix({k: f"{v:.4g}" for k, v in metrics.items()
                               if k in ("loss", "lr", "tokens_per_s", "eval/answer_accuracy")})

    def advance(self, steps: int = 1) -> None:
        self._bar.update(steps)

    def write(self, text: str) -> None:
        """Print a line without breaking the progress bar."""
        self._bar.write(text)

    def finish(self, summary: dict) -> None:
        """Write summary.json, print it, close wandb."""
        with open(os.path.join(self.run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        self._bar.close()
        self._metrics.close()
        print("summary: " + json.dumps(summary))
        if self._wandb is not None:
            try:
                self._wandb.summary.update(summary)
                self._wandb.finish()
            except Exception as e:  # noqa: BLE001
                warnings.warn(f"wandb finish failed: {e}")
