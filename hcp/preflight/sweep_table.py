"""One table at the end of a training sweep (`-m`, `mode=train`):

    python train.py -m optim.lr=1e-3,3e-3 trainer.max_steps=50

Each job writes `summary.json` (`hcp.train.trainer.Trainer.fit`) or, for a point whose config
breaks a rule, `error.txt` (`hcp.entry`; the sweep goes on). Hydra calls
`TrainSweepTable.on_multirun_end` in the launching process once every job is done (registered
under `hydra.callbacks` in `conf/config.yaml`): it prints one row per job, labelled by the
overrides that differ between jobs (`hcp.preflight.plan_table.job_labels`), with its status, its
final evaluation (answer accuracy, loss), final training loss, mean tokens/s and mean step time,
best run first by the sweep's selection metric (`selection_metric`: what a run is chosen by, not
its last training loss, which rewards a learning rate that overfits), writes the table to
`sweep_summary.txt` in the sweep folder and, when a point failed, ends the sweep with exit status
2. Plan sweeps have their own table (`hcp.preflight.plan_table`).
"""
from __future__ import annotations

import json
from pathlib import Path

from hcp.preflight.plan_table import Callback, format_table, job_labels

HEADER = ("run", "status", "eval accuracy", "eval loss", "final loss", "tokens/s", "step time s")
SELECTION = (("eval/answer_accuracy", "higher"), ("eval/loss", "lower"), ("final_loss", "lower"))
"""Selection metrics, preferred first, with the better direction: the first that every finished
run reports ranks the sweep (`trainer.eval_every`, and the evaluation at the end of each run)."""
ERROR_FILE = "error.txt"
"""A failed point's one-line error, in its job folder."""


def _jobs(sweep_dir: Path) -> list[Path]:
    dirs = [d for d in sweep_dir.iterdir()
            if d.is_dir() and d.name.isdigit() and (d / ".hydra").is_dir()]
    return sorted(dirs, key=lambda d: int(d.name))


def selection_metric(summaries: list[dict]) -> tuple[str, str] | None:
    """(metric, `higher` / `lower` is better) that ranks runs with these summaries: the first
    of `SELECTION` that every one reports; None when there is none (or no summary)."""
    for key, better in SELECTION:
        if summaries and all(isinstance(s.get(key), (int, float)) for s in summaries):
            return key, better
    return None


def _figure(value, fmt: str) -> str:
    return "-" if not isinstance(value, (int, float)) else format(value, fmt)


def sweep_rows(sweep_dir) -> tuple[list[tuple[str, ...]], list[str], tuple[str, str] | None]:
    """One row per job of `sweep_dir` (`ok`, `error` or `no summary`: a job that stopped before
    its end), finished runs first, best first by `selection_metric`, then the others in job
    order; the failed points' errors (`label: message`); the metric that ranked them."""
    jobs = _jobs(Path(sweep_dir))
    done, rows, errors = [], [], []
    for job, label in zip(jobs, job_labels(jobs)):
        if (job / ERROR_FILE).is_file():
            rows.append((label, "error", *"-" * 5))
            errors.append(f"{label}: {(job / ERROR_FILE).read_text().strip()}")
        elif (job / "summary.json").is_file():
            done.append((label, json.loads((job / "summary.json").read_text())))
        else:
            rows.append((label, "no summary", *"-" * 5))
    metric = selection_metric([s for _, s in done])
    if metric is not None:  # a stable sort: ties keep job order
        done.sort(key=lambda ls: ls[1][metric[0]] * (-1 if metric[1] == "higher" else 1))
    ranked = [(label, "ok", _figure(s.get("eval/answer_accuracy"), ".3f"),
               _figure(s.get("eval/loss"), ".4f"), _figure(s.get("final_loss"), ".4f"),
               _figure(s.get("tokens_per_s", 0), ",.0f"), _figure(s.get("step_time_s", 0), ".3f"))
              for label, s in done]
    return ranked + rows, errors, metric


class TrainSweepTable(Callback):
    """Hydra callback: print and save the table of a training sweep; exit 2 if a point failed."""

    def on_multirun_end(self, config, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if config.get("mode", "train") != "train" or not sweep_dir.is_dir():
            return
        rows, errors, metric = sweep_rows(sweep_dir)
        if not rows:
            return
        failed = sum(r[1] != "ok" for r in rows)
        ranked = "" if metric is None else f", best first by {metric[0]} ({metric[1]} is better)"
        text = "\n".join([f"training sweep ({len(rows)} runs, {failed} failed{ranked})",
                          format_table(rows, HEADER), *[f"error {e}" for e in errors]])
        (sweep_dir / "sweep_summary.txt").write_text(text + "\n")
        print(text + f"\nhcp: sweep summary written to {sweep_dir / 'sweep_summary.txt'}",
              flush=True)
        if failed:
            raise SystemExit(2)
