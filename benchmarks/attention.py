"""Memory and time of one forward + backward of CP attention per rank (issue 10 part 3).

    python benchmarks/attention.py                          # cp 4, long 4K/8K/16K + 200 short, 64 x 512
    python benchmarks/attention.py --long 1024,2048 --short 0 --strategies p2p --json out.json

Each case runs in a fresh process (so `ru_maxrss` is the case's own peak), which forks `--cp`
gloo ranks; every rank builds its head-tail shard of random q [T, Hq, D], k, v [T, Hkv, D]
(fp32), the micro-batch's attention plan, and times `cp_attention` forward + backward. Cases:
one long document of each `--long` length packed with `--short` short ones (lengths uniform in
[16, `--short-max`], seed 0), and `--docs` documents of 512 (long_doc = 512, short_docs = 0).

Printed per case and strategy (max over ranks): `peak_mib` = ru_maxrss (the process, torch and
gloo included), `attn_mib` = peak minus the resident size just before the call (what attention
itself added), `fwd_bwd_s` = wall seconds of forward + backward (on a shared machine mostly waiting for a
core), `cpu_s` = the rank's thread CPU seconds of the same, `plan_s` = building the plan.
A case that does not fit under `--mem-limit-gib` of address space per rank prints OOM.
`--json PATH` writes {"cases": [{"long_doc", "strategy", "cp", "peak_mib_per_rank", "fwd_bwd_s",
"attn_mib_per_rank", "cpu_s", "plan_s", "short_docs", "tokens"}, ...]}.
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
sys.path.insert(0, REPO)


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

        lengths = lengths_of(case)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        shard = cp_shard(cu, case["cp"], rank)
        g = torch.Generator().manual_seed(rank)
        t, d = len(shard.valid), case["head_dim"]
        q, k, v = (torch.randn(t, h, d, generator=g).requires_grad_()
                   for h in (case["heads"], case["kv_heads"], case["kv_heads"]))
        dout = torch.randn(t, case["heads"], d, generator=g)
        dist.barrier()
        start = time.perf_counter()
        plan = build_cp_plan(cu, dist.group.WORLD, case["strategy"])
        plan_s = time.perf_counter() - start
        before = _rss_mib()
        start, cpu0 = time.perf_counter(), time.thread_time()
        cp_attention(q, k, v, plan).backward(dout)
        elapsed, cpu = time.perf_counter() - start, time.thread_time() - cpu0
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()
        queue.put((rank, "ok", dict(peak=peak, attn=peak - before, time=elapsed, cpu=cpu, plan=plan_s,
                                    tokens=int(cu[-1]))))
        dist.barrier()
    except (RuntimeError, MemoryError) as err:
        queue.put((rank, "oom" if "alloc" in str(err) or isinstance(err, MemoryError) else "error",
                   str(err)[:300]))


def worker(case: dict) -> dict:
    """Run one case on `cp` forked ranks; the max over ranks (or the failure)."""
    from hcp.train.launch import free_port

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
    return dict(status="ok", peak=max(r["peak"] for r in results),
                attn=max(r["attn"] for r in results), time=max(r["time"] for r in results),
                cpu=max(r["cpu"] for r in results),
                plan=max(r["plan"] for r in results), tokens=results[0]["tokens"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--long", default="4096,8192,16384", help="long document lengths")
    ap.add_argument("--short", type=int, default=200, help="short documents packed with each")
    ap.add_argument("--short-max", type=int, default=128, help="longest short document")
    ap.add_argument("--docs", type=int, default=64, help="documents of 512 in the last case (0: none)")
    ap.add_argument("--cp", type=int, default=4)
    ap.add_argument("--strategies", default="allgather,p2p")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--mem-limit-gib", type=float, default=3.0, help="address space per rank")
    ap.add_argument("--timeout-s", type=float, default=300.0, help="per case")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    if args.cp < 1 or args.short < 0 or args.docs < 0 or args.short_max < 16:
        ap.error("--cp must be >= 1, --short and --docs >= 0, --short-max >= 16")
    base = dict(cp=args.cp, short_max=args.short_max, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                mem_limit_gib=args.mem_limit_gib, timeout_s=args.timeout_s)
    shapes = [dict(long_doc=int(x), short_docs=args.short, docs=0) for x in args.long.split(",") if x]
    if args.docs:
        shapes.append(dict(long_doc=512, short_docs=0, docs=args.docs))
    print(f"cp {args.cp}, q heads {args.heads}, kv heads {args.kv_heads}, head dim {args.head_dim}, "
          f"fp32, gloo; max over ranks")
    print(f"{'case':>22} {'strategy':>9} {'tokens':>7} {'peak_mib':>9} {'attn_mib':>9} "
          f"{'fwd_bwd_s':>9} {'cpu_s':>7} {'plan_s':>7}")
    rows = []
    for shape in shapes:
        for strategy in args.strategies.split(","):
            case = dict(base, **shape, strategy=strategy)
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker",
                                   json.dumps(case)], capture_output=True, text=True,
                                  timeout=args.timeout_s + 60)
            try:
                res = json.loads(proc.stdout.strip().splitlines()[-1])
            except (IndexError, json.JSONDecodeError):
                res = dict(status="error", detail=proc.stderr[-300:])
            name = (f"{shape['docs']} x {shape['long_doc']}" if shape["docs"] else
                    f"{shape['long_doc']} + {shape['short_docs']} short")
            if res["status"] != "ok":
                print(f"{name:>22} {strategy:>9} {res['status'].upper():>7}  {res['detail'][:80]}")
                rows.append(dict(long_doc=shape["long_doc"], strategy=strategy, cp=args.cp,
                                 short_docs=shape["short_docs"], status=res["status"],
                                 peak_mib_per_rank=None, fwd_bwd_s=None))
                continue
            print(f"{name:>22} {strategy:>9} {res['tokens']:>7} {res['peak']:>9.0f} "
                  f"{res['attn']:>9.0f} {res['time']:>9.2f} {res['cpu']:>7.2f} {res['plan']:>7.2f}")
            rows.append(dict(long_doc=shape["long_doc"], strategy=strategy, cp=args.cp,
                             peak_mib_per_rank=round(res["peak"], 1), fwd_bwd_s=round(res["time"], 3),
                             attn_mib_per_rank=round(res["attn"], 1), plan_s=round(res["plan"], 3),
                             cpu_s=round(res["cpu"], 3),
                             short_docs=shape["short_docs"], tokens=res["tokens"], status="ok"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cases": rows}, f, indent=1)


if __name__ == "__main__":
    main()
