"""benchmarks/overhead.py: its intervals cover what they claim, each loop's timed region holds
that loop's own batch preparation (a delay put there shows up in that loop's steps only), and a
plain loop that packs differently is caught."""
from __future__ import annotations

import json
import math
import os
import random
import statistics
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import overhead  # noqa: E402
import plain_loop  # noqa: E402
from bench_utils import run_benchmark  # noqa: E402

SMALL = ["--nproc", "2", "--reps", "1", "--warmup", "1"]


def test_median_interval_is_the_order_statistics_of_the_binomial_table():
    # n = 10: P(Bin(10, 1/2) <= 1) = 11/1024 <= 2.5% < P(<= 2) = 56/1024, so [x_(2), x_(9)]
    assert overhead.median_ci([7, 3, 10, 1, 5, 9, 2, 8, 6, 4]) == (5.5, 2, 9)
    # n = 60 at 95%: [x_(22), x_(39)] (the textbook table's ranks)
    assert overhead.median_ci(range(1, 61))[1:] == (22, 39)
    assert all(math.isnan(b) for b in overhead.median_ci([1, 2, 3, 4, 5])[1:])  # too few for 95%


@pytest.mark.parametrize("stat", ["median", "total"])
def test_intervals_cover_the_true_ratio_at_their_level(stat):
    """Simulated step pairs with a true hcp / plain ratio of 0.97 and 20% log-normal noise per
    step: the 95% interval holds 0.97 in about 95% of 300 runs, never in far fewer (too narrow)
    nor in all of them with a width that says nothing (too wide)."""
    rng, true, hits, widths = random.Random(1), 0.97, 0, []
    for trial in range(300):
        plain = [rng.lognormvariate(0, 0.2) for _ in range(40)]
        hcp = [p / true * rng.lognormvariate(0, 0.05) for p in plain]
        if stat == "median":
            m, lo, hi = overhead.median_ci([b / a for a, b in zip(hcp, plain)])
        else:
            m, lo, hi = overhead.ratio_ci(plain, hcp, resamples=400, seed=trial)
        hits += lo <= true <= hi
        widths.append(hi - lo)
    assert 0.88 <= hits / 300 <= 0.995
    assert statistics.median(widths) < 0.06


def test_pairs_alternate_abba():
    orders = [overhead.pair_order(i) for i in range(4)]
    assert orders == [("hcp", "plain"), ("plain", "hcp")] * 2


@pytest.mark.slow
def test_each_loop_pays_for_its_own_batches(monkeypatch):
    """hcp's plan-ahead job for batch 2 (run during the step of batch 1, the first measured one)
    and the plain loop's batch building for batch 2 (its second measured step) each sleep 2 s:
    the hcp step of batch 1 takes at least that long, since the benchmark waits for the job
    inside hcp's step (were the job left to run on during the plain step, the wait would be
    split between steps); the plain step of batch 2 and the plain data section too."""
    from hcp.train.trainer import Trainer

    prepare, batches, delay = Trainer.prepare, plain_loop.PlainLoop.batches, 2.0

    def slow_prepare(self, *a, **k):
        if self.ahead.sampler.position == 2:  # the job's own batch while it runs (PlanAhead.next)
            time.sleep(delay)
        return prepare(self, *a, **k)

    def slow_batches(self):
        if self.step == 2:
            time.sleep(delay)
        return batches(self)

    monkeypatch.setattr(Trainer, "prepare", slow_prepare)  # the forked ranks inherit both
    monkeypatch.setattr(plain_loop.PlainLoop, "batches", slow_batches)
    out = run_benchmark("overhead", [*SMALL, "--steps", "2"])  # warm-up: batch 0; measured: 1, 2
    assert out["hcp"]["wall"][0] >= delay
    assert out["plain"]["wall"][1] >= delay
    assert out["sections"]["plain"]["data"][1] * 2 >= delay  # wall s per step, 2 steps


@pytest.mark.slow
def test_a_plain_loop_that_packs_differently_is_caught(monkeypatch):
    batches = plain_loop.PlainLoop.batches

    def one_more_micro_batch(self):
        out = batches(self)
        return out + out[-1:] if self.step == 1 else out  # its second step runs one twice

    monkeypatch.setattr(plain_loop.PlainLoop, "batches", one_more_micro_batch)
    with pytest.raises(SystemExit, match="the loops differ"):
        run_benchmark("overhead", [*SMALL, "--steps", "2"])


def test_pool_takes_every_pair_of_every_run(tmp_path):
    """Two runs of 30 pairs with hcp 3% slower, pooled: 60 pairs, so the interval is tighter
    than either run's and still holds the true ratio."""
    rng, paths, single = random.Random(2), [], []
    for k, true in enumerate((0.97, 0.97)):
        plain = [rng.lognormvariate(0, 0.2) for _ in range(30)]
        hcp = [w / true * rng.lognormvariate(0, 0.1) for w in plain]
        run = {"hcp": {"wall": hcp, "cpu": hcp}, "plain": {"wall": plain, "cpu": plain},
               "pairs": [b / a for a, b in zip(hcp, plain)], "load": [1.0, 1.0, 1.0]}
        paths.append(str(tmp_path / f"run{k}.json"))
        with open(paths[-1], "w") as f:
            json.dump(run, f)
        single.append(overhead.median_ci(run["pairs"]))
    pooled = run_benchmark("overhead", ["--pool", *paths])
    assert len(pooled["pairs"]) == 60
    assert pooled["median"][1] <= 0.97 <= pooled["median"][2]
    assert pooled["median"][2] - pooled["median"][1] < min(hi - lo for _, lo, hi in single)
