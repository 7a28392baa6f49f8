"""The run's settings outside the module graph, resolved once into typed objects.

`hcp.config.specs` types the modules; this module the choices that join keys of several
blocks: how samples are packed (`PackingSpec`) and what a run saves and starts from
(`CheckpointSpec`). A training or export rank builds them once from the validated `cfg`
(`hcp.train.trainer.Trainer`, `hcp.train.export.run_export_rank`); the layers below receive them
instead of `cfg`. Defaults come from `hcp.config.schema` only (merged when the config is
composed). Blocks that the schema types as a whole (`trainer`, `optim`, `logger`, `export`)
need no class here: `hcp.config.specs.typed` makes them instances of their schema dataclass.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PackingSpec:
    """How a global batch becomes micro-batches: `packing` (`first_fit` or `dynamic_cp`), the
    dynamic-CP cost profile (`packing_profile`), the THD capacity per rank in tokens
    (`trainer.micro_batch_tokens`) and the longest sample (`data.max_seq_len`)."""

    name: str
    profile: str
    micro_batch_tokens: int
    max_seq_len: int

    @classmethod
    def of(cls, cfg) -> PackingSpec:
        """The packing of a validated `cfg`."""
        return cls(str(cfg.packing), str(cfg.packing_profile), int(cfg.trainer.micro_batch_tokens),
                   int(cfg.data.max_seq_len))

    @property
    def dynamic_cp(self) -> bool:
        """Whether each micro-batch picks its own CP group (`hcp.dcp.policy`)."""
        return self.name == "dynamic_cp"


@dataclass(frozen=True)
class CheckpointSpec:
    """Where checkpoints go (`checkpoint.dir`, `checkpoint.keep`: how many are kept, 0 every one)
    and what a run starts from: `resume` (None, `auto` or a checkpoint folder) and
    `init_from_checkpoint` (a folder whose weights start a new stage); `asynchronous`:
    `checkpoint.async`, saves written in the background (`hcp.train.async_checkpoint`)."""

    dir: str
    keep: int
    resume: str | None
    init_from_checkpoint: str | None
    asynchronous: bool = False

    @classmethod
    def of(cls, cfg) -> CheckpointSpec:
        """The checkpointing of a validated `cfg`."""
        return cls(str(cfg.checkpoint.dir), int(cfg.checkpoint.keep), cfg.resume,
                   cfg.init_from_checkpoint, bool(cfg.checkpoint.get("async", False)))
