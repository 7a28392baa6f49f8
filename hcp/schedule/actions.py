"""A pipeline stage's schedule as a list of actions: compute, and batches of point-to-point ops.

- `Compute("F" | "B", i)`: the forward / backward of micro-batch i on this stage;
- `Exchange(ops)`: ops posted together in one `dist.batch_isend_irecv`, each `P2P(kind, i, peer)`
  with kind `SEND_F` / `RECV_F` (activation) or `SEND_B` / `RECV_B` (its gradient);
- `SyncGrads()`: the gradient reduction may start from here (`with_grad_sync`);
- the colocated step's `EncoderCompute("F" | "B")` and `Route("F" | "B", stream)`
  (`hcp.schedule.colocated`).
A lone NCCL send larger than its buffers waits for the peer's receive, so a schedule is safe
when each step's sends and the receives they can wait on are in one batch (checked by
`hcp.schedule.rendezvous`). The builders are pure: the one executor runs any list and the
simulators replay the same lists. Names follow torch.distributed.pipelining's `_ComputationType`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Union

P2P_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")


@dataclass(frozen=True)
class _Kinded:
    """An action with a `kind` checked at construction against the class's `KINDS`."""

    KINDS: ClassVar[tuple[str, ...]] = ("F", "B")
    kind: str

    def __post_init__(self):
        if self.kind not in self.KINDS:
            raise ValueError(f"{type(self).__name__} kind {self.kind!r}: use one of {self.KINDS}")


@dataclass(frozen=True)
class Compute(_Kinded):
    """Forward ("F") or backward ("B") of micro-batch `micro` on this stage."""

    micro: int


@dataclass(frozen=True)
class P2P(_Kinded):
    """One point-to-point op of micro-batch `micro` with stage `peer` (kind: `P2P_KINDS`)."""

    KINDS: ClassVar[tuple[str, ...]] = P2P_KINDS
    micro: int
    peer: int

    @property
    def is_send(self) -> bool:
        return self.kind.startswith("SEND")


@dataclass(frozen=True)
class Exchange:
    """Point-to-point ops posted together in one batch and waited together."""

    ops: tuple[P2P, ...]


@dataclass(frozen=True)
class SyncGrads:
    """The gradient reduction over DP may start: the backwards after it arm it
    (`hcp.schedule.executor.Executor`)."""


@dataclass(frozen=True)
class EncoderCompute(_Kinded):
    """Forward ("F") or backward ("B") of this rank's whole encoder side over all of its
    encoder inputs of the step (colocated: one batch per step, not one per micro-batch)."""


@dataclass(frozen=True)
class Route(_Kinded):
    """A collective over the route group: stream `stream`'s rows ("F", encoder -> LLM CP
    shards) or their gradients ("B", back). Every rank of the group runs it, 0 rows or not."""

    stream: str


Action = Union[Compute, Exchange, SyncGrads, EncoderCompute, Route]


def with_grad_sync(actions: list[Action]) -> list[Action]:
    """`actions` with `SyncGrads` before the last backward, so the DP reduction of the
    gradients overlaps it; unchanged when the list has no backward."""
    last = max((k for k, a in enumerate(actions) if isinstance(a, Compute) and a.kind == "B"),
               default=None)
    return list(actions) if last is None else [*actions[:last], SyncGrads(), *actions[last:]]


def colocated(llm: list[Action], streams) -> list[Action]:
    """The colocated three-phase step around the LLM's list `llm` (`hcp.schedule.colocated`):
    the encoder forward, each stream's forward route (in `streams` order), the LLM's actions,
    each stream's backward route, the encoder backward."""
    streams = tuple(streams)
    return [EncoderCompute("F"), *(Route("F", s) for s in streams), *llm,
            *(Route("B", s) for s in streams), EncoderCompute("B")]


def compute_order(actions: list[Action]) -> list[tuple[str, int]]:
    """The computes of `actions` in order: `[("F", 0), ..., ("B", m - 1)]`."""
    return [(a.kind, a.micro) for a in actions if isinstance(a, Compute)]


def _batch(*ops) -> list[Exchange]:
    """One Exchange of the ops that exist (None = no peer on that side), or nothing."""
    ops = tuple(op for op in ops if op is not None)
    return [Exchange(ops)] if ops else []


def one_f_one_b(stage: int, num_stages: int, num_micro: int) -> list[Action]:
    """Stage `stage` of `num_stages` running 1F1B over `num_micro` micro-batches.

    PipeDream-Flush (Narayanan et al. 2021), in Megatron-LM's order
    (`forward_backward_pipelining_without_interleaving`): `w = min(p - s - 1, m)` warm-up
    forwards (receive, forward, send), then m - w steady steps, each a forward, one batch of
    {send activation i + w, receive gradient i} with the next stage, a backward, and one batch
    of {send gradient i, receive activation i + w + 1} with the previous stage; then w cool-down
    backwards (receive gradient, backward, send gradient). With p = 1 it is plain gradient
    accumulation (F, B per micro-batch, nothing sent).

    Raises ValueError for a stage outside [0, num_stages) or a negative micro-batch count.
    """
    _check(stage, num_stages, num_micro)
    prev = [stage - 1] if stage > 0 else []
    nxt = [stage + 1] if stage + 1 < num_stages else []
    return one_f_one_b_peers(prev, nxt, min(num_stages - stage - 1, num_micro), num_micro)


def one_f_one_b_peers(prev: list[int], nxt: list[int], warmup: int, num_micro: int) -> list[Action]:
    """1F1B of one stage whose inputs come from the stages `prev` and whose output goes to the
    stages `nxt` (several on a join or a branch of a module graph, `hcp.schedule.graph`), with
    `warmup` forwards before the first backward (capped at num_micro). Each step's ops with
    ALL peers on one side share one batch: {send activation f to every next stage, receive
    gradient i from every next stage}, then {send gradient i to every previous stage, receive
    activation f + 1 from every previous stage}. A backward runs on the sum of the gradients
    its next stages returned (the executor's business)."""
    if num_micro < 0 or warmup < 0:
        raise ValueError(f"num_micro ({num_micro}) and warmup ({warmup}) must be >= 0")

    def ops(kind, i, peers):
        return [P2P(kind, i, p) for p in peers]

    warmup = min(warmup, num_micro)
    steady = num_micro - warmup
    out: list[Action] = []
    for i in range(warmup):
        out += _batch(*ops("RECV_F", i, prev))
        out.append(Compute("F", i))
        out += _batch(*ops("SEND_F", i, nxt))
    if steady:
        out += _batch(*ops("RECV_F", warmup, prev))
    for i in range(steady):
        f = warmup + i
        out.append(Compute("F", f))
        out += _batch(*ops("SEND_F", f, nxt), *ops("RECV_B", i, nxt))
        out.append(Compute("B", i))
        more = i + 1 < steady
        out += _batch(*ops("SEND_B", i, prev), *(ops("RECV_F", f + 1, prev) if more else []))
    for i in range(steady, num_micro):
        out += _batch(*ops("RECV_B", i, nxt))
        out.append(Compute("B", i))
        out += _batch(*ops("SEND_B", i, prev))
    return out


def forward_only(stage: int, num_stages: int, num_micro: int) -> list[Action]:
    """Stage `stage` forwarding `num_micro` micro-batches (evaluation): receive, forward, send,
    per micro-batch. Raises ValueError like `one_f_one_b`."""
    _check(stage, num_stages, num_micro)
    out: list[Action] = []
    for i in range(num_micro):
        out += _batch(P2P("RECV_F", i, stage - 1) if stage > 0 else None)
        out.append(Compute("F", i))
        out += _batch(P2P("SEND_F", i, stage + 1) if stage + 1 < num_stages else None)
    return out


def _check(stage: int, num_stages: int, num_micro: int) -> None:
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} is outside [0, {num_stages})")
    if num_micro < 0:
        raise ValueError(f"number of micro-batches must be >= 0, got {num_micro}")
