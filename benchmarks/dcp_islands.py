"""Dynamic CP on the LLM island and encoder CP on the vision island, measured side by side on 8
forked gloo ranks through the trainer (issue 25 section 3).

    python benchmarks/dcp_islands.py                 # 2 rounds of every layout, 1 warm-up + 5 timed steps each
    python benchmarks/dcp_islands.py --rounds 3 --json out.json

Data: LLaVA-JSON records written to a temporary folder, each with 1 to 6 images (tiles: a
long tail, mostly 1-2, some 5-6) and a long-tail text answer (lognormal bytes, 2-250), so the
merged length per sample (text + 36 rows per image) varies widely. Placement=non_colocated on
8 ranks: the vision island on ranks 0-3 (a ViT of 4 blocks, width 384: `ENCODER`), the LLM
island (the tiny LLaVA's LLM, llama_tiny's size) on ranks 4-7. Dynamic CP plans with the cost
profile fitted on this kind of machine (`hcp/dcp/profiles/gloo_llama_tiny.yaml`). Layouts:
- `static`: vision dp4, LLM cp2 x dp2 with `first_fit` (static CP: every micro-batch at cp 2);
- `dynamic`: the same islands, the LLM's pool of 4 with `packing=dynamic_cp`;
- `encoder_cp2`, `encoder_cp4`: as `dynamic`, the vision island at cp2 x dp2 / cp4 (every
  image's tokens split over its CP ranks) instead of dp4 (each lane encodes its block of
  samples, whatever their image counts);
- `wide_dp4`, `wide_cp4`: `dynamic` and `encoder_cp4` with a wider ViT (`WIDE`).
Every layout runs the same global batches, weights and seed (the LLM's losses must agree).

Measured per rank and step: the process CPU time of `Trainer.forward_backward` (gloo runs
collectives on its own threads); an island's critical path is the max over its ranks, the
median over the timed steps of every round (`--rounds`: every layout runs once per round, in
turn, so a drift of the machine's load between layouts, 10-30% over a few minutes here, hits
each alike instead of one comparison); 8 ranks share the machine's cores, so wall time hides imbalance
(docs/design.md 8). LLM island: modelled, the step plans' critical paths under the fitted
profile, each DP replica and CP group running its micro-batches back to back as the trainer
does (`critical_path.predicted_path`, benchmarks/dynamic_cp_train.py's prediction;
`simulate_plan` would wait for every row's slowest group); bound, the static plan's modelled time over the
provable lower bound of any plan of the batch's lengths on the pool (`hcp.dcp.lower_bound`).
Encoder island (`encoder_work`, per rank: FLOPs, K/V bytes, layer calls, CP attention calls):
modelled, the most loaded rank at unit costs measured in this run: seconds per FLOP and per
layer call fitted per ViT width to each rank of the DP-only islands (`calibrate`), per K/V byte
and per call of CP attention and the step's gradient sum over the island from the floor's
measurement. Bound (as the LLM's: the most the new layout could gain under the same model):
DP 4's modelled time over the new layout's columns spread evenly over its ranks (its slowest
rank does at least the mean) at the model's unit costs. Floor bound (no model): the DP-4
island's measured time over the new layout's floor, the same means at unit costs that the
layout's own 8 rank processes measure after each step, apart from the step's code
(`encoder_floor.FloorRound`, `floor_units`: the ViT and its projector forward + backward at
three image counts, the CP attention in groups of its CP size at three, the gradient sum every
layout of the island pays; each rank's least round, the median over the ranks; least-squares
lines give the per-FLOP, per-call and per-byte costs), so the floor sees the machine's load as
the steps did, never the steps' own times: no waiting, no schedule, no route, no executor, a
lower bound of the island's critical path that no layout reaches (DP's included). Reported:
measured ratio (baseline / new), modelled ratio, bound and measured / bound, floor bound and
measured / floor bound; and every layout's floor
over its measured vision critical path (DP layouts included: how far any step is from its
floor on this machine).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)  # encoder_floor.py, critical_path.py beside this file

from encoder_floor import FloorRound, encoder_times, encoder_work, floor_units  # noqa: E402
from critical_path import predicted_path  # noqa: E402
import harness  # noqa: E402

ISLANDS = ["placement=non_colocated", "vision.layout.num_ranks=4", "vision.layout.tp=1", "llm.layout.tp=1",
           "launcher.nproc_per_node=8", "logger=none", "trainer.progress_bar=false", "trainer.eval_every=0",
           "data=llava_json", "data.system_prompt=''", "data.max_seq_len=512",
           "packing_profile=hcp/dcp/profiles/gloo_llama_tiny.yaml"]
ENCODER = ["vision.image_size=12", "vision.patch_size=2", "vision.hidden_size=384", "vision.num_layers=4",
           "vision.num_heads=6", "vision.ffn_hidden_size=1536"]
"""A ViT with about the LLM's FLOPs per sample (36 patches + CLS per image), so the encoder
island's balance matters."""
WIDE = ["vision.hidden_size=1024", "vision.num_heads=16", "vision.ffn_hidden_size=4096"]
"""A ViT of 7x the FLOPs per image (the same rows into the LLM): FLOPs, not per-call costs,
dominate the encoder island, the regime where encoder CP can beat DP."""
LAYOUTS = {
    "static": ["llm.layout.cp=2", "packing=first_fit"],
    "dynamic": ["llm.layout.cp=2", "packing=dynamic_cp"],
    "encoder_cp2": ["llm.layout.cp=2", "packing=dynamic_cp", "vision.layout.cp=2"],
    "encoder_cp4": ["llm.layout.cp=2", "packing=dynamic_cp", "vision.layout.cp=4"],
    "wide_dp4": ["llm.layout.cp=2", "packing=dynamic_cp", *WIDE],
    "wide_cp4": ["llm.layout.cp=2", "packing=dynamic_cp", "vision.layout.cp=4", *WIDE],
}
DP_ONLY = ("static", "dynamic", "wide_dp4")
"""The layouts whose vision island is DP only: the encoder model's calibration (`calibrate`)."""
COMPARE = {"dynamic CP vs static CP (LLM island)": ("static", "dynamic", "llm"),
           "encoder CP 2 x DP 2 vs DP 4 (vision island)": ("dynamic", "encoder_cp2", "vision"),
           "encoder CP 4 vs DP 4 (vision island)": ("dynamic", "encoder_cp4", "vision"),
           "wide ViT: encoder CP 4 vs DP 4 (vision)": ("wide_dp4", "wide_cp4", "vision")}


def make_records(root: str, n: int, seed: int = 0) -> list[str]:
    """`n` records in `root` (module docstring); returns the data overrides."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    records = []
    for i in range(n):
        tiles = int(min(6, rng.geometric(0.5) + (4 if rng.random() < 0.15 else 0)))
        answer = int(np.clip(rng.lognormal(3.5, 1.0), 2, 250))
        paths = []
        for t in range(tiles):
            Image.fromarray(rng.integers(0, 255, (8, 8), dtype=np.uint8)).save(os.path.join(root, f"{i}_{t}.png"))
            paths.append(f"{i}_{t}.png")
        records.append({"id": f"s{i}", "image": paths, "conversations": [
            {"from": "human", "value": "<image>" * tiles + "\nwhat is it?"},
            {"from": "gpt", "value": "".join(rng.choice(list("abcdefgh "), answer))}]})
    with open(os.path.join(root, "d.json"), "w") as f:
        json.dump(records, f)
    return [f"data.path={os.path.join(root, 'd.json')}", f"data.image_folder={root}"]


def _rank(payload) -> None:
    """One rank: build the trainer, run warm-up + timed steps, each followed by a floor round
    (`FloorRound`), write its measurements."""
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from hcp.train.trainer import Trainer

    container, out_dir, warmup, steps = payload
    tr = Trainer(OmegaConf.create(container), out_dir)
    vis = tr.layouts["vision"]
    floor = FloorRound(tr.cfg, vis.cp, list(vis.ranks))
    busy, losses, rounds = [], [], []
    for k in range(warmup + steps):
        indices = tr.sampler.batch(k)
        prepared = tr.prepare(indices)
        dist.barrier()
        t0 = time.process_time()
        loss, _, _ = tr.forward_backward(indices, prepared)
        t = time.process_time() - t0
        tr.optimizer.zero_grad(set_to_none=True)
        units = floor()
        if k >= warmup:
            busy.append(t)
            losses.append(float(loss))
            rounds.append(units)
    with open(os.path.join(out_dir, f"rank{tr.rank}.json"), "w") as f:
        json.dump({"busy": busy, "losses": losses, "head": tr.head, "floor": rounds}, f)


def calibrate(results: dict) -> dict[int, tuple[float, float]]:
    """ViT width -> (seconds per FLOP, seconds per layer call) of the encoder on this machine:
    fitted (non-negative least squares) to every rank and step of the DP-only vision islands of
    that width (`DP_ONLY`, whose CP columns are 0): its CPU seconds less the measured gradient
    sum (`floor_units`) as its FLOPs x a + its layer calls x b. Per rank, as the lanes differ
    in both; per width, as a layer call of the wider ViT costs more (its element-wise work)."""
    from scipy.optimize import nnls

    points = {}
    for name in DP_ONLY:
        v = results[name]["model"]["vision"]
        x, y = points.setdefault(v["width"], ([], []))
        for work, busy in zip(v["work"], np.transpose(results[name]["vision_busy_s"])):
            x += [[w[0], w[2]] for w in work]
            y += [b - v["sync_s"] for b in busy]
    return {width: tuple(float(c) for c in nnls(np.array(x), np.array(y))[0]) for width, (x, y) in points.items()}


def modelled(cfg, layouts, planner, batches) -> dict:
    """LLM island: {"critical", "bound"} seconds under the profile, summed over `batches`;
    vision island: "work", `encoder_work` of each batch (module docstring)."""
    from hcp.dcp.cost_model import CostModel
    from hcp.dcp.hardware import load_profile
    from hcp.dcp.lower_bound import lower_bound

    llm = layouts["llm"]
    cost = CostModel(cfg.llm, load_profile(cfg.packing_profile))
    cap = cfg.trainer.micro_batch_tokens
    out = {"llm": {"critical": 0.0, "bound": 0.0}, "vision": {"work": []}}
    for indices in batches:
        plan = planner(indices)
        out["llm"]["critical"] += predicted_path(plan.packing, plan.sizes.tokens, cost)
        out["llm"]["bound"] += lower_bound(plan.sizes.tokens, cost, llm.dp * llm.cp, cap, several_per_round=True)
        out["vision"]["work"].append(encoder_work(cfg, layouts["vision"], plan).tolist())
    out["vision"]["cp"] = layouts["vision"].cp
    return out


def layout_config(name, data, args, run_dir):
    """(cfg, resolved layouts) of layout `name` on the records `data`."""
    from hcp.config.compose import compose_config
    from hcp.config.validate import validate

    own = {o.split("=")[0] for o in LAYOUTS[name]}
    encoder = [o for o in ENCODER if o.split("=")[0] not in own]
    overrides = [*ISLANDS, *encoder, *data, *LAYOUTS[name], f"trainer.global_batch_size={args.samples}",
                 f"trainer.micro_batch_tokens={args.micro_batch_tokens}", *args.overrides]
    cfg = compose_config(overrides, run_dir=run_dir)
    return cfg, validate(cfg, 8)


def layout_model(cfg, layouts, args) -> dict:
    """`modelled` over the timed steps' global batches of the run `cfg`."""
    from hcp.config.settings import PackingSpec
    from hcp.config.specs import resolve_modules
    from hcp.data.build import build_datasets
    from hcp.data.loader import GlobalBatchSampler
    from hcp.train import encoders as sides
    from hcp.train.planner import StepPlanner

    specs = resolve_modules(cfg, layouts)
    tok, train, _ = build_datasets(cfg, specs)
    planner = StepPlanner(PackingSpec.of(cfg), specs, sides.LengthIndexes(specs, train, tok))
    sampler = GlobalBatchSampler(len(train), args.samples, cfg.seed)
    return modelled(cfg, layouts, planner, [sampler.batch(k) for k in range(args.warmup, args.warmup + args.steps)])


def launch_layout(name, data, args, root, rank_fn) -> tuple:
    """(cfg, layouts, each of the 8 ranks' rank{r}.json) of layout `name` run on 8 forked ranks by
    `rank_fn((cfg as a container, run_dir, warmup, steps))`, which writes run_dir/rank{r}.json.

    Raises:
        RuntimeError: the ranks failed (names the layout and the exit code)."""
    import multiprocessing as mp

    from omegaconf import OmegaConf

    from hcp.launch.launch import start_local_ranks

    run_dir = os.path.join(root, name)
    os.makedirs(run_dir)
    cfg, layouts = layout_config(name, data, args, run_dir)
    launcher = mp.get_context("fork").Process(target=start_local_ranks, args=(
        rank_fn, 8, (OmegaConf.to_container(cfg, resolve=True), run_dir, args.warmup, args.steps), "fork"))
    launcher.start()
    launcher.join()
    if launcher.exitcode:
        raise RuntimeError(f"layout {name}: the ranks failed (exit code {launcher.exitcode})")
    return cfg, layouts, [json.load(open(os.path.join(run_dir, f"rank{r}.json"))) for r in range(8)]


def run_layout(name, cfg, layouts, rounds: list[list[dict]], args) -> dict:
    """Layout `name`'s measurements over `rounds` (per round, each of the 8 ranks' rank{r}.json
    from `launch_layout`; the same global batches every round): every round's timed steps
    pooled, its model inputs (`layout_model`, one entry per pooled step) and the floor's unit
    costs (`floor_units` of every round its ranks ran between the steps)."""
    ranks = [{"busy": [x for rd in rounds for x in rd[r]["busy"]], "head": rounds[0][r]["head"],
              "floor": [x for rd in rounds for x in rd[r]["floor"]]} for r in range(8)]
    critical = {isl: float(np.median(np.max([r["busy"] for r in ranks if (r["head"] == "llm") == (isl == "llm")], 0)))
                for isl in ("llm", "vision")}
    loss = next(r["losses"] for r in rounds[0] if r["head"] == "llm")
    model = layout_model(cfg, layouts, args)
    units = floor_units(cfg, layouts["vision"].cp, [r["floor"] for r in ranks])
    v = model["vision"]
    v["work"] = v["work"] * len(rounds)  # the same batches each round: one entry per pooled step
    v["sync_s"], v["width"] = units["sync_s"], cfg.vision.hidden_size
    v["floor_units"], v["kv_units"] = units["encoder"], units.get("kv", [0.0, 0.0])
    return {"critical_s": critical, "model": model, "losses": loss, "busy_s": [r["busy"] for r in ranks],
            "vision_busy_s": [r["busy"] for r in ranks if r["head"] != "llm"]}


def report(results: dict) -> dict:
    """Calibrate the encoder model on `results` (`run_layout` per layout), set each layout's
    vision "modelled_s", "model_bound_s" and "bound_s" (its floor; `encoder_times`), print the
    floors and the comparisons; returns the comparisons by name."""
    fits = calibrate(results)
    for r in results.values():
        v = r["model"]["vision"]
        (per_flop, per_call), (per_byte, kv_call) = fits[v["width"]], v["kv_units"]
        coef = np.array([per_flop, per_byte, per_call, kv_call])
        floor = np.array([v["floor_units"][0], per_byte, v["floor_units"][1], kv_call])
        v["modelled_s"], v["model_bound_s"], v["bound_s"] = encoder_times(v["work"], coef, floor, v["sync_s"])
    print("encoder model: " + "; ".join(f"width {w}: {1e-9 / max(f, 1e-30):.0f} GFLOP/s, {1e3 * c:.1f} ms per layer "
                                        f"call" for w, (f, c) in sorted(fits.items()))
          + f" (fitted to each rank of the {', '.join(DP_ONLY)} vision islands); CP attention and gradient sum: "
          "the floor's")
    print("encoder floor (the run's 8 ranks between its steps: each the ViT + projector, CP attention in groups of "
          "its size, the island's gradient sum; each rank's least round, the median over the ranks), and each vision "
          "island's floor / measured critical path:")
    for name, r in results.items():
        v = r["model"]["vision"]
        (f, c), (b, k) = v["floor_units"], v["kv_units"]
        kv = f"K/V at {1e-6 / b:.0f} MB/s, {1e3 * k:.1f} ms per CP call, " if b else ""
        print(f"  {name:<11} {1e-9 / f:.0f} GFLOP/s, {1e3 * c:.1f} ms per layer call, {kv}{1e3 * v['sync_s']:.0f} ms "
              f"per gradient sum: floor {v['bound_s']:.3f} s / measured {r['critical_s']['vision']:.3f} s = "
              f"{v['bound_s'] / r['critical_s']['vision']:.2f}")
    rows = {}
    print(f"{'comparison':<42} {'measured':>8} {'modelled':>8} {'bound':>6} {'measured/bound':>14} "
          f"{'floor bound':>11} {'measured/floor bound':>20}")
    for what, (base, new, isl) in COMPARE.items():
        b, n = results[base], results[new]
        measured = b["critical_s"][isl] / n["critical_s"][isl]
        if isl == "llm":
            model = b["model"]["llm"]["critical"] / n["model"]["llm"]["critical"]
            bound = b["model"]["llm"]["critical"] / b["model"]["llm"]["bound"]
            floor = None
        else:
            bv, nv = b["model"]["vision"], n["model"]["vision"]
            model = bv["modelled_s"] / nv["modelled_s"]
            bound = bv["modelled_s"] / nv["model_bound_s"]
            floor = b["critical_s"][isl] / nv["bound_s"]
        rows[what] = {"measured": measured, "modelled": model, "bound": bound, "measured_over_bound": measured / bound,
                      "floor_bound": floor, "measured_over_floor_bound": None if floor is None else measured / floor}
        tail = f"{'-':>11} {'-':>20}" if floor is None else f"{floor:11.2f} {measured / floor:20.2f}"
        print(f"{what:<42} {measured:8.2f} {model:8.2f} {bound:6.2f} {measured / bound:14.2f} {tail}")
    print("bound: the baseline's modelled time over the new layout's lower bound under the same model (the most\n"
          "it could gain there). LLM: the static plan's over the provable lower bound of any plan of the batch\n"
          "(cost profile). Encoder: DP 4's over the new layout's FLOPs, K/V bytes and calls spread evenly over its\n"
          "ranks (its slowest rank does at least the mean) at the model's unit costs (fitted to the DP islands of\n"
          "this run; CP attention and gradient sum: the floor's). floor bound: the DP-4 island's measured time over\n"
          "the new layout's floor: those means at unit costs measured apart from the step by the same 8 rank\n"
          "processes between its steps (each rank's least round): no waiting, no schedule, no route, no executor;\n"
          "no layout reaches it (DP 4's own floor / measured is printed above). bound < 1: that layout cannot beat\n"
          "DP on this machine")
    return rows


def arg_parser(doc: str, over_steps: str) -> argparse.ArgumentParser:
    """The options every 8-rank islands benchmark takes (steps, warm-up, global batch, tokens per
    micro-batch, --json, config overrides); `over_steps`: how it sums the timed steps."""
    ap = harness.arg_parser(doc)
    ap.add_argument("--steps", type=int, default=5, help=f"timed steps per layout ({over_steps} over them)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    ap.add_argument("--samples", type=int, default=16, help="global batch (a multiple of 4)")
    ap.add_argument("--micro-batch-tokens", type=int, default=256, help="THD tokens per rank and micro-batch")
    ap.add_argument("overrides", nargs="*", help="config overrides, as for train.py (every layout)")
    return ap


def main(argv=None) -> dict:
    ap = arg_parser(__doc__, "medians")
    ap.add_argument("--rounds", type=int, default=2,
                    help="runs of every layout in turn (the machine's drift hits each alike); each "
                         "layout's steps of every round pooled")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: must be >= 1")
    t0 = time.perf_counter()
    root, data = workspace("dcp_islands_", args)
    runs = {name: [] for name in LAYOUTS}  # per layout: (cfg, layouts, ranks) per round
    for k in range(args.rounds):
        for name in LAYOUTS:
            runs[name].append(launch_layout(name, data, args, os.path.join(root, f"round{k}"), _rank))
    results = {name: run_layout(name, rs[0][0], rs[0][1], [ranks for *_, ranks in rs], args)
               for name, rs in runs.items()}
    print(f"{'layout':<11} {'LLM island s':>12} {'vision island s':>15} {'losses'}")
    for name, r in results.items():
        print(f"{name:<11} {r['critical_s']['llm']:12.3f} {r['critical_s']['vision']:15.3f} "
              + " ".join(f"{x:.5f}" for x in r["losses"]))
    rows = report(results)
    wall = time.perf_counter() - t0
    print(f"wall time {wall:.0f} s ({args.rounds} round(s) of every layout in turn, each {args.warmup} warm-up + "
          f"{args.steps} timed steps, 8 ranks)")
    out = {"layouts": results, "comparisons": rows, "wall_s": wall}
    harness.write_json(args.json, out, indent=2)
    return out


def workspace(prefix: str, args) -> tuple[str, str]:
    """(a new temporary root, kept: forked ranks must not delete it; the records of every step of
    every layout under root/data) for `args.samples` x (`warmup` + `steps`) steps."""
    root = tempfile.mkdtemp(prefix=prefix)
    os.makedirs(os.path.join(root, "data"))
    return root, make_records(os.path.join(root, "data"), 4 * args.samples * (args.warmup + args.steps))


if __name__ == "__main__":
    main()
