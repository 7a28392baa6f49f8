"""What several benchmarks share: their help formatter and the forked gloo ranks of one run."""
from __future__ import annotations

import argparse
import multiprocessing as mp
import queue as queue_mod
import time
import traceback


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in every flag's help, and the epilog (a column list) kept as written."""


def report(queue, rank: int, measure, *args) -> None:
    """Fork target's body: put (rank, `measure(*args)`) on `queue`, or (rank, the traceback
    text) when it raises, so the parent fails with it instead of waiting."""
    try:
        queue.put((rank, measure(*args)))
    except BaseException:  # noqa: BLE001 - hand the failure to the parent
        queue.put((rank, traceback.format_exc()))


def fork_ranks(target, world: int, args: tuple, name: str, timeout: float) -> list:
    """Fork `world` processes `target(rank, *args, queue)`, each putting (rank, result) on the
    queue (`report`); return the results in rank order. RuntimeError naming `name` when a
    rank fails (its traceback), dies or does not finish within `timeout` seconds."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, *args, queue), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world:
            try:
                rank, payload = queue.get(timeout=5)
            except queue_mod.Empty:  # no word yet: make sure no rank died silently or hangs
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"{name}: rank {dead[0]} died (exit code "
                                       f"{procs[dead[0]].exitcode})") from None
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world)) - set(results))
                    raise RuntimeError(f"{name}: ranks {missing} did not finish within {timeout} s") from None
                continue
            if isinstance(payload, str):
                raise RuntimeError(f"{name}: rank {rank} failed:\n{payload}")
            results[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]
