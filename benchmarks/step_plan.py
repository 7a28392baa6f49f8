"""Time of the step plan at cluster scale (a script, not a test).

    python benchmarks/step_plan.py            # 2048 samples, 4096 ranks, LLaVA-1.5 image rows

Plans a global batch of 2048 LLaVA-like samples (0-2 images of 576 rows each, text 20-1400
tokens) for 4096 ranks: the encoder at tp 2 x dp 2048, the LLM at tp 8 x cp 2 x dp 128 x pp 2,
`first_fit`. Prints the median thread CPU time and wall time of `plan_step` (every rank computes
it) and of one rank's `StepPlan.rank` (its micro-batches and routes).
"""
from __future__ import annotations

import statistics
import time
from types import SimpleNamespace as NS

import numpy as np

from harness import arg_parser, write_json  # beside this file
from hcp.plan.lengths import SampleSizes
from hcp.plan.step import plan_step


def _layout(m, tp=1, cp=1, dp=1, pp=1):
    return NS(module=m, tp=tp, cp=cp, pp=pp, dp=dp, rank_offset=0, num_ranks=tp * cp * dp * pp,
              dp_shard=False)


def llava_batch(batch: int, rows: int, seed: int = 0) -> SampleSizes:
    rng = np.random.default_rng(seed)
    tokens, images = [], []
    for text, n in zip(rng.integers(20, 1400, batch), rng.integers(0, 3, batch)):
        per = [(5 + k * (rows + 3), rows) for k in range(n)]
        tokens.append(int(text) + n * (rows + 3))
        images.append(per)
    return SampleSizes.from_lists(tokens, [t // 3 for t in tokens], images)


def main(argv=None) -> dict:
    ap = arg_parser(__doc__)
    ap.add_argument("--repeats", type=int, default=7, help="plans timed (medians kept)")
    args = ap.parse_args(argv)
    sizes = llava_batch(2048, 576)
    layouts = {"vision": _layout("vision", tp=2, dp=2048), "projector": _layout("projector", tp=2, dp=2048),
               "llm": _layout("llm", tp=8, cp=2, dp=128, pp=2)}
    edges = (("vision", "projector"), ("projector", "llm"))
    plan_cpu, plan_wall, rank_cpu = [], [], []
    for _ in range(args.repeats):
        c0, w0 = time.thread_time(), time.perf_counter()
        plan = plan_step(sizes, layouts, "first_fit", 4096, edges)
        c1, w1 = time.thread_time(), time.perf_counter()
        plan.rank(1234)
        plan_cpu.append(c1 - c0)
        plan_wall.append(w1 - w0)
        rank_cpu.append(time.thread_time() - c1)
    rows = int(sizes.image_rows.sum())
    print(f"2048 samples, 4096 ranks, {rows} image rows, {plan.num_micro_batches} micro-batches per rank")
    print(f"plan_step: {statistics.median(plan_cpu) * 1e3:.0f} ms thread CPU "
          f"({statistics.median(plan_wall) * 1e3:.0f} ms wall), one rank's part: "
          f"{statistics.median(rank_cpu) * 1e3:.1f} ms (median of {args.repeats})")
    out = {"image_rows": rows, "micro_batches_per_rank": plan.num_micro_batches,
           "plan_cpu_s": statistics.median(plan_cpu), "plan_wall_s": statistics.median(plan_wall),
           "rank_cpu_s": statistics.median(rank_cpu)}
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
