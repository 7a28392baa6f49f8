"""What training can run today, checked in the launching process before ranks start.

Plan mode accepts every valid layout; training runs TP, CP (allgather or p2p) and DP inside
the LLM, with the encoder and projector computed on the LLM's lanes (replicated inside its
TP x CP group). The rest of the layout space raises `ConfigError` with what to use instead.
"""
from __future__ import annotations

from hcp.config.errors import ConfigError


def check_trainable(cfg, layouts: dict) -> None:
    """Raise ConfigError for a valid layout that training does not run yet.

    Not yet trained: pipeline parallelism, FSDP (`dp_shard`), activation recompute,
    `packing=dynamic_cp`, non-colocated placement and encoder/projector layouts that differ
    from the LLM's (they need the boundary communicators). Each can be planned with `mode=plan`.
    """
    llm = layouts["llm"]
    for m, lay in sorted(layouts.items(), key=lambda item: item[0] != "llm"):
        if lay.pp > 1:
            raise ConfigError(f"{m}.layout.pp", lay.pp, "pipeline-parallel training is not "
                              "implemented yet", "use pp=1 to train, or mode=plan to plan it")
        if lay.dp_shard:
            raise ConfigError(f"{m}.layout.dp_shard", True, "FSDP training is not implemented yet",
                              "use dp_shard=false")
        if lay.recompute != "none":
            raise ConfigError(f"{m}.layout.recompute", lay.recompute, "activation recompute is not "
                              "implemented in training yet", "use recompute=none")
        if m != "llm" and (lay.rank_offset, lay.num_ranks, lay.tp, lay.cp, lay.dp) != (
                llm.rank_offset, llm.num_ranks, llm.tp, llm.cp, llm.dp):
            raise ConfigError(f"{m}.layout", f"tp{lay.tp} cp{lay.cp} dp{lay.dp}", "training runs "
                              f"every module on the LLM's lanes (tp{llm.tp} cp{llm.cp} dp{llm.dp}) until "
                              "the boundary communicators land", f"set {m}.layout.tp={llm.tp} "
                              f"{m}.layout.cp={llm.cp}, or plan heterogeneous layouts with mode=plan")
    if cfg.packing == "dynamic_cp":
        raise ConfigError("packing", "dynamic_cp", "dynamic-CP training is not wired yet (the "
                          "planner is: benchmarks/dynamic_cp.py)", "use packing=first_fit")
