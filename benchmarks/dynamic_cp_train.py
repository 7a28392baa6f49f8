"""Measured dynamic CP on forked gloo ranks: static CP (packing-only at cp = pool) vs dynamic CP.

    # issue 24's table: 5 held-out seeds of each of Wikipedia, lognormal and code lengths
    python benchmarks/dynamic_cp_train.py --json out.json
    python benchmarks/dynamic_cp_train.py --lengths code --seeds 100 --global-batch 32 \
        --micro-batch-tokens 512 --profile out.profile.yaml

Setup: `--ranks` CPU ranks (gloo, one thread each) form one CP pool; the tiny LLaMA of
`+recipe=llama_tiny` (fp32) runs the trainer's step (`hcp.train.step.StepRunner.forward_backward`:
token-level loss, 1F1B, the DP x CP gradient sync) over the micro-batches of the step plan
(hcp/plan/step.py) on global batches drawn from long-tail document lengths (`--lengths`, a comma list): FlexSP's
Wikipedia sample (the documents that fit `--ranks x --micro-batch-tokens` tokens),
`code`, the code corpus's (this Python's standard-library sources, byte-level; pools in
benchmarks/lengths.py), or `--lengths lognormal`, Megatron's dynamic-CP example's scaled to the pool; token ids
drawn at random: the content does not change the time). The cap forces static CP = pool: the
longest documents need the whole pool, and a static run sizes its CP for them. Static:
`first_fit` at cp = pool (dp 1, every micro-batch on the whole pool). Dynamic: the `dynamic_cp`
policy (hcp/dcp/policy.py) with the cost model under the profile calibrated on this machine
(`--profile`, else `mode=calibrate`'s fit is run first, over every CP size 1 .. pool and the
cap's region, hcp/preflight/calibrate.py `grid`; with `--json X.json` the profile is kept as
X.profile.yaml). Each micro-batch runs on its CP group from the pre-built dynamic-CP groups. Not in
the critical path: the gradient sync (the same for both); no optimizer step runs.

Every (lengths, seed) pair of `--lengths` x `--seeds` is a run of `--steps` global batches;
all runs share one fork of the ranks and one calibration. Per method and rep (`--reps`
measurements of both methods on the same plans, the order alternating, after one unmeasured
warm-up step of each on the first batch of each distribution: gloo connects a group on its
first collective): wall tokens/s (rank 0's wall time; 2 shared cores hide imbalance), and the
critical path from each rank's busy time per micro-batch (hcp/preflight/calibrate.py `busy_time`:
the CPU time of the rank's whole process over the micro-batch's forward and backward, so that
gloo's CP all-gathers and reduce-scatters, which run on gloo's own threads, count, while
waiting for a peer does not: a blocked gloo rank sleeps; neither does the machine's other
load): a micro-batch starts on its group when all its ranks are free and lasts as long as its
slowest rank; the step lasts until the last rank is free. `comm_share` is the part of the
ranks' busy time spent outside the calling thread (communication); `compute_only_speedup` is
the speed-up the calling thread's CPU time alone would show. Per run: `measured_speedup`, the
critical-path ratio static / dynamic (median over reps); `predicted_speedup`, the same
critical path over the cost model's micro-batch times under the same profile (`predicted_path`);
`bound_speedup`, the static prediction over the provable lower bound (hcp/dcp/lower_bound.py),
a limit no plan can pass under that profile; `measured_over_bound`; `prediction_error` =
predicted / measured - 1; `loss_rel_diff`, the largest relative difference of the two methods'
losses (the same batches and weights: ~0). Per distribution: the median of each figure over its
seeds. Last, the cost model's errors inside the trainer's step by micro-batch kind (method, CP size,
one document or packed; `error_table`, from each run's `micro_batch_errors`: per micro-batch its
slowest rank's busy time, median over reps, against the profile's time). `plan ms`: a
rank's CPU time to plan a step (every rank plans). `--json PATH` writes `{"runs": [{"lengths",
"seed", "static": {..., "micro_batch_errors": [...]}, "dynamic": {...}, the figures above}], "summary": {lengths: medians},
"profile": the profile's path}`. On an NCCL cluster the ring-step latency is microseconds and
these ratios would differ: they measure gloo on one host.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace as NS

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # lengths.py, critical_path.py beside this file

from hcp.config.compose import compose_config  # noqa: E402
from hcp.dcp.cost_model import CostModel  # noqa: E402
from hcp.dcp.hardware import load_profile  # noqa: E402
from hcp.dcp.lower_bound import lower_bound  # noqa: E402
from hcp.dcp.policy import dynamic_cp_policy  # noqa: E402
from hcp.plan.step import first_fit_policy  # noqa: E402
from critical_path import critical_path, error_table, micro_batch_errors, predicted_path  # noqa: E402
from lengths import DISTRIBUTIONS, distribution, parse_seeds  # noqa: E402

METHODS = ("static", "dynamic")


def layout(dp: int, cp: int, layers: int):
    return NS(module="llm", tp=1, cp=cp, pp=1, dp=dp, rank_offset=0, num_ranks=dp * cp,
              pp_layers=(layers,), recompute="none", dp_shard=False, cp_comm="allgather",
              sequence_parallel=False)


def pool(name: str, max_len: int) -> np.ndarray:
    """The lengths of pool `name` (`lengths.DISTRIBUTIONS`, scaled to `max_len`) that fit the
    CP pool's `max_len` tokens, sorted."""
    lens = distribution(name, max_len)
    return np.sort(lens[lens <= max_len])


def _rank(payload) -> None:
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from hcp.data.llava import Sample
    from hcp.launch.distributed import init_distributed
    from hcp.model import LlavaModel, init_parameters
    from hcp.model.stage import StageSpec
    from hcp.parallel.groups import ProcessGroupRegistry
    from hcp.plan.lengths import SampleSizes
    from hcp.plan.step import plan_step, register_policy
    from hcp.preflight.calibrate import busy_time
    from hcp.train.rank_data import llm_inputs, micro_batch_groups
    from hcp.train.step import StepRunner

    cfg = OmegaConf.create(payload["cfg"])
    device = init_distributed(cfg.launcher)
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    register_policy("dynamic_cp", dynamic_cp_policy(cfg.llm, payload["profile"]))
    layouts = {"static": {"llm": layout(1, world, cfg.llm.num_layers)},
               "dynamic": {"llm": layout(world, 1, cfg.llm.num_layers)}}
    groups = ProcessGroupRegistry(layouts["dynamic"], dynamic_cp_modules=("llm",))
    model = LlavaModel(None, None, cfg.llm, stage=StageSpec.of((cfg.llm.num_layers,), 0), encoder=False)
    init_parameters(model, 7)
    runner = StepRunner(model, groups, device)  # the trainer's step: 1F1B, token-level loss, DP x CP sync
    gen = torch.Generator().manual_seed(0)
    data = []  # per batch: its documents as samples (random ids: the content does not change the time)
    for lens in payload["batches"]:
        ids = [torch.randint(0, cfg.llm.vocab_size, (int(n),), generator=gen).tolist() for n in lens]
        data.append([Sample(str(j), x, x[1:] + x[:1], [], 0, "") for j, x in enumerate(ids)])
    plans, plan_s = {}, {}
    for method in METHODS:
        packing = "first_fit" if method == "static" else "dynamic_cp"
        plans[method], plan_s[method] = [], []
        for lens in payload["batches"]:
            sizes = SampleSizes.from_lists(list(lens), list(lens), [[] for _ in lens])
            t0 = busy_time()  # CPU seconds: 8 ranks plan at once on the shared cores
            plans[method].append(plan_step(sizes, layouts[method], packing,
                                           payload["cap"]).rank(rank))
            plan_s[method].append(busy_time() - t0)
    marks = []  # (busy, calling-thread) seconds at each micro-batch's forward, then at the grad sync
    for name in ("stage_forward", "sync_grads"):
        def marked(*a, _call=getattr(runner, name), **k):
            marks.append((busy_time(), time.thread_time()))
            return _call(*a, **k)
        setattr(runner, name, marked)

    def run(plan, b):
        """One step of `plan` on batch `b` through the trainer's `StepRunner.forward_backward`:
        per micro-batch (busy, calling-thread) seconds of its forward and backward (0 for one
        this rank does not run), the wall time with the gradient sync, and the step's loss."""
        batches, metas = llm_inputs(plan, range(len(data[b])), data[b], -1, runner.stage, device)
        c = plan.counts
        marks.clear()
        dist.barrier()
        w0 = time.perf_counter()
        loss, _, _, _ = runner.forward_backward([x for _, x in batches], metas, [c.loss_tokens, c.tokens, c.sum_sq_lengths,
                                c.image_rows], False, micro_batch_groups(groups, plan, rank))
        dist.barrier()
        wall = time.perf_counter() - w0
        spans = iter([(b1 - b0, t1 - t0) for (b0, t0), (b1, t1) in zip(marks, marks[1:])])
        runner.model.zero_grad(set_to_none=True)
        return [next(spans) if plan.keep_empty or not mb.empty else (0.0, 0.0)
                for mb in plan.micro_batches], wall, float(loss)

    for method in METHODS:  # warm-up, not measured: gloo connects each group on first use
        for b in payload["warm_up"]:  # the first batch of each distribution
            run(plans[method][b], b)
    reps = []
    for rep in range(payload["reps"]):
        out = {}
        # alternate which method runs first, so a drift of the machine's load hits both
        for method in (METHODS if rep % 2 == 0 else METHODS[::-1]):
            busy, compute, walls, losses = [], [], [], []
            for b, plan in enumerate(plans[method]):
                step, wall, loss = run(plan, b)
                walls.append(wall)
                losses.append(loss)
                busy.append([x for x, _ in step])
                compute.append([c for _, c in step])
            out[method] = {"busy": busy, "compute": compute, "wall": walls, "loss": losses}
        reps.append(out)
    mine = {"reps": reps, "plan_s": plan_s,
            "groups": {m: [[(mb.cp_size, mb.cp_block) for mb in pl.micro_batches]
                           for pl in plans[m]] for m in METHODS}}
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        Path(payload["out"]).write_text(json.dumps(gathered))
    dist.barrier()
    dist.destroy_process_group()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ranks", type=int, default=8, help="gloo ranks: the CP pool")
    p.add_argument("--steps", type=int, default=1, help="global batches (steps) per seed and rep")
    p.add_argument("--reps", type=int, default=3, help="measurements of both methods")
    p.add_argument("--lengths", default="wikipedia,lognormal,code",
                   help=f"comma list of {', '.join(DISTRIBUTIONS)}: the code corpus's, FlexSP's "
                        "Wikipedia sample, or Megatron's example's lognormal scaled to the pool")
    p.add_argument("--global-batch", type=int, default=64, help="documents per step")
    p.add_argument("--micro-batch-tokens", type=int, default=256, help="cap per rank")
    p.add_argument("--seeds", default="100-104",
                   help="A-B (inclusive) or a comma list; each draws its own global batches "
                        "(held out: the solver was tuned on seeds 0-1)")
    p.add_argument("--profile", help="a mode=calibrate profile.yaml; None: calibrate now")
    p.add_argument("--json", help="write the results here (and the fitted profile beside it)")
    args = p.parse_args(argv)
    if args.ranks < 1 or args.ranks & (args.ranks - 1):
        p.error(f"--ranks {args.ranks}: the CP pool must be a power of two")
    for flag in ("steps", "reps", "global_batch", "micro_batch_tokens"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be >= 1")
    args.lengths = args.lengths.split(",")
    for name in args.lengths:
        if name not in DISTRIBUTIONS:
            p.error(f"--lengths {name}: not one of {', '.join(DISTRIBUTIONS)}; give a comma list of them")
    try:
        args.seeds = parse_seeds(args.seeds)
    except ValueError as err:
        p.error(str(err))
    if args.json and not Path(args.json).resolve().parent.is_dir():
        p.error(f"--json {args.json}: its directory does not exist; create it or pick another path")
    if args.profile is None:
        from hcp.preflight.calibrate import check_cap
        try:
            check_cap(args.micro_batch_tokens)
        except ValueError as err:
            p.error(f"--micro-batch-tokens {args.micro_batch_tokens}: {err} (or give --profile)")
    else:
        try:
            load_profile(args.profile)
        except ValueError as err:
            p.error(f"--profile {args.profile}: {err}")
    max_len = args.ranks * args.micro_batch_tokens
    for name in args.lengths:
        if pool(name, max_len).size < args.global_batch:
            p.error(f"--global-batch {args.global_batch}: only {pool(name, max_len).size} "
                    f"{name} documents fit {max_len} tokens; lower it")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    cfg = compose_config(["+recipe=llama_tiny", f"launcher.nproc_per_node={args.ranks}"])
    max_len = args.ranks * args.micro_batch_tokens
    runs, batches = [], []  # a run: one (lengths, seed), its `--steps` batches
    for name in args.lengths:
        lens = pool(name, max_len)
        for seed in args.seeds:
            rng = np.random.default_rng(seed)
            runs.append({"lengths": name, "seed": seed, "first": len(batches)})
            batches += [rng.choice(lens, args.global_batch, replace=False)
                        for _ in range(args.steps)]
    from omegaconf import OmegaConf

    from hcp.launch.launch import start_local_ranks

    # mkdtemp, not TemporaryDirectory: forked ranks inherit its finalizer and would delete it
    tmp = tempfile.mkdtemp(prefix="dcp-train-")
    keep = None
    try:
        profile = args.profile
        if profile is None:  # every CP size the plans use, over the plans' region (the cap)
            from hcp.preflight.calibrate import run_calibrate
            sizes = [1 << e for e in range(args.ranks.bit_length())]
            profile = run_calibrate(cfg, tmp, sizes, args.micro_batch_tokens)
            keep = Path(args.json).with_suffix(".profile.yaml") if args.json else None
            if keep:
                shutil.copy(profile, keep)
        out = os.path.join(tmp, "measured.json")
        payload = {"cfg": OmegaConf.to_container(cfg, resolve=True), "profile": profile,
                   "batches": [b.tolist() for b in batches], "cap": args.micro_batch_tokens,
                   "reps": args.reps, "out": out,
                   "warm_up": sorted({r["first"] for r in runs
                                      if r["seed"] == args.seeds[0]})}
        start_local_ranks(_rank, args.ranks, payload, "fork")
        ranks = json.loads(Path(out).read_text())
        hw = load_profile(profile)
        policy = dynamic_cp_policy(cfg.llm, profile)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    cost = CostModel(cfg.llm, hw, pp=1, tp=1, recompute="none")
    lays = {"static": layout(1, args.ranks, cfg.llm.num_layers),
            "dynamic": layout(args.ranks, 1, cfg.llm.num_layers)}
    for run in runs:
        run.update(measure(run, batches, ranks, args, cost, lays, policy))
    result = {"runs": runs, "summary": summary(runs), "profile": str(keep) if keep else args.profile}
    print_table(args, result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


KEYS = ("measured_speedup", "predicted_speedup", "bound_speedup", "measured_over_bound",
        "prediction_error")


def measure(run, batches, ranks, args, cost, lays, policy) -> dict:
    """The figures of one run (module docstring) from the ranks' busy times of its batches."""
    first = run.pop("first")
    idx = range(first, first + args.steps)
    out = {}
    for method in METHODS:
        plans = [first_fit_policy(batches[b], lays[method], args.micro_batch_tokens)
                 if method == "static" else policy(batches[b], lays[method], args.micro_batch_tokens)
                 for b in idx]
        pred = [predicted_path(pl, batches[b], cost) for pl, b in zip(plans, idx)]
        mbs = [m for pl, b in zip(plans, idx) for m in micro_batch_errors(
            pl, batches[b], cost, [[r["reps"][k][method]["busy"][b] for r in ranks]
                                   for k in range(args.reps)])]
        crit, crit_compute = ([sum(critical_path([r["reps"][k][method][key][b] for r in ranks],
                                                 [r["groups"][method][b] for r in ranks])
                                   for b in idx) for k in range(args.reps)]
                              for key in ("busy", "compute"))
        wall = [sum(ranks[0]["reps"][k][method]["wall"][b] for b in idx) for k in range(args.reps)]
        # the share of the ranks' busy time that is not the calling thread's: communication
        tot = {key: sum(sum(r["reps"][k][method][key][b]) for r in ranks for b in idx
                        for k in range(args.reps)) for key in ("busy", "compute")}
        tokens = float(sum(batches[b].sum() for b in idx))
        out[method] = {"critical_path_s": float(np.median(crit)), "critical_path_s_reps": crit,
                       "wall_s_reps": wall, "critical_path_compute_s_reps": crit_compute,
                       "tokens_per_s_wall": tokens / float(np.median(wall)),
                       "predicted_s": float(sum(pred)),
                       "comm_share": 1.0 - tot["compute"] / tot["busy"],
                       "plan_s_mean": float(np.mean([ranks[0]["plan_s"][method][b] for b in idx])),
                       "micro_batches": float(np.mean([len(ranks[0]["groups"][method][b])
                                                       for b in idx])),
                       "cp_histogram": _histogram(plans), "micro_batch_errors": mbs}
    st, dy = out["static"], out["dynamic"]
    per_rep = [a / b for a, b in zip(st["critical_path_s_reps"], dy["critical_path_s_reps"])]
    out["measured_speedup_reps"] = per_rep
    out["measured_speedup"] = float(np.median(per_rep))
    out["compute_only_speedup"] = float(np.median(
        [a / b for a, b in zip(st["critical_path_compute_s_reps"],
                               dy["critical_path_compute_s_reps"])]))
    out["predicted_speedup"] = st["predicted_s"] / dy["predicted_s"]
    # the most any plan could gain under the profile: static over the provable lower bound
    bound = sum(lower_bound(batches[b], cost, args.ranks, args.micro_batch_tokens,
                            several_per_round=True) for b in idx)
    out["bound_speedup"] = st["predicted_s"] / bound
    out["measured_over_bound"] = out["measured_speedup"] / out["bound_speedup"]
    out["prediction_error"] = out["predicted_speedup"] / out["measured_speedup"] - 1.0
    # the same batches and weights: static and dynamic plans must give the same loss
    loss = {m: [ranks[0]["reps"][0][m]["loss"][b] for b in idx] for m in METHODS}
    out["loss_rel_diff"] = max(abs(a - b) / abs(a) for a, b in zip(loss["static"], loss["dynamic"]))
    return out


def summary(runs) -> dict:
    """Per distribution: the median over its seeds of each of `KEYS`."""
    names = list(dict.fromkeys(r["lengths"] for r in runs))
    return {n: {k: float(np.median([r[k] for r in runs if r["lengths"] == n])) for k in KEYS}
            for n in names}


def print_table(args, result) -> None:
    print(f"{args.ranks} gloo ranks, llama_tiny, documents <= {args.ranks * args.micro_batch_tokens}"
          f" tokens, GBS {args.global_batch}, cap {args.micro_batch_tokens}/rank, {args.steps} "
          f"step(s) per seed x {args.reps} reps after a warm-up step; profile {result['profile']}")
    print(f"{'lengths':>10} {'seed':>6} {'measured (per rep)':>26} {'predicted':>9} {'bound':>6} "
          f"{'meas/bound':>10} {'pred err':>8} {'comm s/d':>10} {'plan ms':>8}")
    for r in result["runs"]:
        reps = " ".join(f"{x:.2f}" for x in r["measured_speedup_reps"])
        print(f"{r['lengths']:>10} {r['seed']:>6} {r['measured_speedup']:6.2f}x ({reps:>16}) "
              f"{r['predicted_speedup']:8.2f}x {r['bound_speedup']:5.2f}x "
              f"{r['measured_over_bound']:10.2f} {r['prediction_error']:+8.1%} "
              f"{r['static']['comm_share']:4.2f}/{r['dynamic']['comm_share']:4.2f} "
              f"{1e3 * r['dynamic']['plan_s_mean']:8.1f}")
    for n, v in result["summary"].items():
        print(f"{n:>10} {'median':>6} {v['measured_speedup']:6.2f}x {'':>18} "
              f"{v['predicted_speedup']:8.2f}x {v['bound_speedup']:5.2f}x "
              f"{v['measured_over_bound']:10.2f} {v['prediction_error']:+8.1%}")
    print("measured: critical-path speed-up static / dynamic (median over reps); predicted: the "
          "same critical path over the profile's micro-batch times; bound: static's prediction over the provable lower "
          "bound (no plan can beat it); pred err: predicted / measured - 1; comm: "
          "communication's share of busy time; plan ms: a rank's CPU time to plan a step")
    print(f"largest relative loss difference static / dynamic (same batches and weights): "
          f"{max(r['loss_rel_diff'] for r in result['runs']):.1e}")
    print("\n".join(error_table(result["runs"], METHODS)))


def _histogram(plans) -> dict[int, int]:
    out: dict[int, int] = {}
    for pl in plans:
        for c, n in pl.cp_histogram().items():
            out[c] = out.get(c, 0) + n
    return dict(sorted(out.items()))


if __name__ == "__main__":
    main()
