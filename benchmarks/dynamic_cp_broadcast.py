"""Where the dynamic-CP plan comes from: every rank plans it, or one rank plans and broadcasts it.

    python benchmarks/dynamic_cp_broadcast.py --ranks 8 --reps 5 --json out.json

For each setting (pool 8 = the seed-sized GBS 2048, PP 8, Wikipedia lengths; pool 64 at PP 8
and at PP 1 on lognormal lengths, the settings of benchmarks/dynamic_cp.py), `--ranks` forked
gloo ranks (one thread each) measure, on the same global batch:
- plan: the solver's thread CPU time on each rank (every rank plans the same deterministic
  plan; `plan_s` is the slowest rank's, to hide behind the step that runs meanwhile);
- broadcast: rank 0's plan pickled and sent with `torch.distributed.broadcast_object_list`
  (size and payload: two broadcasts), from a barrier until every rank has unpickled it, wall
  time of the slowest rank (the least of `--reps`), and the pickled bytes;
- the simulated step time of the plan (H100 profile, LLaMA-13B), which planning must hide
  behind.

Measured here (8 gloo ranks forked on 2 cores shared with other jobs, load ~35, seed 100,
H100 profile; the solver with its LP-shaped candidates):
                  setting  plan_ms  bcast_ms    bytes  step_s plan/step bcast/step
      pool8_pp8_wikipedia    871.8     11.34    25094   7.571     0.115     0.0015
     pool64_pp8_wikipedia    557.9      8.87    17967   1.551     0.360     0.0057
     pool64_pp1_lognormal    196.9      5.88     9426   1.955     0.101     0.0030

- node-shared (hcp/plan/shared.py, `trainer.plan_share=node`, the default): rank 0 plans and
  publishes the plan in a directory, the others poll for it and unpickle it; CPU per node per
  step is the sum over the ranks of their process CPU seconds until they hold the plan
  (`node_cpu_ms`: every rank plans; `shared_ms`: node-shared; `reader_ms`: the costliest
  reader's).

Decision before the node-shared planner (a broadcast): planning costs 10-36%
of the step it plans in CPU time and runs on the data iterator's background thread while step k
computes, so it is hidden and needs no collective. The broadcast is cheap (0.2-0.6% of the step)
but could only be hidden on that background thread too, where a collective may interleave
differently with the main thread's collectives on different ranks (a hang under NCCL); on the
main thread between steps it is exposed on every step, and the planning rank still has to hide
its own plan time, so it saves nothing that is on the critical path. Every rank planning costs
no exposed time; should planning stop being hidden, the fix is a cheaper search (a broadcast
does not shorten the planner's own plan time).
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import arg_parser, write_json  # noqa: E402  (beside this file)

SETTINGS = {  # name: (lengths, GBS, pool, pp, cap, max_len)
    "pool8_pp8_wikipedia": ("wikipedia", 2048, 8, 8, 8192, 65536),
    "pool64_pp8_wikipedia": ("wikipedia", 2048, 64, 8, 8192, 65536),
    "pool64_pp1_lognormal": ("lognormal", 256, 64, 1, 2048, 8192),
    # benchmarks/dynamic_cp_train.py's default: llama_tiny on 8 gloo ranks, its shipped profile
    "pool8_pp1_wikipedia_tiny": ("wikipedia", 64, 8, 1, 256, 2048),
}
COSTS = {"pool8_pp1_wikipedia_tiny": ("llama_tiny", "hcp/dcp/profiles/gloo_llama_tiny.yaml")}
"""Recipe and cost profile of a setting (the others: LLaMA-13B, the H100 profile)."""


def batch(name: str, seed: int) -> np.ndarray:
    """The global batch of a setting: `--global-batch` lengths drawn as benchmarks/dynamic_cp.py
    draws them (lengths <= max_len, numpy default_rng(seed))."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "lengths", Path(__file__).resolve().parent / "lengths.py")
    lengths = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lengths)
    dist_name, gbs, _, _, _, max_len = SETTINGS[name]
    pool = lengths.distribution(dist_name)
    pool = pool[pool <= max_len]
    return np.random.default_rng(seed).choice(pool, gbs, replace=False)


def _rank(payload) -> None:
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from hcp.dcp.cost_model import load_cost, recipe_llm
    from hcp.dcp.solver import solve
    from hcp.launch.distributed import init_distributed
    from hcp.plan.shared import NodeSharedPlanner

    init_distributed(OmegaConf.create(payload["launcher"]))
    torch.set_num_threads(1)
    rank = dist.get_rank()
    out = {}
    for name, lens in payload["batches"].items():
        _, _, pool, pp, cap, max_len = SETTINGS[name]
        recipe, profile = COSTS.get(name, ("llama13b_dynamic_cp", "h100"))
        if profile.endswith(".yaml"):  # beside the repository root
            profile = str(Path(__file__).resolve().parents[1] / profile)
        cost = load_cost(recipe_llm(recipe), profile, pp=pp)
        lens = np.asarray(lens)
        dist.barrier()
        c0 = time.thread_time()
        sol = solve(lens, cost, pool, cap, max_len, several_per_round=pp == 1)
        plan_s = time.thread_time() - c0
        blob = len(pickle.dumps(sol.plan))
        walls = []
        for _ in range(payload["reps"]):
            obj = [sol.plan if rank == 0 else None]
            dist.barrier()
            w0 = time.perf_counter()
            dist.broadcast_object_list(obj, src=0)
            assert obj[0].num_rounds == sol.plan.num_rounds
            walls.append(time.perf_counter() - w0)
        # one planner per node (hcp/plan/shared.py): rank 0 plans and publishes, the others
        # poll for the file and unpickle it; each rank's process CPU seconds until it holds
        # the plan (a fresh directory per setting: nothing published before)
        shared = NodeSharedPlanner(
            lambda lengths: solve(lengths, cost, pool, cap, max_len, pp == 1).plan,
            os.path.join(payload["share_dir"], name), leader=rank == 0)
        dist.barrier()
        c0 = time.process_time()
        got = shared(lens)
        share_cpu = time.process_time() - c0
        assert got.num_rounds == sol.plan.num_rounds and shared.self_planned == 0
        cpus = [torch.zeros(2, dtype=torch.float64) for _ in range(dist.get_world_size())]
        dist.all_gather(cpus, torch.tensor([plan_s, share_cpu], dtype=torch.float64))
        cpus = torch.stack(cpus)
        t = torch.tensor([plan_s, min(walls)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out[name] = {"plan_s": t[0].item(), "broadcast_s": t[1].item(), "bytes": blob,
                     "step_s": sol.time, "micro_batches": sol.plan.num_micro_batches,
                     "node_cpu_every_rank_s": cpus[:, 0].sum().item(),
                     "node_cpu_shared_s": cpus[:, 1].sum().item(),
                     "reader_cpu_s": cpus[1:, 1].max().item()}
    if rank == 0:
        Path(payload["out"]).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> dict:
    p = arg_parser(__doc__, seed=100, reps=5, reps_help="broadcasts per setting (least kept)")
    p.add_argument("--ranks", type=int, default=8, help="forked gloo ranks")
    p.add_argument("--settings", default=",".join(SETTINGS), help="comma list of " +
                   ", ".join(SETTINGS))
    args = p.parse_args(argv)
    names = args.settings.split(",")
    bad = [n for n in names if n not in SETTINGS]
    if bad or args.ranks < 2 or args.reps < 1:
        p.error(f"unknown settings {bad} (use {list(SETTINGS)}), or --ranks < 2 or --reps < 1")
    from hcp.config.compose import compose_config
    from omegaconf import OmegaConf

    from hcp.launch.launch import start_local_ranks

    cfg = compose_config(["+recipe=llama_tiny", f"launcher.nproc_per_node={args.ranks}"])
    tmp = tempfile.mkdtemp(prefix="dcp-bcast-")  # not TemporaryDirectory: forked finalizers
    try:
        out = os.path.join(tmp, "out.json")
        payload = {"launcher": OmegaConf.to_container(cfg.launcher, resolve=True),
                   "batches": {n: batch(n, args.seed).tolist() for n in names},
                   "reps": args.reps, "out": out, "share_dir": os.path.join(tmp, "plans")}
        start_local_ranks(_rank, args.ranks, payload, "fork")
        result = json.loads(Path(out).read_text())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{args.ranks} gloo ranks; plan: solver thread CPU time (slowest rank); broadcast: "
          f"pickled plan, broadcast_object_list, least of {args.reps} (slowest rank)")
    print(f"{'setting':>22} {'plan_ms':>8} {'bcast_ms':>9} {'bytes':>8} {'step_s':>7} "
          f"{'plan/step':>9} {'bcast/step':>10} {'node_cpu_ms':>11} {'shared_ms':>9} "
          f"{'reader_ms':>9}")
    for n, v in result.items():
        print(f"{n:>22} {1e3 * v['plan_s']:8.1f} {1e3 * v['broadcast_s']:9.2f} {v['bytes']:8d} "
              f"{v['step_s']:7.3f} {v['plan_s'] / v['step_s']:9.3f} "
              f"{v['broadcast_s'] / v['step_s']:10.4f} {1e3 * v['node_cpu_every_rank_s']:11.1f} "
              f"{1e3 * v['node_cpu_shared_s']:9.1f} {1e3 * v['reader_cpu_s']:9.2f}")
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
