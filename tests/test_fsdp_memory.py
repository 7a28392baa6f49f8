"""What FSDP (`dp_shard`) holds, as plan mode charges it (hcp/preflight/memory.py) and as
`trainer.fsdp_reduce` decides it (hcp/train/fsdp.py): a rehearsal of a sharded LLM with several
micro-batches per step agrees with plan mode on every role, under both policies."""
from __future__ import annotations

import pytest

WIDE = ["+recipe=llama_tiny", "trainer.global_batch_size=16", "trainer.micro_batch_tokens=512",
        "llm.hidden_size=1024", "llm.ffn_hidden_size=2816", "llm.num_heads=8", "llm.num_kv_heads=8",
        "llm.num_layers=4", "llm.layout.dp=2", "llm.layout.pp=2", "llm.layout.dp_shard=true"]
"""Two LLM layers of width 1024 per stage, sharded over DP 2, eight micro-batches per lane."""


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("reduce, precision", [("per_micro_batch", "fp32"), ("per_step", "fp32"),
                                               ("per_step", "bf16")])
def test_rehearsal_of_a_sharded_llm_with_micro_batches_agrees_with_plan_mode(tmp_path, reduce,
                                                                             precision):
    """One rank of each role (PP stage 0 and 1) rehearsed for one step: its tracked peak within
    20% of plan mode's estimate (before issue 39 plan mode charged only the gradient shard and
    none of FSDP's all-gathered weights: 0.67 and 0.55 of the tracked peaks). Each backward's
    reduce-scatters are recorded: one per FSDP unit and micro-batch under `per_micro_batch`,
    one per unit under `per_step`. Under bf16 the layers gather in bf16 and `per_step`
    accumulates in fp32."""
    from hcp.config.layouts import resolve_layouts, world_size_of
    from hcp.data.build import prepare_data
    from hcp.parallel.roles import role_table
    from hcp.preflight.memory import GIB
    from hcp.preflight.plan_mode import memory_per_rank, running_layouts
    from hcp.preflight.rehearse.runner import rehearsal_config, rehearse_rank
    from tests.cfg_utils import compose_cfg, with_specs

    cfg = compose_cfg(["mode=rehearse", "logger=none", *WIDE, f"trainer.fsdp_reduce={reduce}",
                       f"precision={precision}"],
                      run_dir=str(tmp_path))
    list(prepare_data(*with_specs(cfg)))
    world = world_size_of(cfg, 4)
    layouts = resolve_layouts(cfg, world)
    roles = role_table(running_layouts(cfg, layouts), world)
    reps = {role.stage("llm"): role.rank for role in roles}
    assert sorted(reps) == [0, 1]
    for stage, rank in sorted(reps.items()):
        res = rehearse_rank(rehearsal_config(cfg), str(tmp_path), rank, world, 1)
        assert res.error is None, res.error
        micro = len(res.micro_batches)
        assert micro > 1 and max(res.step_worth) > 1
        rows = memory_per_rank(cfg, layouts, world, micro_batches=max(res.step_worth))
        plan = {r["rank"]: r for r in rows}
        ratio = plan[rank]["total"] * GIB / res.peak_bytes
        assert abs(ratio - 1) <= 0.2, (reduce, stage, plan[rank], res.peak_bytes / GIB)
        scatters = sum(op.op.startswith("_reduce_scatter") for op in res.ops if op.step == 1)
        units = 2 + 1  # two decoder layers and the stage's root
        assert scatters == units * (micro if reduce == "per_micro_batch" else 1), (scatters, micro)
