"""1F1B timing model: a hand-computed timeline and dependency properties."""
import numpy as np
from hypothesis import given, settings, strategies as st

from hcp.schedule.actions import compute_order, one_f_one_b
from hcp.schedule.simulator import simulate_1f1b, stage_order

# 3 stages, 4 micro-batches, F = 1 s, B = 2 s. Worked by hand from the 1F1B orders:
# stage 0: F0 F1 F2 B0 F3 B1 B2 B3; stage 1: F0 F1 B0 F2 B1 F3 B2 B3; stage 2: F0 B0 F1 B1 ...
HAND = {
    (0, "F", 0): (0, 1), (0, "F", 1): (1, 2), (0, "F", 2): (2, 3), (0, "B", 0): (7, 9),
    (0, "F", 3): (9, 10), (0, "B", 1): (10, 12), (0, "B", 2): (13, 15), (0, "B", 3): (16, 18),
    (1, "F", 0): (1, 2), (1, "F", 1): (2, 3), (1, "B", 0): (5, 7), (1, "F", 2): (7, 8),
    (1, "B", 1): (8, 10), (1, "F", 3): (10, 11), (1, "B", 2): (11, 13), (1, "B", 3): (14, 16),
    (2, "F", 0): (2, 3), (2, "B", 0): (3, 5), (2, "F", 1): (5, 6), (2, "B", 1): (6, 8),
    (2, "F", 2): (8, 9), (2, "B", 2): (9, 11), (2, "F", 3): (11, 12), (2, "B", 3): (12, 14),
}


def test_hand_computed_three_stage_four_micro_batch_timeline():
    tl = simulate_1f1b(np.ones((3, 4)), 2 * np.ones((3, 4)))
    got = {(o.stage, o.kind, o.micro_batch): (o.start, o.end) for o in tl.ops}
    assert got == HAND
    assert tl.iteration_time == 18.0  # (M + p - 1) (F + B) for uniform micro-batches
    assert [tl.busy(s) for s in range(3)] == [12.0, 12.0, 12.0]


def test_stage_order_is_warmup_steady_cooldown():
    assert stage_order(0, 3, 4) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1),
                                    ("B", 2), ("B", 3)]
    assert stage_order(0, 4, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]


def test_stage_order_is_the_executors_action_list():
    """The simulator's direct order (built without actions, for the solver's speed) is the
    computes of the action list the executor runs, on every stage, short and long pipelines."""
    for p in (1, 2, 3, 8):
        for m in (0, 1, 2, 5, 9, 40):
            for s in range(p):
                assert stage_order(s, p, m) == compute_order(one_f_one_b(s, p, m)), (s, p, m)


@settings(max_examples=60, derandomize=True, deadline=None)
@given(st.integers(1, 9), st.integers(1, 12), st.integers(0, 10**6))
def test_dependencies_and_no_overlap(p, m, seed):
    rng = np.random.default_rng(seed)
    fwd, bwd = rng.uniform(0.1, 2, (p, m)), rng.uniform(0.1, 4, (p, m))
    tl = simulate_1f1b(fwd, bwd)
    end = {(o.stage, o.kind, o.micro_batch): o.end for o in tl.ops}
    for o in tl.ops:
        dur = (fwd if o.kind == "F" else bwd)[o.stage, o.micro_batch]
        assert np.isclose(o.end - o.start, dur)
        if o.kind == "F" and o.stage:
            assert o.start >= end[o.stage - 1, "F", o.micro_batch] - 1e-12
        if o.kind == "B":
            dep = (o.stage + 1, "B", o.micro_batch) if o.stage < p - 1 else (o.stage, "F", o.micro_batch)
            assert o.start >= end[dep] - 1e-12
    for s in range(p):
        ops = sorted((o for o in tl.ops if o.stage == s), key=lambda o: o.start)
        assert all(a.end <= b.start + 1e-12 for a, b in zip(ops, ops[1:]))
        # in the stage's 1F1B order, each op as early as allowed: when the stage is free and
        # its dependency has ended
        assert [(o.kind, o.micro_batch) for o in ops] == stage_order(s, p, m)
        for prev, o in zip([None] + ops, ops):
            if o.kind == "F":
                dep = end[s - 1, "F", o.micro_batch] if s else 0.0
            else:
                dep = end[(s + 1, "B", o.micro_batch) if s < p - 1 else (s, "F", o.micro_batch)]
            assert o.start == max(prev.end if prev else 0.0, dep)
    assert tl.iteration_time >= max(fwd.sum(1) + bwd.sum(1)) - 1e-9
