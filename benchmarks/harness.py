"""What the benchmarks share: their argument parser and common flags (`arg_parser`), the
`--json` output (`write_json`) and the forked gloo ranks of one run (`fork_ranks`). Every
benchmark runs through `python -m benchmarks NAME` (benchmarks/__main__.py) or as
`python benchmarks/NAME.py`."""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import queue as queue_mod
import time
import traceback


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in every flag's help, and the epilog (a column list) kept as written."""


def arg_parser(doc: str, epilog: str | None = None, *, json_help: str = "write the results here",
               seed: int | None = None, reps: int | None = None,
               reps_help: str = "repetitions") -> argparse.ArgumentParser:
    """A benchmark's parser: the first paragraph of `doc` (its module docstring) as description,
    `epilog` (e.g. the columns of its table) kept as written, defaults in every help, and the common
    flags: `--json PATH` always; `--seed N` and `--reps N` when given a default."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0], epilog=epilog,
                                 formatter_class=HelpFormatter)
    ap.add_argument("--json", metavar="PATH", help=json_help)
    if seed is not None:
        ap.add_argument("--seed", type=int, default=seed, help="random seed")
    if reps is not None:
        ap.add_argument("--reps", type=int, default=reps, help=reps_help)
    return ap


def write_json(path: str | None, out, indent: int = 1) -> None:
    """`out` as indented JSON at `path` (the `--json` flag), if given."""
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=indent)


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
