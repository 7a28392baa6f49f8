"""1F1B as action lists (issue 10 part 2): every stage's list finishes under NCCL's rendezvous
semantics (a send completes only when its receive is posted in the same batch or earlier), and
the order the project used before (a lone `isend`, then a blocking `recv`) does not."""
from __future__ import annotations

import pytest

from hcp.schedule.actions import Compute, Exchange, P2P, forward_only, one_f_one_b
from hcp.schedule.rendezvous import ScheduleDeadlock, run_rendezvous

GRID = [(p, m) for p in (2, 3, 4) for m in range(1, 10)]


def unbatched_isend_then_recv(stage, num_stages, num_micro):
    """The previous executor's order: every op alone (isend posted, then a blocking recv)."""
    prev = stage - 1 if stage > 0 else None
    nxt = stage + 1 if stage + 1 < num_stages else None
    out = []

    def alone(kind, i, peer):
        if peer is not None:
            out.append(Exchange((P2P(kind, i, peer),)))

    def forward(i):
        alone("RECV_F", i, prev)
        out.append(Compute("F", i))
        alone("SEND_F", i, nxt)

    def backward(i):
        alone("RECV_B", i, nxt)
        out.append(Compute("B", i))
        alone("SEND_B", i, prev)

    warmup = min(num_stages - stage - 1, num_micro)
    for i in range(warmup):
        forward(i)
    for i in range(warmup, num_micro):
        forward(i)
        backward(i - warmup)
    for i in range(num_micro - warmup, num_micro):
        backward(i)
    return out


@pytest.mark.parametrize("p,m", GRID)
def test_1f1b_action_lists_finish_under_rendezvous(p, m):
    programs = [one_f_one_b(s, p, m) for s in range(p)]
    log = run_rendezvous(programs)
    for s, prog in enumerate(programs):
        computes = [a for a in prog if isinstance(a, Compute)]
        assert sorted((a.kind, a.micro) for a in computes) == sorted(
            (k, i) for k in "FB" for i in range(m))
        # 1F1B's memory bound: at most min(p - s, m) micro-batches' activations alive
        alive = peak = 0
        for a in computes:
            alive += 1 if a.kind == "F" else -1
            peak = max(peak, alive)
        assert peak == min(p - s, m)
        # sends to the next stage and receives from it share batches in the steady state
        if s + 1 < p and m > p - s - 1:
            assert any({o.kind for o in a.ops} == {"SEND_F", "RECV_B"} for a in prog
                       if isinstance(a, Exchange))
    assert len(log) == sum(map(len, programs))


@pytest.mark.parametrize("p,m", GRID)
def test_forward_only_action_lists_finish_under_rendezvous(p, m):
    run_rendezvous([forward_only(s, p, m) for s in range(p)])


def test_the_previous_unbatched_order_deadlocks_once_neighbours_are_both_steady():
    stuck = {(p, m) for p, m in GRID
             if _deadlocks([unbatched_isend_then_recv(s, p, m) for s in range(p)])}
    # stage p-2 sends activation i while stage p-1 sends gradient i-1 back: both wait
    assert stuck == {(p, m) for p, m in GRID if m >= 2}


def _deadlocks(programs) -> bool:
    try:
        run_rendezvous(programs)
    except ScheduleDeadlock:
        return True
    return False


def test_one_stage_is_gradient_accumulation_with_nothing_sent():
    assert one_f_one_b(0, 1, 3) == [Compute(k, i) for i in range(3) for k in "FB"]


def test_a_send_received_as_another_message_is_an_error():
    a = [Compute("F", 0), Compute("F", 1), Exchange((P2P("SEND_F", 1, 1),))]
    b = [Exchange((P2P("RECV_F", 0, 0),)), Compute("F", 0)]
    with pytest.raises(ValueError, match="is received as"):
        run_rendezvous([a, b])


def test_a_forward_before_its_activation_arrives_is_an_error():
    a = [Compute("F", 0), Exchange((P2P("SEND_F", 0, 1),))]
    b = [Compute("F", 0), Exchange((P2P("RECV_F", 0, 0),))]
    with pytest.raises(ValueError, match="runs before"):
        run_rendezvous([a, b])


def test_bad_stage_or_count_is_rejected():
    with pytest.raises(ValueError, match="outside"):
        one_f_one_b(2, 2, 1)
    with pytest.raises(ValueError, match=">= 0"):
        forward_only(0, 2, -1)


def test_a_negative_warmup_or_count_alone_is_rejected_by_the_graph_stages_1f1b():
    from hcp.schedule.actions import one_f_one_b_peers

    with pytest.raises(ValueError, match="must be >= 0"):
        one_f_one_b_peers([], [1], -1, 2)  # warmup alone (a found mutant: `or` -> `and`)
    with pytest.raises(ValueError, match="must be >= 0"):
        one_f_one_b_peers([], [1], 1, -2)
