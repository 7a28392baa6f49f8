"""hcp's framework overhead end to end: its `dp4` training loop beside a plain torch DDP loop of
the same model, samples, packing, token count and initial weights (issue 10 part 3, issue 28).

    python benchmarks/overhead.py --steps 20 --reps 3   # 4 gloo ranks, +recipe=llama_tiny
    python benchmarks/overhead.py --steps 4 --reps 1 --profile 10
    python benchmarks/overhead.py --json a.json; ...; python benchmarks/overhead.py --pool a.json b.json

On each of `--nproc` forked gloo ranks: hcp's real loop (`Trainer.fit_step`: the plan-ahead data
wrapper with its plan and data reading, forward/backward, clipping, optimizer, step metrics,
logging to metrics.jsonl, the preemption check) and a plain loop written here with nothing from
hcp's model, plan, step or trainer code (`benchmarks/plain_loop.py`, the way a torch user writes
it: it reads its DP lane's contiguous block of the same global batch from the same data set,
packs it first-fit into THD micro-batches of `trainer.micro_batch_tokens` itself, then
`nn.Module`s with per-document SDPA, `DistributedDataParallel` with `no_sync` for gradient
accumulation, `clip_grad_norm_`, AdamW, the same cosine schedule). Both start from the same
weights (copied from hcp's layout-invariant init by parameter name).

The loops alternate one step at a time in ABBA order (hcp plain, plain hcp, ...), each step after
a barrier, so both see the same machine load even when it drifts; step i of each runs the same
global batch, so each pair of steps gives one tokens/s ratio (plain wall / hcp wall, slowest
rank). hcp's plan-ahead thread prepares step k+1 during step k; the benchmark waits for that job
at the end of hcp's step, inside its timed region, so none of hcp's work runs during a plain step.
Evaluation and checkpoints are off on both sides (`trainer.eval_every=0`, `trainer.save_every=0`:
training throughput only); hcp's hooks that decide them still run.

Prints, per repetition of `--steps` pairs: tokens/s of each (global tokens / summed step wall),
their ratio, the median pair ratio, the critical-path CPU (largest per-rank process CPU seconds,
all threads, per step) of each and its ratio plain / hcp. Then over all pairs, with
`--confidence` intervals: the median of the pair ratios (distribution-free interval from order
statistics), the ratio of total times (bootstrap over pairs) and the median CPU pair ratio. Then
the largest difference of their per-step losses (identical up to fp32 summation order: checked
against `--loss-rtol`) and whether both ran the same global tokens and micro-batches per step
(checked), main-thread CPU and wall time per step in the sections of a step (data, forward +
backward with gradient sync, clipping, optimizer, hcp's metrics and its logging + preemption
check) and the CPU of hcp's plan-ahead thread. `--profile N` adds a torch.profiler table of N
more steps of each on rank 0 (the operators where hcp spends more CPU time than the plain loop).
Under a loaded machine one step pair's ratio varies by tens of percent; `--json` keeps a run's
step pairs and `--pool` prints the intervals over several runs' pairs together.
"""
from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import random
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from hcp.launch.launch import free_port  # noqa: E402
from harness import arg_parser, write_json  # noqa: E402
from plain_loop import PlainLoop, Sections  # noqa: E402  (benchmarks/plain_loop.py)

OVERRIDES = ["+recipe=llama_tiny", "trainer.eval_every=0", "trainer.save_every=0"]


def instrument(trainer) -> Sections:
    """Sections of hcp's `Trainer.fit_step` (data, forward/backward with gradient sync, clipping,
    optimizer, metrics with the preemption flag's agreement, then logging and the preemption
    check), by wrapping the calls it makes."""
    sec = Sections()
    sec.wrap(trainer.ahead, "next", "data", start=True)
    sec.wrap(trainer.runner, "forward_backward", "forward_backward")
    sec.wrap(trainer, "clip", "clip")
    sec.wrap(trainer.scheduler, "step", "optimizer")
    sec.wrap(trainer.stats, "issue", "metrics")  # lands the previous step's figures, sends this one's
    sec.wrap(trainer, "fit_step", "logging")  # logging and the preemption check: to fit_step's end
    return sec


class Prefetch:
    """Watches hcp's plan-ahead thread (it calls `trainer.ahead.prepare`): the thread CPU seconds
    its jobs took, and `settle()`, which waits until the job for the step after the last one ran
    is done, so that it never runs behind the plain loop's steps (it is charged to hcp's block)."""

    def __init__(self, trainer):
        import threading

        self.trainer, self.prepare, self.cpu = trainer, trainer.ahead.prepare, 0.0
        self.done, self.cond = 0, threading.Condition()
        trainer.ahead.prepare = self

    def __call__(self, *args):
        cpu = time.thread_time()
        try:
            return self.prepare(*args)
        finally:
            with self.cond:
                self.cpu += time.thread_time() - cpu
                self.done += 1
                self.cond.notify_all()

    def settle(self) -> None:
        with self.cond:  # after n steps the wrapper has started n + 1 jobs (no resume here)
            self.cond.wait_for(lambda: self.done >= self.trainer.step + 1)


def pair_order(pair: int) -> tuple[str, str]:
    """Which loop runs first in step pair `pair`: hcp, plain, then plain, hcp, ... (ABBA at the
    grain of one step, so a drift in load between steps cancels and neither loop always runs
    right after the other)."""
    return ("hcp", "plain") if pair % 2 == 0 else ("plain", "hcp")


def median_ci(values, confidence: float = 0.95) -> tuple[float, float, float]:
    """(median, lower, upper) of `values`, with the distribution-free confidence interval of
    the median from order statistics (binomial(n, 1/2) ranks; needs no model of the noise).
    The bounds are NaN when n is too small for `confidence` (n < 6 at 95%)."""
    xs, n = sorted(values), len(values)
    tail = (1 - confidence) / 2
    k, below = 0, 0.0  # largest k with P(Binomial(n, 1/2) < k) <= tail: the CI is [x_(k), x_(n+1-k)]
    while below + math.comb(n, k) / 2 ** n <= tail:
        below += math.comb(n, k) / 2 ** n
        k += 1
    if k == 0:
        return statistics.median(xs), math.nan, math.nan
    return statistics.median(xs), xs[k - 1], xs[n - k]


def ratio_ci(num, den, confidence: float = 0.95, resamples: int = 2000, seed: int = 0):
    """(sum(num) / sum(den), lower, upper): the ratio of totals with a percentile bootstrap
    interval over resampled pairs (num[i], den[i]) (seeded: the same data gives the same interval)."""
    rng, n = random.Random(seed), len(num)
    boot = []
    for _ in range(resamples):
        idx = [rng.randrange(n) for _ in range(n)]
        boot.append(sum(num[i] for i in idx) / sum(den[i] for i in idx))
    boot.sort()
    tail = (1 - confidence) / 2
    return (sum(num) / sum(den), boot[int(tail * resamples)],
            boot[min(resamples - 1, int((1 - tail) * resamples))])


def _rank(rank, world, port, overrides, pairs, warmup, profile, queue):
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from hcp.config.compose import compose_config
    from hcp.train.trainer import Trainer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    run_dir = tempfile.mkdtemp(prefix="hcp-overhead-")
    cfg = compose_config([*OVERRIDES, *overrides], run_dir=run_dir)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    hcp = Trainer(OmegaConf.create(OmegaConf.to_container(cfg)), run_dir)
    plain = PlainLoop(hcp.cfg)
    sections = {"hcp": instrument(hcp), "plain": plain.sections}
    prefetch = Prefetch(hcp)

    def hcp_step():
        m = hcp.fit_step()
        sections["hcp"].start()
        prefetch.settle()  # the job for the next step, charged to this one (see the docstring)
        sections["hcp"].mark("data")
        return m["loss"], round(m["tokens_per_s"] * m["step_time_s"]), m["micro_batches"]

    steps = {"hcp": hcp_step, "plain": plain.train_step}
    for i in range(warmup):  # unmeasured
        for name in pair_order(i):
            steps[name]()
    for sec in sections.values():
        sec.total.clear()
    prefetch.cpu = 0.0
    rows = {"hcp": [], "plain": []}  # per step: (wall s, process CPU s, loss, tokens, micro-batches)
    for i in range(pairs):
        for name in pair_order(warmup + i):
            dist.barrier()
            cpu0, t0 = time.process_time(), time.perf_counter()
            out = steps[name]()
            rows[name].append((time.perf_counter() - t0, time.process_time() - cpu0, *out))
    table = None
    if profile and rank == 0:
        table = _profile(hcp, plain, profile)
    elif profile:  # the same steps in the same order as rank 0's
        for fn in (hcp.fit_step, plain.train_step):
            for _ in range(profile):
                fn()
    dist.barrier()
    totals = {k: v.total for k, v in sections.items()}
    totals["hcp"]["plan-ahead thread"] = (prefetch.cpu, 0.0)
    queue.put((rank, rows, table, totals))
    dist.destroy_process_group()


def _profile(hcp, plain, steps: int) -> str:
    """Operators by CPU time per step, hcp beside plain, largest differences first."""
    from torch.profiler import ProfilerActivity, profile

    totals = {}
    for name, fn in (("hcp", hcp.fit_step), ("plain", plain.train_step)):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                fn()
        totals[name] = {e.key: (e.self_cpu_time_total / steps, e.count / steps)
                        for e in prof.key_averages()}
    keys = set(totals["hcp"]) | set(totals["plain"])
    diff = sorted(keys, key=lambda k: -(totals["hcp"].get(k, (0, 0))[0] - totals["plain"].get(k, (0, 0))[0]))
    lines = [f"{'operator (self CPU per step, rank 0)':<48} {'hcp ms':>8} {'calls':>6} "
             f"{'plain ms':>8} {'calls':>6}"]
    for k in diff[:25]:
        (h, hc), (p, pc) = totals["hcp"].get(k, (0, 0)), totals["plain"].get(k, (0, 0))
        lines.append(f"{k[:48]:<48} {h / 1e3:8.2f} {hc:6.0f} {p / 1e3:8.2f} {pc:6.0f}")
    lines.append(f"{'total':<48} {sum(v[0] for v in totals['hcp'].values()) / 1e3:8.2f} {'':>6} "
                 f"{sum(v[0] for v in totals['plain'].values()) / 1e3:8.2f}")
    return "\n".join(lines)


def print_intervals(hcp_wall, plain_wall, hcp_cpu, plain_cpu, confidence: float) -> dict:
    """Print (and return) the hcp / plain tokens/s ratio over step pairs i (both loops' step i:
    the same global batch, so the same tokens): the median of the pair ratios, the ratio of
    total times, and the median critical-path CPU ratio, each with its `confidence` interval."""
    wall = [b / a for a, b in zip(hcp_wall, plain_wall)]
    cpu = [b / a for a, b in zip(hcp_cpu, plain_cpu)]
    out = dict(median=median_ci(wall, confidence), total=ratio_ci(plain_wall, hcp_wall, confidence),
               cpu_median=median_ci(cpu, confidence))
    fmt = lambda m, lo, hi: f"{m:.3f}x [{lo:.3f}, {hi:.3f}]"  # noqa: E731
    print(f"hcp / plain tokens/s over {len(wall)} step pairs, {confidence:.0%} interval: median of pairs "
          f"{fmt(*out['median'])}; total tokens / total time {fmt(*out['total'])} (bootstrap); "
          f"critical-path CPU (plain / hcp) median of pairs {fmt(*out['cpu_median'])}")
    return dict(out, pairs=wall, cpu_pairs=cpu)


def pool(paths: list[str], confidence: float) -> dict:
    """The intervals over the step pairs of several runs' `--json` files together."""
    runs = [json.load(open(path)) for path in paths]
    for path, r in zip(paths, runs):
        print(f"{path}: {len(r['pairs'])} pairs, load {' '.join(f'{x:.1f}' for x in r['load'])} at its end")
    return print_intervals(*[[x for r in runs for x in r[loop][key]] for key, loop in
                             (("wall", "hcp"), ("wall", "plain"), ("cpu", "hcp"), ("cpu", "plain"))],
                           confidence)


def run(args) -> list:
    """Every rank's report (rank, rows, profile table, section totals), by rank."""
    ctx = mp.get_context("fork")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank, args=(r, args.nproc, port, args.overrides, args.reps * args.steps,
                                             args.warmup, args.profile, queue))
             for r in range(args.nproc)]
    for p in procs:
        p.start()
    results = []
    while len(results) < len(procs):
        try:
            results.append(queue.get(timeout=5))
        except Exception:  # queue.Empty: a rank that died never reports, say so instead of waiting
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    p.kill()
                raise SystemExit(f"rank(s) {dead} failed (traceback above)")
    for p in procs:
        p.join()
    return sorted(results, key=lambda r: r[0])


def per_step(results, name: str) -> dict:
    """Loop `name`'s steps over every rank: slowest-rank wall s and largest process CPU s (the
    critical path) per step, rank 0's loss, global tokens, and the most micro-batches of any rank."""
    cols = list(zip(*[rows[name] for _, rows, _, _ in results]))  # per step: every rank's row
    return dict(wall=[max(r[0] for r in c) for c in cols], cpu=[max(r[1] for r in c) for c in cols],
                losses=[c[0][2] for c in cols], tokens=[c[0][3] for c in cols],
                micro=[max(r[4] for r in c) for c in cols])


def main(argv=None) -> dict:
    ap = arg_parser(__doc__,
                    json_help="also write the per-step figures and the intervals to this file",
                    reps=3, reps_help="repetitions (a row each; the intervals pool them)")
    ap.add_argument("--nproc", type=int, default=4, help="gloo ranks (pure DP)")
    ap.add_argument("--steps", type=int, default=20, help="measured steps of each loop per repetition")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured first steps of each loop")
    ap.add_argument("--profile", type=int, default=0, help="profile this many more steps")
    ap.add_argument("--confidence", type=float, default=0.95, help="level of the printed intervals")
    ap.add_argument("--loss-rtol", type=float, default=1e-4,
                    help="largest relative difference of the two loops' per-step losses (else exit 1)")
    ap.add_argument("--pool", nargs="+", metavar="JSON", help="run nothing: the intervals over the step "
                    "pairs of these earlier runs' --json files together")
    ap.add_argument("overrides", nargs="*", help="extra hcp config overrides")
    args = ap.parse_args(argv)
    if min(args.steps, args.nproc, args.reps) < 1 or args.warmup < 0:
        ap.error("--steps, --reps and --nproc must be >= 1, --warmup >= 0")
    if args.pool:
        return pool(args.pool, args.confidence)
    results = run(args)
    h, p = per_step(results, "hcp"), per_step(results, "plain")
    diff = max(abs(a - b) / abs(b) for a, b in zip(h["losses"], p["losses"]))
    same = h["tokens"] == p["tokens"] and h["micro"] == p["micro"]
    # pair i: both loops' step i, the same global batch (same tokens), run back to back
    wall = [b / a for a, b in zip(h["wall"], p["wall"])]
    print(f"{args.nproc} gloo ranks, +recipe=llama_tiny {' '.join(args.overrides)}, {args.reps} x "
          f"{args.steps} steps of each (after {args.warmup} warm-up), alternating one step at a time "
          f"(hcp plain, plain hcp, ...)")
    print(f"{'rep':<4} {'hcp tok/s':>9} {'plain tok/s':>11} {'ratio':>6} {'pair median':>11} "
          f"{'hcp cpu s':>9} {'plain cpu s':>11} {'cpu ratio':>9}")
    for k in range(args.reps):
        s = slice(k * args.steps, (k + 1) * args.steps)
        tok = sum(h["tokens"][s])
        hw, pw, hc, pc = (sum(x[s]) for x in (h["wall"], p["wall"], h["cpu"], p["cpu"]))
        print(f"{k + 1:<4} {tok / hw:9.0f} {tok / pw:11.0f} {pw / hw:6.3f} {statistics.median(wall[s]):11.3f} "
              f"{hc / args.steps:9.4f} {pc / args.steps:11.4f} {pc / hc:9.3f}")
    intervals = print_intervals(h["wall"], p["wall"], h["cpu"], p["cpu"], args.confidence)
    print(f"wall ms per step (slowest rank), hcp / plain: median {statistics.median(h['wall']) * 1e3:.1f} / "
          f"{statistics.median(p['wall']) * 1e3:.1f}, mean {statistics.mean(h['wall']) * 1e3:.1f} / "
          f"{statistics.mean(p['wall']) * 1e3:.1f}; critical-path CPU ms per step, mean "
          f"{statistics.mean(h['cpu']) * 1e3:.1f} / {statistics.mean(p['cpu']) * 1e3:.1f}")
    print(f"losses {h['losses'][0]:.5f} -> {h['losses'][-1]:.5f}, largest relative difference {diff:.2e} "
          f"(rtol {args.loss_rtol:g}): {'identical' if diff <= args.loss_rtol else 'DIFFERENT'}; tokens and "
          f"micro-batches per step {'the same' if same else 'DIFFERENT'} "
          f"({sum(h['tokens']) / len(h['tokens']):.0f} tokens, {max(h['micro'])} micro-batches)")
    names = ["data", "forward_backward", "clip", "optimizer", "metrics", "logging", "plan-ahead thread"]
    sections = {loop: {n: tuple(sum(r[3][loop].get(n, (0, 0))[i] for r in results) / len(results)
                                / (args.reps * args.steps) for i in (0, 1)) for n in names}
                for loop in ("hcp", "plain")}  # (CPU s, wall s) per step, mean over ranks
    for i, what in enumerate(("main-thread CPU", "wall")):
        print(f"{what} ms per step by section, mean over ranks (hcp / plain): " + ", ".join(
            f"{n} {sections['hcp'][n][i] * 1e3:.1f} / {sections['plain'][n][i] * 1e3:.1f}" for n in names[:-1])
            + (f"; hcp's plan-ahead thread CPU {sections['hcp'][names[-1]][0] * 1e3:.1f}" if i == 0 else ""))
    if results[0][2]:
        print(results[0][2])
    out = dict(hcp=h, plain=p, sections=sections, **intervals, loss_rel_diff=diff)
    write_json(args.json, {**out, "load": os.getloadavg(), "args": vars(args)}, indent=None)
    if diff > args.loss_rtol or not same:
        raise SystemExit(f"the loops differ: losses by {diff:.2e} (--loss-rtol {args.loss_rtol:g}), "
                         f"tokens or micro-batches per step {'equal' if same else 'not equal'}")
    return out


if __name__ == "__main__":
    main()
