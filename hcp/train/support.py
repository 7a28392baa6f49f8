"""What training can run today, checked in the launching process before ranks start.

Plan mode accepts every valid layout. Training runs the LLM under TP, CP (allgather or p2p), PP
(1F1B), DP and FSDP, and the encoder side (vision encoder + projector) under its own TP, CP and
DP (and FSDP over its own DP x CP group: `vision.layout.dp_shard`, `projector.layout.dp_shard`),
colocated on the same ranks: the step plan routes the projector's rows into the LLM's layout
(`hcp.plan`), with `packing=first_fit` or `dynamic_cp`; or, under `placement=non_colocated`,
one island per encoder (encoder + its projectors under the encoder's TP, CP, DP and PP: one
encoder, a join, a branch) before the LLM island (`hcp.train.islands`). The rest of the layout space
raises `ConfigError` with what to use instead.
"""
from __future__ import annotations

from hcp.config.errors import ConfigError


def check_trainable(cfg, specs) -> None:
    """Raise ConfigError for a valid layout that training does not run yet (each can still be
    planned with `mode=plan`; `specs`: `hcp.config.specs.ModuleSpecs` with layouts): a pooling
    projector (`pool` > 1) behind encoder CP, encoder PP under colocated placement, what
    `_check_several_encoders_trainable` refuses, under non_colocated a projector unlike its island
    or on an island of its own or a fully frozen island (`_check_islands_trainable`), `selective`
    recompute outside the LLM, tied embeddings across LLM stages, and under `packing=dynamic_cp` a
    cost profile that does not load (`check_profile`)."""
    layouts = specs.layouts
    llm = layouts["llm"]
    check_profile(cfg)
    _check_several_encoders_trainable(cfg, specs)
    _check_encoder_cp_trainable(specs)
    if cfg.placement == "non_colocated":
        _check_islands_trainable(cfg, specs)
    if llm.pp > 1 and specs.llm.arch.tie_embeddings:
        raise ConfigError("llm.tie_embeddings", True, f"the embedding (first of {llm.pp} pipeline "
                          "stages) and the LM head (last stage) cannot share one table",
                          "set llm.tie_embeddings=false, or llm.layout.pp=1")
    for m, lay in layouts.items():
        if m == "llm":
            continue
        if lay.pp > 1 and cfg.placement == "colocated":
            raise ConfigError(f"{m}.layout.pp", lay.pp, f"{m} runs whole on every rank of its lane "
                              "(encoder pipelines come with placement=non_colocated)",
                              f"use {m}.layout.pp=1 (more {m}.layout.dp or tp), or mode=plan to "
                              f"plan it")
        if lay.recompute == "selective":
            raise ConfigError(f"{m}.layout.recompute", lay.recompute, "selective recompute is "
                              "implemented in the LLM's decoder layers only",
                              "use recompute=none or full")


def _check_encoder_cp_trainable(specs) -> None:
    """Encoder CP (`<encoder>.layout.cp` > 1) trains behind per-row projectors only: a projector
    with `pool` > 1 averages windows of the whole patch grid, which the CP ranks hold in chunks."""
    for s in specs.streams:
        enc, proj = specs[s.encoder], specs[s.projector]
        cp, pool = enc.layout.cp, proj.pool
        if cp > 1 and pool > 1:
            raise ConfigError(f"{proj.key}.pool", pool, f"its windows span the patch grid that "
                              f"{enc.key}.layout.cp={cp} splits over CP ranks",
                              f"set {proj.key}.pool=1, or {enc.key}.layout.cp=1 (more dp or tp)")


def _check_several_encoders_trainable(cfg, specs) -> None:
    """Several encoders or streams (joins, branches: `hcp.config.modules`) train colocated, each
    encoder at its own TP/DP layout (`hcp.train.encoders`), or non_colocated, each encoder on its
    own island (`hcp.train.islands`, checked by `_check_islands_trainable`); the rest raises
    ConfigError: (colocated) FSDP of the encoder side, a named encoder's `init_from`, and
    (colocated) encoder recompute that differs between encoders (the colocated step recomputes
    the whole encoder side)."""
    if not specs.several_streams:
        return
    layouts = specs.layouts
    for spec in specs:
        m, key = spec.name, spec.key
        if m == "llm":
            continue
        if cfg.placement == "colocated" and layouts[m].dp_shard:
            raise ConfigError(f"{key}.layout.dp_shard", True,
                              "FSDP of the encoder side is built for "
                              "LLaVA's one encoder and projector",
                              f"set {key}.layout.dp_shard=false")
        if m != "vision" and spec.kind == "encoder" and spec.init_from:
            raise ConfigError(f"{key}.init_from", spec.init_from, "weights are loaded for "
                              "`vision` and `llm` only",
                              f"remove {key}.init_from (it would be ignored)")
        if cfg.placement == "colocated" and layouts[m].recompute != layouts["vision"].recompute:
            raise ConfigError(f"{key}.layout.recompute", layouts[m].recompute, "the colocated step "
                              "recomputes the whole encoder side or none of it "
                              f"(vision.layout.recompute={layouts['vision'].recompute})",
                              f"set it to {layouts['vision'].recompute}")


def _check_islands_trainable(cfg, specs) -> None:
    """`placement=non_colocated` trains one island per encoder (the encoder with the projectors
    it feeds, under the encoder's TP, DP and PP) and the LLM island (`hcp.train.islands`): one
    encoder, a join of several, a branch; the rest raises ConfigError."""
    from hcp.config.spans import projector_island_error
    from hcp.plan.step import island_head

    layouts, edges = specs.layouts, specs.edges
    heads = list(dict.fromkeys(island_head(layouts, edges, m) for m in layouts if m != "llm"))
    if not heads:
        raise ConfigError("placement", "non_colocated", "a text-only LLM has no encoder island "
                          "to place apart", "use placement=colocated")
    for head in heads:
        if specs[head].kind != "encoder":
            raise projector_island_error(cfg, head)
    for head in heads:
        members = [m for m in layouts if m != "llm" and island_head(layouts, edges, m) == head]
        for m in members:
            lay, key = layouts[m], specs[m].key
            if (m != head and (lay.tp != layouts[head].tp or lay.pp != 1
                               or lay.cp not in (1, layouts[head].cp))):
                raise ConfigError(f"{key}.layout.tp", lay.tp, f"{m} runs on the last stage of "
                                  f"{head}'s island with {head}'s TP and CP groups "
                                  f"(tp={layouts[head].tp}, cp={layouts[head].cp})",
                                  f"set {key}.layout.tp={layouts[head].tp}, "
                                  f"its cp to 1 or {layouts[head].cp} and its pp to 1")
            if m != head and lay.recompute not in ("none", layouts[head].recompute):
                raise ConfigError(f"{key}.layout.recompute", lay.recompute, f"{m} runs inside "
                                  f"{head}'s last stage, which recomputes as {head} says "
                                  f"(recompute={layouts[head].recompute})",
                                  f"set {specs[head].key}.layout.recompute={lay.recompute} "
                                  f"for the island, or {key}.layout.recompute=none")
            if m != head and lay.dp_shard and not layouts[head].dp_shard:
                raise ConfigError(f"{key}.layout.dp_shard", True, f"{m} runs inside {head}'s last "
                                  f"stage, which shards (FSDP) as {head} says (dp_shard=false)",
                                  f"set {specs[head].key}.layout.dp_shard=true for the island, "
                                  f"or {key}.layout.dp_shard=false")
        for island in (members, ["llm"]):
            if all(specs[m].freeze for m in island):
                raise ConfigError(f"{specs[island[0]].key}.freeze", True, f"every module of the "
                                  f"island {island} is frozen: its ranks would have nothing to "
                                  f"train",
                                  "use placement=colocated for this stage (e.g. LLaVA pretraining)")


def check_profile(cfg) -> None:
    """Under `packing=dynamic_cp`: ConfigError naming `packing_profile` unless the solver's cost
    profile loads (`hcp.dcp.policy.check_dynamic_cp`). Training and plan mode both run it as
    an error (a missing file is not a layout to plan)."""
    if cfg.packing == "dynamic_cp":
        from hcp.dcp.policy import check_dynamic_cp

        check_dynamic_cp(cfg)
