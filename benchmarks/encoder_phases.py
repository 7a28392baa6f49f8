"""Where the vision island's step goes, per phase and rank: encoder DP vs encoder CP of
`benchmarks/dcp_islands.py` side by side (issue 25 section 3).

    python benchmarks/encoder_phases.py                       # dynamic (DP 4) vs encoder_cp4
    python benchmarks/encoder_phases.py --layouts wide_dp4 wide_cp4 --steps 2

Each layout runs on 8 forked gloo ranks through the trainer, with timers around the phases of
`Trainer.forward_backward` on the vision ranks: `forward` and `backward` (the executor's compute
spans) and, inside them, CP attention's fused calls with their K/V all-gather and its backward
reduce-scatter (`cp kernels`); `route` (the batched P2P exchanges with the LLM island), `grad sync`
(the encoder's DP x CP gradient sum) and `other` (the rest of the step). Per phase: process CPU
seconds (every thread of the rank, gloo's included) and wall seconds per step (means over the
timed steps); wall - CPU is waiting plus time the rank was runnable but not running (8 ranks on
the machine's cores)."""
from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import dcp_islands  # noqa: E402

PHASES = ("forward", "backward", "cp kernels", "route", "grad sync", "other", "total")


class Timers:
    """CPU (process) and wall seconds and calls per phase name."""

    def __init__(self):
        self.cpu, self.wall, self.calls = defaultdict(float), defaultdict(float), defaultdict(int)

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            c0, w0 = time.process_time(), time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.cpu[name] += time.process_time() - c0
                self.wall[name] += time.perf_counter() - w0
                self.calls[name] += 1
        return timed

    def reset(self):
        self.cpu.clear(), self.wall.clear(), self.calls.clear()


def install(timers: Timers) -> None:
    """Wrap the phases (module docstring) of this process's hcp in `timers`."""
    from hcp.model import cp_attention
    from hcp.schedule import executor
    from hcp.train import islands

    span = executor.BusyClock.span

    def clock_span(self, fn, *args):
        name = "backward" if fn is executor.torch.autograd.backward else "forward"
        return timers.wrap(name, span)(self, fn, *args)
    executor.BusyClock.span = clock_span
    executor.Executor._exchange = timers.wrap("route", executor.Executor._exchange)
    islands.sync_grads = timers.wrap("grad sync", islands.sync_grads)
    fused = cp_attention._FusedAttention
    fused.forward = staticmethod(timers.wrap("cp kernels", fused.forward))
    fused.backward = staticmethod(timers.wrap("cp kernels", fused.backward))


def _rank(payload) -> None:
    """One rank: the trainer's warm-up + timed steps with the phase timers; writes them."""
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from hcp.train.trainer import Trainer

    container, out_dir, warmup, steps = payload
    timers = Timers()
    install(timers)
    tr = Trainer(OmegaConf.create(container), out_dir)
    fb = timers.wrap("total", tr.forward_backward)
    for k in range(warmup + steps):
        if k == warmup:
            timers.reset()
        indices = tr.sampler.batch(k)
        prepared = tr.prepare(indices)
        dist.barrier()
        fb(indices, prepared)
        tr.optimizer.zero_grad(set_to_none=True)
    out = {"head": tr.head, "cpu": {}, "wall": {}, "calls": {}}
    for what in ("cpu", "wall", "calls"):
        d = getattr(timers, what)
        out[what] = {p: d.get(p, 0) / steps for p in PHASES}
        out[what]["other"] = d["total"] - sum(d[p] for p in ("forward", "backward", "route", "grad sync"))
        out[what]["other"] /= steps
    with open(os.path.join(out_dir, f"rank{tr.rank}.json"), "w") as f:
        json.dump(out, f)


def run(name: str, data, args, root: str) -> list[dict]:
    """The vision ranks' phase timers of layout `name` (`dcp_islands.LAYOUTS`)."""
    _, _, ranks = dcp_islands.launch_layout(name, data, args, root, _rank)
    return [r for r in ranks if r["head"] != "llm"]


def print_table(name: str, ranks: list[dict]) -> None:
    """Per phase: each vision rank's CPU ms (wall ms) per step, and the CP calls per step."""
    print(f"{name}: ms per step, CPU (wall), vision ranks 0-{len(ranks) - 1}")
    for p in PHASES:
        cells = " ".join(f"{1e3 * r['cpu'][p]:7.0f} ({1e3 * r['wall'][p]:5.0f})" for r in ranks)
        calls = ranks[0]["calls"][p]
        print(f"  {p:<18} {cells}" + (f"   {calls:.0f} calls" if p in ("cp kernels", "route") else ""))


def main(argv=None) -> dict:
    ap = dcp_islands.arg_parser(__doc__, "means")
    ap.add_argument("--layouts", nargs="+", default=["dynamic", "encoder_cp4"], choices=list(dcp_islands.LAYOUTS),
                    help="layouts of benchmarks/dcp_islands.py to time (default: dynamic encoder_cp4)")
    args = ap.parse_args(argv)
    root, data = dcp_islands.workspace("encoder_phases_", args)
    out = {}
    for name in args.layouts:
        out[name] = run(name, data, args, root)
        print_table(name, out[name])
    dcp_islands.harness.write_json(args.json, out, indent=2)
    return out


if __name__ == "__main__":
    main()
