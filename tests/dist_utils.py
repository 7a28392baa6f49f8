"""Run a function on N gloo ranks forked from the test process (docs/design.md section 7).

`run_ranks(fn, world_size, *args)` forks `world_size` processes, initializes a gloo process
group on a free local port in each, calls `fn(rank, world_size, *args)` and returns the list of
results ordered by rank. A child's exception is re-raised in the parent with its rank and
traceback; a rank that does not finish within `timeout` seconds fails the test (never a hang).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import traceback

from hcp.launch.launch import free_port


def _forget_parent_meshes() -> None:
    """Clear the DTensor sharding-propagation caches (Python and C++ fast path) this fork
    inherited from the test process. They key a result on its `DeviceMesh`, which compares by
    ranks and device type, not by process group: a mesh of an earlier in-process test (torch's
    fake world of ranks 0, 1, group '0') equals a rank's FSDP mesh over its pair 0, 1 here, and
    a cached output spec hands back the old mesh, whose group '0' is this world of 4 (a
    `full_tensor` then gathers 4 shards where 2 belong)."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()  # torch's Python cache and its C++ fast path's


def _child(fn, rank, world_size, port, args, queue):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    _forget_parent_meshes()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                init_method=f"tcp://127.0.0.1:{port}")
        result = fn(rank, world_size, *args)
        dist.barrier()
        # plain pickle: torch's queue reducers share tensors through file descriptors that
        # vanish when this process exits
        queue.put((rank, True, pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout: float = 120.0) -> list:
    """Fork `world_size` gloo ranks running `fn(rank, world_size, *args)`; return results by rank.

    Raises:
        RuntimeError: a rank raised (message holds its rank and traceback) or timed out.
    """
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, args, queue), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    import queue as queue_mod
    import time

    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError(f"ranks {sorted(set(range(world_size)) - set(results))} "
                                   f"did not finish within {timeout:.0f} s")
            try:
                rank, ok, payload = queue.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results
                        and p.exitcode not in (0, None)]
                if dead:
                    raise RuntimeError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}")
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            results[rank] = pickle.loads(payload)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]
