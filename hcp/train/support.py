"""What training can run today, checked in the launching process before ranks start.

Plan mode accepts every valid layout; training runs TP, CP (allgather or p2p), PP (1F1B) and DP
inside the LLM, with the encoder and projector computed on the LLM's lanes (replicated inside
its TP x CP group; under PP on its first stage, colocated with the embedding). The rest of the
layout space raises `ConfigError` with what to use instead.
"""
from __future__ import annotations

from hcp.config.errors import ConfigError


def check_trainable(cfg, layouts: dict) -> None:
    """Raise ConfigError for a valid layout that training does not run yet.

    Not yet trained: FSDP and activation recompute set on modules other than the LLM (the
    LLM's `dp_shard` shards the encoder and projector with it), `packing=dynamic_cp`,
    non-colocated placement, pipelines of modules other than the LLM, tied embeddings across
    LLM stages, and encoder/projector layouts that differ from the LLM's lanes (they need the
    boundary communicators). Each can be planned with `mode=plan`.
    """
    llm = layouts["llm"]
    if cfg.placement == "non_colocated":
        raise ConfigError("placement", "non_colocated", "training on islands needs the boundary "
                          "communicators, which are not built yet", "train with placement=colocated, "
                          "or plan islands with mode=plan")
    if llm.pp > 1 and cfg.llm.tie_embeddings:
        raise ConfigError("llm.tie_embeddings", True, f"the embedding (first of {llm.pp} pipeline "
                          "stages) and the LM head (last stage) cannot share one table",
                          "set llm.tie_embeddings=false, or llm.layout.pp=1")
    for m, lay in layouts.items():
        if m == "llm":
            continue
        if lay.pp > 1:
            raise ConfigError(f"{m}.layout.pp", lay.pp, f"{m} runs whole on the LLM's first "
                              "pipeline stage", f"use {m}.layout.pp=1, or mode=plan to plan it")
        if lay.dp_shard:
            raise ConfigError(f"{m}.layout.dp_shard", True, f"{m} runs on the LLM's lanes and is "
                              "sharded with it", f"set llm.layout.dp_shard=true and {m}.layout.dp_shard=false")
        if lay.recompute != "none":
            raise ConfigError(f"{m}.layout.recompute", lay.recompute, "activation recompute is "
                              "implemented in the LLM's decoder layers only", "use recompute=none")
    others = [m for m, lay in layouts.items() if m != "llm" and (lay.tp, lay.cp, lay.dp) != (
        llm.tp, llm.cp, llm.dp * llm.pp)]
    if others:
        lay = layouts[others[0]]
        raise ConfigError(f"{others[0]}.layout", f"tp{lay.tp} cp{lay.cp} dp{lay.dp}", "training runs "
                          f"every module on the LLM's lanes (tp{llm.tp} cp{llm.cp}) until the boundary "
                          "communicators land", " ".join(f"{m}.layout.tp={llm.tp} {m}.layout.cp={llm.cp}"
                                                         for m in others) + " (or mode=plan)")
    if cfg.packing == "dynamic_cp":
        raise ConfigError("packing", "dynamic_cp", "dynamic-CP training is not wired yet (the "
                          "planner is: benchmarks/dynamic_cp.py)", "use packing=first_fit")
