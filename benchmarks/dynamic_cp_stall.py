"""The stall that dynamic-CP planning causes to a busy training thread: planning on the
plan-ahead thread vs in the plan-ahead worker process (hcp/plan/ahead.py).

    python benchmarks/dynamic_cp_stall.py --json stall.json    # ~1-2 minutes of CPU

The main thread runs a fixed pure-Python loop per step (`--work` CPU seconds: the stand-in for a
training step's Python and kernel launches, which need the GIL) while `PlanAhead` plans the next
global batch with the solver (hcp/dcp/solver.py) at the seed-sized setting of
benchmarks/dynamic_cp.py (LLaMA-13B, H100 profile, pool 8, PP 8, cap 8192/rank, GBS 2048; 1024
for `code`, which has fewer documents; held-out seeds 100 on): on its background thread or in
its worker. Per mode and distribution, per step (the first step, which waits for the first
plan, is not measured), medians over `--steps` steps:
  gil_s     CPU seconds the process's other threads ran during the loop: the time planning held
            the GIL while the main thread wanted it (pure Python runs one thread at a time);
            the machine's other load does not count in it
  slowdown  the loop's wall time over its own CPU time (counts the machine's load too)
  plan_s    the background job's wall time (planning, and in the worker its round trip)
The two modes run in turns on the same batches, so their ratios are side by side.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # dynamic_cp beside this file

from harness import arg_parser, write_json  # noqa: E402
from lengths import distribution  # noqa: E402
from hcp.plan.ahead import PlanAhead  # noqa: E402

POOL, PP, CAP, MAX_LEN = 8, 8, 8192, 65536
_COST = None


def plan(lens):
    """The solver's plan of one global batch (lengths `[B]`), as the policy computes it."""
    global _COST
    from hcp.dcp.cost_model import CostModel, recipe_llm
    from hcp.dcp.hardware import load_profile
    from hcp.dcp.solver import solve

    if _COST is None:
        _COST = CostModel(recipe_llm("llama13b_dynamic_cp"), load_profile("h100"), pp=PP)
    return solve(lens, _COST, POOL, CAP, MAX_LEN).plan


class Batches:
    """A sampler of global batches of lengths: batch k is drawn with seed 100 + k."""

    def __init__(self, name: str):
        pool = distribution(name)
        self.pool, self.position = pool[pool <= MAX_LEN], 0
        self.size = 1024 if name == "code" else 2048

    def batch(self, k: int) -> np.ndarray:
        return np.random.default_rng(100 + k).choice(self.pool, self.size, replace=False)


def busy(seconds: float) -> None:
    """Pure Python until `seconds` of this thread's CPU time."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def measure(name: str, mode: str, steps: int, work: float) -> dict:
    sampler = Batches(name)
    ahead = (PlanAhead(sampler, plan) if mode == "thread"
             else PlanAhead(sampler, lambda lens, p: p, plan))
    rows = []
    try:
        ahead.next()  # the first plan (and in the worker its start-up): not measured
        for _ in range(steps):
            cpu, own, wall = time.process_time(), time.thread_time(), time.perf_counter()
            busy(work)
            gil = (time.process_time() - cpu) - (time.thread_time() - own)
            slowdown = (time.perf_counter() - wall) / (time.thread_time() - own)
            _, _, stats = ahead.next()
            rows.append((gil, slowdown, stats["plan_s"]))
    finally:
        ahead.close()
    gil, slowdown, plan_s = (float(np.median(c)) for c in zip(*rows))
    return {"gil_s": gil, "slowdown": slowdown, "plan_s": plan_s}


def main(argv=None) -> dict:
    p = arg_parser(__doc__)
    p.add_argument("--lengths", default="wikipedia,lognormal,code", help="comma list")
    p.add_argument("--steps", type=int, default=3, help="measured steps per mode")
    p.add_argument("--work", type=float, default=1.5, help="main thread CPU seconds per step")
    args = p.parse_args(argv)
    if args.steps < 1 or not args.work > 0:
        p.error(f"--steps {args.steps} / --work {args.work}: need >= 1 steps and work > 0 s")
    names = args.lengths.split(",")
    for name in names:
        if name not in ("wikipedia", "lognormal", "code"):
            p.error(f"--lengths {name}: not one of wikipedia, lognormal, code")
    out = {}
    print(f"{'lengths':>10} {'mode':>7} {'gil_s':>7} {'slowdown':>9} {'plan_s':>7}   "
          f"(main thread: {args.work} CPU s of pure Python per step)")
    for i, name in enumerate(names):
        out[name] = {}
        for mode in ("thread", "worker")[::1 if i % 2 == 0 else -1]:
            r = out[name][mode] = measure(name, mode, args.steps, args.work)
            print(f"{name:>10} {mode:>7} {r['gil_s']:7.3f} {r['slowdown']:9.2f} {r['plan_s']:7.2f}",
                  flush=True)
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
