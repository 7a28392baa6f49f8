"""What training can run today, checked in the launching process before ranks start.

Plan mode accepts every valid layout. Training runs the LLM under TP, CP (allgather or p2p), PP
(1F1B), DP and FSDP, and the encoder side (vision encoder + projector) under its own TP and DP,
colocated on the same ranks: the step plan routes the projector's rows into the LLM's layout
(`hcp.plan`), with `packing=first_fit` or `dynamic_cp`. The rest of the layout space raises
`ConfigError` with what to use instead.
"""
from __future__ import annotations

from hcp.config.errors import ConfigError


def check_trainable(cfg, layouts: dict) -> None:
    """Raise ConfigError for a valid layout that training does not run yet.

    Not yet trained: non-colocated placement, encoder-side CP, PP (encoder PP comes with
    non-colocated placement) and FSDP, `selective` recompute outside the LLM, and tied embeddings
    across LLM stages. Each can be planned with `mode=plan`. `packing=dynamic_cp` trains under
    every LLM layout that trains (TP, PP, dp_shard, an encoder side), given a power-of-two CP
    pool that holds the longest sample (`_check_dynamic_cp_trainable`).
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
        if lay.dp_shard:
            raise ConfigError(f"{m}.layout.dp_shard", True, f"FSDP of the encoder side is not built "
                              f"yet (its weights are replicated over {m}'s DP lanes)",
                              f"set {m}.layout.dp_shard=false (llm.layout.dp_shard shards the LLM)")
        if lay.recompute == "selective":
            raise ConfigError(f"{m}.layout.recompute", lay.recompute, "selective recompute is "
                              "implemented in the LLM's decoder layers only", "use recompute=none or full")
    if cfg.packing == "dynamic_cp":
        _check_dynamic_cp_trainable(cfg, layouts)


def _check_dynamic_cp_trainable(cfg, layouts: dict) -> None:
    """`packing=dynamic_cp` regroups the LLM's CP pool (dp * cp ranks of one TP index and
    pipeline stage) per micro-batch; it trains with TP (every TP rank of a pool position runs
    the same micro-batches), PP (every stage of a pool position runs the plan's micro-batches,
    empty ones included, with its CP group of each), `llm.layout.dp_shard` (one micro-batch
    per group and round, so every micro-batch's FSDP all-gather spans the whole pool) and an
    encoder side (image rows routed to the CP rank that holds their positions). Raises
    ConfigError (`hcp.dcp.policy.check_dynamic_cp`) unless the pool is a power of two and the
    longest sample (`data.max_seq_len`) fits it at `trainer.micro_batch_tokens` per rank, head-tail
    padding counted, and `packing_profile` loads; also for placement=non_colocated (islands do not
    route into dynamic groups yet). A global batch with fewer samples than pool
    ranks trains: the ranks without a sample run empty micro-batches (no collective hangs)."""
    from hcp.dcp.policy import check_dynamic_cp

    if cfg.placement != "colocated":
        raise ConfigError("packing", "dynamic_cp", f"dynamic CP is wired and tested with "
                          f"placement=colocated only (placement={cfg.placement})",
                          "use placement=colocated with packing=dynamic_cp, or packing=first_fit")
    check_dynamic_cp(cfg, layouts["llm"])
