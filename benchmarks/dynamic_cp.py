"""Dynamic-CP benchmark: our solver against packing-only, greedy and Megatron-Core, simulated.

The model is the recipe's `llm` (`--recipe`, default llama13b_dynamic_cp: LLaMA-13B), the
hardware the profile `--cost` (default h100: analytic H100 defaults). `--exact` adds the exact
optimum (small instances, pp=1); `--megatron` adds Megatron-Core's `BalancedCPScheduler`
(optional `bench` extra: `pip install -e .[bench]`; pp=1 only, as Megatron runs it).

    # held-out seeds (never used to tune the solver: tuning used seeds 0-1), three length
    # distributions, against Megatron's scheduler at pp = 1
    python benchmarks/dynamic_cp.py --lengths lognormal --global-batch 256 --pp 1 \
        --max-tokens-per-rank 2048 --max-len 8192 --seeds 100-109 --megatron
    # seed-sized: 64 GPUs = PP 8 x CP pool 8, global batch 2048 (--lp-bound: the tighter
    # pipeline bound, hcp/dcp/pipeline_bound.py with the longest sequence pinned,
    # hcp/dcp/pinned_bound.py; seconds to a minute per batch, needs highspy: .[bench])
    python benchmarks/dynamic_cp.py --global-batch 2048 --cp-pool 8 --pp 8 \
        --max-tokens-per-rank 8192 --max-len 65536 --seeds 100-109 --json out.json [--lp-bound]

Per batch and on average: simulated iteration time (s), its ratio to the provable lower bound
(hcp/dcp/lower_bound.py; with `--lp-bound` and pp > 1 the tighter hcp/dcp/pinned_bound.py),
rounds, CP-size histogram (sequences per CP size), planning wall time, and TFLOPS/GPU = model FLOPs of the real tokens (hcp/model/flops.py) / (iteration time *
GPUs), GPUs = pool * pp * tp. At pp = 1 (without `--dp-shard`) a group may run several
micro-batches per round (hcp/dcp/packing.py), for our solver and for Megatron's scheduler alike.
Lengths (`--lengths`): `wikipedia` (FlexSP's Wikipedia sample, hcp/data/lengths/), `code`
(this Python's standard-library sources as byte-level documents: the `code_corpus` data set's
document lengths), `lognormal` (numpy `lognormal(mean=ln 1024, sigma=1.5)`, i.e. median
1024, rounded and clipped to [128, 8192] as in Megatron's dynamic-CP example; a fixed pool of
100,000 draws, default_rng(20260101): median 1023, mean 2111 after clipping) or a file of one
positive integer per line. Each seed of `--seeds` draws `--batches` batches of `--global-batch`
lengths without replacement from those <= `--max-len` (numpy default_rng(seed)). Bad arguments
are parser errors (exit status 2).
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # dynamic_cp_report, harness, lengths beside this file

from dynamic_cp_report import METHODS, draw_timeline, print_summary, summarize  # noqa: E402
from harness import HelpFormatter  # noqa: E402
from hcp.dcp.baselines import greedy, packing_only  # noqa: E402
from hcp.dcp.cost_model import CostModel, recipe_llm  # noqa: E402
from hcp.dcp.hardware import load_profile  # noqa: E402
from hcp.dcp.exact import solve_exact  # noqa: E402
from hcp.dcp.lower_bound import lower_bound  # noqa: E402
from hcp.dcp.megatron_peer import megatron_plan  # noqa: E402
from hcp.dcp.pinned_bound import pinned_bound  # noqa: E402
from hcp.dcp.packing import max_length, prepare_lengths, validate_plan  # noqa: E402
from hcp.dcp.solver import simulate_plan, solve  # noqa: E402
from lengths import DISTRIBUTIONS, distribution, parse_seeds  # noqa: E402,F401  (beside this file)

COLUMNS = """columns, per batch and method (the summary averages them over the batches):
  time_s      simulated iteration time of the method's plan through 1F1B (seconds, cost model --cost)
  /bound      time_s over the provable lower bound of the batch (1.0 = optimal)
  max/bound   (summary) the worst batch's /bound
  /opt        time_s over the best plan the exact solver found (--exact only; else -)
  opt<=       (summary, --exact) time_s over the larger proven lower bound: an upper bound on /opt
  M, rounds   rounds of the plan (a round: the pool's groups between two synchronisations)
  plan_ms     wall time to compute the plan (mean/max in the summary); the summary also gives
              the solver's planning thread CPU time over time_s (the step it must hide behind)
  TFLOPS      model FLOPs of the batch (3 x forward, real tokens) / time_s / GPUs (cp-pool x pp x tp)
  cp histogram  {CP size: sequences planned at that size}"""


def parse_args(argv=None):
    """`(args, cost model, length pool)`; every bad argument, the cost profile and the
    `--lengths` file included, is a parser error (exit 2) naming the value and the fix."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=COLUMNS,
                                formatter_class=HelpFormatter)
    p.add_argument("--lengths", default="wikipedia",
                   help="wikipedia, code, lognormal, or a file of one positive integer per line "
                        "(blank lines and # comments allowed)")
    p.add_argument("--global-batch", type=int, default=2048, help="sequences per global batch")
    p.add_argument("--cp-pool", type=int, default=8, help="dp * cp ranks per stage")
    p.add_argument("--pp", type=int, default=8, help="pipeline stages (1F1B) the plans are simulated on")
    p.add_argument("--max-tokens-per-rank", type=int, default=8192,
                   help="memory cap: tokens one rank holds per micro-batch")
    p.add_argument("--max-len", type=int, default=65536, help="drop longer sequences")
    p.add_argument("--batches", type=int, default=1, help="batches per seed")
    p.add_argument("--seeds", default="100-109",
                   help="A-B (inclusive) or comma list; 0-1 tuned the solver, so report others")
    p.add_argument("--recipe", default="llama13b_dynamic_cp", help="the model: a recipe's llm")
    p.add_argument("--tp", type=int, default=None, help="TP size (default: the recipe's)")
    p.add_argument("--dp-shard", action="store_true",
                   help="FSDP over the pool: every micro-batch synchronises it (changes pp=1 "
                        "only: under PP every micro-batch is a pipeline unit already)")
    p.add_argument("--cost", default="h100", help="h100 or a profile YAML")
    p.add_argument("--megatron", action="store_true",
                   help="add Megatron-Core's BalancedCPScheduler (pp=1; pip install -e .[bench])")
    p.add_argument("--exact", action="store_true",
                   help="also solve exactly (pp=1, small only; branch and bound, hcp/dcp/exact.py; "
                        "plans of one micro-batch per group and round)")
    p.add_argument("--exact-time-limit", type=float, default=10.0, help="seconds per batch")
    p.add_argument("--lp-bound", action="store_true",
                   help="pp > 1: /bound against the tighter pipeline bound (min over M of a 1F1B "
                        "linear program, the longest sequence's micro-batch pinned, "
                        "hcp/dcp/pinned_bound.py; seconds to a minute per batch; needs highspy)")
    p.add_argument("--timeline", help="PNG of the solver's timeline for the first batch")
    p.add_argument("--json", help="write the summary here")
    args = p.parse_args(argv)
    try:
        args.seeds = parse_seeds(args.seeds)
    except ValueError as err:
        p.error(str(err))
    if args.megatron and args.pp > 1:
        p.error(f"--megatron: Megatron runs its hybrid-CP scheduler without PP; use --pp 1 "
                f"(not {args.pp})")
    if args.tp is not None and args.tp < 1:
        p.error(f"--tp {args.tp}: must be >= 1")
    for flag, low in (("--global-batch", 1), ("--cp-pool", 1), ("--pp", 1), ("--batches", 1),
                      ("--max-tokens-per-rank", 1), ("--max-len", 1)):
        v = getattr(args, flag[2:].replace("-", "_"))
        if v < low:
            p.error(f"{flag} {v}: must be >= {low}")
    if args.cp_pool & (args.cp_pool - 1):
        ok = 1 << (args.cp_pool.bit_length() - 1)
        p.error(f"--cp-pool {args.cp_pool}: not a power of two (aligned CP blocks); use {ok} or "
                f"{2 * ok}")
    if args.lp_bound:
        try:
            import highspy  # noqa: F401
        except ImportError:
            p.error("--lp-bound needs highspy (HiGHS with warm starts): pip install -e .[bench]")
    if args.exact and args.pp > 1:
        p.error(f"--exact solves single-stage plans only; drop it or use --pp 1 (not {args.pp})")
    if not args.exact_time_limit > 0:
        p.error(f"--exact-time-limit {args.exact_time_limit}: must be > 0 seconds")
    limit = max_length(args.cp_pool, args.max_tokens_per_rank)
    if args.max_len > limit:
        p.error(f"--max-len {args.max_len} exceeds what --cp-pool {args.cp_pool} holds at "
                f"--max-tokens-per-rank {args.max_tokens_per_rank} (head-tail padding counted): "
                f"{limit}, so the longest sequences fit nowhere; lower --max-len to {limit} or "
                f"raise --cp-pool / --max-tokens-per-rank")
    if args.lengths not in DISTRIBUTIONS and not Path(args.lengths).is_file():
        what = "a directory" if Path(args.lengths).is_dir() else "no such file"
        p.error(f"--lengths {args.lengths}: {what}; give a text file, one length per line")
    for flag, out in (("--json", args.json), ("--timeline", args.timeline)):
        if out and not Path(out).resolve().parent.is_dir():
            p.error(f"{flag} {out}: its directory does not exist; create it or pick another path")
    try:
        hw = load_profile(args.cost)
        lengths = distribution(args.lengths)
    except ValueError as err:
        p.error(str(err))
    try:
        llm = recipe_llm(args.recipe)
    except ValueError as err:  # ConfigError: no such recipe
        p.error(f"--recipe {args.recipe}: {err}")
    tp = llm.layout.tp if args.tp is None else args.tp
    if llm.num_heads % tp or llm.num_kv_heads % tp:
        p.error(f"--tp {tp}: --recipe {args.recipe} has {llm.num_heads} heads and "
                f"{llm.num_kv_heads} K/V heads; use a TP size that divides both")
    if args.pp > llm.num_layers:
        p.error(f"--pp {args.pp}: more stages than the {llm.num_layers} layers of --recipe "
                f"{args.recipe}; use --pp <= {llm.num_layers}")
    usable = int((lengths <= args.max_len).sum())
    if lengths.size == 0:
        p.error(f"--lengths {args.lengths} holds no lengths; give one token count per line")
    if usable == 0:
        p.error(f"--lengths {args.lengths}: no length <= --max-len {args.max_len}; raise --max-len")
    if usable < args.global_batch:
        p.error(f"--lengths {args.lengths} has {usable} lengths <= --max-len {args.max_len}; "
                f"lower --global-batch to <= {usable} or raise --max-len")
    # the exact branch and bound searches one micro-batch per group and round
    args.several_per_round = args.pp == 1 and not args.dp_shard and not args.exact
    return args, CostModel(llm, hw, pp=args.pp, tp=args.tp), lengths


def draw_batches(args, lengths: np.ndarray) -> list[np.ndarray]:
    """For each seed, `--batches` batches of `--global-batch` lengths drawn from those
    <= `--max-len`."""
    lens = lengths[lengths <= args.max_len]
    out = []
    for seed in args.seeds:
        rng = np.random.default_rng(seed)
        out += [rng.choice(lens, args.global_batch, replace=False) for _ in range(args.batches)]
    return out


def plan_batch(method, lens, cost, args):
    """(plan, planning wall seconds, planning thread CPU seconds) for one method. A full garbage
    collection runs first, so that a collection of earlier garbage (the timeline figure's
    objects) is not charged to it. The CPU time is what the planning costs on an idle core
    (wall time on this shared machine counts the other processes' load too)."""
    pool, m = args.cp_pool, args.max_tokens_per_rank
    gc.collect()
    start, cpu = time.perf_counter(), time.thread_time()
    if method == "packing_only":
        plan = packing_only(lens, pool, m, args.max_len)
    elif method == "greedy":
        plan = greedy(lens, pool, m)
    elif method == "megatron":
        plan = megatron_plan(lens, pool, m)
    else:
        plan = solve(lens, cost, pool, m, args.max_len, args.several_per_round).plan
    return plan, time.perf_counter() - start, time.thread_time() - cpu


def main(argv=None):
    args, cost, lengths = parse_args(argv)
    gpus = args.cp_pool * args.pp * cost.tp
    planners = METHODS + (("megatron",) if args.megatron else ())
    if args.megatron:  # import (~17 s) before any plan is timed
        import megatron.core.pipeline_parallel.hybrid_cp_schedule  # noqa: F401
    methods = planners + (("exact",) if args.exact else ())
    rows = {k: [] for k in methods}
    print(f"{'batch':>5} {'method':>12} {'time_s':>8} {'/bound':>7} {'/opt':>7} {'M':>4} "
          f"{'plan_ms':>8} {'TFLOPS':>7}  cp histogram")
    for b, raw in enumerate(draw_batches(args, lengths)):
        lens, _ = prepare_lengths(raw, args.cp_pool, args.max_tokens_per_rank)
        bound = lower_bound(lens, cost, args.cp_pool, args.max_tokens_per_rank,
                            args.several_per_round)
        if args.lp_bound and args.pp > 1:
            pb = pinned_bound(lens, cost, args.cp_pool, args.max_tokens_per_rank)
            u = pb.unpinned
            print(f"{b:>5} pipeline bound {pb.bound:.3f} s (simple {u.simple:.3f}; LP {u.bound:.3f} "
                  f"at M={u.best_m}, {u.lps} LPs; longest sequence pinned x{pb.bound / u.bound:.3f}"
                  f" at M in {pb.best_range}, {pb.lps} LPs; {pb.seconds:.1f} s)")
            bound = pb.bound
        flops = cost.model_flops(lens)
        plans, plan_cpu = {}, {}
        for k in planners:
            plan, secs, cpu = plan_batch(k, lens, cost, args)
            validate_plan(plan, lens, args.cp_pool, args.max_tokens_per_rank,
                          args.several_per_round)
            plans[k] = (plan, secs, simulate_plan(plan, lens, cost).iteration_time)
            plan_cpu[k] = cpu
        opt = None
        if args.exact:
            start = time.perf_counter()
            res = solve_exact(lens, cost, args.cp_pool, args.max_tokens_per_rank,
                              tuple(p for p, _, _ in plans.values()), args.exact_time_limit)
            secs = time.perf_counter() - start
            plan = res.plan
            t = simulate_plan(plan, lens, cost).iteration_time
            plans["exact"] = (plan, secs, t)
            opt = t  # best known plan; the optimum lies in [opt_low, t]
            opt_low = max(res.dual_bound, bound)  # both are proven lower bounds
        for k in methods:
            plan, secs, t = plans[k]
            row = {"time": t, "over_bound": t / bound, "rounds": plan.num_rounds,
                   "solve_ms": 1e3 * secs, "tflops_per_gpu": flops / t / gpus / 1e12,
                   "cp_histogram": plan.cp_histogram()}
            if k in plan_cpu:  # planning CPU time over the step it plans (to hide behind it)
                row["plan_cpu_ms"] = 1e3 * plan_cpu[k]
                row["plan_over_step"] = plan_cpu[k] / t
            if opt is not None:
                row["over_optimum"] = t / opt
                row["over_optimum_dual"] = t / opt_low
                row["optimal_proven"] = bool(res.optimal)
            rows[k].append(row)
            print(f"{b:>5} {k:>12} {t:8.3f} {t / bound:7.3f} "
                  f"{(f'{t / opt:7.3f}' if opt else '      -')} {plan.num_rounds:>4} "
                  f"{1e3 * secs:8.1f} {row['tflops_per_gpu']:7.1f}  {row['cp_histogram']}")
        if b == 0 and args.timeline:
            draw_timeline(args.timeline, plans["solver"][0], lens, cost, args.cp_pool)
    summary = summarize(rows, args.exact)
    print_summary(summary, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), **summary, "batches": rows},
                                              indent=1, default=str))
    return summary


if __name__ == "__main__":
    main()
