"""One planner per node: the node's first local rank plans each step, its other ranks read it.

Every rank needs the same step plan (docs/design.md 4.1), and the plan is a pure function of
the global batch's sample indices, so the ranks of a node need not each compute it (under
`packing=dynamic_cp` the solver's search costs every rank the same CPU time). With
`NodeSharedPlanner` the node's local rank 0 (the leader) plans, pickles the plan and publishes
it in a directory its node can read, under a name made from the indices, atomically (written
to a temporary file, then renamed); the other local ranks (readers) wait for that file and
unpickle it. Either runs where the plan-ahead job runs (hcp/plan/ahead.py: a background thread
or the worker process), so a reader's wait hides behind the current step as the leader's
planning does.

No collective is issued: a collective on the plan-ahead thread could interleave with the
training thread's collectives in a different order on different ranks (a hang under NCCL;
benchmarks/dynamic_cp_broadcast.py), while a file leaves every rank's collective order as it
was. The per-step checksum (hcp/train/plan_check.py) still checks that every rank of the world
holds the same plan. Each node plans for itself: where several nodes share the directory (a
run directory on a shared file system) their leaders write the same bytes under the same name.

A reader that finds no plan within `wait_s` seconds (its leader died, or stopped before
planning this batch: the prefetch past the last step) plans the batch itself: the same plan,
since planning is deterministic, only slower. The leader keeps its `keep` newest plans and
removes older ones (the last `keep` stay in the run directory, a few plans of tens of KB).
"""
from __future__ import annotations

import hashlib
import os
import pickle
import socket
import tempfile
import time
from collections import deque
from typing import Callable

import numpy as np

POLL_FIRST_S = 0.0005  # a reader's first poll interval; it doubles up to POLL_MAX_S
POLL_MAX_S = 0.01


def plan_name(indices) -> str:
    """File name of the plan of a global batch: a digest of its sample indices (int64)."""
    raw = np.ascontiguousarray(np.asarray(indices, dtype=np.int64)).tobytes()
    return hashlib.blake2b(raw, digest_size=16).hexdigest() + ".plan"


class NodeSharedPlanner:
    """`planner(indices) -> plan`, computed once per node (see module docstring). Picklable
    (the plan-ahead worker process runs it), as its `planner` must be.

    Args:
        planner: the pure `indices -> plan` (`hcp.train.planner.StepPlanner`).
        directory: where the leader publishes plans (created if missing).
        leader: whether this rank plans (the node's local rank 0) or reads.
        wait_s: seconds a reader waits for a plan before planning it itself (> 0).
        keep: plans the leader keeps on disk (>= 1); a reader more than `keep` batches
            behind its leader plans itself.
    Raises:
        ValueError: `wait_s <= 0` or `keep < 1`.
    """

    def __init__(self, planner: Callable, directory: str, leader: bool, wait_s: float = 120.0,
                 keep: int = 4):
        if not wait_s > 0 or keep < 1:
            raise ValueError(f"wait_s={wait_s} must be > 0 seconds and keep={keep} >= 1")
        self.planner, self.directory, self.leader = planner, str(directory), bool(leader)
        self.wait_s, self.keep = float(wait_s), int(keep)
        self.published: deque[str] = deque()
        self.self_planned = 0  # batches a reader planned itself (no plan came in time)
        os.makedirs(self.directory, exist_ok=True)

    def __call__(self, indices):
        path = os.path.join(self.directory, plan_name(indices))
        if self.leader:
            plan = self.planner(indices)
            self._publish(path, plan)
            return plan
        plan = self._read(path)
        if plan is None:
            self.self_planned += 1
            plan = self.planner(indices)
        return plan

    def _publish(self, path: str, plan) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            pickle.dump(plan, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)
        if path in self.published:  # the same batch again (a repeated epoch order)
            self.published.remove(path)
        self.published.append(path)
        while len(self.published) > self.keep:
            _remove(self.published.popleft())

    def _read(self, path: str):
        deadline, pause = time.monotonic() + self.wait_s, POLL_FIRST_S
        while True:
            try:
                with open(path, "rb") as f:
                    return pickle.load(f)
            except FileNotFoundError:
                pass
            if time.monotonic() >= deadline:
                return None
            time.sleep(pause)
            pause = min(2 * pause, POLL_MAX_S)


def node_planner(planner: Callable, run_dir: str, enabled: bool = True, env=None) -> Callable:
    """`planner` planned once per node (`NodeSharedPlanner`, its plans in
    `run_dir/plans/<host>-<launching process id>-<MASTER_PORT>`: one directory per node and
    launch, so a relaunch in the same run directory never reads an earlier launch's plans) when
    `enabled` and this rank's launcher set `LOCAL_RANK` (torchrun, srun through
    hcp.launch.launch, `python train.py`'s local ranks); else `planner` itself (every rank
    plans: a rank started alone, the rehearsal's fake process group)."""
    env = os.environ if env is None else env
    if not enabled or "LOCAL_RANK" not in env:
        return planner
    launch = f"{socket.gethostname()}-{os.getppid()}-{env.get('MASTER_PORT', '')}"
    directory = os.path.join(str(run_dir), "plans", launch)
    return NodeSharedPlanner(planner, directory, leader=int(env["LOCAL_RANK"]) == 0)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
