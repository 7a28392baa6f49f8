"""Reporting for benchmarks/dynamic_cp.py: the summary over batches, its printout and the
solver's timeline figure. Seconds throughout."""
from __future__ import annotations

import numpy as np

from hcp.dcp.solver import simulate_plan

METHODS = ("packing_only", "greedy", "solver")
ONE_PER_ROUND = "one micro-batch per group and round"


def summarize(rows, exact):
    out = {}
    for k, rs in rows.items():
        s = {"mean_time_s": float(np.mean([r["time"] for r in rs])),
             "mean_time_over_bound": float(np.mean([r["over_bound"] for r in rs])),
             "max_time_over_bound": float(np.max([r["over_bound"] for r in rs])),
             "mean_solve_ms": float(np.mean([r["solve_ms"] for r in rs])),
             "max_solve_ms": float(np.max([r["solve_ms"] for r in rs])),
             "mean_rounds": float(np.mean([r["rounds"] for r in rs])),
             "max_plan_over_step": float(np.max([r.get("plan_over_step", np.nan) for r in rs])),
             "tflops_per_gpu": float(np.mean([r["tflops_per_gpu"] for r in rs]))}
        if exact:
            s["mean_time_over_optimum"] = float(np.mean([r["over_optimum"] for r in rs]))
            s["mean_time_over_optimum_dual_bound"] = float(
                np.mean([r["over_optimum_dual"] for r in rs]))
            s["optimum_proven_batches"] = int(sum(r["optimal_proven"] for r in rs))
        out[k] = s
    sol = np.array([r["time"] for r in rows["solver"]])
    for k in rows:
        if k != "solver":  # solver time / peer time per batch: < 1 means ours is faster
            ratio = sol / np.array([r["time"] for r in rows[k]])
            out[f"solver_over_{k}"] = {"mean": float(ratio.mean()), "max": float(ratio.max()),
                                       "batches_slower": int((ratio > 1 + 1e-9).sum()),
                                       "batches": int(ratio.size)}
    out["tflops_gain_over_packing_only"] = (out["solver"]["tflops_per_gpu"]
                                            / out["packing_only"]["tflops_per_gpu"])
    return out


def print_summary(s, args):
    print(f"\nlengths {args.lengths}, seeds {args.seeds[0]}-{args.seeds[-1]} x {args.batches} "
          f"batches, GBS {args.global_batch}, pool {args.cp_pool}, pp {args.pp}, "
          f"cap {args.max_tokens_per_rank}/rank, "
          f"{'several micro-batches per round' if args.several_per_round else ONE_PER_ROUND}")
    print("method        time_s  /bound  max/bound   /opt  opt<=  rounds  plan_ms(mean/max)  "
          "TFLOPS/GPU")
    for k in (m for m in (*METHODS, "megatron", "exact") if m in s):
        v = s[k]
        opt = (f"{v['mean_time_over_optimum']:6.3f} {v['mean_time_over_optimum_dual_bound']:6.3f}"
               if "mean_time_over_optimum" in v else "     -      -")
        print(f"{k:>12} {v['mean_time_s']:7.3f} {v['mean_time_over_bound']:7.3f} "
              f"{v['max_time_over_bound']:9.3f} {opt} {v['mean_rounds']:6.1f} "
              f"{v['mean_solve_ms']:8.1f}/{v['max_solve_ms']:<8.1f} {v['tflops_per_gpu']:8.1f}")
    for k in (m for m in (*METHODS, "megatron", "exact") if f"solver_over_{m}" in s):
        r = s[f"solver_over_{k}"]
        print(f"solver time / {k}: mean {r['mean']:.3f}, worst {r['max']:.3f}, slower on "
              f"{r['batches_slower']} of {r['batches']} batches")
    v = s["solver"]
    print(f"solver planning: thread CPU time / simulated step time, worst batch: "
          f"{v['max_plan_over_step']:.3f} ("
          f"{'< 1: hidden' if v['max_plan_over_step'] < 1 else '>= 1: NOT hidden'} behind the "
          f"step it plans)")
    print(f"TFLOPS/GPU gain over packing-only: {s['tflops_gain_over_packing_only']:.2f}x "
          f"(published Megatron-LM dynamic CP at GBS 2048 PP 8 CP 8, for comparison: GitHub "
          f"1.48x, CommonCrawl 1.25x)")
    if "exact" in s:
        print(f"exact: optimum proven within 1% on {s['exact']['optimum_proven_batches']} "
              f"batches; /opt is against the best plan found, opt<= against the larger of the "
              f"branch and bound's proven bound and ours (an upper bound on the true ratio)")


def draw_timeline(path, plan, lens, cost, pool):
    """Ranks (stage-major) x time (s); each rank's share of every op, one colour per micro-batch
    (forward solid, backward lighter); gaps are idle time. One `broken_barh` per rank row."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgba
    tl = simulate_plan(plan, lens, cost, record=True)
    arr = np.asarray(lens, dtype=np.float64)
    busy = np.zeros((cost.pp, plan.num_rounds, pool))  # forward s of [stage, mb, rank]
    for j, mb in enumerate(plan.rounds):
        for g in mb.groups:
            f = sum(cost.fwd(arr[q].sum(), (arr[q] ** 2).sum(), g.cp_size)  # [pp]
                    for q in g.micro_batches)
            busy[:, j, g.rank_offset:g.rank_offset + g.cp_size] = np.asarray(f)[:, None]
    cmap = plt.get_cmap("tab20")
    fig, ax = plt.subplots(figsize=(14, 0.12 * pool * cost.pp + 2))
    hw = cost.hw
    for s in range(cost.pp):
        ops = [o for o in tl.ops if o.stage == s]
        fwd = np.array([o.kind == "F" for o in ops])
        mbs = np.array([o.micro_batch for o in ops])
        starts = np.array([o.start for o in ops])
        spans = np.where(fwd[:, None], hw.micro_batch_overhead_fwd + busy[s, mbs],  # [ops, rank]
                         hw.micro_batch_overhead_bwd + cost.bwd_factor * busy[s, mbs])
        colours = [to_rgba(cmap(j % 20), 1.0 if f else 0.55) for j, f in zip(mbs, fwd)]
        for r in range(pool):
            ax.broken_barh(np.stack([starts, spans[:, r]], axis=1), (s * pool + r - 0.45, 0.9),
                           facecolors=colours)
    ax.set_xlim(left=0)
    ax.invert_yaxis()
    ax.set_xlabel("time (s)")
    ax.set_ylabel("rank (stage * pool + pool rank)")
    ax.set_title(f"solver plan: {plan.num_rounds} micro-batches, "
                 f"iteration {tl.iteration_time:.3f} s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
