"""One table at the end of a training sweep (`-m`, `mode=train`):

    python train.py -m optim.lr=1e-3,3e-3 trainer.max_steps=50

Each job writes `summary.json` (`hcp.train.trainer.Trainer.fit`) or, for a point whose config
breaks a rule, `error.txt` (`hcp.entry`; the sweep goes on). Hydra calls
`TrainSweepTable.on_multirun_end` in the launching process once every job is done (registered
under `hydra.callbacks` in `conf/config.yaml`): it prints one row per job, labelled by the
overrides that differ between jobs (`hcp.preflight.plan_table.job_labels`), with its status, final
loss, mean tokens/s and mean step time, writes the table to `sweep_summary.txt` in the sweep
folder and, when a point failed, ends the sweep with exit status 2. Plan sweeps have their own
table (`hcp.preflight.plan_table`).
"""
from __future__ import annotations

import json
from pathlib import Path

from hcp.preflight.plan_table import Callback, format_table, job_labels

HEADER = ("run", "status", "final loss", "tokens/s", "step time s")
ERROR_FILE = "error.txt"
"""A failed point's one-line error, in its job folder."""


def _jobs(sweep_dir: Path) -> list[Path]:
    dirs = [d for d in sweep_dir.iterdir() if d.is_dir() and d.name.isdigit() and (d / ".hydra").is_dir()]
    return sorted(dirs, key=lambda d: int(d.name))


def sweep_rows(sweep_dir) -> tuple[list[tuple[str, ...]], list[str]]:
    """One row per job of `sweep_dir` in job order (`ok`, `error` or `no summary`: a job that
    stopped before its end), and the failed points' errors (`label: message`)."""
    jobs = _jobs(Path(sweep_dir))
    rows, errors = [], []
    for job, label in zip(jobs, job_labels(jobs)):
        if (job / ERROR_FILE).is_file():
            rows.append((label, "error", "-", "-", "-"))
            errors.append(f"{label}: {(job / ERROR_FILE).read_text().strip()}")
        elif (job / "summary.json").is_file():
            s = json.loads((job / "summary.json").read_text())
            loss = s.get("final_loss")
            rows.append((label, "ok", "-" if loss is None else f"{loss:.4f}",
                         f"{s.get('tokens_per_s', 0):,.0f}", f"{s.get('step_time_s', 0):.3f}"))
        else:
            rows.append((label, "no summary", "-", "-", "-"))
    return rows, errors


class TrainSweepTable(Callback):
    """Hydra callback: print and save the table of a training sweep; exit 2 if a point failed."""

    def on_multirun_end(self, config, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if config.get("mode", "train") != "train" or not sweep_dir.is_dir():
            return
        rows, errors = sweep_rows(sweep_dir)
        if not rows:
            return
        failed = sum(r[1] != "ok" for r in rows)
        text = "\n".join([f"training sweep ({len(rows)} runs, {failed} failed)", format_table(rows, HEADER),
                          *[f"error {e}" for e in errors]])
        (sweep_dir / "sweep_summary.txt").write_text(text + "\n")
        print(text + f"\nhcp: sweep summary written to {sweep_dir / 'sweep_summary.txt'}", flush=True)
        if failed:
            raise SystemExit(2)
