"""Whether the layouts of a module-graph edge can be joined (checked at validation, before ranks).

Colocated LLaVA runs the encoder side (vision encoder, then projector) on its own layout and
routes the projector's rows into the LLM's layout (the step plan, `hcp.plan`). The projector follows
its encoder on the same ranks with no route between them, so the two must share one layout. The
other join rules live with the layouts (`hcp.config.layouts`): DP sizes of an edge divide one
another (lanes map in blocks), every module's dp divides the global batch, and under `colocated`
every module spans all ranks (so the encoder's ranks cover the LLM's).
"""
from __future__ import annotations

from hcp.config.errors import ConfigError
from hcp.config.modules import kind, module_key


def _describe(lay) -> str:
    return f"{lay.module}.layout tp{lay.tp} cp{lay.cp} pp{lay.pp} dp{lay.dp}"


def check_joins(cfg, layouts: dict) -> None:
    """Raise ConfigError when an encoder -> projector edge joins two different layouts, or the
    encoder asks for PP (colocated encoders run whole; their pipelines run on islands).

    The error names both layouts and the overrides that make the projector's equal the encoder's.
    """
    if cfg.placement != "colocated":
        return
    for src, dst in (tuple(e) for e in cfg.graph.edges):
        if kind(cfg, src) != "encoder" or kind(cfg, dst) != "projector":
            continue
        a, b = layouts[src], layouts[dst]
        if a.pp > 1:  # the projector would need a.pp stages of its own: not a layout to fix
            skey = module_key(cfg, src)
            raise ConfigError(f"{skey}.layout.pp", a.pp,
                              f"under placement=colocated {src} runs whole "
                              f"on every rank of its lane, its projector right after it; encoder "
                              f"pipelines run on their own island", f"set placement=non_colocated "
                              f"with {skey}.layout.num_ranks=N (its island), or {skey}.layout.pp=1")
        if (a.tp, a.cp, a.pp, a.dp) != (b.tp, b.cp, b.pp, b.dp):
            key = module_key(cfg, dst)
            fix = " ".join(f"{key}.layout.{k}={getattr(a, k)}" for k in ("tp", "cp", "pp", "dp")
                           if getattr(a, k) != getattr(b, k))
            raise ConfigError(f"{key}.layout", f"tp{b.tp} cp{b.cp} pp{b.pp} dp{b.dp}",
                              f"edge {src}->{dst} joins {_describe(a)} and {_describe(b)}; the "
                              f"projector runs right after {src} on the same ranks, without a "
                              f"route between them",
                              f"give it {src}'s layout: {fix}")
