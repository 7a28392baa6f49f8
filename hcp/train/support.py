"""What training can run today, checked in the launching process before ranks start.

Plan mode accepts every valid layout. Training runs the LLM under TP, CP (allgather or p2p), PP
(1F1B), DP and FSDP, and the encoder side (vision encoder + projector) under its own TP and DP
(and FSDP over its own DP group: `vision.layout.dp_shard`, `projector.layout.dp_shard`),
colocated on the same ranks: the step plan routes the projector's rows into the LLM's layout
(`hcp.plan`). The rest of the layout space raises `ConfigError` with what to use instead.
"""
from __future__ import annotations

from hcp.config.errors import ConfigError


def check_trainable(cfg, layouts: dict) -> None:
    """Raise ConfigError for a valid layout that training does not run yet.

    Not yet trained: non-colocated placement, encoder-side CP and PP (encoder PP comes with
    non-colocated placement), `selective` recompute outside the LLM, tied embeddings across LLM
    stages, and `packing=dynamic_cp` beyond a text-only LLM with tp = 1, pp = 1 and no
    dp_shard. Each can be planned with `mode=plan`.
    """
    llm = layouts["llm"]
    if cfg.placement == "non_colocated":
        raise ConfigError("placement", "non_colocated", "training on islands needs the non-colocated "
                          "boundary communicators, which are not built yet", "train with "
                          "placement=colocated, or plan islands with mode=plan")
    if llm.pp > 1 and cfg.llm.tie_embeddings:
        raise ConfigError("llm.tie_embeddings", True, f"the embedding (first of {llm.pp} pipeline "
                          "stages) and the LM head (last stage) cannot share one table",
                          "set llm.tie_embeddings=false, or llm.layout.pp=1")
    for m, lay in layouts.items():
        if m == "llm":
            continue
        if lay.pp > 1:
            raise ConfigError(f"{m}.layout.pp", lay.pp, f"{m} runs whole on every rank of its lane "
                              "(encoder pipelines come with placement=non_colocated)",
                              f"use {m}.layout.pp=1 (more {m}.layout.dp or tp), or mode=plan to plan it")
        if lay.cp > 1:
            raise ConfigError(f"{m}.layout.cp", lay.cp, f"{m} does not split images over CP ranks "
                              "(its rows are routed to the LLM's CP shards instead)",
                              f"use {m}.layout.cp=1 and more {m}.layout.dp or tp")
        if lay.recompute == "selective":
            raise ConfigError(f"{m}.layout.recompute", lay.recompute, "selective recompute is "
                              "implemented in the LLM's decoder layers only", "use recompute=none or full")
    if cfg.packing == "dynamic_cp":
        _check_dynamic_cp_trainable(cfg, layouts)


def _check_dynamic_cp_trainable(cfg, layouts: dict) -> None:
    """`packing=dynamic_cp` trains a text-only LLM with tp = 1, pp = 1 and plain DP (its CP
    pool dp * cp regrouped per micro-batch); the rest raises ConfigError, then the pool and
    the longest sample are checked (`hcp.dcp.policy.check_dynamic_cp`)."""
    from hcp.dcp.policy import check_dynamic_cp

    llm = layouts["llm"]
    why = "dynamic-CP training is wired for a text-only LLM with tp=1, pp=1 and no dp_shard"
    for field, value, ok in (("llm.layout.tp", llm.tp, 1), ("llm.layout.pp", llm.pp, 1),
                             ("llm.layout.dp_shard", bool(llm.dp_shard), False)):
        if value != ok:
            raise ConfigError(field, value, why, f"set {field}={str(ok).lower()} with "
                              "packing=dynamic_cp, or use packing=first_fit")
    others = [m for m in layouts if m != "llm"]
    if others:
        raise ConfigError("packing", "dynamic_cp", f"{why} (this model also has {others})",
                          "use packing=first_fit for a model with an encoder side")
    check_dynamic_cp(cfg, llm)
