"""Planners for the worker-process tests of tests/test_plan_ahead.py, in a module of their own
that imports nothing heavy: the spawned worker imports it to unpickle them."""
import os
import time


def busy(seconds: float) -> int:
    """Pure-Python work until `seconds` of this thread's CPU time (holds the GIL throughout)."""
    end, n = time.thread_time() + seconds, 0
    while time.thread_time() < end:
        n += 1
    return n


def pid_planner(indices):
    """(the planning process's id, sum of the indices)."""
    return os.getpid(), sum(indices)


def busy_planner(indices):
    """One CPU second of pure Python, then the sum of the indices."""
    busy(1.0)
    return sum(indices)


class FlagPlanner:
    """Sums the indices; unpickling it (in the worker, as the worker starts) creates `path`."""

    def __init__(self, path: str):
        self.path = path

    def __setstate__(self, state):
        self.__dict__.update(state)
        open(self.path, "w").close()

    def __call__(self, indices):
        return sum(indices)


class ImportsPlanner:
    """Runs `planner` and also returns whether its process has imported torch."""

    def __init__(self, planner):
        self.planner = planner

    def __call__(self, indices):
        import sys
        return self.planner(indices), "torch" in sys.modules
