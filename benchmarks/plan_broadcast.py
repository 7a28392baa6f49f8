"""Dynamic CP: every rank plans the step, or one rank plans and broadcasts it? (issue 13 part 1)

    python benchmarks/plan_broadcast.py                # LLaMA-13B recipe: GBS 2048, pool 8, PP 8
    python benchmarks/plan_broadcast.py --ranks 8 --seeds 100-102

For each seed, a global batch of Wikipedia lengths (hcp/data/lengths/, <= 65,536 tokens) is
planned for `+recipe=llama13b_dynamic_cp` (pool dp*cp = 8 per stage, PP 8, 8,192 tokens per rank):
- `plan_s`: `hcp.plan.step.plan_step` with the `dynamic_cp` policy (solver + routing), what each
  rank runs on its plan-ahead thread when every rank plans;
- `broadcast_s`: on `--ranks` forked gloo ranks, rank 0 sends the solver's `Plan` to every
  rank (`broadcast_object_list`), which then runs `plan_step` on the received plan
  (`replan_s`: routing and shards only);
- `step_s`: the simulated iteration time of that plan under the cost model (H100 profile),
  the time the plan must hide behind.
Every-rank planning costs `plan_s` on each rank's plan-ahead thread, hidden behind the step;
broadcasting costs one rank `plan_s`, then `broadcast_s + replan_s` on every rank, and its
collective would have to run on the main thread (collectives issued from the plan-ahead thread
could cross the step's on NCCL) or on a dedicated group with its own ordering. Output: one line
per seed, then the means.
"""
from __future__ import annotations

import argparse
import os
import pickle
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from hcp.config.compose import compose_config  # noqa: E402
from hcp.config.layouts import resolve_layouts  # noqa: E402
from hcp.dcp.policy import dynamic_cp_policy  # noqa: E402
from hcp.plan.lengths import SampleSizes  # noqa: E402
from hcp.plan.step import plan_step, register_policy  # noqa: E402

WIKIPEDIA = ROOT / "hcp/data/lengths/wikipedia_sample.txt"


def setting():
    cfg = compose_config(["+recipe=llama13b_dynamic_cp"], run_dir="/tmp/hcp-plan-broadcast")
    layouts = resolve_layouts(cfg, 64)
    return cfg, layouts


def batch(seed: int, size: int, max_len: int) -> SampleSizes:
    lens = np.array([int(x) for x in WIKIPEDIA.read_text().split()], dtype=np.int64)
    lens = np.random.default_rng(seed).choice(lens[lens <= max_len], size, replace=False)
    return SampleSizes.from_lists(lens.tolist(), (lens - 1).tolist(), [[] for _ in lens])


def _rank(rank, world, sizes, cfg_container):
    import torch.distributed as dist
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(cfg_container)
    layouts = resolve_layouts(cfg, 64)
    mbt = cfg.trainer.micro_batch_tokens
    policy = dynamic_cp_policy(cfg.llm, cfg.packing_profile)
    obj = [None]
    if rank == 0:
        obj = [policy(sizes.tokens, layouts["llm"], mbt)]
    dist.barrier()
    t0 = time.perf_counter()
    dist.broadcast_object_list(obj, src=0)
    t_bcast = time.perf_counter() - t0
    register_policy("received", lambda tokens, llm, cap: obj[0])
    t0 = time.perf_counter()
    plan_step(sizes, layouts, "received", mbt)
    return t_bcast, time.perf_counter() - t0, len(pickle.dumps(obj[0]))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", default="100-102", help="first-last seed, inclusive")
    p.add_argument("--ranks", type=int, default=8, help="gloo ranks of the broadcast")
    args = p.parse_args(argv)
    first, last = (int(x) for x in args.seeds.split("-"))
    from omegaconf import OmegaConf

    from dist_utils import run_ranks
    from hcp.dcp.cost_model import CostModel, load_profile
    from hcp.dcp.plan import prepare_lengths
    from hcp.dcp.solver import solve

    cfg, layouts = setting()
    llm, mbt = layouts["llm"], cfg.trainer.micro_batch_tokens
    register_policy("dynamic_cp", dynamic_cp_policy(cfg.llm, cfg.packing_profile))
    cost = CostModel(cfg.llm, load_profile(cfg.packing_profile), pp=llm.pp, tp=llm.tp,
                     recompute=llm.recompute == "full")
    container = OmegaConf.to_container(cfg, resolve=True)
    rows = []
    for seed in range(first, last + 1):
        sizes = batch(seed, cfg.trainer.global_batch_size, cfg.data.max_seq_len)
        t0 = time.perf_counter()
        plan_step(sizes, layouts, "dynamic_cp", mbt)
        plan_s = time.perf_counter() - t0
        lens, _ = prepare_lengths(sizes.tokens, llm.dp * llm.cp, mbt)
        step_s = solve(lens, cost, llm.dp * llm.cp, mbt).time
        out = run_ranks(_rank, args.ranks, sizes, container, timeout=600)
        bcast = max(o[0] for o in out)
        replan = max(o[1] for o in out)
        rows.append((plan_s, bcast, replan, step_s))
        print(f"seed {seed}: plan_s {plan_s:.3f}  broadcast_s {bcast:.4f} ({out[0][2] / 1024:.0f} KiB "
              f"to {args.ranks} ranks)  replan_s {replan:.4f}  step_s {step_s:.3f}  "
              f"plan/step {plan_s / step_s:.3f}", flush=True)
    m = np.mean(rows, axis=0)
    print(f"mean: plan_s {m[0]:.3f}  broadcast_s {m[1]:.4f}  replan_s {m[2]:.4f}  step_s {m[3]:.3f}  "
          f"plan/step {m[0] / m[3]:.3f}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
