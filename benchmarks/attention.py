"""Time and memory of one forward + backward of CP attention per rank, next to the ideal: one
rank's fused SDPA over the same documents divided by the CP size (issue 24 part 2).

    python benchmarks/attention.py                     # cp 2,4,8; long 4K/8K/16K + 200 short, 64 x 512
    python benchmarks/attention.py --long 4096 --docs 0 --cp 2,4 --strategies allgather --json out.json
    git worktree add /tmp/hcp-old <commit> && python benchmarks/attention.py --baseline /tmp/hcp-old

Each measurement runs in a fresh process (so `ru_maxrss` is its own peak). A CP case forks `c`
gloo ranks; every rank builds its head-tail shard of random q [T, Hq, D], k, v [T, Hkv, D]
(fp32, one thread), the micro-batch's plan, and runs `cp_attention` forward + backward once to
warm up, then `--reps` times. The ideal runs `hcp.model.attention.thd_attention` (one causal
SDPA per document, the c = 1 path) over all T tokens in one process the same way; its time
divided by c is what a perfectly balanced CP rank without overhead would take. Cases: one long
document of each `--long` length packed with `--short` short ones (lengths uniform in
[16, `--short-max`], seed 0), and `--docs` documents of 512.

Columns (CP: max over ranks; times: the median over the reps): `fwd_bwd_s` = the rank's thread
CPU seconds of forward + backward (the time it takes with a core of its own: c ranks share 2
cores here, so wall time would mostly measure the wait; gloo's own threads are not counted),
`wall_s` = wall seconds of the same, `ideal_s` = the ideal's thread CPU seconds / c,
`time_over_ideal` = fwd_bwd_s / ideal_s, `peak_mib` = ru_maxrss (the process, torch and gloo
included), `attn_mib` = peak minus the resident size before the first call, `plan_s` =
building the plan. `--baseline PATH`: the same CP cases run with another checkout of hcp (the
previous implementation) and printed beside as `base_s` and `base/new`. A case that does not fit
under `--mem-limit-gib` of address space per rank prints OOM.
`--json PATH` writes {"cases": [{"long_doc", "short_docs", "tokens", "strategy", "cp",
"fwd_bwd_s", "wall_s", "ideal_s", "time_over_ideal", "peak_mib_per_rank", "attn_mib_per_rank",
"plan_s", "baseline_fwd_bwd_s", "baseline_peak_mib_per_rank", "status"}, ...]}.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import arg_parser, write_json  # noqa: E402  (beside this file)


def lengths_of(case: dict) -> list[int]:
    import torch

    if case["short_docs"] == 0 and case["docs"]:
        return [case["long_doc"]] * case["docs"]
    g = torch.Generator().manual_seed(0)
    return [case["long_doc"], *torch.randint(16, case["short_max"] + 1, (case["short_docs"],),
                                                 generator=g).tolist()]


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _timed(fn, reps: int) -> tuple[float, float]:
    """(median thread CPU seconds, median wall seconds) of fn() over `reps` runs after a
    warm-up."""
    fn()
    cpus, walls = [], []
    for _ in range(reps):
        wall, cpu = time.perf_counter(), time.thread_time()
        fn()
        cpus.append(time.thread_time() - cpu)
        walls.append(time.perf_counter() - wall)
    return sorted(cpus)[reps // 2], sorted(walls)[reps // 2]


def _inputs(case: dict, t: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    d = case["head_dim"]
    q, k, v = (torch.randn(t, h, d, generator=g).requires_grad_()
               for h in (case["heads"], case["kv_heads"], case["kv_heads"]))
    return q, k, v, torch.randn(t, case["heads"], d, generator=g)


def _cu(lengths):
    import torch

    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _rank(rank: int, case: dict, port: int, queue) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    limit = int(case["mem_limit_gib"] * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=case["cp"],
                                init_method=f"tcp://127.0.0.1:{port}",
                                timeout=datetime.timedelta(seconds=120))
        from hcp.model.cp_attention import build_cp_plan, cp_attention
        from hcp.parallel.cp_sharding import cp_shard

        cu = _cu(lengths_of(case))
        shard = cp_shard(cu, case["cp"], rank)
        q, k, v, dout = _inputs(case, len(shard.valid), rank)
        dist.barrier()
        start = time.perf_counter()
        plan = build_cp_plan(cu, dist.group.WORLD, case["strategy"])
        plan_s = time.perf_counter() - start
        before = _rss_mib()
        cpu, wall = _timed(lambda: cp_attention(q, k, v, plan).backward(dout), case["reps"])
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()
        queue.put((rank, "ok", dict(peak=peak, attn=peak - before, cpu=cpu, wall=wall, plan=plan_s,
                                    tokens=int(cu[-1]))))
        dist.barrier()
    except (RuntimeError, MemoryError) as err:
        queue.put((rank, "oom" if "alloc" in str(err) or isinstance(err, MemoryError) else "error",
                   str(err)[:300]))


def ideal(case: dict) -> dict:
    """One process: thd_attention over the whole micro-batch (the c = 1 path)."""
    import torch

    from hcp.model.attention import thd_attention

    torch.set_num_threads(1)
    lengths = lengths_of(case)
    cu = _cu(lengths)
    q, k, v, dout = _inputs(case, int(cu[-1]), 0)
    before = _rss_mib()
    cpu, wall = _timed(lambda: thd_attention(q, k, v, cu, max(lengths)).backward(dout), case["reps"])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return dict(status="ok", cpu=cpu, wall=wall, peak=peak, attn=peak - before, tokens=int(cu[-1]))


def worker(case: dict) -> dict:
    """Run one CP case on `cp` forked ranks; the max over ranks (or the failure)."""
    from hcp.launch.launch import free_port

    ctx = mp.get_context("fork")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank, args=(r, case, port, queue), daemon=True)
             for r in range(case["cp"])]
    for p in procs:
        p.start()
    results = []
    try:
        for _ in procs:
            rank, status, payload = queue.get(timeout=case["timeout_s"])
            if status != "ok":
                return dict(status=status, detail=f"rank {rank}: {payload}")
            results.append(payload)
    except Exception as err:  # noqa: BLE001 - queue.Empty: a rank hung or died
        return dict(status="timeout", detail=repr(err))
    finally:
        for p in procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
    return dict(status="ok", tokens=results[0]["tokens"],
                **{key: max(r[key] for r in results) for key in ("peak", "attn", "cpu", "wall", "plan")})


def run(case: dict, repo: str, what: str) -> dict:
    """`what` (cp or ideal) of `case` in a fresh process importing hcp from `repo`."""
    try:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), f"--{what}", json.dumps(case)],
                              capture_output=True, text=True, timeout=case["timeout_s"] + 60,
                              env=dict(os.environ, PYTHONPATH=repo))
    except subprocess.TimeoutExpired:
        return dict(status="timeout", detail=f"over {case['timeout_s'] + 60:.0f} s")
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return dict(status="error", detail=proc.stderr[-300:])


def main(argv=None) -> None:
    ap = arg_parser(__doc__, reps=3, reps_help="timed runs after one warm-up (median kept)")
    ap.add_argument("--long", default="4096,8192,16384", help="long document lengths")
    ap.add_argument("--short", type=int, default=200, help="short documents packed with each")
    ap.add_argument("--short-max", type=int, default=128, help="longest short document")
    ap.add_argument("--docs", type=int, default=64, help="documents of 512 in the last case (0: none)")
    ap.add_argument("--cp", default="2,4,8", help="CP sizes, comma-separated")
    ap.add_argument("--strategies", default="allgather,p2p",
                    help="CP attention strategies, comma-separated")
    ap.add_argument("--heads", type=int, default=4, help="query heads")
    ap.add_argument("--kv-heads", type=int, default=2, help="key/value heads (GQA)")
    ap.add_argument("--head-dim", type=int, default=64, help="channels per head")
    ap.add_argument("--baseline", help="another hcp checkout whose CP attention runs beside")
    ap.add_argument("--mem-limit-gib", type=float, default=3.0, help="address space per rank")
    ap.add_argument("--timeout-s", type=float, default=300.0, help="per case")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--ideal", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker or args.ideal:
        sys.path.insert(0, os.environ.get("PYTHONPATH") or REPO)
        print(json.dumps(worker(json.loads(args.worker)) if args.worker else ideal(json.loads(args.ideal))))
        return
    try:
        cps = [int(x) for x in args.cp.split(",") if x]
    except ValueError:
        ap.error(f"--cp {args.cp!r}: a comma-separated list of CP sizes, e.g. 2,4,8")
    if not cps or min(cps) < 1 or args.short < 0 or args.docs < 0 or args.short_max < 16 or args.reps < 1:
        ap.error("--cp sizes must be >= 1, --short and --docs >= 0, --short-max >= 16, --reps >= 1")
    if args.baseline and not os.path.isdir(os.path.join(args.baseline, "hcp")):
        ap.error(f"--baseline {args.baseline}: not an hcp checkout (no hcp/ folder there)")
    base = dict(short_max=args.short_max, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                mem_limit_gib=args.mem_limit_gib, timeout_s=args.timeout_s, reps=args.reps)
    shapes = [dict(long_doc=int(x), short_docs=args.short, docs=0) for x in args.long.split(",") if x]
    if args.docs:
        shapes.append(dict(long_doc=512, short_docs=0, docs=args.docs))
    print(f"q heads {args.heads}, kv heads {args.kv_heads}, head dim {args.head_dim}, fp32, one thread "
          f"per rank, gloo; CP: max over ranks; times: thread CPU s, median of {args.reps}")
    print(f"{'case':>18} {'cp':>3} {'strategy':>9} {'tokens':>7} {'fwd_bwd_s':>9} {'ideal_s':>8} "
          f"{'over_ideal':>10} {'wall_s':>7} {'peak_mib':>8} {'attn_mib':>8} {'plan_s':>6}"
          + (f" {'base_s':>7} {'base/new':>8} {'base_mib':>8}" if args.baseline else ""))
    rows = []
    for shape in shapes:
        name = (f"{shape['docs']} x {shape['long_doc']}" if shape["docs"] else
                f"{shape['long_doc']} + {shape['short_docs']} short")
        ref = run(dict(base, **shape), REPO, "ideal")
        if ref["status"] != "ok":
            print(f"{name:>18} ideal {ref['status'].upper()}  {ref['detail'][:80]}")
            continue
        print(f"{name:>18} {1:>3} {'sdpa':>9} {ref['tokens']:>7} {ref['cpu']:>9.3f} {ref['cpu']:>8.3f} "
              f"{1:>10.2f} {ref['wall']:>7.3f} {ref['peak']:>8.0f} {ref['attn']:>8.0f}")
        for c in cps:
            for strategy in args.strategies.split(","):
                case = dict(base, **shape, cp=c, strategy=strategy)
                res = run(case, REPO, "worker")
                row = dict(long_doc=shape["long_doc"], short_docs=shape["short_docs"], strategy=strategy,
                           cp=c, status=res["status"], ideal_s=round(ref["cpu"] / c, 6))
                if res["status"] != "ok":
                    print(f"{name:>18} {c:>3} {strategy:>9} {res['status'].upper():>7}  {res['detail'][:80]}")
                    rows.append(row)
                    continue
                over = res["cpu"] / (ref["cpu"] / c)
                row.update(tokens=res["tokens"], fwd_bwd_s=round(res["cpu"], 6), wall_s=round(res["wall"], 6),
                           time_over_ideal=round(over, 3), peak_mib_per_rank=round(res["peak"], 1),
                           attn_mib_per_rank=round(res["attn"], 1), plan_s=round(res["plan"], 4))
                line = (f"{name:>18} {c:>3} {strategy:>9} {res['tokens']:>7} {res['cpu']:>9.3f} "
                        f"{ref['cpu'] / c:>8.3f} {over:>10.2f} {res['wall']:>7.3f} {res['peak']:>8.0f} "
                        f"{res['attn']:>8.0f} {res['plan']:>6.3f}")
                if args.baseline:
                    old = run(case, args.baseline, "worker")
                    if old["status"] == "ok":
                        row.update(baseline_fwd_bwd_s=round(old["cpu"], 4),
                                   baseline_peak_mib_per_rank=round(old["peak"], 1))
                        line += f" {old['cpu']:>7.3f} {old['cpu'] / res['cpu']:>8.2f} {old['peak']:>8.0f}"
                    else:
                        line += f" {old['status'].upper():>7}"
                print(line, flush=True)
                rows.append(row)
    write_json(args.json, {"cases": rows})


if __name__ == "__main__":
    main()
