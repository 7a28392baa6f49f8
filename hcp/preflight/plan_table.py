"""One comparison table at the end of a `mode=plan` sweep:

    python train.py +recipe=llava_hetero mode=plan -m llm.layout.tp=4,8 llm.layout.pp=1,2,4

Each job of the sweep writes `plan.json` (or, for a layout that breaks a rule, `plan_error.txt`)
into its folder; Hydra calls `PlanSweepTable.on_multirun_end` in the launching process once every
job is done (registered under `hydra.callbacks` in `conf/config.yaml`). It prints one row per
job, labelled by the overrides that differ between jobs, with the largest per-rank memory
estimate, whether it fits `cluster.device_memory_gib`, the estimated step time, TFLOPS/GPU and
pipeline bubble (`hcp.preflight.estimate`), and writes the table to `plan_comparison.txt` in the
sweep folder. Sweeps that are not plan sweeps (no `plan.json` / `plan_error.txt`) print nothing.
"""
from __future__ import annotations

import json
from pathlib import Path

import yaml

try:
    from hydra.experimental.callback import Callback
except ImportError:  # pragma: no cover - hydra < 1.1
    Callback = object

HEADER = ("layout", "max mem/rank GiB", "fits", "est. step s", "est. TFLOPS/GPU", "bubble")


def _job_dirs(sweep_dir: Path) -> list[Path]:
    dirs = [d for d in sweep_dir.iterdir() if d.is_dir() and ((d / "plan.json").is_file()
                                                              or (d / "plan_error.txt").is_file())]
    return sorted(dirs,
                  key=lambda d: (not d.name.isdigit(), int(d.name) if d.name.isdigit() else d.name))


def _overrides(job: Path) -> list[str]:
    path = job / ".hydra" / "overrides.yaml"
    return list(yaml.safe_load(path.read_text()) or []) if path.is_file() else [job.name]


def job_labels(jobs: list[Path]) -> list[str]:
    """Each sweep job's label: its overrides that differ between the jobs (else its folder name)."""
    overrides = [_overrides(j) for j in jobs]
    common = set.intersection(*map(set, overrides)) if overrides else set()
    return [" ".join(o for o in ovr if o not in common) or job.name
            for job, ovr in zip(jobs, overrides)]


def comparison_rows(sweep_dir) -> tuple[list[tuple[str, ...]], list[str]]:
    """The table's rows, one per plan job of `sweep_dir` in job order, and the errors of the
    invalid layouts (`label: message`)."""
    jobs = _job_dirs(Path(sweep_dir))
    rows, errors = [], []
    for job, label in zip(jobs, job_labels(jobs)):
        if (job / "plan_error.txt").is_file():
            rows.append((label, "-", "invalid", "-", "-", "-"))
            errors.append(f"{label}: {(job / 'plan_error.txt').read_text().strip()}")
            continue
        est = json.loads((job / "plan.json").read_text())["estimate"]
        rows.append((label, f"{est['max_memory_gib']:.1f}", "yes" if est["fits"] else "NO",
                     f"{est['step_time_s']:.3g}", f"{est['tflops_per_gpu']:.0f}",
                     f"{est['bubble_fraction']:.1%}"))
    return rows, errors


def format_table(rows, header=HEADER) -> str:
    """Aligned text table with `header`; rows may end with one extra note column (`<- ...`)."""
    table = [tuple(header) + ("",)] + [tuple(r) + ("",) * (len(header) + 1 - len(r)) for r in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
                     + ("  " + r[-1] if r[-1] else "")
                     for r in table)


def mark_fastest(rows) -> list[tuple[str, ...]]:
    """Plan rows with the fastest layout that fits marked."""
    fits = [r for r in rows if r[2] == "yes"]
    best = min(fits, key=lambda r: float(r[3])) if fits else None
    return [r + (("<- fastest that fits",) if r is best else ()) for r in rows]


class PlanSweepTable(Callback):
    """Hydra callback: print and save the comparison table of a plan sweep."""

    def on_multirun_end(self, config, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.is_dir():
            return
        rows, errors = comparison_rows(sweep_dir)
        if not rows:
            return
        text = "\n".join([f"plan comparison ({len(rows)} layouts; estimates: "
                          f"hcp/preflight/estimate.py)",
                          format_table(mark_fastest(rows)), *[f"invalid {e}" for e in errors]])
        (sweep_dir / "plan_comparison.txt").write_text(text + "\n")
        print(text + f"\nhcp: plan comparison written to {sweep_dir / 'plan_comparison.txt'}",
              flush=True)
