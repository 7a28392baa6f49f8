"""Homogeneous vs colocated vs non-colocated heterogeneous layouts of an encoder-heavy LLaVA on 8
CPU ranks in one run (issue 14 section 5; the 4-rank two-layout comparison of issue 12 section 7
with --world 4), and plan mode's per-rank memory of the full-size recipes in both placements.

    python benchmarks/hetero.py                        # 8 ranks, 3 timed steps after 1 warm-up
    python benchmarks/hetero.py --steps 5 --json hetero.json
    python benchmarks/hetero.py --world 4              # issue 12: homogeneous vs colocated
    python benchmarks/hetero.py --plan-only            # only the full-size memory table
    python benchmarks/hetero.py vision.num_layers=6    # any config override (all layouts)

The configuration is `+recipe=llava_tiny_hetero` with a wider ViT on larger images (`MODEL`,
stated in the output); trailing Hydra overrides change it. On 8 ranks (`LAYOUTS[8]`):
- homogeneous: the LLM at tp2 x cp2 x pp2, the ViT inside its first stage (every first-stage
  rank encodes every image of its micro-batches);
- heterogeneous (colocated): the same LLM, the encoder at tp1 x dp8 on all 8 ranks, the
  three-phase schedule;
- non_colocated: the encoder at dp4 on an island of ranks 0-3 (`--encoder-ranks`), the LLM at
  cp2 x pp2 on ranks 4-7, one graph-aware 1F1B over encoder stage -> LLM stage 0 -> stage 1, the
  encoder lanes as the step plan gives them (`hcp.plan.island_routes.balanced_lanes`: each
  micro-batch's samples shared over the lanes by inputs, in the LLM's consumption order; before
  it, blocks of the batch that the lanes encoded in turns).
The encoder is deepened on 8 ranks (`MODEL_8`) so that it carries about as many FLOPs as the
LLM: the regime where the island split matters. All layouts run the same global batch, packing,
weights and seed on freshly forked gloo ranks (`benchmarks/hetero_rank.py`), and must report the
same loss.

Reported per layout: the critical path (max over ranks of the step's thread CPU time, mean over
steps: the 2 shared cores hide imbalance in wall time); the modeled step (each stage's measured
per-micro-batch forward/backward thread CPU times, max over the stage's ranks, replayed through
the schedule's action lists by `hcp.schedule.graph_timing`, plus the colocated encoder phases:
the step on dedicated cores with free transfers, which the busy maximum misses because it has no
pipeline waits); step wall time and tokens/s (merged tokens per wall second); the pipeline bubble
of each stage of each island (idle share of the modeled step); the LLM stage-time balance
(busy seconds of each LLM stage's micro-batches, max/min); encoder FLOPs and images per rank;
bytes both routes moved (summed over ranks) against the minimum (`min_route_rows`).
Plan mode (`benchmarks/hetero_plan.py`): per-rank memory of `+recipe=llava_hetero` colocated and
non-colocated and of `+recipe=internvit6b_llama70b` (a 6B encoder and a 70B LLM) both ways, with
the estimated LLM step; then the regime conclusion.
"""
from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import hetero_plan  # noqa: E402
# autograd.backward(out, grad) imports this lazily (seconds per forked rank on a loaded machine,
# inside the first timed step): import it once here, before the ranks fork
import torch.fx.experimental.symbolic_shapes  # noqa: E402,F401
import functools  # noqa: E402

import hetero_rank  # noqa: E402
from hetero_rank import PHASES, encoder_flops, make_data, run_rank, schedule_graph  # noqa: E402,F401
from harness import arg_parser, fork_ranks, write_json  # noqa: E402
from hcp.launch.launch import free_port  # noqa: E402

MODEL = ["vision.image_size=32", "vision.patch_size=4", "vision.hidden_size=256",
         "vision.num_layers=4", "vision.num_heads=4", "vision.ffn_hidden_size=1024",
         "llm.hidden_size=256", "llm.num_layers=4", "llm.num_heads=8", "llm.num_kv_heads=4",
         "llm.ffn_hidden_size=768", "trainer.micro_batch_tokens=512"]
MODEL_8 = ["vision.num_layers=8", "trainer.micro_batch_tokens=256", "llm.layout.pp=2"]
"""On 8 ranks: an encoder with about the LLM's FLOPs, and more micro-batches for the pipeline."""
LAYOUTS = {
    4: {"homogeneous": [], "heterogeneous": []},
    8: {"homogeneous": [], "heterogeneous": [],
        "non_colocated": ["placement=non_colocated", "vision.layout.num_ranks={enc}", "llm.layout.tp=1"]},
}
"""World size -> layout name -> its overrides (`{enc}`: --encoder-ranks)."""


@functools.lru_cache(maxsize=None)
def _compose(overrides: tuple):
    return hetero_rank.compose(list(overrides))


def compose(overrides):
    """(config, resolved layouts) of the overrides (cached: Hydra takes ~1 s per call)."""
    return _compose(tuple(overrides))


def layout_overrides(world: int, name: str, args) -> list[str]:
    """Every override of one layout's run."""
    extra = [o.format(enc=args.encoder_ranks) for o in LAYOUTS[world][name]]
    return [*MODEL, *(MODEL_8 if world == 8 else []), f"launcher.nproc_per_node={world}", *extra,
            *args.overrides]


def _collect(world, name, overrides, args) -> list[dict]:
    """Each rank's measurements of one layout (`hetero_rank.run_rank` on forked gloo ranks)."""
    return fork_ranks(run_rank, world, (world, free_port(), name, compose(overrides), args), name, args.timeout)


def _modeled(per_rank, graph, colocated: bool):
    """Per step: (modeled step seconds, busy seconds per global stage, pipeline busy per stage)
    from the measured per-micro-batch times (module docstring)."""
    import numpy as np

    from hcp.schedule.graph import graph_one_f_one_b
    from hcp.schedule.graph_timing import time_actions

    n_stages, steps = len(graph.stages), len(per_rank[0]["per_micro"])
    m = len(per_rank[0]["per_micro"][0][0])
    programs = graph_one_f_one_b(graph, m)
    out = []
    for k in range(steps):
        fwd, bwd = np.zeros((n_stages, m)), np.zeros((n_stages, m))
        pre = post = 0.0
        for r in per_rank:
            f, b = r["per_micro"][k]
            fwd[r["stage"]] = np.maximum(fwd[r["stage"]], f)
            bwd[r["stage"]] = np.maximum(bwd[r["stage"]], b)
            if colocated:
                ph = dict(zip(PHASES, r["phases"][k]))
                pre = max(pre, ph["encoder_forward"] + ph["route_forward"])
                post = max(post, ph["route_backward"] + ph["encoder_backward"])
        tl = time_actions(programs, fwd.tolist(), bwd.tolist())
        pipe = np.array(tl.busy)
        out.append((pre + tl.iteration_time + post, pipe + pre + post, pipe))
    return out


def summarize(name, per_rank, world, overrides, args) -> dict:
    """One layout's figures (module docstring) from its ranks' measurements."""
    import numpy as np

    from hcp.parallel.grid import Grid
    from route_keys import min_route_rows

    cfg, layouts = compose(overrides)
    _, sizes = make_data(cfg, args.samples, args.text_tokens)
    graph = schedule_graph(cfg, layouts)
    busy = np.array([[rec[0] for rec in r["records"]] for r in per_rank])   # [ranks, steps]
    wall = np.array([[rec[1] for rec in r["records"]] for r in per_rank])
    modeled = _modeled(per_rank, graph, name == "heterogeneous")
    step_s = float(np.mean([mo[0] for mo in modeled]))
    stage_busy = np.mean([mo[1] for mo in modeled], axis=0)
    pipe_busy = np.mean([mo[2] for mo in modeled], axis=0)
    bubble = {}
    for g, (module, s) in enumerate(graph.stages):
        bubble.setdefault(module, []).append(round(float(1 - stage_busy[g] / step_s), 4))
    llm_stages = [float(pipe_busy[g]) for g, (module, _) in enumerate(graph.stages) if module == "llm"]
    steps = args.warmup + args.steps
    route = [sum(r["route"][i] for r in per_rank) / steps for i in (0, 1)]
    llm_grid = Grid.of(layouts["llm"])
    shard_of = [(lambda c: c["dp"] * llm_grid.cp + c["cp"])(llm_grid.coords(r)) if llm_grid.contains(r)
                else -1 - r for r in range(world)]  # the ranks of one TP group: one shard
    rows = min_route_rows([r["dst_keys"] for r in per_rank], shard_of)
    minimum = [n * cfg.llm.hidden_size * 4 for n in rows] if name != "homogeneous" else [0, 0]
    extra = {}
    if name == "heterogeneous":  # thread CPU s per phase: max over ranks, mean over steps
        ph = np.array([r["phases"] for r in per_rank])                  # [ranks, steps, phases]
        extra["phase_busy_s"] = dict(zip(PHASES, ph.max(axis=0).mean(axis=0).round(4).tolist()))
        enc = ph[:, :, [PHASES.index("encoder_forward"), PHASES.index("encoder_backward")]].sum(2)
        extra["encoder_busy_s_per_image"] = float(np.mean([e.mean() / r["images"] for e, r in zip(enc, per_rank)]))
    elif name.startswith("non_colocated"):  # thread CPU s of the encoder stage's micro-batches
        extra["encoder_busy_s_per_image"] = float(np.mean(
            [np.mean([sum(f) + sum(b) for f, b in r["per_micro"]]) / r["images"]
             for r in per_rank if r["stage"] == graph.index("vision", 0) and r["images"]]))
    step_wall = float(wall.max(axis=0).mean())
    loss = next(r["records"][-1][2] for r in per_rank if r["last_llm"])
    return {**extra,
            "placement": cfg.placement,
            "layouts": {m: f"{lay.tp}x{lay.cp}x{lay.pp}x{lay.dp} ranks {lay.rank_offset}-"
                           f"{lay.rank_offset + lay.num_ranks - 1}" for m, lay in layouts.items()},
            "loss": loss,
            "critical_path_s": float(busy.max(axis=0).mean()),
            "mean_busy_s": float(busy.mean()),
            "modeled_step_s": step_s,
            "step_wall_s": step_wall,
            "tokens_per_s": float(sizes.tokens.sum()) / step_wall,
            "modeled_tokens_per_s": float(sizes.tokens.sum()) / step_s,
            "bubble": bubble,
            "llm_stage_busy_s": llm_stages,
            "llm_stage_balance": max(llm_stages) / max(min(llm_stages), 1e-12),
            "encoder_flops_per_rank": [r["flops"] for r in per_rank],
            "images_per_rank": [r["images"] for r in per_rank],
            "micro_batches": max(r["micro_batches"] for r in per_rank),
            "samples_per_micro_batch": args.samples / max(r["micro_batches"] for r in per_rank),
            "encoder_lanes": layouts["vision"].dp,
            "route_bytes": int(sum(route)),
            "route_min_bytes": int(sum(minimum)),
            "route_bytes_by_direction": [int(b) for b in route],
            "route_min_bytes_by_direction": [int(b) for b in minimum],
            }


def print_table(results) -> None:
    w = max(14, *map(len, results))
    print(f"{'layout':<{w}} {'loss':>8} {'critical s':>10} {'modeled s':>9} {'wall s':>7} "
          f"{'tokens/s':>8} {'bubble per island (stage)':<28} {'LLM stage busy s':<17} {'bal':>5} "
          f"{'enc GFLOP/rank':>14} {'images/rank':>16} {'route MB':>8} {'min MB':>7}")
    for name, r in results.items():
        bub = " ".join(f"{m} " + "/".join(f"{b:.0%}" for b in v) for m, v in r["bubble"].items())
        print(f"{name:<{w}} {r['loss']:8.5f} {r['critical_path_s']:10.3f} {r['modeled_step_s']:9.3f} "
              f"{r['step_wall_s']:7.3f} {r['tokens_per_s']:8.0f} {bub:<28} "
              f"{'/'.join(f'{s:.3f}' for s in r['llm_stage_busy_s']):<17} {r['llm_stage_balance']:5.2f} "
              f"{max(r['encoder_flops_per_rank']) / 1e9:14.2f} "
              f"{'/'.join(map(str, r['images_per_rank'])):>16} {r['route_bytes'] / 1e6:8.3f} "
              f"{r['route_min_bytes'] / 1e6:7.3f}")


def _describe(world, args) -> dict:
    """Print the batch and model; return the encoder's FLOPs share of the homogeneous step."""
    from hcp.plan.step import plan_step
    from hcp.train.throughput import model_flops

    cfg, layouts = compose(layout_overrides(world, "homogeneous", args))
    _, sizes = make_data(cfg, args.samples, args.text_tokens)
    plan = plan_step(sizes, layouts, cfg.packing, cfg.trainer.micro_batch_tokens,
                     tuple(tuple(e) for e in cfg.graph.edges))
    llm, v = layouts["llm"], cfg.vision
    images = int(sizes.images.sum())
    lengths = sizes.tokens.astype(float)
    llm_all = model_flops(cfg.llm, lengths.sum(), (lengths ** 2).sum())
    enc_all = encoder_flops(v, cfg.llm.hidden_size, images)
    enc_homo = encoder_flops(v, cfg.llm.hidden_size, images / llm.dp)
    llm_first = llm_all / (llm.tp * llm.cp * llm.dp * llm.pp)
    share = enc_homo / (enc_homo + llm_first)
    print(f"global batch: {args.samples} samples, {images} images of {v.image_size}x{v.image_size} "
          f"({(v.image_size // v.patch_size) ** 2} patches each), {int(lengths.sum())} merged tokens "
          f"in {plan.num_micro_batches} micro-batches per lane; ViT {v.num_layers}x{v.hidden_size} "
          f"(ffn {v.ffn_hidden_size}), LLM {cfg.llm.num_layers}x{cfg.llm.hidden_size} (ffn "
          f"{cfg.llm.ffn_hidden_size}); {world} CPU ranks")
    print(f"encoder share of all training FLOPs {enc_all / (enc_all + llm_all):.0%}; of a homogeneous "
          f"first-stage rank's FLOPs {share:.0%}")
    return {"encoder_flops_share_homogeneous": share,
            "encoder_flops_share": enc_all / (enc_all + llm_all)}


def measured_conclusion(results) -> str:
    """One paragraph on what the measured layouts show."""
    homo = results["homogeneous"]
    lines = []
    for name, r in results.items():
        if name == "homogeneous":
            continue
        lines.append(f"{name} vs homogeneous: critical-path speed-up "
                     f"{homo['critical_path_s'] / r['critical_path_s']:.2f}x, modeled-step speed-up "
                     f"{homo['modeled_step_s'] / r['modeled_step_s']:.2f}x, wall speed-up "
                     f"{homo['step_wall_s'] / r['step_wall_s']:.2f}x, loss difference "
                     f"{abs(homo['loss'] - r['loss']):.2e}")
    islands = [n for n in results if n.startswith("non_colocated")]
    if islands and "heterogeneous" in results:
        co = results["heterogeneous"]
        best = min(islands, key=lambda n: results[n]["modeled_step_s"])
        nc = results[best]
        winner = "colocated" if co["modeled_step_s"] < nc["modeled_step_s"] else best
        lines.append(f"measured (memory not binding on CPU): {winner} is faster; colocated / {best} "
                     f"modeled step {co['modeled_step_s']:.3f} / {nc['modeled_step_s']:.3f} s "
                     f"({nc['modeled_step_s'] / co['modeled_step_s']:.2f}x), critical path "
                     f"{co['critical_path_s']:.3f} / {nc['critical_path_s']:.3f} s (busy time has no "
                     f"pipeline waits); encoder thread CPU s per image {co['encoder_busy_s_per_image']:.3f} "
                     f"(one batch per step) / {nc['encoder_busy_s_per_image']:.3f} (one per micro-batch; "
                     f"{nc['samples_per_micro_batch']:.1f} samples per LLM micro-batch keep at most that many "
                     f"of the island's {nc['encoder_lanes']} lanes busy at once); LLM stage balance "
                     + ", ".join(f"{n} {r['llm_stage_balance']:.2f}" for n, r in results.items()))
    return "\n".join(lines)


def regime_summary(out: dict) -> str:
    """The seed's finding (colocated wins with memory headroom; non-colocated wins when encoder
    state squeezes the LLM's memory), checked against this run's measured and planned numbers."""
    parts, colo, squeeze = [], 0, 0
    lay = out.get("layouts", {})
    islands = [n for n in lay if n.startswith("non_colocated")]
    if islands and "heterogeneous" in lay:
        best = min(islands, key=lambda n: lay[n]["modeled_step_s"])
        ratio = lay[best]["modeled_step_s"] / lay["heterogeneous"]["modeled_step_s"]
        colo += ratio > 1
        parts.append(f"measured on CPU (memory never binds): colocated {'faster' if ratio > 1 else 'slower'} "
                     f"than the best non-colocated layout by {max(ratio, 1 / ratio):.2f}x (modeled step)")
    cases = out.get("plan", {}).get("cases", [])
    for scenario in dict.fromkeys(c["scenario"] for c in cases):
        rows = [c for c in cases if c["scenario"] == scenario and "error" not in c]
        fit = [c for c in rows if c["fits"]]
        if not fit:
            continue
        best = min(fit, key=lambda c: c["step_s"])
        co = next((c for c in rows if c["placement"].startswith("colocated")), None)
        if best["placement"].startswith("colocated"):
            colo += 1
            parts.append(f"{scenario}: colocated wins with headroom (max {best['max_gib']:.1f} of "
                         f"{best['device_memory_gib']:.0f} GiB)")
        elif co is not None:
            squeeze += not co["fits"] or co["step_s"] > best["step_s"]
            parts.append(f"{scenario}: non-colocated wins, colocated ranks would need "
                         f"{co['max_gib']:.1f} GiB{'' if co['fits'] else ' (does not fit)'}")
    if not parts:
        return ("seed's finding not tested (it needs both the colocated `heterogeneous` layout and a "
                "non-colocated one, or the plan section)")
    verdict = "reproduced" if colo and squeeze else "partly reproduced" if colo or squeeze else "refuted"
    return f"seed's finding {verdict}: " + "; ".join(parts)


def main(argv=None) -> dict:
    ap = arg_parser(__doc__)
    ap.add_argument("--world", type=int, default=8, choices=sorted(LAYOUTS),
                    help="CPU ranks: 8 runs three layouts, 4 the two of issue 12")
    ap.add_argument("--layouts", default=None,
                    help="comma-separated subset of the world's layouts, `homogeneous` always "
                         "among them (the baseline); 8 ranks: " + ",".join(LAYOUTS[8]) + "; 4 ranks: "
                         + ",".join(LAYOUTS[4]) + "; omitted: all")
    ap.add_argument("--encoder-ranks", type=int, default=4, help="encoder island size (non_colocated)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per layout")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    ap.add_argument("--samples", type=int, default=None,
                    help="global batch size (a multiple of every module's dp); default 8 on 4 "
                         "ranks, 16 on 8")
    ap.add_argument("--text-tokens", type=int, default=96, help="text tokens per sample")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per layout before the run fails")
    ap.add_argument("--plan", choices=("full", "none"), default="full",
                    help="print plan mode's memory of the full-size recipes (full) or not")
    ap.add_argument("--plan-only", action="store_true", help="only the plan section")
    ap.add_argument("overrides", nargs="*", help="config overrides, as for train.py")
    args = ap.parse_args(argv)
    args.samples = args.samples or (16 if args.world == 8 else 8)
    if args.steps < 1 or args.warmup < 0 or args.samples < 1 or args.text_tokens < 8:
        ap.error("--steps >= 1, --warmup >= 0, --samples >= 1 and --text-tokens >= 8 are needed")
    if args.json and os.path.isdir(args.json):
        ap.error(f"--json {args.json} is a directory: give a file path")
    world = args.world
    names = list(LAYOUTS[world]) if args.layouts is None else args.layouts.split(",")
    if not set(names) <= set(LAYOUTS[world]) or "homogeneous" not in names:
        ap.error(f"--layouts {args.layouts}: choose from {list(LAYOUTS[world])}, homogeneous included")
    out = {"config": {"world": world, "steps": args.steps, "warmup": args.warmup,
                      "samples": args.samples, "text_tokens": args.text_tokens}}
    if not args.plan_only:
        from hcp.config.errors import ConfigError

        for name in names:
            try:
                _, layouts = compose(layout_overrides(world, name, args))
            except ConfigError as err:
                ap.error(f"layout {name}: {err}")
            for m, lay in layouts.items():
                if args.samples % lay.dp:
                    ap.error(f"--samples {args.samples} does not split into {name}'s {m} dp={lay.dp} lanes")
        out["config"] |= {"overrides": layout_overrides(world, "homogeneous", args), **_describe(world, args)}
        results = {}
        for name in names:
            ovr = layout_overrides(world, name, args)
            results[name] = summarize(name, _collect(world, name, ovr, args), world, ovr, args)
            print(f"{name}: " + ", ".join(f"{m} {s}" for m, s in results[name]["layouts"].items()))
        print_table(results)
        if "heterogeneous" in results:
            print("heterogeneous phases (thread CPU s, max over ranks): " + ", ".join(
                f"{k} {v:.3f}" for k, v in results["heterogeneous"]["phase_busy_s"].items()))
        text = measured_conclusion(results)
        print(text)
        out |= {"layouts": results, "conclusion_measured": text}
        if "heterogeneous" in results:
            out["critical_path_speedup"] = (results["homogeneous"]["critical_path_s"]
                                            / results["heterogeneous"]["critical_path_s"])
    if args.plan == "full" or args.plan_only:
        out["plan"] = hetero_plan.plan_section()
    out["regime"] = regime_summary(out)
    print(out["regime"])
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        write_json(args.json, out, indent=2)
    return out


if __name__ == "__main__":
    main()
