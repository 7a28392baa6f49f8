"""The model's modules as training runs them: their parameters' names and shapes (the model built
on the meta device) and the layouts they run under. Read by plan mode and by `layout=auto`'s
pricing (`hcp.preflight.auto_cost`), which must agree on both."""
from __future__ import annotations

import dataclasses

import torch

from hcp.model.encoder_side import llava_kwargs
from hcp.model.llava import LlavaModel
from hcp.plan.step import island_head


def named_shapes(specs) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """Parameter names (relative to each module) and shapes of the model of `specs`
    (`hcp.config.specs.ModuleSpecs`) built on the meta device."""
    with torch.device("meta"):  # named encoders and projectors too (h-encoders)
        model = LlavaModel(**llava_kwargs(specs))
    return {m: [(n, tuple(p.shape)) for n, p in sub.named_parameters()]
            for m, sub in model.named_children() if sub is not None}


def running_layouts(cfg, layouts) -> dict:
    """The layouts modules run under: under `non_colocated` a module sharing an encoder's island
    (the projector; `hcp.plan.step.island_head`) runs on the head's LAST stage with the head's
    TP and DP, so its grid is that stage's ranks (one stage, its own recompute; sharded when it
    or its head has dp_shard, as training shards the island's stage whole); every other module
    keeps its layout."""
    edges = [tuple(e) for e in cfg.graph.edges]
    out = {}
    for m, lay in layouts.items():
        head = m if m == "llm" else island_head(layouts, edges, m)
        h = layouts[head]
        stage_ranks = h.tp * h.cp * h.dp
        out[m] = lay if head == m else dataclasses.replace(
            h, module=m, pp=1, pp_layers=(1,), num_ranks=stage_ranks,
            rank_offset=h.rank_offset + (h.pp - 1) * stage_ranks, recompute=lay.recompute,
            dp_shard=bool(lay.dp_shard or h.dp_shard))
    return out
