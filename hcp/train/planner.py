"""The step plan of a global batch from its sample indices, as one picklable object: what
`Trainer.plan` computes and, under `packing=dynamic_cp` with `trainer.plan_process=true`, what
the plan-ahead worker process runs (hcp/plan/ahead.py), so the solver's pure-Python planning never
holds the training process's GIL."""
from __future__ import annotations

from hcp.config.settings import PackingSpec
from hcp.config.specs import ModuleSpecs
from hcp.dcp.policy import dynamic_cp_policy
from hcp.plan.policies import policy
from hcp.plan.step import StepPlan, plan_step, register_policy


class StepPlanner:
    """`planner(indices) -> StepPlan` of a run (pure; the same on every rank).

    Args:
        packing: the run's `hcp.config.settings.PackingSpec`.
        specs: its `hcp.config.specs.ModuleSpecs` with layouts (the LLM's architecture, every
            module's layout, the graph's edges).
        index: `hcp.plan.lengths.LengthIndexes` of the training set (its `take(indices)`).
    """

    def __init__(self, packing: PackingSpec, specs: ModuleSpecs, index):
        self.packing, self.index = packing, index
        self.llm, self.layouts, self.edges = specs.llm.arch, specs.layouts, specs.edges
        if packing.dynamic_cp:  # this run's model and profile, whatever this process
            self._register()    # planned before (the registry is process-wide)

    def _register(self) -> None:
        register_policy("dynamic_cp", dynamic_cp_policy(self.llm, self.packing.profile))

    def __call__(self, indices) -> StepPlan:
        if self.packing.dynamic_cp:
            try:
                policy("dynamic_cp")
            except ValueError:  # a fresh worker process: register the solver there too
                self._register()
        sizes, streams = self.index.take(indices)
        return plan_step(sizes, self.layouts, self.packing.name, self.packing.micro_batch_tokens,
                         self.edges, stream_sizes=streams)
