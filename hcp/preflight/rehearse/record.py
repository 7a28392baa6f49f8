"""Record every communication op and process-group creation of one rank (mode=rehearse).

`Recorder` is a `TorchDispatchMode`: every collective and point-to-point op reaches the
dispatcher as a `c10d.*` op with its tensors and process group, FSDP's included (wrapping
`torch.distributed.*` in Python would miss FSDP's). `torch.distributed.batch_isend_irecv` is
wrapped only to know which sends and receives were posted together (NCCL rendezvouses a batch
as a whole), and `distributed_c10d._new_group_with_tag` (behind `new_group`) to record group
creation in call order, members-only calls (`use_local_synchronization=True`) included.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.utils._python_dispatch import TorchDispatchMode

from hcp.parallel.groups import SELF_GROUP_DESC

P2P_OPS = {"send": "send", "recv_": "recv", "recv_any_source_": "recv"}
"""c10d point-to-point ops -> `Op.kind`."""
UNEVEN_OPS = {"alltoall_base_"}
"""Collectives whose shapes legitimately differ between members (uneven splits): matched on
op and dtype, and their splits checked pairwise (hcp.preflight.rehearse.checks)."""


@dataclass(frozen=True)
class Op:
    """One communication op as a rank issued it.

    `kind` is `collective`, `send` or `recv`; `op` the c10d op (`allreduce_`,
    `_allgather_base_`, `_reduce_scatter_base_`, `alltoall_base_`, `send`, `recv_`, ...);
    `group` the global ranks of its process group and `group_name` that group's name (two
    groups over the same ranks stay apart); `shapes` and `dtype` of its tensors; `peer` the
    global rank of a send's destination or a receive's source; `tag`; `batch` the rank's
    sequence number of the `batch_isend_irecv` (or lone send/recv) it was posted in; `splits`
    (output, input) split sizes of an all-to-all; `reduce_op` a reducing collective's
    `ReduceOp` name (`SUM`, `AVG`, `MAX`, ...); `step` the training step (0: set-up)."""

    kind: str
    op: str
    group: tuple[int, ...]
    group_name: str
    shapes: tuple[tuple[int, ...], ...]
    dtype: str
    step: int
    peer: int | None = None
    tag: int | None = None
    batch: int | None = None
    splits: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    reduce_op: str | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of the op's tensors (a send: the bytes it sends)."""
        size = torch.empty((), dtype=getattr(torch, self.dtype.split(".")[-1])).element_size()
        return sum(size * int(torch.Size(s).numel()) for s in self.shapes)

    def signature(self) -> tuple:
        """What every member of a collective must agree on: op, dtype, reduce op and (unless
        its splits may be uneven) shapes; a send/recv: shape and dtype."""
        shapes = () if self.op in UNEVEN_OPS else self.shapes
        return (self.op, shapes, self.dtype, self.reduce_op)

    def __str__(self) -> str:
        where = f" peer {self.peer} tag {self.tag}" if self.peer is not None else ""
        reduce = f" {self.reduce_op}" if self.reduce_op else ""
        return (f"{self.op}{reduce} {list(map(list, self.shapes))} "
                f"{self.dtype.replace('torch.', '')} on group {list(self.group)}{where}")


def _tensors(args) -> list[torch.Tensor]:
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out += _tensors(a)
    return out


def _fake_pg_alltoall_args(args) -> tuple:
    """torch's fake process group refuses an all-to-all whose rank sends nothing but receives
    rows (legal on gloo and NCCL: a rank with no rows of its own); hand it a one-row input
    instead. The recorded op keeps the real input."""
    out, inp, pg, out_splits, in_splits, *rest = args
    dummy = inp.new_empty((1, *inp.shape[1:]))
    return (out, dummy, pg, out_splits, [1] + [0] * (len(in_splits) - 1), *rest)


def _script_object(args, kind: str):
    return next((a for a in args if isinstance(a, torch.ScriptObject) and kind in str(a._type())),
                None)


def _group(args) -> dist.ProcessGroup:
    pg = _script_object(args, "ProcessGroup")
    if pg is None:
        raise RuntimeError("a c10d op without a process group")
    return dist.ProcessGroup.unbox(pg)


def _reduce_op(args) -> str | None:
    """The name of a reducing collective's `ReduceOp` (the dispatcher passes it boxed)."""
    op = _script_object(args, "ReduceOp")
    return None if op is None else dist.ReduceOp.RedOpType(op.op()).name


class Recorder(TorchDispatchMode):
    """Records this rank's communication ops (`ops`, in issue order) while active, and its
    group creations (`creations`: the ranks of every `new_group`, in call order; `names`: rank
    set -> the name of the first group created over it) between `install()` and `uninstall()`. Set
    `step` before each training step."""

    def __init__(self):
        super().__init__()
        self.ops: list[Op] = []
        self.creations: list[tuple[int, ...]] = []
        self.names: dict[frozenset, str] = {}
        self.step = 0
        self._batch, self._in_batch = 0, False
        self._saved: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d":
            self._record(func._opname, args)
            if func._opname in UNEVEN_OPS and args[1].numel() == 0 and any(args[3]):
                args = _fake_pg_alltoall_args(args)
        return func(*args, **kwargs)

    def _record(self, name: str, args) -> None:
        if name in ("wait", "barrier") and not _tensors(args):
            return
        pg = _group(args)
        ranks = tuple(dist.get_process_group_ranks(pg))
        tensors = _tensors(args)
        shapes = tuple(tuple(t.shape) for t in tensors)
        dtype = str(tensors[0].dtype) if tensors else ""
        common = dict(group=ranks, group_name=pg.group_name, shapes=shapes, dtype=dtype,
                      step=self.step)
        if name in P2P_OPS:
            ints = [a for a in args if isinstance(a, int) and not isinstance(a, bool)]
            peer, tag = ints[0], ints[1] if len(ints) > 1 else None
            if not self._in_batch:
                self._batch += 1
            self.ops.append(Op(P2P_OPS[name], name, peer=ranks[peer], tag=tag, batch=self._batch,
                               **common))
            return
        splits = None
        if name in UNEVEN_OPS:  # (output, input, pg, output_split_sizes, input_split_sizes, ...)
            splits = (tuple(args[3]), tuple(args[4]))
            shapes = tuple(tuple(t.shape) for t in tensors[:2])
            common["shapes"] = shapes
        self.ops.append(Op("collective", name, splits=splits, reduce_op=_reduce_op(args), **common))

    @contextlib.contextmanager
    def _batched(self):
        self._batch += 1
        self._in_batch = True
        try:
            yield
        finally:
            self._in_batch = False

    def install(self) -> None:
        """Wrap `batch_isend_irecv` (batch boundaries) and group creation (recorded)."""
        batch_fn, create_fn = dist.batch_isend_irecv, c10d._new_group_with_tag

        def batch_isend_irecv(p2p_op_list):
            with self._batched():
                return batch_fn(p2p_op_list)

        def new_group_with_tag(ranks=None, *args, **kwargs):
            members = range(dist.get_world_size()) if ranks is None else ranks
            if kwargs.get("group_desc") != SELF_GROUP_DESC:  # a rank's own stand-in: no world step
                self.creations.append(tuple(sorted(int(r) for r in members)))
            count = c10d._world.group_count  # a group's name is the count (members or not)
            group = create_fn(ranks, *args, **kwargs)
            if c10d._world.group_count == count + 1:
                self.names.setdefault(frozenset(int(r) for r in members), str(count))
            return group

        self._saved = [(dist, "batch_isend_irecv", batch_fn), (c10d, "batch_isend_irecv", batch_fn),
                       (c10d, "_new_group_with_tag", create_fn)]
        dist.batch_isend_irecv = c10d.batch_isend_irecv = batch_isend_irecv
        c10d._new_group_with_tag = new_group_with_tag

    def uninstall(self) -> None:
        for owner, name, fn in self._saved:
            setattr(owner, name, fn)
        self._saved = []
