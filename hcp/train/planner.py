"""The step plan of a global batch from its sample indices, as one picklable object: what
`Trainer.plan` computes and, under `packing=dynamic_cp` with `trainer.plan_process=true`, what
the plan-ahead worker process runs (hcp/plan/ahead.py), so the solver's pure-Python planning never
holds the training process's GIL."""
from __future__ import annotations

from hcp.dcp.policy import dynamic_cp_policy
from hcp.plan.policies import policy
from hcp.plan.step import StepPlan, plan_step, register_policy


class StepPlanner:
    """`planner(indices) -> StepPlan` of the run `cfg` (pure; the same on every rank).

    Args:
        cfg: the run's config (packing, packing_profile, llm, trainer.micro_batch_tokens).
        layouts: module -> `hcp.config.layouts.ResolvedLayout`.
        index: `hcp.plan.lengths.LengthIndexes` of the training set (its `take(indices)`).
        edges: the module graph's edges `(src, dst)`.
    """

    def __init__(self, cfg, layouts: dict, index, edges: tuple):
        self.packing, self.mbt = cfg.packing, cfg.trainer.micro_batch_tokens
        self.llm_cfg, self.profile = cfg.llm, cfg.packing_profile
        self.layouts, self.index, self.edges = layouts, index, edges
        if self.packing == "dynamic_cp":  # this run's model and profile, whatever this process
            self._register()              # planned before (the registry is process-wide)

    def _register(self) -> None:
        register_policy("dynamic_cp", dynamic_cp_policy(self.llm_cfg, self.profile))

    def __call__(self, indices) -> StepPlan:
        if self.packing == "dynamic_cp":
            try:
                policy("dynamic_cp")
            except ValueError:  # a fresh worker process: register the solver there too
                self._register()
        sizes, streams = self.index.take(indices)
        return plan_step(sizes, self.layouts, self.packing, self.mbt, self.edges,
                         stream_sizes=streams)
