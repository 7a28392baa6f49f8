"""hcp's framework overhead end to end: its `dp4` training loop beside a plain torch DDP loop of
the same model, samples, packing, token count and initial weights (issue 10 part 3, issue 28).

    python benchmarks/overhead.py                    # 4 gloo ranks, +recipe=llama_tiny, 3 x 8 steps
    python benchmarks/overhead.py --reps 5 --steps 8 --block 4 --profile 3

On each of `--nproc` forked gloo ranks: hcp's real loop (`Trainer.fit_step`: the plan-ahead data
wrapper with its plan and data reading, forward/backward, clipping, optimizer, step metrics,
logging to metrics.jsonl, the preemption check) and a plain loop written here with nothing from
hcp's model, plan, step or trainer code (the way a torch user writes it: it reads its DP lane's
contiguous block of the same global batch from the same data set, packs it first-fit into THD
micro-batches of `trainer.micro_batch_tokens` itself, then `nn.Module`s with per-document SDPA,
`DistributedDataParallel` with `no_sync` for gradient accumulation, `clip_grad_norm_`, AdamW, the
same cosine schedule). Both start from the same weights (copied from hcp's layout-invariant init
by parameter name). The two loops alternate in blocks of `--block` steps (ABBA: hcp,
plain, plain, hcp, ...), so both see the same machine load; each block's wall time and every
rank's process CPU time (all its threads) are measured. hcp's plan-ahead thread prepares step
k+1 during step k; at the end of an hcp block the benchmark waits for that job inside hcp's
timed block, so it never runs behind the plain loop's steps (nor its CPU into theirs).
Evaluation and checkpoints are off on both sides (`trainer.eval_every=0`,
`trainer.save_every=0`: training throughput only); hcp's hooks that decide them still run.

Prints, for each of `--reps` repetitions of `--steps` steps and their median: tokens/s of each
(global tokens / summed slowest-rank block wall time), the ratio hcp / plain, the critical path
(largest per-rank process CPU seconds per block, per step) of each and its ratio plain / hcp;
the median tokens/s ratio of adjacent block pairs (robust to load that changes between blocks).
Then the largest difference of their per-step losses (identical up to fp32 summation order:
checked against `--loss-rtol`) and whether both ran the same global tokens and micro-batches
per step (checked), main-thread CPU and wall time per step in the sections of a step (data,
forward + backward with gradient sync, clipping, optimizer, hcp's metrics and its logging +
preemption check) and the CPU of hcp's plan-ahead thread. `--profile N` adds a torch.profiler
table of N more steps of each on rank 0 (the operators where hcp spends more CPU time than the
plain loop).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from hcp.launch.launch import free_port  # noqa: E402
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


def _rank(rank, world, port, overrides, blocks, block, warmup, profile, queue):
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
        return m["loss"], round(m["tokens_per_s"] * m["step_time_s"]), m["micro_batches"]

    steps = {"hcp": hcp_step, "plain": plain.train_step}
    for i in range(warmup):  # unmeasured
        for name in ("hcp", "plain"):
            steps[name]()
            if name == "hcp":
                prefetch.settle()
    for sec in sections.values():
        sec.total.clear()
    prefetch.cpu = 0.0
    rows = {"hcp": [], "plain": []}  # per block: (wall s, process CPU s, [(loss, tokens, micro)])
    for b in range(2 * blocks):
        name = ("hcp", "plain")[(b + b // 2) % 2]  # hcp plain plain hcp hcp plain ...
        dist.barrier()
        cpu0, t0 = time.process_time(), time.perf_counter()
        out = [steps[name]() for _ in range(block)]
        if name == "hcp":
            sections["hcp"].start()
            prefetch.settle()
            sections["hcp"].mark("data")
        rows[name].append((time.perf_counter() - t0, time.process_time() - cpu0, out))
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


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--nproc", type=int, default=4, help="gloo ranks (pure DP)")
    ap.add_argument("--steps", type=int, default=8, help="measured steps of each loop per repetition")
    ap.add_argument("--block", type=int, default=4, help="steps of one loop run back to back")
    ap.add_argument("--reps", type=int, default=3, help="repetitions (reported each and their median)")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured first steps of each loop")
    ap.add_argument("--profile", type=int, default=0, help="profile this many more steps")
    ap.add_argument("--loss-rtol", type=float, default=1e-4)
    ap.add_argument("overrides", nargs="*", help="extra hcp config overrides")
    args = ap.parse_args(argv)
    if min(args.steps, args.nproc, args.reps, args.block) < 1 or args.steps % args.block:
        ap.error("--steps, --reps, --block and --nproc must be >= 1, --steps a multiple of --block")
    per_rep = args.steps // args.block  # blocks of each loop per repetition
    ctx = mp.get_context("fork")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank, args=(r, args.nproc, port, args.overrides, args.reps * per_rep,
                                             args.block, args.warmup, args.profile, queue))
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
    results.sort(key=lambda r: r[0])
    for p in procs:
        p.join()

    def loop(name, first, last):
        """tokens/s, critical-path CPU s per step, and per step loss, global tokens and most
        micro-batches of any rank, over blocks [first, last)."""
        per_rank = [rows[name][first:last] for _, rows, _, _ in results]
        wall = sum(max(r[i][0] for r in per_rank) for i in range(last - first))
        cpu = sum(max(r[i][1] for r in per_rank) for i in range(last - first))
        steps = [s for blk in per_rank[0] for s in blk[2]]
        micro = [max(s[2] for s in col) for col in zip(*[[s for blk in r for s in blk[2]]
                                                         for r in per_rank])]
        return dict(tokens_per_s=sum(s[1] for s in steps) / wall, critical_cpu_s=cpu / len(steps),
                    losses=[s[0] for s in steps], tokens=[s[1] for s in steps], micro=micro)

    print(f"{args.nproc} gloo ranks, +recipe=llama_tiny {' '.join(args.overrides)}, {args.reps} x "
          f"{args.steps} steps of each (after {args.warmup} warm-up), in alternating blocks of "
          f"{args.block} (ABBA)")
    print(f"{'rep':<6} {'hcp tok/s':>9} {'plain tok/s':>11} {'ratio':>6} {'hcp cpu s':>9} "
          f"{'plain cpu s':>11} {'cpu ratio':>9}")
    reps = []
    for k in range(args.reps):
        h, p = (loop(n, k * per_rep, (k + 1) * per_rep) for n in ("hcp", "plain"))
        reps.append((h["tokens_per_s"] / p["tokens_per_s"], p["critical_cpu_s"] / h["critical_cpu_s"]))
        print(f"{k + 1:<6} {h['tokens_per_s']:9.0f} {p['tokens_per_s']:11.0f} {reps[-1][0]:6.3f} "
              f"{h['critical_cpu_s']:9.4f} {p['critical_cpu_s']:11.4f} {reps[-1][1]:9.3f}")
    ratio, cpu_ratio = (statistics.median(r[i] for r in reps) for i in range(2))
    pairs = [loop("hcp", b, b + 1)["tokens_per_s"] / loop("plain", b, b + 1)["tokens_per_s"]
             for b in range(args.reps * per_rep)]  # hcp block b and plain block b ran next to each other
    print(f"median over the {len(pairs)} adjacent (hcp, plain) block pairs of their tokens/s ratio: "
          f"{statistics.median(pairs):.3f}x (quartiles {' / '.join(f'{q:.3f}' for q in statistics.quantiles(pairs, n=4))})"
          if len(pairs) > 1 else "")
    out = {n: loop(n, 0, args.reps * per_rep) for n in ("hcp", "plain")}
    h, p = out["hcp"], out["plain"]
    diff = max(abs(a - b) / abs(b) for a, b in zip(h["losses"], p["losses"]))
    same = h["tokens"] == p["tokens"] and h["micro"] == p["micro"]
    print(f"median hcp / plain tokens/s: {ratio:.3f}x (critical-path CPU: {cpu_ratio:.3f}x); "
          f"losses {h['losses'][0]:.5f} -> {h['losses'][-1]:.5f}, largest "
          f"relative difference {diff:.2e} (rtol {args.loss_rtol:g}): "
          f"{'identical' if diff <= args.loss_rtol else 'DIFFERENT'}; tokens and micro-batches per "
          f"step {'the same' if same else 'DIFFERENT'} ({sum(h['tokens']) / len(h['tokens']):.0f} "
          f"tokens, {max(h['micro'])} micro-batches)")
    names = ["data", "forward_backward", "clip", "optimizer", "metrics", "logging"]
    measured = args.reps * args.steps
    for i, what in enumerate(("main-thread CPU", "wall")):
        mean = lambda loop, n: sum(r[3][loop].get(n, (0, 0))[i] for r in results) / len(results)  # noqa: E731
        print(f"{what} ms per step by section, mean over ranks (hcp / plain): " + ", ".join(
            f"{n} {mean('hcp', n) / measured * 1e3:.1f} / {mean('plain', n) / measured * 1e3:.1f}"
            for n in names) + (f"; hcp's plan-ahead thread CPU {mean('hcp', 'plan-ahead thread') / measured * 1e3:.1f}"
                               if i == 0 else ""))
    if results[0][2]:
        print(results[0][2])
    out.update(ratio=ratio, cpu_ratio=cpu_ratio, reps=reps, pairs=pairs, loss_rel_diff=diff)
    if diff > args.loss_rtol or not same:
        raise SystemExit(f"the loops differ: losses by {diff:.2e} (--loss-rtol {args.loss_rtol:g}), "
                         f"tokens or micro-batches per step {'equal' if same else 'not equal'}")
    return out


if __name__ == "__main__":
    main()
