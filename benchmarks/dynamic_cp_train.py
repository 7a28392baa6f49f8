"""Measured dynamic CP on forked gloo ranks: static CP (packing-only at cp = pool) vs dynamic CP.

    python benchmarks/dynamic_cp_train.py --ranks 8 --steps 3 --json out.json

Setup: `--ranks` CPU ranks (gloo, one thread each) form one CP pool; the tiny LLaMA of
`+recipe=llama_tiny` (fp32) runs forward + backward of every micro-batch of the step plan
(hcp/plan/step.py) on global batches of the code corpus's document lengths (this Python's
standard-library sources, byte-level, split at `--max-len` like the `code_corpus` data set;
token ids drawn at random: the content does not change the time). Static: `first_fit` at
cp = pool (dp 1, every micro-batch on the whole pool, the static CP a run with this max length
needs). Dynamic: the `dynamic_cp` policy (hcp/dcp/policy.py) with the cost model under the
profile calibrated on this machine (`--profile`, else `mode=calibrate`'s fit is run first over
CP sizes up to the pool). Each micro-batch runs on its CP group from the pre-built
dynamic-CP groups. Not measured: gradient sync and the optimizer step (the same for both).

Reported per method: wall tokens/s (rank 0's wall time per step; 2 shared cores hide
imbalance), and the critical path from each rank's busy time (thread CPU time of each
micro-batch): a micro-batch starts on its group when all its ranks are free and lasts as long as
its slowest rank; the step lasts until the last rank is free. Speed-ups are critical-path
ratios, static / dynamic; the predicted one is the simulator's (hcp/schedule/simulator.py via
hcp/dcp/solver.simulate_plan) under the same profile. `--json PATH` writes
`{"static": {...}, "dynamic": {...}, "predicted_speedup": x, "measured_speedup": y}`.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace as NS

import numpy as np

from hcp.config.compose import compose_config
from hcp.dcp.cost_model import CostModel, load_profile
from hcp.dcp.policy import dynamic_cp_policy
from hcp.dcp.solver import simulate_plan
from hcp.plan.step import first_fit_policy

METHODS = ("static", "dynamic")


def layout(dp: int, cp: int, layers: int):
    return NS(module="llm", tp=1, cp=cp, pp=1, dp=dp, rank_offset=0, num_ranks=dp * cp,
              pp_layers=(layers,), recompute="none", dp_shard=False, cp_comm="allgather",
              sequence_parallel=False)


def code_lengths(max_len: int) -> np.ndarray:
    """Sample lengths of the code corpus: each file `[bos] + bytes + [eos]` cut at max_len."""
    from hcp.data.code_corpus import stdlib_sources

    out = []
    for f in stdlib_sources():
        n = os.path.getsize(f) + 2
        out += [max_len] * (n // max_len) + ([n % max_len] if n % max_len else [])
    return np.array(out, dtype=np.int64)


def _rank(payload) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from omegaconf import OmegaConf

    from hcp.model.init import init_parameters
    from hcp.model.llama import LlamaDecoder
    from hcp.parallel.cp_sharding import cp_shard
    from hcp.parallel.groups import ProcessGroupRegistry
    from hcp.plan.lengths import SampleSizes
    from hcp.plan.step import plan_step, register_policy
    from hcp.dcp.policy import micro_batch_group
    from hcp.train.distributed import init_distributed

    cfg = OmegaConf.create(payload["cfg"])
    init_distributed(cfg.launcher)
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    register_policy("dynamic_cp", dynamic_cp_policy(cfg.llm, payload["profile"]))
    layouts = {"static": {"llm": layout(1, world, cfg.llm.num_layers)},
               "dynamic": {"llm": layout(world, 1, cfg.llm.num_layers)}}
    groups = ProcessGroupRegistry(layouts["dynamic"], dynamic_cp_modules=("llm",))
    model = LlamaDecoder(cfg.llm)
    init_parameters(model, 7, prefix="llm.")
    gen = torch.Generator().manual_seed(0)
    out = {}
    for method in METHODS:
        packing = "first_fit" if method == "static" else "dynamic_cp"
        busy, walls, plan_s = [], [], []
        for lens in payload["batches"]:
            sizes = SampleSizes.from_lists(list(lens), list(lens), [[] for _ in lens])
            t0 = time.perf_counter()
            plan = plan_step(sizes, layouts[method], packing, payload["cap"]).rank(rank)
            plan_s.append(time.perf_counter() - t0)
            dist.barrier()
            w0 = time.perf_counter()
            step = []
            for mb in plan.micro_batches:
                if mb.empty:
                    step.append(0.0)
                    continue
                group = micro_batch_group(groups, mb, rank)
                n = int(mb.cu_seqlens[-1])
                ids = torch.randint(0, cfg.llm.vocab_size, (n,), generator=gen)
                cu = torch.from_numpy(mb.cu_seqlens)
                if mb.cp_size > 1:
                    sh = cp_shard(cu, mb.cp_size, mb.cp_rank)
                    ids, pos = ids[sh.token_index], sh.position_ids
                else:
                    pos = torch.cat([torch.arange(int(b - a)) for a, b in
                                     zip(mb.cu_seqlens[:-1], mb.cu_seqlens[1:])])
                c0 = time.thread_time()
                h = model.exit(model.run_layers(model.enter(model.embed(ids)), pos, cu,
                                                mb.max_seqlen, cp_group=group), ids.shape[0])
                F.cross_entropy(model.logits(h), ids).backward()
                step.append(time.thread_time() - c0)
            dist.barrier()
            walls.append(time.perf_counter() - w0)
            busy.append(step)
        out[method] = {"busy": busy, "wall": walls, "plan_s": plan_s,
                       "groups": [[(mb.cp_size, mb.cp_block) for mb in
                                   plan_step(SampleSizes.from_lists(list(lens), list(lens),
                                                                    [[] for _ in lens]),
                                             layouts[method], packing,
                                             payload["cap"]).rank(rank).micro_batches]
                                  for lens in payload["batches"]]}
    gathered = [None] * world
    dist.all_gather_object(gathered, out)
    if rank == 0:
        Path(payload["out"]).write_text(json.dumps(gathered))
    dist.barrier()
    dist.destroy_process_group()


def critical_path(busy, groups) -> float:
    """Seconds: micro-batch j of a group starts when all its ranks are free and lasts as long
    as its slowest rank (busy[r][j]); the end of the last rank. `groups[r][j]` = (c, block)."""
    world = len(busy)
    free = np.zeros(world)
    for j in range(len(busy[0])):
        seen = set()
        for r in range(world):
            c, block = groups[r][j]
            if (c, block) in seen:
                continue
            seen.add((c, block))
            members = [q for q in range(world) if tuple(groups[q][j]) == (c, block)]
            start = free[members].max()
            free[members] = start + max(busy[q][j] for q in members)
    return float(free.max())


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--micro-batch-tokens", type=int, default=512, help="cap per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", help="a mode=calibrate profile.yaml (default: calibrate now)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.ranks < 1 or args.ranks & (args.ranks - 1):
        p.error(f"--ranks {args.ranks}: the CP pool must be a power of two")
    cfg = compose_config(["+recipe=llama_tiny", f"launcher.nproc_per_node={args.ranks}"])
    max_len = args.ranks * args.micro_batch_tokens
    pool = code_lengths(max_len)
    rng = np.random.default_rng(args.seed)
    batches = [rng.choice(pool, args.global_batch, replace=False) for _ in range(args.steps)]
    from omegaconf import OmegaConf

    from hcp.train.launch import start_local_ranks

    # mkdtemp, not TemporaryDirectory: forked ranks inherit its finalizer and would delete it
    tmp = tempfile.mkdtemp(prefix="dcp-train-")
    try:
        profile = args.profile
        if profile is None:
            from hcp.train.calibrate import run_calibrate
            sizes = [1 << e for e in range(args.ranks.bit_length())]
            profile = run_calibrate(cfg, tmp, sizes)
        out = os.path.join(tmp, "measured.json")
        payload = {"cfg": OmegaConf.to_container(cfg, resolve=True), "profile": profile,
                   "batches": [b.tolist() for b in batches], "cap": args.micro_batch_tokens,
                   "out": out}
        start_local_ranks(_rank, args.ranks, payload, "fork")
        ranks = json.loads(Path(out).read_text())
        hw = load_profile(profile)
        policy = dynamic_cp_policy(cfg.llm, profile)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    cost = CostModel(cfg.llm, hw, pp=1, tp=1, recompute=False)
    result = {}
    tokens = float(sum(b.sum() for b in batches))
    for method in METHODS:
        crit = [critical_path([r[method]["busy"][s] for r in ranks],
                              [r[method]["groups"][s] for r in ranks])
                for s in range(args.steps)]
        wall = [r[method]["wall"] for r in ranks][0]
        lay = layout(1, args.ranks, cfg.llm.num_layers) if method == "static" else \
            layout(args.ranks, 1, cfg.llm.num_layers)
        plans = [first_fit_policy(b, lay, args.micro_batch_tokens) if method == "static"
                 else policy(b, lay, args.micro_batch_tokens) for b in batches]
        pred = [simulate_plan(pl, b, cost).iteration_time for pl, b in zip(plans, batches)]
        result[method] = {"tokens_per_s_wall": tokens / sum(wall),
                          "critical_path_s": float(sum(crit)), "wall_s": float(sum(wall)),
                          "predicted_s": float(sum(pred)),
                          "plan_s_mean": float(np.mean(ranks[0][method]["plan_s"])),
                          "micro_batches": float(np.mean([len(x) for x in
                                                          ranks[0][method]["busy"]]))}
    result["predicted_speedup"] = result["static"]["predicted_s"] / result["dynamic"]["predicted_s"]
    result["measured_speedup"] = (result["static"]["critical_path_s"]
                                  / result["dynamic"]["critical_path_s"])
    print(f"{args.ranks} gloo ranks, llama_tiny, code-corpus lengths (max {max_len}), "
          f"GBS {args.global_batch}, cap {args.micro_batch_tokens}/rank, {args.steps} steps")
    print(f"{'method':>8} {'tokens/s(wall)':>15} {'crit_path_s':>12} {'wall_s':>8} "
          f"{'predicted_s':>12} {'micro-batches':>14} {'plan_ms':>8}")
    for m in METHODS:
        v = result[m]
        print(f"{m:>8} {v['tokens_per_s_wall']:15.0f} {v['critical_path_s']:12.3f} "
              f"{v['wall_s']:8.2f} {v['predicted_s']:12.3f} {v['micro_batches']:14.1f} "
              f"{1e3 * v['plan_s_mean']:8.1f}")
    print(f"speed-up (critical path, static / dynamic): measured "
          f"{result['measured_speedup']:.2f}x, predicted {result['predicted_speedup']:.2f}x "
          f"(prediction / measurement = "
          f"{result['predicted_speedup'] / result['measured_speedup']:.2f})")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
