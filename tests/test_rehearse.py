"""`mode=rehearse` (hcp/preflight/rehearse): the checks on hand-made traces, then the real trainer at
8 ranks on torch's fake process group: the tiny recipes pass, and each seeded fault is named."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch.distributed as dist

from hcp.parallel.grid import AXES, Grid
from hcp.preflight.auto_cost import Scorer
from hcp.preflight.rehearse.report import JOB_RECORD, job_facts
from hcp.preflight.rehearse.checks import check_collectives, check_creations, check_rendezvous
from hcp.preflight.rehearse.record import Op
from tests.cfg_utils import REPO, compose_cfg
from tests.rehearse_utils import local_only_init, rehearse
from tests.cfg_utils import with_specs

WORLD = ("launcher.nproc_per_node=8",)
HETERO = ("+recipe=llava_tiny_hetero", *WORLD)
ISLANDS = (*HETERO, "placement=non_colocated", "vision.layout.num_ranks=4")


def _coll(shape, group=(0, 1), step=1, op="allreduce_"):
    return Op("collective", op, tuple(group), "g", (tuple(shape),), "torch.float32", step)


def _p2p(kind, peer, shape=(4,), batch=1):
    return Op(kind, "send" if kind == "send" else "recv_", (0, 1), "p", (tuple(shape),), "torch.float32",
              1, peer=peer, tag=0, batch=batch)


def test_checks_name_a_skipped_and_a_swapped_collective():
    skipped = check_collectives({0: [_coll([2]), _coll([3])], 1: [_coll([3])]})
    assert len(skipped) == 1 and skipped[0].ranks == [0, 1] and skipped[0].position == 0
    assert "allreduce_ [[2]]" in skipped[0].sides[0] and "[[3]]" in skipped[0].sides[1]
    swapped = check_collectives({0: [_coll([2]), _coll([3])], 1: [_coll([3]), _coll([2])]})
    assert swapped[0].what == "collective" and swapped[0].position == 0
    assert check_collectives({0: [_coll([2]), _coll([3])], 1: [_coll([2]), _coll([3])]}) == []
    # the ranks named in rank order, whatever order the ranks finished in
    g = (0, 2, 3)
    (late,) = check_collectives({3: [_coll([3], g)], 0: [_coll([2], g)], 2: [_coll([3], g)]})
    assert late.ranks == [0, 2, 3]
    # a collective one member never reaches also leaves the others waiting
    assert check_rendezvous({0: [_coll([2])], 1: []}, 2)[0].what == "deadlock"


def _recorded(rank: int, world: int, reduce_op) -> list:
    """Rank `rank` of `world` on torch's fake process group, recorded: an all-reduce with
    `reduce_op` and a reduce-scatter (AVG) on the world."""
    import torch
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hcp.preflight.rehearse.record import Recorder

    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        with Recorder() as rec:
            dist.all_reduce(torch.ones(3), op=reduce_op)
            dist.reduce_scatter_tensor(torch.ones(2), torch.ones(2 * world), op=dist.ReduceOp.AVG)
    finally:
        dist.destroy_process_group()
    return rec.ops


def test_a_rank_that_reduces_with_another_op_is_caught():
    """Rank 1 all-reduces with MAX where ranks 0 and 2 SUM: the recorded reduce ops differ, the
    mismatch names both sides; with SUM everywhere the group agrees."""
    same = {r: _recorded(r, 3, dist.ReduceOp.SUM) for r in range(3)}
    assert [op.reduce_op for op in same[0]] == ["SUM", "AVG"] and check_collectives(same) == []
    seeded = {r: _recorded(r, 3, dist.ReduceOp.MAX if r == 1 else dist.ReduceOp.SUM) for r in range(3)}
    (bad,) = check_collectives(seeded)
    assert bad.ranks == [0, 1] and bad.position == 0
    assert bad.sides[0].startswith("allreduce_ SUM [[3]]") and bad.sides[1].startswith("allreduce_ MAX [[3]]")


def test_rendezvous_of_sends_and_receives():
    """A send and a receive posted in one batch on both sides finish (NCCL's batched
    rendezvous); the same ops posted one at a time, both sends first, wait forever; a receive
    of another shape is named with both sides."""
    batched = {0: [_p2p("send", 1), _p2p("recv", 1)], 1: [_p2p("send", 0), _p2p("recv", 0)]}
    assert check_rendezvous(batched, 2) == []
    crossed = {0: [_p2p("send", 1, batch=1), _p2p("recv", 1, batch=2)],
               1: [_p2p("send", 0, batch=1), _p2p("recv", 0, batch=2)]}
    (dead,) = check_rendezvous(crossed, 2)
    assert dead.what == "deadlock" and dead.ranks == [0, 1]
    (shape,) = check_rendezvous({0: [_p2p("send", 1, (4,))], 1: [_p2p("recv", 0, (3,))]}, 2)
    assert shape.what == "send/recv" and "[[4]]" in shape.sides[0] and "[[3]]" in shape.sides[1]
    (missing,) = check_rendezvous({0: [_p2p("send", 1)], 1: []}, 2)
    assert missing.what == "deadlock" and missing.ranks == [0]


def test_creations_must_match_on_every_rank():
    assert check_creations({0: [(0, 1), (0, 1, 2, 3)], 1: [(0, 1), (0, 1, 2, 3)]}) == []
    (bad,) = check_creations({0: [(0, 1), (2, 3)], 1: [(0, 1), (2, 3)], 2: [(2, 3)]})
    assert bad.what == "group creation" and bad.ranks == [0, 2] and bad.position == 0


def test_each_rank_is_charged_its_own_step_whatever_else_is_rehearsed(monkeypatch, tmp_path):
    """Plan mode's estimate of a rank is of its own step's micro-batches (its lane's plan): a
    stage-0 rank whose step fills half a micro-batch gets the same figure rehearsed alone and
    beside a stage-0 rank of another lane whose step fills two (which is charged two in flight),
    not the larger step's: a subset and the whole world agree on a rank. The ranks' results are
    stand-ins (no rank runs)."""
    import hcp.preflight.rehearse.runner as runner
    from hcp.config.layouts import resolve_layouts
    from hcp.parallel.roles import role_of
    from hcp.preflight.rehearse import run_rehearsal

    cfg = compose_cfg(["mode=rehearse", "logger=none", "+recipe=llama_tiny", *WORLD, "llm.layout.pp=2",
                       "llm.layout.recompute=none"], run_dir=str(tmp_path))
    layouts = resolve_layouts(cfg, 8)
    first, other = [r for r in range(8) if role_of(layouts, r).stage("llm") == 0][:2]
    worth, plans = {first: 0.5, other: 2.0}, []
    for ranks in ([first], [first, other]):
        monkeypatch.setattr(runner, "rehearse_ranks", lambda *a, **k: {
            r: runner.RankResult(r, step_worth=[worth[r]]) for r in ranks})
        run_rehearsal(cfg, str(tmp_path), 8, progress=False)
        plans.append({int(r): rank["plan_gib"] for r, rank in json.load(open(tmp_path / "rehearsal.json"))["ranks"].items()})
    assert 0 < plans[0][first] == plans[1][first] < plans[1][other]


@pytest.mark.parametrize("override, field", [("rehearse.steps=0", "rehearse.steps"),
                                             ("rehearse.jobs=0", "rehearse.jobs"),
                                             ("rehearse.ranks=[]", "rehearse.ranks"),
                                             ("rehearse.ranks=[0,4]", "rehearse.ranks"),
                                             ("rehearse.ranks=[0] rehearse.by_class=true", "rehearse.ranks")])
def test_bad_rehearse_values_name_field_value_and_fix(override, field):
    from hcp.config.errors import ConfigError
    from hcp.preflight.rehearse import check_rehearse

    with pytest.raises(ConfigError) as err:
        check_rehearse(compose_cfg(override.split()), 4)  # the base config's world: 4 ranks
    assert str(err.value).startswith(f"{field}=") and "Fix:" in str(err.value)
    assert check_rehearse(compose_cfg(["rehearse.ranks=[3,1]"]), 4) == [1, 3]


@pytest.mark.timeout(300)
def test_one_rank_runs_under_fake_tensors_with_its_whole_training_state(tmp_path):
    """Rank 0 of 8 (a TP 2 x PP 2 LLM beside a data-parallel encoder side), one step in this
    process under `FakeTensorMode`: no host read of a device value stops it, and the peak
    tracked holds the fp32 weights, their gradients and both Adam moments (16 B per trained
    parameter) besides activations; each LLM micro-batch's FLOPs counted (attention included)
    are the cost model's within 5%: its padded CP shard, the masked short-document call that
    doubles a CP rank 0's scores, the flash backward's recomputed scores, and full recompute
    (which skips each layer's last matmul)."""
    import torch.distributed as dist

    from hcp.config.validate import validate
    from hcp.data.build import prepare_data
    from hcp.preflight.rehearse.runner import rehearsal_config, rehearse_rank

    cfg = compose_cfg(["mode=rehearse", "logger=none", *HETERO, "llm.layout.tp=2", "llm.layout.pp=2",
                       "llm.layout.recompute=full", "trainer.global_batch_size=8"], run_dir=str(tmp_path))
    validate(cfg, 8)
    list(prepare_data(*with_specs(cfg)))
    res = rehearse_rank(rehearsal_config(cfg), str(tmp_path), 0, 8, 1)
    assert res.error is None, res.error
    assert not dist.is_initialized() and res.flops > 0 and res.ops and res.param_bytes > 0
    assert res.peak_bytes > 4 * res.param_bytes
    from hcp.config.layouts import resolve_layouts
    from hcp.parallel.roles import role_of
    from hcp.preflight.estimate import cost_model, hardware
    from hcp.preflight.rehearse.report import micro_batch_flops

    layouts = resolve_layouts(cfg, 8)
    cost, stage = cost_model(cfg, layouts["llm"], hardware(cfg)), role_of(layouts, 0).stage("llm")
    assert res.micro_batches and sum(c for c, *_ in res.micro_batches) <= res.flops
    assert {(c, r) for _, _, c, r, _ in res.micro_batches} == {(2, 0)}  # CP rank 0 of 2: short documents
    pairs = micro_batch_flops({0: res}, {0: stage}, cost, layouts["llm"])[0]
    assert pairs and all(abs(counted / modelled - 1) < 0.05 for counted, modelled in pairs), pairs


@pytest.mark.timeout(300)
def test_a_rank_with_a_sharded_encoder_rehearses(tmp_path):
    """`vision.layout.dp_shard=true` (FSDP builds a `DeviceMesh`, which reads its ranks on the
    host): rank 0 of 8 runs its step and FSDP's all-gathers and reduce-scatters are recorded
    (internvit6b_llama70b's encoder is sharded)."""
    from hcp.config.validate import validate
    from hcp.data.build import prepare_data
    from hcp.preflight.rehearse.runner import rehearsal_config, rehearse_rank

    cfg = compose_cfg(["mode=rehearse", "logger=none", *HETERO, "vision.layout.dp_shard=true",
                       "trainer.global_batch_size=8"], run_dir=str(tmp_path))
    validate(cfg, 8)
    list(prepare_data(*with_specs(cfg)))
    res = rehearse_rank(rehearsal_config(cfg), str(tmp_path), 0, 8, 1)
    assert res.error is None, res.error
    ops = {op.op for op in res.ops if op.group == tuple(range(8))}
    assert any("allgather" in o for o in ops) and any("reduce_scatter" in o for o in ops), ops


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("overrides", [("+recipe=llama_tiny", *WORLD), HETERO, ISLANDS,
                                       ("+recipe=llava_tiny_two_encoders", *WORLD)],
                         ids=["llama_tiny", "llava_tiny_hetero", "llava_tiny_hetero_islands", "two_encoders"])
def test_tiny_recipes_pass_at_8_ranks(monkeypatch, tmp_path, overrides):
    assert rehearse(monkeypatch, tmp_path, overrides) == []
    report = json.load(open(tmp_path / "rehearsal.json"))
    assert report["passed"] and len(report["ranks"]) == 8
    assert all(r["ops"] > 0 and r["error"] is None for r in report["ranks"].values())
    micro = [pair for r in report["ranks"].values() for pair in r["micro_batch_flops"]]
    assert micro and all(abs(counted / modelled - 1) < 0.05 for counted, modelled in micro), micro


def _by_class(op, grid, rank) -> tuple:
    """`op` of `rank` with its group named by the grid axes it spans and its peer by the peer's
    pipeline-stage offset: what two ranks of one class must agree on."""
    coords = {r: grid.coords(r) for r in op.group}
    axes = tuple(a for a in AXES if len({c[a] for c in coords.values()}) > 1)
    peer = None if op.peer is None else grid.coords(op.peer)["pp"] - grid.coords(rank)["pp"]
    return op.kind, op.op, axes, op.shapes, op.dtype, op.step, peer, op.tag, op.splits, op.reduce_op


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ranks_of_one_class_issue_the_same_ops(tmp_path):
    """The assumption a class rehearsal (`rehearse.by_class`) rests on: ranks 0 and 3 of a TP 2 x PP 2 x DP 2
    LLM (stage 0, other TP and DP coordinates, other data) issue the same ops, op by op, once
    groups are named by the axes they span; rank 4 (stage 1, another class) does not."""
    from hcp.config.layouts import resolve_layouts
    from hcp.config.validate import validate
    from hcp.data.build import prepare_data
    from hcp.preflight.rehearse.runner import rehearsal_config, rehearse_ranks

    cfg = compose_cfg(["mode=rehearse", "logger=none", "+recipe=llama_tiny", *WORLD, "llm.layout.tp=2",
                       "llm.layout.pp=2", "trainer.global_batch_size=8"], run_dir=str(tmp_path))
    validate(cfg, 8)
    list(prepare_data(*with_specs(cfg)))
    grid = Grid.of(resolve_layouts(cfg, 8)["llm"])
    assert grid.dp == 2 and grid.coords(0)["dp"] != grid.coords(3)["dp"]
    res = rehearse_ranks(rehearsal_config(cfg), str(tmp_path), [0, 3, 4], 8, 1, 2)
    trace = {r: [_by_class(op, grid, r) for op in res[r].ops] for r in res}
    assert all(res[r].error is None for r in res) and trace[0]
    assert trace[0] == trace[3]
    assert trace[0] != trace[4]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_local_only_group_creation_is_caught(monkeypatch, tmp_path):
    """The registry before the cluster-readiness fix (each rank creates only its own groups,
    `use_local_synchronization=True`) under `placement=non_colocated`: named."""
    found = rehearse(monkeypatch, tmp_path, ISLANDS, registry=local_only_init)
    (bad,) = [m for m in found if m.what == "group creation"]
    assert bad.position == 0 and len(bad.ranks) > 1 and "new_group([" in bad.sides[bad.ranks[0]]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_lane_that_skips_the_encoder_gradient_sync_is_caught(monkeypatch, tmp_path):
    import hcp.train.encoders as sides

    sync = sides.sync_encoder_grads
    monkeypatch.setattr(sides, "sync_encoder_grads",
                        lambda *a: None if dist.get_rank() == 5 else sync(*a))
    found = rehearse(monkeypatch, tmp_path, HETERO)
    (bad,) = [m for m in found if m.what == "collective"]
    assert bad.ranks == [0, 5] and bad.step == 1 and bad.position == 0
    assert bad.sides[0].startswith("allreduce_") and bad.sides[5].startswith("nothing")


class Done:
    """A finished `Work` stand-in for an op a seeded fault did not issue."""

    def wait(self, *a):
        return True


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_ranks_that_swap_two_all_reduces_are_caught(monkeypatch, tmp_path):
    """Ranks 2 and 3 issue their first two all-reduces of the step in swapped order (the plan
    check's all-reduce off, so the two are the step's own)."""
    real, held = dist.all_reduce, []

    def swapped(tensor, *args, **kwargs):
        if dist.get_rank() not in (2, 3) or held == ["done"]:
            return real(tensor, *args, **kwargs)
        if not held:
            held.append((tensor, args, kwargs))
            return Done() if kwargs.get("async_op") else None
        first = held.pop()
        held.append("done")
        work = real(tensor, *args, **kwargs)
        real(first[0], *first[1], **first[2])
        return work

    monkeypatch.setattr(dist, "all_reduce", swapped)
    found = rehearse(monkeypatch, tmp_path, ("+recipe=llama_tiny", "trainer.check_plan=false", *WORLD))
    (bad,) = [m for m in found if m.what == "collective"]
    assert bad.ranks == [0, 2, 3] and bad.position == 0 and bad.step == 1
    assert bad.sides[2] == bad.sides[3] != bad.sides[0]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("fault", ["missing", "shape"])
def test_a_receive_missing_or_of_another_shape_is_caught(monkeypatch, tmp_path, fault):
    """Pipeline stages (pp 2): rank 5's first batch of sends and receives drops its receive,
    or receives into a buffer one element short."""
    real, seen = dist.batch_isend_irecv, []

    def seeded(ops):
        if dist.get_rank() == 5 and not seen and any(op.op is dist.irecv for op in ops):
            seen.append(True)
            recv = next(op for op in ops if op.op is dist.irecv)
            rest = [op for op in ops if op is not recv]
            if fault == "shape":
                return real(rest + [dist.P2POp(dist.irecv, recv.tensor.flatten()[1:].clone(), recv.peer,
                                               recv.group, recv.tag)])
            return (real(rest) if rest else []) + [Done()]  # the receive is never posted
        return real(ops)

    monkeypatch.setattr(dist, "batch_isend_irecv", seeded)
    found = rehearse(monkeypatch, tmp_path, ("+recipe=llama_tiny", *WORLD, "llm.layout.pp=2"))
    kinds = {m.what for m in found}
    if fault == "missing":
        (dead,) = [m for m in found if m.what == "deadlock"]
        assert 1 in dead.ranks and "send" in dead.sides[1]  # rank 1 (stage 0) waits in its send to 5
    else:
        (bad,) = [m for m in found if m.what == "send/recv"]
        assert bad.ranks == [1, 5] and bad.step == 1 and "send" in bad.sides[1] and "recv" in bad.sides[5]
    assert kinds <= {"deadlock", "send/recv", "collective"}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_dynamic_cp_plan_that_differs_on_one_rank_is_caught(monkeypatch, tmp_path):
    """Rank 6 plans its micro-batches with half the token cap: its CP groups and micro-batches
    differ from its pool's."""
    import hcp.train.planner as planner

    plan = planner.plan_step
    monkeypatch.setattr(planner, "plan_step", lambda sizes, layouts, packing, cap, *a, **k: plan(
        sizes, layouts, packing, cap // 2 if dist.get_rank() == 6 else cap, *a, **k))
    found = rehearse(monkeypatch, tmp_path, ("+recipe=llama_tiny", *WORLD, "packing=dynamic_cp",
                                             "llm.layout.cp=2", "trainer.micro_batch_tokens=128"))
    bad = [m for m in found if m.what == "collective"]
    assert bad and all(6 in m.ranks for m in bad)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cli_exit_status_report_and_bad_input(tmp_path):
    """The command line: a rank over the device memory fails the rehearsal (exit 1, named, in
    rehearsal.json, which records the job for `layout=auto`'s `rehearse.report`); a bad
    `rehearse.*` value is a one-line error before any rank starts."""
    env = dict(os.environ, PYTHONPATH=REPO)
    base = [sys.executable, "train.py", "+recipe=llama_tiny", "mode=rehearse", "logger=none"]
    proc = subprocess.run([*base, "rehearse.ranks=[0]", "rehearse.steps=1", "cluster.device_memory_gib=0.0001",
                           f"hydra.run.dir={tmp_path}"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=500)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "rehearsal failed" in proc.stdout and "memory: ranks [0]" in proc.stdout
    report = json.load(open(tmp_path / "rehearsal.json"))
    assert not report["passed"] and list(report["ranks"]) == ["0"]
    # the job it rehearsed, which layout=auto checks a report against (tests/test_auto_layout.py)
    cfg = compose_cfg(["+recipe=llama_tiny", "layout=auto", f"rehearse.report={tmp_path}/rehearsal.json"])
    world = report["job"]["world_size"]
    assert report["job"]["ranks"] == [0] and report["job"]["placement"] == cfg.placement
    assert report["job"]["layouts"]["llm"]["tp"] == cfg.llm.layout.tp
    assert {k: v for k, v in report["job"].items() if k not in JOB_RECORD} == job_facts(*with_specs(cfg), world)
    assert Scorer(cfg, world, "h100").correction >= 1  # this run's report: taken
    bad = subprocess.run([*base, "rehearse.ranks=[9]", f"hydra.run.dir={tmp_path}/bad"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "rehearse.ranks=[9]" in bad.stderr and "Fix:" in bad.stderr
    # `rehearse.report` is an input of layout=auto, not where a rehearsal writes: refused without it
    bad = subprocess.run([*base, f"rehearse.report={tmp_path}/out.json", f"hydra.run.dir={tmp_path}/bad"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "only layout=auto reads it" in bad.stderr, bad.stderr[-2000:]
