"""Plans that agree, checked (hcp.train.plan_check, `trainer.check_plan`, on by default): two
processes with different PYTHONHASHSEED and thread counts plan the same 50 dynamic-CP steps
(LLaMA-13B recipe at full size: PP 8 x CP 8, the solver's HiGHS LPs) identically; a rank whose
plan is perturbed stops every rank with one error naming the step, never a hang."""
import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from omegaconf import OmegaConf

from cfg_utils import compose_cfg
from dist_utils import run_ranks
from test_hetero_parity import SMALL

TESTS = os.path.dirname(os.path.abspath(__file__))


def digests(steps: int = 50, batch: int = 32) -> list[int]:
    """Checksums of `steps` dynamic-CP step plans of the llama13b_dynamic_cp recipe at its full
    size, for seeded long-tailed global batches of `batch` documents."""
    from hcp.config.layouts import check_layouts, world_size_of
    from hcp.dcp.policy import dynamic_cp_policy
    from hcp.plan.lengths import SampleSizes
    from hcp.plan.step import plan_step, register_policy

    cfg = compose_cfg(["+recipe=llama13b_dynamic_cp"], resolve=False)
    layouts = check_layouts(cfg, world_size_of(cfg))
    register_policy("dynamic_cp", dynamic_cp_policy(cfg.llm, cfg.packing_profile))
    rng = np.random.default_rng(0)
    out = []
    for _ in range(steps):
        lens = np.minimum(rng.lognormal(7.5, 1.3, batch).astype(np.int64) + 2, cfg.data.max_seq_len // 2)
        sizes = SampleSizes.from_lists(list(lens), [int(n) - 1 for n in lens], [[] for _ in lens])
        out.append(plan_step(sizes, layouts, "dynamic_cp", cfg.trainer.micro_batch_tokens).checksum())
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_processes_with_other_hash_seeds_and_threads_plan_the_same_50_steps():
    code = "import json, test_plan_agreement as t; print(json.dumps(t.digests()))"
    procs = []
    for seed, threads in (("1", "1"), ("4242", "2")):
        env = {**os.environ, "PYTHONHASHSEED": seed, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
               "OPENBLAS_NUM_THREADS": threads, "PYTHONPATH": os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")])}
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True))
    outs = [json.loads(p.communicate(timeout=580)[0].strip().splitlines()[-1]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len(outs[0]) == 50 and len(set(outs[0])) == 50  # 50 different steps
    assert outs[0] == outs[1]


def _agree(rank, world, checksums, step):
    from hcp.train.plan_check import check_plans_agree

    try:
        check_plans_agree(checksums[rank], step, "cpu")
    except RuntimeError as e:
        return str(e)
    return None


def test_every_rank_names_the_step_when_one_rank_holds_another_plan():
    assert run_ranks(_agree, 4, [5, 5, 5, 5], 3, timeout=60) == [None] * 4
    messages = run_ranks(_agree, 4, [5, 5, 2**63 - 1, 5], 7, timeout=60)
    assert all(m is not None and m.startswith("step 7: the ranks computed different step plans")
               for m in messages), messages
    assert "this rank's 0x7fffffffffffffff" in messages[2] and "this rank's 0x0000000000000005" in messages[0]


def _perturbed_step(rank, world, container):
    from hcp.train.trainer import Trainer

    tr = Trainer(OmegaConf.create(container), "/tmp/unused")
    plan = tr.plan
    seen = []

    def other_order(indices):  # rank 1 breaks a tie another way: its micro-batches reversed
        step = plan(indices)
        if rank == 1:
            swapped = dataclasses.replace(step, group_at=step.group_at[::-1].copy())
            seen.append(swapped.checksum() != step.checksum())
            return swapped
        return step

    tr.plan = other_order
    try:
        tr.train_step()
    except RuntimeError as e:
        return str(e), seen
    finally:
        tr.ahead.close()
    return None, seen


@pytest.mark.timeout(240)
def test_a_rank_with_a_perturbed_plan_stops_every_rank_at_that_step(tmp_path):
    overrides = [*SMALL, "logger=none", "trainer.micro_batch_tokens=80"]  # check_plan: its default
    container = OmegaConf.to_container(compose_cfg(overrides, run_dir=str(tmp_path)), resolve=True)
    (m0, _), (m1, seen) = run_ranks(_perturbed_step, 2, container, timeout=220)
    assert seen and all(seen)  # the perturbation changed rank 1's plans
    for m in (m0, m1):
        assert m is not None and m.startswith("step 1: the ranks computed different step plans"), m


def test_the_checksum_has_64_bits_and_covers_the_lengths():
    from hcp.plan.lengths import SampleSizes
    from hcp.plan.step import plan_step
    from test_step_plan import EDGES, layouts, random_sizes

    rng = np.random.default_rng(3)
    lays = layouts(1, 8, 2, 2, 2)
    sums = [plan_step(random_sizes(rng, 8), lays, "first_fit", 64, EDGES).checksum() for _ in range(20)]
    assert max(sums) >= 2**32 and all(0 <= c < 2**63 for c in sums)
    sizes = SampleSizes.from_lists([30, 31, 32, 33], [29, 30, 31, 32], [[], [], [], []])
    longer = SampleSizes.from_lists([30, 31, 32, 34], [29, 30, 31, 33], [[], [], [], []])
    a, b = (plan_step(s, {"llm": lays["llm"]}, "first_fit", 64) for s in (sizes, longer))
    assert [g.seq_indices for g in a.groups] == [g.seq_indices for g in b.groups]  # same packing
    assert a.checksum() != b.checksum()  # yet another cu_seqlens on one rank


def _swapped(values: np.ndarray) -> np.ndarray:
    """`values` with its first two entries (rows, for a 2-d array) of different value swapped."""
    out = np.array(values, copy=True)
    first = out[0]
    other = next(i for i in range(1, len(out)) if not np.array_equal(out[i], first))
    out[[0, other]] = out[[other, 0]]
    return out


def test_ranks_that_disagree_on_any_field_of_a_route_fail_the_check():
    """Two ranks whose plans differ only in one routing table's field (a row delivered to
    another destination row, from another source row, ...) hold other checksums, and the check
    stops both (each field is fed to the digest: `StepPlan.checksum`)."""
    from hcp.plan.step import plan_step
    from test_step_plan import EDGES, layouts, random_sizes

    plan = plan_step(random_sizes(np.random.default_rng(5), 8), layouts(1, 8, 2, 2, 2), "first_fit",
                     64, EDGES)
    (edge, table), = plan.tables.items()
    assert len(table.src) > 2
    for field in ("src", "src_row", "shard", "dst_row", "shard_ranks"):
        other = dataclasses.replace(table, **{field: _swapped(getattr(table, field))})
        moved = dataclasses.replace(plan, tables={**plan.tables, edge: other})
        assert moved.checksum() != plan.checksum(), f"the checksum ignores RowTable.{field}"
    other = dataclasses.replace(table, dst_row=_swapped(table.dst_row))
    moved = dataclasses.replace(plan, tables={**plan.tables, edge: other}).checksum()
    messages = run_ranks(_agree, 2, [plan.checksum(), moved], 4, timeout=60)
    assert all(m and m.startswith("step 4: the ranks computed different step plans")
               for m in messages)


def test_the_checksum_range_is_checked_at_both_ends():
    """[0, 2**63): both ends pass the check, one past either end is refused before any
    collective (mutants of the range survived every other test)."""
    from hcp.train.plan_check import check_plans_agree

    for outside in (-1, 2**63):
        with pytest.raises(ValueError, match="outside"):
            check_plans_agree(outside, 1, "cpu")
    assert run_ranks(_agree, 2, [0, 0], 1, timeout=60) == [None, None]
    assert run_ranks(_agree, 2, [2**63 - 1] * 2, 1, timeout=60) == [None, None]
