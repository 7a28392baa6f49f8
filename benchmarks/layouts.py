"""Side-by-side throughput and communication volume of LLM layouts (TP / CP / DP, both cp_comm).

    python benchmarks/layouts.py                         # llama_tiny, 4 CPU ranks, default layouts
    python benchmarks/layouts.py --layouts dp4,tp2cp2,cp4:p2p --steps 6

Every layout runs the same `+recipe=llama_tiny` steps (same data, same seed) on freshly forked
gloo ranks, one layout after another in this one process tree, so the ratios between rows are
measured side by side on the same machine state. For each layout it prints the mean loss (the
layouts must agree), tokens/s (global tokens per wall second), the largest per-rank CPU time per
step (the critical path: on a shared 2-core machine wall time hides imbalance) and the bytes each
collective moved per step, summed over ranks (all-reduce: the tensor; all-gather: the output;
reduce-scatter: the input; P2P: the tensors sent).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import re
import sys
import tempfile
import time
from collections import Counter

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from harness import arg_parser, write_json  # noqa: E402
from hcp.launch.launch import free_port  # noqa: E402

SMALL = ["trainer.global_batch_size=8", "data.max_seq_len=512", "trainer.micro_batch_tokens=1024",
         "trainer.eval_every=0", "trainer.progress_bar=false", "logger=none"]


def parse_layout(spec: str) -> list[str]:
    """`tp2cp2:p2p` -> llm.layout overrides (dp inferred from the rest)."""
    name, _, comm = spec.partition(":")
    sizes = dict((k, int(v)) for k, v in re.findall(r"(tp|cp|dp)(\d+)", name))
    out = [f"llm.layout.{k}={v}" for k, v in sizes.items() if k != "dp"]
    return out + ([f"llm.layout.cp_comm={comm}"] if comm else [])


def _count_collectives(counter: Counter) -> None:
    """Wrap torch.distributed's collectives to add the bytes each call moves to `counter`."""
    import torch.distributed as dist

    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    sizes = {
        "all_reduce": lambda a, k: nbytes(a[0]),
        "broadcast": lambda a, k: nbytes(a[0]),
        "all_gather": lambda a, k: sum(nbytes(t) for t in a[0]),
        "all_gather_into_tensor": lambda a, k: nbytes(a[0]),
        "reduce_scatter": lambda a, k: sum(nbytes(t) for t in a[1]),
        "reduce_scatter_tensor": lambda a, k: nbytes(a[1]),
        "batch_isend_irecv": lambda a, k: sum(nbytes(op.tensor) for op in a[0] if op.op is dist.isend),
    }
    for name, size in sizes.items():
        original = getattr(dist, name)

        def wrapped(*args, _orig=original, _name=name, _size=size, **kwargs):
            counter[_name] += _size(args, kwargs)
            return _orig(*args, **kwargs)

        setattr(dist, name, wrapped)


def _rank(rank, world, port, overrides, steps, warmup, queue):
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from hcp.config.compose import compose_config

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    counter: Counter = Counter()
    _count_collectives(counter)
    from hcp.train.trainer import Trainer

    run_dir = tempfile.mkdtemp(prefix="hcp-bench-")
    cfg = compose_config(["+recipe=llama_tiny", *SMALL, *overrides], run_dir=run_dir)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    trainer = Trainer(OmegaConf.create(OmegaConf.to_container(cfg)), run_dir)
    for _ in range(warmup):
        trainer.train_step()
    dist.barrier()
    counter.clear()
    cpu0, t0, losses, tokens = time.thread_time(), time.perf_counter(), [], 0.0
    for _ in range(steps):
        m = trainer.train_step()
        losses.append(m["loss"])
        tokens += m["tokens_per_s"] * m["step_time_s"]
    dist.barrier()
    queue.put((rank, time.perf_counter() - t0, time.thread_time() - cpu0, losses, tokens, dict(counter)))
    dist.destroy_process_group()


def run_layout(spec: str, nproc: int, steps: int, warmup: int) -> dict:
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, nproc, port, parse_layout(spec), steps, warmup, queue))
             for r in range(nproc)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=900) for _ in procs]
    for p in procs:
        p.join()
    wall = max(r[1] for r in results)
    comm = Counter()
    for r in results:
        comm.update(r[5])
    return {"layout": spec, "loss": sum(results[0][3]) / steps, "tokens_per_s": results[0][4] / wall,
            "critical_cpu_s": max(r[2] for r in results) / steps,
            "bytes_per_step": {k: v / steps for k, v in comm.items()}}


def build_parser() -> argparse.ArgumentParser:
    ap = arg_parser(__doc__, COLUMNS)
    ap.add_argument("--layouts", default="dp4,tp2,cp2,cp2:p2p,tp2cp2,tp2cp2:p2p,cp4,cp4:p2p",
                    help="comma-separated LLM layouts: tpN, cpN (dp inferred), `:p2p` for ring CP "
                         "attention (default allgather); the first is the ratio's baseline")
    ap.add_argument("--nproc", type=int, default=4, help="gloo ranks forked per layout")
    ap.add_argument("--steps", type=int, default=4, help="measured optimizer steps per layout")
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured steps before them")
    return ap


COLUMNS = """columns (one line per layout, printed as soon as it finishes):
  loss        mean training loss over the measured steps (every layout must agree)
  tokens/s    global tokens per wall second
  ratio       tokens/s over the first layout's
  cpu s/step  largest per-rank CPU time per step (the critical path on a shared machine)
  MB/step     megabytes each collective moved per step, summed over ranks"""


def format_row(r: dict, base: float) -> str:
    """One layout's line: layout, loss, tokens/s, ratio to `base` tokens/s, CPU s/step, MB/step."""
    volume = " ".join(f"{k}={v / 1e6:.2f}" for k, v in sorted(r["bytes_per_step"].items())) or "-"
    return (f"{r['layout']:<12} {r['loss']:8.4f} {r['tokens_per_s']:9.0f} {r['tokens_per_s'] / base:6.2f} "
            f"{r['critical_cpu_s']:10.3f}  {volume}")


def main(argv=None) -> list[dict]:
    args = build_parser().parse_args(argv)
    print(f"{'layout':<12} {'loss':>8} {'tokens/s':>9} {'ratio':>6} {'cpu s/step':>10}  MB/step by collective",
          flush=True)
    rows = []
    for spec in args.layouts.split(","):
        rows.append(run_layout(spec, args.nproc, args.steps, args.warmup))
        print(format_row(rows[-1], rows[0]["tokens_per_s"]), flush=True)
    write_json(args.json, {"layouts": rows})
    return rows


if __name__ == "__main__":
    main()
