"""Training time lost per checkpoint save, synchronous vs asynchronous (`checkpoint.async`), side
by side in one run, on forked gloo ranks (CPU).

    python benchmarks/checkpoint_async.py                      # 2 ranks, 6 timed steps, 3 saves
    python benchmarks/checkpoint_async.py --world 4 --steps 8 llm.layout.dp_shard=true
    python benchmarks/checkpoint_async.py --rounds 3           # sync, async, sync, ...: medians

Each rank builds the trainer of `+recipe=llama_tiny` widened to `MODEL` (about 14M parameters:
a save writes its weights and both Adam moments, ~167 MB, into a temporary folder) with any
trailing overrides, trains `--warmup` untimed steps, then `--steps` steps without a save and
`--steps` steps with a save after every `--save-every`-th (the end waits for the last write, as
the end of a run does). Lost per save = (time of the steps with saves - `--steps` x the median
step without) / saves; blocked per save = the time the training loop spent inside `save()` and
the final wait, / saves; each the slowest rank's. On a GPU the background write runs on host
cores the step does not use, so blocked is what a save costs there; on a shared CPU the write
also takes cores from the step (lost - blocked). Under `async` a save costs its staging (a copy
of the state in host memory) and whatever the background write takes from the step's cores; the
synchronous save costs the whole write.
Figures on a shared CPU are noisy: compare the two columns of one run, not runs.

Columns:
  mode           sync or async (checkpoint.async)
  step s         mean step time without a save
  lost/save s    training time lost per save (end to end)
  blocked/save s time the training loop waited inside save() and the final wait, per save
  saves          saves in the timed steps
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import arg_parser, fork_ranks, report, write_json  # noqa: E402
from hcp.launch.launch import free_port  # noqa: E402

BASE = ["+recipe=llama_tiny", "logger=none", "trainer.progress_bar=false", "trainer.eval_every=0",
        "trainer.global_batch_size=8", "trainer.micro_batch_tokens=256", "data.max_seq_len=128"]
MODEL = ["llm.hidden_size=512", "llm.num_layers=4", "llm.num_heads=8", "llm.num_kv_heads=8",
         "llm.ffn_hidden_size=1536"]
"""The widths of the measured model (left out by --tiny)."""


def _measure(rank: int, world: int, port: int, container: dict, args) -> dict:
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from hcp.train.trainer import Trainer

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        tr = Trainer(OmegaConf.create(container), container["checkpoint"]["dir"])
        for _ in range(args.warmup):
            tr.train_step()
        plain = []
        for _ in range(args.steps):
            dist.barrier()
            start = time.perf_counter()
            tr.train_step()
            plain.append(time.perf_counter() - start)
        dist.barrier()
        start, saves, blocked = time.perf_counter(), 0, 0.0
        for i in range(1, args.steps + 1):
            tr.train_step()
            if i % args.save_every == 0:
                t = time.perf_counter()
                tr.save()
                blocked += time.perf_counter() - t
                saves += 1
        t = time.perf_counter()
        if tr.writer is not None:
            tr.writer.wait()  # the end of a run waits for the last write
        blocked += time.perf_counter() - t
        with_saves = time.perf_counter() - start
        tr.ahead.close()
        step = statistics.median(plain)
        return {"step_s": step, "lost_s": (with_saves - args.steps * step) / max(1, saves),
                "blocked_s": blocked / max(1, saves), "saves": saves}
    finally:
        dist.destroy_process_group()


def _rank(rank, world, port, container, args, queue) -> None:
    report(queue, rank, _measure, rank, world, port, container, args)


def run_mode(mode: str, args, root: str) -> dict:
    """One mode's run on `args.world` forked ranks: the slowest rank's figures."""
    from omegaconf import OmegaConf

    from hcp.config.compose import compose_config
    from hcp.config.specs import resolve_modules
    from hcp.data.build import prepare_data

    run_dir = tempfile.mkdtemp(prefix=f"{mode}-", dir=root)
    model = BASE if args.tiny else [*BASE, *MODEL]
    cfg = compose_config([*model, f"launcher.nproc_per_node={args.world}",
                          f"checkpoint.async={mode == 'async'}", f"checkpoint.dir={run_dir}",
                          "checkpoint.keep=1", *args.overrides], run_dir=run_dir)
    list(prepare_data(cfg, resolve_modules(cfg)))
    container = OmegaConf.to_container(cfg, resolve=True)
    ranks = fork_ranks(_rank, args.world, (args.world, free_port(), container, args),
                       f"checkpoint_async {mode}", args.timeout)
    return {k: max(r[k] for r in ranks) for k in ("step_s", "lost_s", "blocked_s", "saves")}


def main(argv=None) -> dict:
    ap = arg_parser(__doc__, __doc__.split("\n\n", 1)[1])  # the columns as epilog
    ap.add_argument("--world", type=int, default=2, help="gloo ranks")
    ap.add_argument("--steps", type=int, default=6,
                    help="timed steps without saves, then as many with")
    ap.add_argument("--save-every", type=int, default=2, help="a save after every this many steps")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    ap.add_argument("--rounds", type=int, default=1,
                    help="runs of each mode, alternated; medians shown")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per run before it fails")
    ap.add_argument("--tiny", action="store_true",
                    help="llama_tiny as it is (the test suite's run)")
    ap.add_argument("overrides", nargs="*", help="config overrides, as for train.py")
    args = ap.parse_args(argv)
    runs: dict = {"sync": [], "async": []}
    with tempfile.TemporaryDirectory(prefix="hcp-checkpoint-async-") as root:
        for _ in range(args.rounds):
            for mode in runs:
                runs[mode].append(run_mode(mode, args, root))
    keys = ("step_s", "lost_s", "blocked_s", "saves")
    out = {mode: {k: statistics.median(r[k] for r in rs) for k in keys}
           for mode, rs in runs.items()}
    print(f"{'mode':<8} {'step s':>8} {'lost/save s':>12} {'blocked/save s':>15} {'saves':>6}")
    for mode, r in out.items():
        print(f"{mode:<8} {r['step_s']:8.3f} {r['lost_s']:12.3f} {r['blocked_s']:15.3f} "
              f"{int(r['saves']):6d}")
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
