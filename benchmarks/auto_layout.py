"""Does `layout=auto` pick a fast layout? Real 8-rank training of the layouts its search ranks,
against its predictions (issue 27 section 2).

    python benchmarks/auto_layout.py --json auto.json             # 4 layouts x 4 variants
    python benchmarks/auto_layout.py --profile profile.yaml       # a `mode=calibrate` profile
    python benchmarks/auto_layout.py --layouts 0                  # every layout the search ranks (slow)

For each variant of `+recipe=llava_tiny_hetero` (`VARIANTS`: the recipe; a much larger encoder;
much longer text; and `HELD_OUT`, one not looked at while tuning, reported apart) on
`--world` local gloo ranks: the search (`hcp.train.auto_layout.search`) ranks every layout of
its space with `PINS` held (no recompute, no FSDP: they change memory, not the CPU time
measured here) under `--profile` (`benchmarks/cpu_profile.yaml`: a rough CPU profile whose
comments say what is measured and what guessed); `--layouts N` of them are trained: the
predicted best plus an even spread over the rest of the ranking (0: all). Each runs the real trainer on freshly forked ranks (the same
data, seed and batch), `--warmup` steps, then `--steps` timed ones; its measured step is the
mean wall `step_time_s` of the timed steps (metrics.jsonl). Reported per variant: the auto
choice's measured step over the best measured one (target <= 1.10) and the Spearman rank
correlation of predicted and measured steps (target >= 0.8). Caveat: on a machine with fewer
cores than ranks wall time sums the ranks' work instead of following the critical path the
estimate models; on shared cores it is also noisy (run once, read as such).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

RUN = ["logger=none", "trainer.progress_bar=false", "trainer.log_every=1", "trainer.eval_samples=1"]
PINS = ["vision.layout.recompute=none", "vision.layout.dp_shard=false", "llm.layout.recompute=none",
        "llm.layout.dp_shard=false"]
VARIANTS = {
    "llava_tiny_hetero": [],
    "large_encoder": ["vision.image_size=16", "vision.hidden_size=128", "vision.num_layers=4",
                      "vision.ffn_hidden_size=512"],
    "long_text": ["data.system_prompt=" + "A chat between a curious user and an assistant. " * 8,
                  "data.max_seq_len=512", "trainer.micro_batch_tokens=1024"],
}
HELD_OUT = {"wide_llm": ["llm.hidden_size=256", "llm.ffn_hidden_size=768", "llm.num_layers=4"]}
"""Not looked at while tuning the search or this benchmark."""


def _rank(payload) -> None:
    from omegaconf import OmegaConf

    from hcp.train.trainer import run_rank

    container, run_dir = payload
    run_rank(OmegaConf.create(container), run_dir)


def measure(cfg, world: int, run_dir: str, steps: int) -> float:
    """Mean wall seconds of the timed steps of `cfg` trained on `world` forked local ranks."""
    from omegaconf import OmegaConf

    from hcp.data.build import prepare_data
    from hcp.train.launch import start_local_ranks

    os.makedirs(run_dir, exist_ok=True)
    prepare_data(cfg)
    container = OmegaConf.to_container(cfg, resolve=True)
    start_local_ranks(_rank, world, (container, run_dir), "fork")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        times = [json.loads(line)["step_time_s"] for line in f if "step_time_s" in line]
    return sum(times[-steps:]) / steps


def _spread(n_total: int, n: int) -> list[int]:
    """Indices of the ranking to train: 0 (the auto choice) and an even spread to the last."""
    if n <= 0 or n >= n_total:
        return list(range(n_total))
    return sorted({round(k * (n_total - 1) / (n - 1)) for k in range(n)}) if n > 1 else [0]


def run_variant(name: str, overrides: list[str], args) -> dict:
    """One variant's measurements and figures (module docstring)."""
    import copy

    from omegaconf import OmegaConf
    from scipy.stats import spearmanr

    from hcp.config.compose import compose_config
    from hcp.train.auto_layout import apply_layout, describe, search
    from hcp.train.auto_space import pinned_fields

    cli = ["+recipe=llava_tiny_hetero", f"launcher.nproc_per_node={args.world}", *RUN, *PINS, *overrides,
           f"trainer.max_steps={args.warmup + args.steps}", f"packing_profile={args.profile}"]
    cfg = compose_config(cli, run_dir=os.path.join(args.out, name))
    OmegaConf.resolve(cfg)
    t0 = time.perf_counter()
    result = search(cfg, args.world, pinned_fields(cfg, PINS), top=10**6, prune=False)
    search_s = time.perf_counter() - t0
    picks = _spread(len(result.ranked), args.layouts)
    rows = []
    for k in picks:
        cand, score = result.ranked[k]
        trial = copy.deepcopy(cfg)
        apply_layout(trial, cand)
        run_dir = os.path.join(args.out, name, f"rank{k}")
        trial.checkpoint.dir = os.path.join(run_dir, "checkpoints")
        measured = measure(trial, args.world, run_dir, args.steps)
        rows.append({"predicted_rank": k + 1, "placement": cand.placement, "layout": describe(cand),
                     "predicted_s": score.step_time_s, "measured_s": measured})
        print(f"  {name}: #{k + 1} {cand.placement} {describe(cand)} predicted {score.step_time_s:.4g} s, "
              f"measured {measured:.4g} s", flush=True)
    best = min(r["measured_s"] for r in rows)
    rho = float(spearmanr([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows])[0]) \
        if len(rows) > 2 else float("nan")
    return {"name": name, "auto_over_best": rows[0]["measured_s"] / best, "rank_correlation": rho,
            "layouts_measured": len(rows), "layouts_ranked": len(result.ranked),
            "search_s": search_s, "rows": rows}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=8, help="local gloo ranks")
    p.add_argument("--layouts", type=int, default=4, help="layouts trained per variant (0: all ranked)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per layout")
    p.add_argument("--steps", type=int, default=2, help="timed steps per layout")
    p.add_argument("--profile", default=os.path.join(HERE, "cpu_profile.yaml"),
                   help="packing_profile of the predictions (h100: the analytic H100 defaults)")
    p.add_argument("--variants", nargs="*", default=None, help="names to run (default: all)")
    p.add_argument("--out", default="/tmp/hcp-auto-layout-bench", help="run directories of the trained layouts")
    p.add_argument("--json", default=None, help="write {'variants': [...]} here")
    args = p.parse_args(argv)
    start = time.perf_counter()
    todo = {**VARIANTS, **HELD_OUT}
    out = []
    for name, overrides in todo.items():
        if args.variants and name not in args.variants:
            continue
        out.append(run_variant(name, overrides, args))
    print(f"\nauto_layout benchmark: {args.world} ranks, {args.warmup} warm-up + {args.steps} timed steps, "
          f"profile {args.profile}, {time.perf_counter() - start:.0f} s wall")
    print(f"  {'variant':<20} {'auto/best':>9} {'rank corr':>9} {'measured':>8} {'ranked':>6}  target <= 1.10, >= 0.8")
    for v in out:
        tag = " (held out)" if v["name"] in HELD_OUT else ""
        print(f"  {v['name']:<20} {v['auto_over_best']:>9.3f} {v['rank_correlation']:>9.2f} "
              f"{v['layouts_measured']:>8} {v['layouts_ranked']:>6}{tag}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"variants": out}, f, indent=1)


if __name__ == "__main__":
    main()
