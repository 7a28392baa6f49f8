"""A collective that never completes ends the run within `launcher.timeout_s`, naming the rank and
the operation, through torch's own machinery.

- NCCL: the ProcessGroupNCCL watchdog aborts a collective past the process group's timeout and
  logs `[Rank R] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=.., OpType=..)`;
  with `TORCH_NCCL_DUMP_ON_TIMEOUT=1` it first writes its flight recorder (the last
  `TORCH_FR_BUFFER_SIZE` collectives of every group) to `TORCH_FR_DUMP_TEMP_FILE<rank>`.
- gloo: the blocked call raises `Timed out waiting ..ms for recv operation` after the timeout,
  naming neither the rank nor the operation. gloo feeds the same flight recorder, so
  `stuck_collective` reads its newest entry (this rank's last collective, the stuck one) and
  raises `CollectiveTimeout` naming both, after dumping the recorder to the same file as NCCL.

`watch_collectives` sets these variables (a value already set wins) before the process group
starts. NCCL's dumps of every rank are compared by torch's analyzer,
`torchfrtrace <run dir>/flight_recorder -p rank_`, which names the rank that issued another
collective or none (it needs the process groups' configs, which gloo's recorder leaves empty).
"""
from __future__ import annotations

import os
import pickle

import torch.distributed as dist

FOLDER = "flight_recorder"
PREFIX = "rank_"


class CollectiveTimeout(RuntimeError):
    """A collective of this rank did not complete within `launcher.timeout_s`."""


def watch_collectives(run_dir: str, nccl: bool) -> None:
    """Set torch's flight recorder and NCCL watchdog variables for this rank (before
    `init_process_group`; a variable already set is left as it is). `nccl`: the run uses NCCL
    (its watchdog dumps into `<run_dir>/flight_recorder/`, made here)."""
    folder = os.path.join(run_dir, FOLDER)
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")  # torch's default, said once
    os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", os.path.join(folder, PREFIX))
    if nccl:  # the dump needs the monitor thread and a recorder (ProcessGroupNCCL.hpp)
        for name, value in (("TORCH_NCCL_DUMP_ON_TIMEOUT", "1"),
                            ("TORCH_NCCL_ENABLE_MONITORING", "1"),
                            ("TORCH_NCCL_TRACE_BUFFER_SIZE", os.environ["TORCH_FR_BUFFER_SIZE"])):
            os.environ.setdefault(name, value)
        os.makedirs(folder, exist_ok=True)


def _entries() -> tuple[list[dict], bytes]:
    """(this rank's flight recorder entries, oldest first; the pickled dump as NCCL writes it)."""
    from torch._C._distributed_c10d import _dump_fr_trace

    raw = _dump_fr_trace()
    return pickle.loads(raw).get("entries", []), raw


def _group_ranks(name: str):
    """The global ranks of the process group the recorder calls `name` ("?" if unknown)."""
    for group, pg_name in dist.distributed_c10d._world.pg_names.items():
        if pg_name == name:
            return dist.get_process_group_ranks(group)
    return "?"


def _caller(entry: dict) -> str:
    """`file:line (function)` of the innermost frame outside torch that issued `entry` (a file
    of hcp relative to the folder holding the `hcp` package)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for frame in entry.get("frames", ()):
        name = frame["filename"]
        if f"{os.sep}torch{os.sep}" not in name:
            name = os.path.relpath(name, root) if name.startswith(root + os.sep) else name
            return f"{name}:{frame['line']} ({frame['name']})"
    return "?"


def _from_c10d(error: BaseException) -> bool:
    """`error` was raised inside torch.distributed (not, say, by a data loader's own timeout)."""
    tb = error.__traceback__
    while tb is not None:
        if f"{os.sep}torch{os.sep}distributed{os.sep}" in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


def stuck_collective(error: BaseException, timeout_s: float, step: int | None = None):
    """A `CollectiveTimeout` naming this rank's stuck collective when `error` is a collective's
    timeout (gloo's), else None. The recorder's dump goes to `TORCH_FR_DUMP_TEMP_FILE<rank>`.

    `step`: the step the rank was running (1-based), or None (before the first)."""
    if "timed out" not in str(error).lower() or not dist.is_initialized() or not _from_c10d(error):
        return None
    rank = dist.get_rank()
    entries, raw = _entries()
    if not entries:
        return None
    last = entries[-1]
    pg_name, pg_desc = (list(last.get("process_group", ())) + ["", ""])[:2]
    seq = last.get("p2p_seq_id") if last.get("is_p2p") else last.get("collective_seq_id")
    path = os.environ.get("TORCH_FR_DUMP_TEMP_FILE", "")
    where = ""
    if path:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(f"{path}{rank}", "wb") as f:
            f.write(raw)
        where = f" This rank's last collectives (torch's flight recorder, a pickle): {path}{rank}."
    at = f" at step {step}" if step is not None else ""
    return CollectiveTimeout(
        f"rank {rank}{at}: collective {last.get('profiling_name', '?')} #{seq} on process group "
        f"{pg_desc or pg_name} (ranks {_group_ranks(pg_name)}; input sizes "
        f"{last.get('input_sizes')}), issued at {_caller(last)}, did not complete within "
        f"launcher.timeout_s={timeout_s:g}: a rank of that group issued another collective or "
        f"none.{where}")
