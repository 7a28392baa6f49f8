"""Does `layout=auto` pick a fast layout? Real 8-rank training of every layout its search
considers, against its predictions (issue 27 section 2).

    python benchmarks/auto_layout.py --json auto.json     # 7 layouts x 4 variants x 4 rounds (~80 min)
    python benchmarks/auto_layout.py --reuse              # the figures again from earlier measurements
    python benchmarks/auto_layout.py --calibrate --reuse  # fit cpu_profile.yaml's host model (2 rounds)

For each variant of `+recipe=llava_tiny_hetero` (`VARIANTS`: the recipe; a much larger encoder;
much longer text; and `HELD_OUT`, one not looked at while tuning, reported apart) on `--world`
local gloo ranks, the search (`hcp.preflight.auto_layout.search`) ranks every layout of its space
with `PINS` held (recompute none, dp_shard off, vision tp 1, cp 1 and pp 1, LLM tp 1 and pp 1:
what is left is the placement, the island size and the LLM's cp) under `--profile`
(`benchmarks/cpu_profile.yaml`: the CPU profile with its `host:` model, fitted on the recipe's
variant and `CALIBRATION`'s, never on the others). Every ranked layout is trained: the real
trainer on freshly forked ranks (the same data, seed and batch), `--warmup` steps, then
`--steps` timed ones, in `--rounds` interleaved rounds; measured (`measure_all`): the fastest
wall `step_time_s` (metrics.jsonl) of the timed steps, and the median CPU seconds of all ranks
together per timed step (load-robust: other users of the machine stretch wall time, not CPU
time). Reported per variant, on both: the auto choice's measured step
over the best measured one (target <= 1.10) and the Spearman rank correlation of predicted and
measured steps (target >= 0.8).
"""
from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from harness import arg_parser, write_json  # noqa: E402  (beside this file)

RUN = ["logger=none", "trainer.progress_bar=false", "trainer.log_every=1", "trainer.eval_samples=1"]
PINS = ["vision.layout.recompute=none", "vision.layout.dp_shard=false", "llm.layout.recompute=none",
        "llm.layout.dp_shard=false", "vision.layout.tp=1", "vision.layout.cp=1", "vision.layout.pp=1",
        "llm.layout.tp=1", "llm.layout.pp=1"]
"""The benchmark's narrowed space: placement, island size and the LLM's cp (dp the rest), so
that every layout the search considers is trained (encoder CP, searched since, is held at 1:
the space and figures stay those this benchmark measured)."""
VARIANTS = {
    "llava_tiny_hetero": [],
    "large_encoder": ["vision.image_size=16", "vision.hidden_size=128", "vision.num_layers=4",
                      "vision.ffn_hidden_size=512"],
    "long_text": ["data.system_prompt=" + "A chat between a curious user and an assistant. " * 8,
                  "data.max_seq_len=512", "trainer.micro_batch_tokens=1024"],
}
HELD_OUT = {"wide_llm": ["llm.hidden_size=256", "llm.ffn_hidden_size=768", "llm.num_layers=4"]}
"""Not looked at while tuning the search or this benchmark."""
CALIBRATION = {"small_micro_batches": ["trainer.micro_batch_tokens=256"],
               "large_batch": ["trainer.global_batch_size=128"]}
"""Measured only to fit `cpu_profile.yaml`'s host model (`--calibrate`), with the recipe's
variant: more, smaller micro-batches tell per-call costs from per-module ones; a 4x larger
batch (longer micro-batches, the same model and lengths) prices the ranks' long stretches of
compute without a collective (`hcp.preflight.auto_host.Host.stacked_cores`)."""
ROUNDS = {"table": 4, "calibrate": 2}
"""`--rounds` unless given: the table in docs/planning.md was measured in 4 rounds;
`cpu_profile.yaml` was fitted (`--calibrate`) on 2, which `--calibrate --reuse` reads back
(rounds 0 and 1) to reproduce that fit."""


def _rank(payload) -> None:
    """One rank: the trainer, with this process's CPU seconds at the end of every step (the
    trainer's per-step metrics call, which every rank makes) written to `cpu/RANK.json`."""
    from omegaconf import OmegaConf

    from hcp.train import trainer
    from hcp.train.throughput import WorldStats

    container, run_dir = payload
    marks, inner = [], WorldStats.issue

    def timed(*args, **kwargs):
        out = inner(*args, **kwargs)
        marks.append(time.process_time())
        return out

    WorldStats.issue = timed
    try:
        trainer.run_rank(OmegaConf.create(container), run_dir)
    finally:
        os.makedirs(os.path.join(run_dir, "cpu"), exist_ok=True)
        with open(os.path.join(run_dir, "cpu", os.environ["RANK"] + ".json"), "w") as f:
            json.dump(marks, f)


def train(cfg, world: int, run_dir: str) -> None:
    """Train `cfg` on `world` forked local ranks into `run_dir` (`_rank`)."""
    from omegaconf import OmegaConf

    from hcp.config.specs import resolve_modules
    from hcp.data.build import prepare_data
    from hcp.launch.launch import start_local_ranks

    os.makedirs(run_dir, exist_ok=True)
    prepare_data(cfg, resolve_modules(cfg))
    container = OmegaConf.to_container(cfg, resolve=True)
    start_local_ranks(_rank, world, (container, run_dir), "fork")


def timed_steps(run_dir: str, world: int, steps: int) -> dict:
    """{"wall_s": [steps], "cpu_s": [steps]} of the last `steps` steps a run left in `run_dir`:
    each step's wall `step_time_s` (metrics.jsonl) and the CPU seconds of all ranks over it."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        times = [json.loads(line)["step_time_s"] for line in f if "step_time_s" in line]
    cpu = np.zeros(steps)
    for r in range(world):
        with open(os.path.join(run_dir, "cpu", f"{r}.json")) as f:
            cpu += np.diff(json.load(f)[-1 - steps:])
    return {"wall_s": times[-steps:], "cpu_s": cpu.tolist()}


def _measured(trial, name: str, cand, args, round_: int) -> dict:
    """`timed_steps` of the candidate applied in `trial`, trained in round `round_`; with
    `--reuse`, those of an earlier run of the same variant, layout, round and step counts."""
    from hcp.preflight.auto_layout import describe

    tag = "-".join([cand.placement] + [f"{m}_{d}" for m, d in describe(cand).items()]).replace(" ", "_")
    run_dir = os.path.join(args.out, name, tag, f"round{round_}")
    key = {"layout": tag, "warmup": args.warmup, "steps": args.steps, "world": args.world}
    saved = os.path.join(run_dir, "measured.json")
    if args.reuse and os.path.exists(saved):
        with open(saved) as f:
            if json.load(f)["key"] == key:
                return timed_steps(run_dir, args.world, args.steps)
    trial.checkpoint.dir = os.path.join(run_dir, "checkpoints")
    train(trial, args.world, run_dir)
    with open(saved, "w") as f:
        json.dump({"key": key}, f)
    return timed_steps(run_dir, args.world, args.steps)


def measure_all(cfg, name: str, cands, args) -> list[dict]:
    """{"wall_s", "cpu_s"} of each candidate over `--rounds` rounds, each training every
    candidate once in turn (interleaved: the machine's load drifting over a variant's minutes
    stretches every layout alike): wall, the fastest timed step of any round (other jobs of
    the machine only ever stretch a step: the least stretched, as timeit's repeats); CPU, the
    median over the rounds of each round's median step (other jobs barely move CPU seconds)."""
    import copy

    from hcp.preflight.auto_layout import apply_layout

    rounds = [[] for _ in cands]
    for r in range(args.rounds):
        for k, cand in enumerate(cands):
            trial = copy.deepcopy(cfg)
            apply_layout(trial, cand)
            rounds[k].append(_measured(trial, name, cand, args, r))
    return [{"wall_s": float(min(min(m["wall_s"]) for m in ms)),
             "cpu_s": float(np.median([np.median(m["cpu_s"]) for m in ms]))} for ms in rounds]


def variant_config(name: str, overrides: list[str], args):
    """The variant's resolved config under the benchmark's pins and run settings."""
    from omegaconf import OmegaConf

    from hcp.config.compose import compose_config

    cli = ["+recipe=llava_tiny_hetero", f"launcher.nproc_per_node={args.world}", *RUN, *PINS, *overrides,
           f"trainer.max_steps={args.warmup + args.steps}", f"packing_profile={args.profile}"]
    cfg = compose_config(cli, run_dir=os.path.join(args.out, name))
    OmegaConf.resolve(cfg)
    return cfg


def run_variant(name: str, overrides: list[str], args) -> dict:
    """One variant's measurements and figures (module docstring)."""
    from scipy.stats import spearmanr

    from hcp.preflight.auto_layout import describe, search
    from hcp.preflight.auto_space import pinned_fields

    cfg = variant_config(name, overrides, args)
    t0 = time.perf_counter()
    result = search(cfg, args.world, pinned_fields(cfg, PINS), top=10**6, prune=False)
    search_s = time.perf_counter() - t0
    rows = []
    measured = measure_all(cfg, name, [cand for cand, _ in result.ranked], args)
    for k, ((cand, score), m) in enumerate(zip(result.ranked, measured)):
        rows.append({"predicted_rank": k + 1, "placement": cand.placement, "layout": describe(cand),
                     "predicted_s": score.step_time_s, "predicted_work_s": score.work_s,
                     "measured_s": m["wall_s"], "cpu_s": m["cpu_s"]})
        print(f"  {name}: #{k + 1} {cand.placement} {describe(cand)} predicted {score.step_time_s:.4g} s "
              f"({score.work_s:.4g} CPU s), measured {m['wall_s']:.4g} s wall, {m['cpu_s']:.4g} s CPU of "
              f"all ranks", flush=True)
    pred = [r["predicted_s"] for r in rows]

    def rho(key):
        return float(spearmanr(pred, [r[key] for r in rows])[0]) if len(rows) > 2 else float("nan")

    return {"name": name, "auto_over_best": rows[0]["measured_s"] / min(r["measured_s"] for r in rows),
            "rank_correlation": rho("measured_s"),
            "auto_over_best_cpu": rows[0]["cpu_s"] / min(r["cpu_s"] for r in rows),
            "rank_correlation_cpu": rho("cpu_s"), "layouts_measured": len(rows),
            "search_s": search_s, "rows": rows}


SPREADS = (0.0, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0)
"""`spread_s` values `calibrate` tries (CPU seconds of a stretch half run stacked)."""


def calibrate(args) -> None:
    """Fit `--profile`'s `peak_flops`, `cp_latency` and host model (`hcp.preflight.auto_host.Host`)
    on the recipe's variant and the `CALIBRATION` ones (measured now, or `--reuse`d). CPU: the
    predicted work of all ranks is linear in 1 / peak_flops, layer_s, cp_layer_s, cp_latency
    and module_step_s, so non-negative least squares over them on the measured CPU seconds.
    Wall: under that work, the host's seconds are linear in 1 / cores and 1 / stacked_cores
    for a given spread_s, so least squares over them on the measured wall seconds (relative
    errors) for each of `SPREADS`, keeping the best. Prints the fitted values to paste into
    the profile."""
    import tempfile

    import yaml
    from scipy.optimize import nnls

    from hcp.dcp.hardware import read_profile
    from hcp.preflight.auto_cost import Scorer
    from hcp.preflight.auto_layout import search
    from hcp.preflight.auto_space import pinned_fields

    base = dict(read_profile(args.profile))
    names = ("layer_s", "cp_layer_s", "cp_latency", "module_step_s")
    rows, cpu, wall = [], [], []
    for name, overrides in {"llava_tiny_hetero": [], **CALIBRATION}.items():
        cfg = variant_config(name, overrides, args)
        result = search(cfg, args.world, pinned_fields(cfg, PINS), top=10**6, prune=False)
        cands = [cand for cand, _ in result.ranked]
        for cand, m in zip(cands, measure_all(cfg, name, cands, args)):
            rows.append((cfg, cand, result.lengths))
            cpu.append(m["cpu_s"])
            wall.append(m["wall_s"])
    cpu, wall = np.array(cpu), np.array(wall)

    def scores(tmp, tag, peak_flops, cp_latency, host):
        path = os.path.join(tmp, f"{tag}.yaml")
        with open(path, "w") as f:
            yaml.safe_dump({**base, "peak_flops": peak_flops, "cp_latency": cp_latency, "host": host}, f)
        return [Scorer(cfg, args.world, path, lengths).score(cand) for cfg, cand, lengths in rows]

    zero = dict.fromkeys(names, 0.0)
    basis = [(zero, 1.0), (zero, 2.0)] + [({**zero, n: 1.0}, 1.0) for n in names]  # (values, peak x)
    with tempfile.TemporaryDirectory() as tmp:
        work = np.column_stack([
            [s.work_s for s in scores(tmp, f"basis{j}", base["peak_flops"] * peak, values["cp_latency"],
                                      {"cores": 1.0, **{n: values[n] for n in names if n != "cp_latency"}})]
            for j, (values, peak) in enumerate(basis)])
        flops = 2 * (work[:, 0] - work[:, 1])  # the FLOPs' seconds at the profile's peak
        rest = work[:, 0] - flops  # the syncs and routes (bandwidths)
        theta, resid = nnls(np.column_stack([flops, work[:, 2:] - work[:, :1]]), cpu - rest)
        fitted = dict(zip(names, (float(f"{t:.3g}") for t in theta[1:])))
        peak_flops = float(f"{base['peak_flops'] / theta[0]:.3g}") if theta[0] else base["peak_flops"]
        host = {n: fitted[n] for n in names if n != "cp_latency"}
        fits = []
        for spread in SPREADS:
            got = scores(tmp, f"spread{spread}", peak_flops, fitted["cp_latency"],
                         {"cores": 1.0, "stacked_cores": 1.0, "spread_s": spread, **host})
            terms = np.array([[s.work_s - s.stacked_s, s.stacked_s] for s in got]) / wall[:, None]
            inv, err = nnls(terms, np.ones(len(wall)))  # relative errors: each row over its wall
            fits.append((err, spread, inv))
    err, spread, inv = min(fits, key=lambda f: f[0])
    cores = float(f"{1 / inv[0]:.3g}") if inv[0] else float(f"{cpu.sum() / wall.sum():.3g}")
    print(f"calibrated on {len(rows)} layouts of llava_tiny_hetero, {', '.join(CALIBRATION)} "
          f"(CPU residual {resid:.3g} s; wall: relative residual {err:.3g}, "
          f"{', '.join(f'{f[1]:g} s: {f[0]:.3g}' for f in fits)} by spread_s):")
    print(yaml.safe_dump({"peak_flops": peak_flops, "cp_latency": fitted["cp_latency"],
                          "host": {"cores": cores, **host,
                                   "stacked_cores": float(f"{1 / inv[1]:.3g}") if inv[1] else None,
                                   "spread_s": spread}}))


def main(argv=None) -> None:
    p = arg_parser(__doc__, json_help="write {'variants': [...]} here")
    p.add_argument("--world", type=int, default=8, help="local gloo ranks")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per layout")
    p.add_argument("--steps", type=int, default=4, help="timed steps per layout")
    p.add_argument("--rounds", type=int, default=None,
                   help=f"times every layout is trained, interleaved (default {ROUNDS['table']}; with --calibrate "
                        f"{ROUNDS['calibrate']})")
    p.add_argument("--profile", default=os.path.join(HERE, "cpu_profile.yaml"),
                   help="packing_profile of the predictions (h100: the analytic H100 defaults)")
    p.add_argument("--variants", nargs="*", default=None, help="names to run (default: all)")
    p.add_argument("--out", default="/tmp/hcp-auto-layout-bench", help="run directories of the trained layouts")
    p.add_argument("--reuse", action="store_true",
                   help="reuse the measurements an earlier run left under --out (same layout and steps)")
    p.add_argument("--calibrate", action="store_true",
                   help="fit the profile's host model on the calibration variant(s) and print it")
    args = p.parse_args(argv)
    if args.rounds is None:
        args.rounds = ROUNDS["calibrate" if args.calibrate else "table"]
    if args.calibrate:
        return calibrate(args)
    start = time.perf_counter()
    todo = {**VARIANTS, **HELD_OUT}
    out = []
    for name, overrides in todo.items():
        if args.variants and name not in args.variants:
            continue
        out.append(run_variant(name, overrides, args))
    print(f"\nauto_layout benchmark: {args.world} ranks, {args.rounds} rounds of {args.warmup} warm-up + "
          f"{args.steps} timed steps (wall: the fastest step; CPU: medians), profile {args.profile}, {time.perf_counter() - start:.0f} s wall, "
          f"load average now {os.getloadavg()[0]:.1f}")
    print(f"  {'variant':<20} {'auto/best':>9} {'rank corr':>9} {'CPU auto/best':>13} {'CPU corr':>8} "
          f"{'measured':>8}  (wall; CPU: all ranks' CPU seconds) target <= 1.10, >= 0.8")
    for v in out:
        tag = " (held out)" if v["name"] in HELD_OUT else " (calibrated on)" if v["name"] == "llava_tiny_hetero" else ""
        print(f"  {v['name']:<20} {v['auto_over_best']:>9.3f} {v['rank_correlation']:>9.2f} "
              f"{v['auto_over_best_cpu']:>13.3f} {v['rank_correlation_cpu']:>8.2f} {v['layouts_measured']:>8}{tag}")
    write_json(args.json, {"variants": out})


if __name__ == "__main__":
    main()
