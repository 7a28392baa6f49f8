"""One planner per node (hcp/plan/shared.py): the leader plans, the readers read its plan."""
import pickle
import threading

import numpy as np
import pytest

from hcp.plan.shared import NodeSharedPlanner, node_planner, plan_name


class Counting:
    """A pure planner that counts its calls (the plan: the indices' sum and a copy)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, indices):
        self.calls += 1
        return {"sum": int(np.sum(indices)), "indices": list(indices)}


def test_readers_get_the_leaders_plan_without_planning(tmp_path):
    """Three readers started before the leader: each waits for the leader's file and returns
    its plan; the solver runs once per batch on the node, not once per rank."""
    leader_planner, reader_planners = Counting(), [Counting() for _ in range(3)]
    # keep: the leader may run all five batches before a reader polls (in a run the step's
    # collectives keep it within a batch or two of its readers)
    leader = NodeSharedPlanner(leader_planner, tmp_path, leader=True, keep=5)
    readers = [NodeSharedPlanner(p, tmp_path, leader=False) for p in reader_planners]
    batches = [np.arange(k, k + 8) for k in range(5)]
    got = [[] for _ in readers]

    def read(r, out):
        for b in batches:
            out.append(r(b))

    threads = [threading.Thread(target=read, args=(r, out)) for r, out in zip(readers, got)]
    for t in threads:
        t.start()
    mine = [leader(b) for b in batches]
    for t in threads:
        t.join(30)
    assert all(out == mine for out in got)
    assert leader_planner.calls == len(batches)
    assert [p.calls for p in reader_planners] == [0, 0, 0]
    assert all(r.self_planned == 0 for r in readers)


def test_reader_plans_itself_when_no_plan_comes(tmp_path):
    """No leader (it died, or stopped before this batch): the reader plans the batch itself
    after `wait_s`, the same plan, instead of hanging."""
    planner = Counting()
    reader = NodeSharedPlanner(planner, tmp_path, leader=False, wait_s=0.05)
    assert reader([3, 4]) == {"sum": 7, "indices": [3, 4]}
    assert planner.calls == 1 and reader.self_planned == 1


def test_leader_keeps_its_newest_plans(tmp_path):
    leader = NodeSharedPlanner(Counting(), tmp_path, leader=True, keep=2)
    for k in range(5):
        leader([k])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(plan_name([k]) for k in (3, 4))
    with open(tmp_path / plan_name([4]), "rb") as f:
        assert pickle.load(f) == {"sum": 4, "indices": [4]}


def test_node_planner_needs_a_launcher_and_a_real_world(tmp_path):
    planner = Counting()
    assert node_planner(planner, tmp_path, True, env={}) is planner  # started alone
    assert node_planner(planner, tmp_path, False, env={"LOCAL_RANK": "1"}) is planner  # fake pg
    env = {"LOCAL_RANK": "1", "MASTER_PORT": "29500"}
    shared = node_planner(planner, tmp_path, True, env=env)
    assert isinstance(shared, NodeSharedPlanner) and not shared.leader
    assert shared.directory.startswith(str(tmp_path / "plans"))
    assert node_planner(planner, tmp_path, True, env={**env, "LOCAL_RANK": "0"}).leader
    pickle.loads(pickle.dumps(shared))  # the plan-ahead worker process runs it


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="wait_s"):
        NodeSharedPlanner(Counting(), tmp_path, leader=False, wait_s=0)
    with pytest.raises(ValueError, match="keep"):
        NodeSharedPlanner(Counting(), tmp_path, leader=True, keep=0)
