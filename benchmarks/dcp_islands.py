"""Dynamic CP on the LLM island and encoder CP on the vision island, measured side by side on 8
forked gloo ranks through the trainer (issue 25 section 3).

    python benchmarks/dcp_islands.py                 # 1 warm-up + 2 timed steps per layout
    python benchmarks/dcp_islands.py --steps 3 --json out.json

Data: LLaVA-JSON records written to a temporary folder, each with 1 to 6 images (tiles: a
long tail, mostly 1-2, some 5-6) and a long-tail text answer (lognormal bytes, 2-250), so the
merged length per sample (text + 36 rows per image) varies widely. Placement=non_colocated on
8 ranks: the vision island on ranks 0-3 (a ViT of 4 blocks, width 256: `ENCODER`), the LLM
island (the tiny LLaVA's LLM, llama_tiny's size) on ranks 4-7. Dynamic CP plans with the cost
profile fitted on this kind of machine (`hcp/dcp/profiles/gloo_llama_tiny.yaml`). Layouts:
- `static`: vision dp4, LLM cp2 x dp2 with `first_fit` (static CP: every micro-batch at cp 2);
- `dynamic`: the same islands, the LLM's pool of 4 with `packing=dynamic_cp`;
- `encoder_cp`: as `dynamic`, the vision island at cp4 (every image's tokens split over 4 ranks)
  instead of dp4 (each lane encodes its block of samples, whatever their image counts).
Every layout runs the same global batches, weights and seed (the losses must agree).

Measured per rank and step: the process CPU time of `Trainer.forward_backward` (gloo runs
collectives on its own threads; a rank waiting for a peer sleeps): an island's critical path is
the max over its ranks (mean over the timed steps); 8 ranks share the machine's cores, so wall
time hides imbalance (docs/design.md 8). Modelled and bound, LLM island: the step plans'
iteration times under the fitted profile (`hcp.dcp.solver.simulate_plan`) and the provable
lower bound of any plan of the batch's lengths on the pool (`hcp.dcp.lower_bound`); encoder
island: training FLOPs (`hcp.model.flops.encoder_flops`) of the most loaded rank (its lane's
images, split over its CP group), bound: the island's FLOPs spread evenly (CP's K/V exchange
not counted). The bound ratio is the baseline's modelled time over the bound: the most any
layout could gain. Reported: measured ratio (baseline / new), modelled ratio, bound ratio and
measured / bound.
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

ISLANDS = ["placement=non_colocated", "vision.layout.num_ranks=4", "vision.layout.tp=1", "llm.layout.tp=1",
           "launcher.nproc_per_node=8", "logger=none", "trainer.progress_bar=false", "trainer.eval_every=0",
           "data=llava_json", "data.system_prompt=''", "data.max_seq_len=512",
           "packing_profile=hcp/dcp/profiles/gloo_llama_tiny.yaml"]
ENCODER = ["vision.image_size=12", "vision.patch_size=2", "vision.hidden_size=384", "vision.num_layers=4",
           "vision.num_heads=6", "vision.ffn_hidden_size=1536"]
"""A ViT with about the LLM's FLOPs per sample (36 patches + CLS per image), so the encoder
island's balance matters."""
LAYOUTS = {
    "static": ["llm.layout.cp=2", "packing=first_fit"],
    "dynamic": ["llm.layout.cp=2", "packing=dynamic_cp"],
    "encoder_cp2": ["llm.layout.cp=2", "packing=dynamic_cp", "vision.layout.cp=2"],
    "encoder_cp4": ["llm.layout.cp=2", "packing=dynamic_cp", "vision.layout.cp=4"],
}
COMPARE = {"dynamic CP vs static CP (LLM island)": ("static", "dynamic", "llm"),
           "encoder CP 2 x DP 2 vs DP 4 (vision island)": ("dynamic", "encoder_cp2", "vision"),
           "encoder CP 4 vs DP 4 (vision island)": ("dynamic", "encoder_cp4", "vision")}


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
    """One rank: build the trainer, run warm-up + timed steps, write its measurements."""
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from hcp.train.trainer import Trainer

    container, out_dir, warmup, steps = payload
    tr = Trainer(OmegaConf.create(container), out_dir)
    busy, losses = [], []
    for k in range(warmup + steps):
        indices = tr.sampler.batch(k)
        prepared = tr.prepare(indices)
        dist.barrier()
        t0 = time.process_time()
        loss, _, _ = tr.forward_backward(indices, prepared)
        t = time.process_time() - t0
        tr.optimizer.zero_grad(set_to_none=True)
        if k >= warmup:
            busy.append(t)
            losses.append(float(loss))
    with open(os.path.join(out_dir, f"rank{tr.rank}.json"), "w") as f:
        json.dump({"busy": busy, "losses": losses, "head": tr.head}, f)


def modelled(cfg, layouts, planner, batches) -> dict[str, dict]:
    """Per island: {"critical", "bound"} (seconds under the profile for the LLM, FLOPs for the
    encoder), summed over `batches` (module docstring)."""
    from hcp.dcp.cost_model import CostModel
    from hcp.dcp.hardware import load_profile
    from hcp.dcp.lower_bound import lower_bound
    from hcp.dcp.solver import simulate_plan
    from hcp.model.flops import encoder_flops

    llm, vis = layouts["llm"], layouts["vision"]
    cost = CostModel(cfg.llm, load_profile(cfg.packing_profile))
    cap = cfg.trainer.micro_batch_tokens
    out = {"llm": [0.0, 0.0], "vision": [0.0, 0.0]}
    per_image = encoder_flops(cfg.vision, cfg.llm.hidden_size, 1.0)
    for indices in batches:
        plan = planner(indices)
        out["llm"][0] += simulate_plan(plan.packing, plan.sizes.tokens, cost).iteration_time
        out["llm"][1] += lower_bound(plan.sizes.tokens, cost, llm.dp * llm.cp, cap, several_per_round=True)
        images = plan.sizes.images.astype(float)
        lanes = images.reshape(vis.dp, -1).sum(1)   # lane l encodes block l; its CP ranks split each image
        out["vision"][0] += lanes.max() * per_image / vis.cp
        out["vision"][1] += images.sum() * per_image / vis.num_ranks
    return {k: {"critical": a, "bound": b} for k, (a, b) in out.items()}


def run_layout(name, data, args, root) -> dict:
    from hcp.config.compose import compose_config
    from hcp.config.validate import validate
    from hcp.train import encoders as sides
    from hcp.launch.launch import start_local_ranks
    from hcp.train.planner import StepPlanner
    from omegaconf import OmegaConf

    run_dir = os.path.join(root, name)
    os.makedirs(run_dir)
    overrides = [*ISLANDS, *ENCODER, *data, *LAYOUTS[name], f"trainer.global_batch_size={args.samples}",
                 f"trainer.micro_batch_tokens={args.micro_batch_tokens}", *args.overrides]
    cfg = compose_config(overrides, run_dir=run_dir)
    layouts = validate(cfg, 8)
    container = OmegaConf.to_container(cfg, resolve=True)
    import multiprocessing as mp

    launcher = mp.get_context("fork").Process(target=start_local_ranks, args=(
        _rank, 8, (container, run_dir, args.warmup, args.steps), "fork"))
    launcher.start()
    launcher.join()
    if launcher.exitcode:
        raise RuntimeError(f"layout {name}: the ranks failed (exit code {launcher.exitcode})")
    ranks = [json.load(open(os.path.join(run_dir, f"rank{r}.json"))) for r in range(8)]
    from hcp.data.build import build_datasets
    from hcp.data.loader import GlobalBatchSampler

    tok, train, _ = build_datasets(cfg)
    planner = StepPlanner(cfg, layouts, sides.LengthIndexes(cfg, train, tok), tuple(map(tuple, cfg.graph.edges)))
    sampler = GlobalBatchSampler(len(train), args.samples, cfg.seed)
    batches = [sampler.batch(k) for k in range(args.warmup, args.warmup + args.steps)]
    model = modelled(cfg, layouts, planner, batches)
    critical = {isl: float(np.mean(np.max([r["busy"] for r in ranks if (r["head"] == "llm") == (isl == "llm")], 0)))
                for isl in ("llm", "vision")}
    loss = next(r["losses"] for r in ranks if r["head"] == "llm")
    return {"critical_s": critical, "modelled_flops": model, "losses": loss}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2, help="timed steps per layout")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    ap.add_argument("--samples", type=int, default=16, help="global batch (a multiple of 4)")
    ap.add_argument("--micro-batch-tokens", type=int, default=256, help="THD tokens per rank and micro-batch")
    ap.add_argument("--json", metavar="PATH", help="write the results here")
    ap.add_argument("overrides", nargs="*", help="config overrides, as for train.py (every layout)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    root = tempfile.mkdtemp(prefix="dcp_islands_")  # kept: forked ranks must not delete it
    os.makedirs(os.path.join(root, "data"))
    data = make_records(os.path.join(root, "data"), 4 * args.samples * (args.warmup + args.steps))
    results = {name: run_layout(name, data, args, root) for name in LAYOUTS}
    print(f"{'layout':<11} {'LLM island s':>12} {'vision island s':>15} {'losses'}")
    for name, r in results.items():
        print(f"{name:<11} {r['critical_s']['llm']:12.3f} {r['critical_s']['vision']:15.3f} "
              + " ".join(f"{x:.5f}" for x in r["losses"]))
    rows = {}
    print(f"{'comparison':<42} {'measured':>8} {'modelled':>8} {'bound':>6} {'measured/bound':>14}")
    for what, (base, new, isl) in COMPARE.items():
        b, n = results[base], results[new]
        measured = b["critical_s"][isl] / n["critical_s"][isl]
        model = b["modelled_flops"][isl]["critical"] / n["modelled_flops"][isl]["critical"]
        bound = b["modelled_flops"][isl]["critical"] / b["modelled_flops"][isl]["bound"]
        rows[what] = {"measured": measured, "modelled": model, "bound": bound, "measured_over_bound": measured / bound}
        print(f"{what:<42} {measured:8.2f} {model:8.2f} {bound:6.2f} {measured / bound:14.2f}")
    wall = time.perf_counter() - t0
    print(f"wall time {wall:.0f} s ({args.warmup} warm-up + {args.steps} timed steps per layout, 8 ranks)")
    out = {"layouts": results, "comparisons": rows, "wall_s": wall}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
