"""`<run dir>/metrics.png`: the run's training loss, evaluation metrics and tokens/s over the
steps, drawn from its `metrics.jsonl` by the logging rank at each evaluation and at the end
(`RunLogger.plot`)."""
from __future__ import annotations

import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

FILE = "metrics.png"


def read_records(path: str) -> list[dict]:
    """The records of a `metrics.jsonl` (one JSON object per line, each with its `step`)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    pairs = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [s for s, _ in pairs], [v for _, v in pairs]


def plot_run(run_dir: str) -> str:
    """Draw `run_dir/metrics.jsonl` into `run_dir/metrics.png` (three panels: loss with the
    evaluation loss, the other `eval/*` metrics, tokens/s); returns the PNG's path."""
    records = read_records(os.path.join(run_dir, "metrics.jsonl"))
    evals = sorted({k for r in records for k in r if k.startswith("eval/") and k not in
                    ("eval/loss", "eval/samples")})
    fig, (loss_ax, eval_ax, rate_ax) = plt.subplots(1, 3, figsize=(11, 3.2), dpi=80)
    loss_ax.plot(*_series(records, "loss"), lw=1, label="train")
    loss_ax.plot(*_series(records, "eval/loss"), "o-", ms=4, label="eval")
    losses = [v for line in loss_ax.get_lines() for v in line.get_ydata()]
    if losses and min(losses) > 0 and max(losses) > 20 * min(losses):  # the tail stays readable
        loss_ax.set_yscale("log")
    loss_ax.set(title="loss (nats/token)", xlabel="step")
    loss_ax.legend(frameon=False)
    for key in evals:
        eval_ax.plot(*_series(records, key), "o-", ms=4, label=key[len("eval/"):])
    eval_ax.set(title="evaluation", xlabel="step")
    if evals:
        eval_ax.legend(frameon=False)
    else:
        eval_ax.text(0.5, 0.5, "no eval/* metric but the loss", ha="center", va="center",
                     transform=eval_ax.transAxes, color="gray")
    steps, rates = _series(records, "tokens_per_s")
    rate_ax.plot(steps, [r / 1e3 for r in rates], lw=1, color="tab:green")
    rate_ax.set(title="throughput (k tokens/s)", xlabel="step", ylim=(0, None))
    for ax in (loss_ax, eval_ax, rate_ax):
        ax.grid(alpha=0.3)
    fig.suptitle(os.path.basename(os.path.normpath(run_dir)), fontsize=9)
    fig.tight_layout()
    path = os.path.join(run_dir, FILE)
    fig.savefig(path)
    plt.close(fig)
    return path
