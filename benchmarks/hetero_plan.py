"""Plan mode's per-rank memory of full-size heterogeneous recipes in both placements, with an
estimated step, and the regime conclusion (the plan section of `benchmarks/hetero.py`).

Cases (`CASES`): `+recipe=llava_hetero` (CLIP ViT-L/14-336 + LLaMA-13B on 64 H100s) colocated
and non-colocated (the recipe's own alternative), and `+recipe=internvit6b_llama70b` (a 6B
encoder + a 70B LLM on 160 H100s) colocated and non-colocated, each also with the encoder state
replicated over its DP lanes (`dp_shard=false`: the encoder FSDP that training lacks today).
Per case: the LLM and encoder layouts, the largest per-rank memory (`hcp.preflight.plan_mode.memory_per_rank`:
a rank holds only its island's modules) on encoder-only ranks and on LLM ranks, whether it fits
`cluster.device_memory_gib`, plan mode's LLM step estimate and bubble (`hcp.preflight.estimate`),
and the encoder's seconds per rank: its training FLOPs (`hetero_rank.encoder_flops`; 4/3 of
them again under recompute) for the images of one lane per step (`global_batch / dp *
data.images_per_sample`) at the H100 profile's peak x matmul efficiency. Step estimate:
colocated = LLM step + encoder seconds (the three phases run one after the other); non-colocated
= max(LLM step, encoder seconds) + one encoder micro-batch through the encoder's pp stages (the
island fills the pipeline first), assuming the encoder lanes work concurrently (the measured
block-lane caveat of `benchmarks/hetero.py`). The LLM estimate is plan mode's: text lengths
from its length sample, so it does not grow with the images per sample.
"""
from __future__ import annotations

import math

from hetero_rank import encoder_flops

NON_COLOCATED_13B = ["placement=non_colocated", "vision.layout.num_ranks=16", "llm.layout.pp=3",
                     "llm.layout.pp_layers=[13,14,13]"]
NON_COLOCATED_70B = ["placement=non_colocated", "vision.layout.num_ranks=32", "vision.layout.recompute=none"]
ENCODER_PP4 = ["vision.layout.pp=4", "vision.layout.pp_layers=[12,11,11,11]"]
REPLICATED = ["vision.layout.dp_shard=false", "projector.layout.dp_shard=false"]
BIG = "internvit6b_llama70b"
CASES = [  # (scenario, recipe, placement label, overrides)
    ("llava_hetero (0.3B ViT + 13B)", "llava_hetero", "colocated", []),
    ("llava_hetero (0.3B ViT + 13B)", "llava_hetero", "non_colocated", NON_COLOCATED_13B),
    ("6B ViT + 70B, encoder FSDP", BIG, "colocated", []),
    ("6B ViT + 70B, encoder FSDP", BIG, "non_colocated", NON_COLOCATED_70B),
    ("6B ViT + 70B, encoder replicated", BIG, "colocated", REPLICATED),
    ("6B ViT + 70B, encoder replicated", BIG, "non_colocated, enc. pp4", [*NON_COLOCATED_70B, *REPLICATED, *ENCODER_PP4]),
    ("6B ViT + 70B, 4 images/sample", BIG, "colocated", ["data.images_per_sample=4"]),
    ("6B ViT + 70B, 4 images/sample", BIG, "non_colocated, enc. pp4", [*NON_COLOCATED_70B, *ENCODER_PP4, "data.images_per_sample=4"]),
]
"""Encoder replicated: `dp_shard=false`, the encoder state on every rank of its lanes (training
has no encoder FSDP yet); colocated cannot pipeline the encoder, an island can (`ENCODER_PP4`)."""


def _lay(lay) -> str:
    return (f"tp{lay.tp} cp{lay.cp} pp{lay.pp} dp{lay.dp}{' fsdp' if lay.dp_shard else ''} "
            f"r{lay.rank_offset}-{lay.rank_offset + lay.num_ranks - 1}")


def plan_case(recipe: str, overrides) -> dict:
    """One case's figures (module docstring). A layout plan mode rejects gives {"error": ...}."""
    from hcp.config.compose import compose_config
    from hcp.config.errors import ConfigError
    from hcp.config.layouts import check_layouts, world_size_of
    from hcp.dcp.hardware import load_profile
    from hcp.parallel.roles import role_table
    from hcp.preflight.estimate import estimate_step
    from hcp.preflight.plan_mode import memory_per_rank, stage_memory

    cfg = compose_config([f"+recipe={recipe}", "mode=plan", *overrides])
    world = world_size_of(cfg)
    try:
        layouts = check_layouts(cfg, world)
    except ConfigError as err:
        return {"error": str(err)}
    stage_mem = stage_memory(cfg, layouts)
    mem = memory_per_rank(cfg, layouts, world, stage_mem)
    roles = role_table(layouts, world)
    enc_only = [m["total"] for m, r in zip(mem, roles) if "llm" not in r.modules]
    llm_ranks = [m["total"] for m, r in zip(mem, roles) if "llm" in r.modules]
    llm, vis = layouts["llm"], layouts["vision"]
    est = estimate_step(cfg, llm, world, [s.params for s in stage_mem["llm"]])
    hw = load_profile("h100")
    images = cfg.trainer.global_batch_size / vis.dp * float(cfg.data.images_per_sample)
    recompute = 4 / 3 if vis.recompute == "full" else 1.0
    enc_s = encoder_flops(cfg.vision, cfg.llm.hidden_size, images) * recompute / (vis.tp * vis.pp) / (
        hw.peak_flops * hw.matmul_efficiency)
    if cfg.placement == "non_colocated":
        patches = (cfg.vision.image_size // cfg.vision.patch_size) ** 2
        per_micro = min(images, max(1, cfg.trainer.micro_batch_tokens * llm.cp // patches))
        step = max(est["step_time_s"], enc_s) + enc_s * vis.pp / math.ceil(images / per_micro)
    else:
        step = est["step_time_s"] + enc_s
    cap = float(cfg.cluster.device_memory_gib)
    worst = max(m["total"] for m in mem)
    return {"world": world, "llm_layout": _lay(llm), "encoder_layout": _lay(vis),
            "encoder_rank_max_gib": max(enc_only) if enc_only else None,
            "llm_rank_max_gib": max(llm_ranks), "llm_rank_min_gib": min(llm_ranks),
            "max_gib": worst, "fits": worst <= cap, "device_memory_gib": cap,
            "llm_step_s": est["step_time_s"], "llm_bubble": est["bubble_fraction"],
            "encoder_s": enc_s, "step_s": step,
            "samples_per_s": cfg.trainer.global_batch_size / step}


def conclusion(rows: dict) -> str:
    """Per scenario: the fastest case that fits, and the LLM ranks' memory both ways."""
    lines = []
    for scenario in dict.fromkeys(k[0] for k in rows):
        cases = {k[1]: v for k, v in rows.items() if k[0] == scenario and "error" not in v}
        fit = {p: v for p, v in cases.items() if v["fits"]}
        mem = ", ".join(f"{p} {v['max_gib']:.1f} GiB{'' if v['fits'] else ' (does not fit)'}"
                        for p, v in cases.items())
        if not fit:
            lines.append(f"{scenario}: nothing fits ({mem})")
            continue
        best = min(fit, key=lambda p: fit[p]["step_s"])
        rest = ", ".join(f"{p} {v['step_s']:.2f} s" for p, v in fit.items() if p != best)
        lines.append(f"{scenario}: {best} wins, est. step {fit[best]['step_s']:.2f} s"
                     f"{' vs ' + rest if rest else ' (the only one that fits)'}; max per-rank memory {mem}")
    return "\n".join(lines)


def plan_section(cases=CASES) -> dict:
    """Print the memory table and the conclusion; return {"cases": [...], "conclusion": text}."""
    rows = {(sc, p): plan_case(r, o) for sc, r, p, o in cases}
    print("plan mode, full size (per-rank memory GiB: max on encoder-only ranks / on LLM ranks; "
          "estimates: H100 profile)")
    print(f"{'scenario':<33} {'placement':<24} {'ranks':>5} {'LLM layout':<25} {'encoder layout':<28} "
          f"{'enc GiB':>7} {'LLM GiB':>7} {'fits':>4} {'LLM s':>6} {'bubble':>6} {'enc s':>6} {'step s':>6}")
    for (scenario, placement), v in rows.items():
        if "error" in v:
            print(f"{scenario:<33} {placement:<24} invalid: {v['error']}")
            continue
        enc = "-" if v["encoder_rank_max_gib"] is None else f"{v['encoder_rank_max_gib']:.1f}"
        print(f"{scenario:<33} {placement:<24} {v['world']:>5} {v['llm_layout']:<25} {v['encoder_layout']:<28} "
              f"{enc:>7} {v['llm_rank_max_gib']:7.1f} {'yes' if v['fits'] else 'NO':>4} "
              f"{v['llm_step_s']:6.2f} {v['llm_bubble']:6.1%} {v['encoder_s']:6.2f} {v['step_s']:6.2f}")
    text = conclusion(rows)
    print(text)
    return {"cases": [{"scenario": sc, "placement": p, **v} for (sc, p), v in rows.items()],
            "conclusion": text}
