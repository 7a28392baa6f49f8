"""Long runs (docs/long_runs.md): a profile of chosen steps, the run's plot, a slow rank named, a
stuck collective named, and a limit on skipped non-finite steps, each through `train.py`.

A slow or stuck rank is planted by a driver that patches hcp in the launching process and then
runs `train.py` (`DRIVER`): the forked ranks inherit the patch, production code has no hook."""
import json
import os
import subprocess
import sys
import textwrap
import time
import types

import pytest
import torch

from cfg_utils import REPO, compose_cfg, logged_steps
from dist_utils import run_ranks

TINY = ["+recipe=llama_tiny", "trainer.eval_samples=4", "trainer.log_every=1",
        "trainer.progress_bar=false", "trainer.micro_batch_tokens=256", "data.max_seq_len=256",
        "logger=none"]

DRIVER = textwrap.dedent("""
    import os, runpy, sys, time
    import hcp.train.trainer as T

    plant = sys.argv.pop(1)
    if plant == "slow":  # rank 1 loads its data slowly (on the plan-ahead thread)
        prepare = T.Trainer.prepare
        def slow(self, *args, **kwargs):
            if os.environ["RANK"] == "1":
                time.sleep(2.0)
            return prepare(self, *args, **kwargs)
        T.Trainer.prepare = slow
    if plant == "hang":  # rank 1 skips step 3's plan check: rank 0's all-reduce never completes
        check = T.check_plans_agree
        def skip(checksum, step, device):
            if not (os.environ["RANK"] == "1" and step == 3):
                check(checksum, step, device)
        T.check_plans_agree = skip
    sys.argv = ["train.py", *sys.argv[1:]]
    runpy.run_path("train.py", run_name="__main__")
""")


def _train(tmp_path, args, plant="none", env=None, ranks=2, timeout=300):
    """`train.py *args` on `ranks` CPU ranks (DP) through `DRIVER` with `plant`; returns the
    finished process."""
    (tmp_path / "driver.py").write_text(DRIVER)
    run_dir = tmp_path / "run"
    return subprocess.run([sys.executable, str(tmp_path / "driver.py"), plant, *TINY, *args,
                           f"launcher.nproc_per_node={ranks}",
                           f"trainer.global_batch_size={4 * ranks}", f"hydra.run.dir={run_dir}"],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": REPO, **(env or {})})


@pytest.mark.slow
def test_profile_plot_and_a_slow_rank_named(tmp_path):
    """profile.steps=[2,3]: one Chrome trace per rank with hcp's actions as ranges; on CPU
    profile.memory says there is no snapshot; metrics.png is drawn; of 3 ranks, rank 1, whose
    data takes 2 s a step, is named by the straggler line (log_every=2), and no other rank is."""
    proc = _train(tmp_path, ["trainer.max_steps=5", "trainer.eval_every=3", "profile.steps=[2,3]",
                             "profile.memory=true", "trainer.log_every=2"], "slow", ranks=3)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "run"
    out = proc.stdout
    assert "hcp: profile.memory: no CUDA memory snapshot on cpu ranks" in out
    assert f"hcp: profile of steps 2-3: traces of every rank in {run / 'profile'}" in out
    for rank in (0, 1, 2):
        with open(run / "profile" / f"rank{rank}_steps2-3.json") as f:
            names = {e.get("name", "") for e in json.load(f)["traceEvents"]}
        for name in ("hcp.step 2", "hcp.step 3", "hcp.data_wait", "hcp.forward mb0",
                     "hcp.backward mb0", "hcp.grad_sync", "hcp.clip", "hcp.optimizer"):
            assert name in names, (rank, name)
        assert "hcp.step 1" not in names and "hcp.step 4" not in names  # only the steps asked for
    assert (run / "metrics.png").stat().st_size > 10_000
    stragglers = [line for line in out.splitlines() if line.startswith("hcp: straggler:")]
    assert stragglers, out
    assert all(line.startswith("hcp: straggler: rank 1 took") for line in stragglers), out
    assert "trainer.straggler_factor=2)" in stragglers[0]
    assert [r["step"] for r in logged_steps(run)] == [2, 3, 4, 5]


@pytest.mark.slow
def test_a_skipped_collective_ends_the_run_within_the_timeout_naming_rank_and_op(tmp_path):
    """Rank 1 skips step 3's plan-check all-reduce: rank 0's gloo all-reduce times out after
    launcher.timeout_s=4 s and its error names rank 0, the step, the op, its group and the hcp
    call that issued it; its flight recorder is dumped into the run directory."""
    t0 = time.monotonic()
    proc = _train(tmp_path, ["trainer.max_steps=6", "trainer.eval_every=0", "launcher.timeout_s=4"],
                  "hang")
    assert proc.returncode != 0
    assert time.monotonic() - t0 < 120
    line = next((s for s in proc.stderr.splitlines() if s.startswith("hcp: rank 0/2")),
                proc.stderr[-3000:])
    assert ("CollectiveTimeout: rank 0 at step 3: collective gloo:all_reduce #" in line
            and "on process group default_pg (ranks [0, 1]" in line
            and "hcp/train/plan_check.py" in line and "(check_plans_agree)" in line
            and "within launcher.timeout_s=4" in line), line
    assert (tmp_path / "run" / "flight_recorder" / "rank_0").stat().st_size > 0


@pytest.mark.slow
def test_skipped_nonfinite_steps_are_said_and_the_limit_stops_naming_step_and_batch(tmp_path):
    """Steps 2, 3 and 4 are non-finite under on_nonfinite=skip, max_skipped_steps=2: steps 2
    and 3 are skipped with a line each, step 4 stops the run naming the step and its batch."""
    proc = _train(tmp_path, ["trainer.max_steps=6", "trainer.eval_every=0",
                             "trainer.on_nonfinite=skip", "trainer.max_skipped_steps=2"],
                  env={"HCP_TEST_NONFINITE_STEP": "2,3,4"})
    assert proc.returncode != 0
    err = proc.stderr
    assert "hcp: step 2: loss=nan grad_norm=nan is not finite; update skipped (1 skipped so far, " \
           "trainer.max_skipped_steps=2; trainer.on_nonfinite=skip); global batch: samples [" in err
    assert "hcp: step 3: loss=nan" in err and "(2 skipped so far" in err
    assert ("NonFiniteError: step 4: loss=nan grad_norm=nan is not finite; stopped before the "
            "update (2 steps skipped already: trainer.max_skipped_steps=2, at steps [2, 3]); "
            "global batch: samples [") in err, err[-3000:]


def _stats(rank, world, steps):
    """`steps` steps of `WorldStats` with a watch on rank 0; rank r computes r + 1 s, rank 2
    waits 10 s for data. Counts the collectives issued."""
    import torch.distributed as dist

    import hcp.train.throughput as throughput
    from hcp.train.stragglers import StragglerWatch

    calls = []
    gather = dist.all_gather
    dist.all_gather = lambda *a, **k: calls.append(1) or gather(*a, **k)
    dist.all_reduce = dist.broadcast = None  # calling either fails the test
    watch = StragglerWatch(2.0) if rank == 0 else None
    stats = throughput.WorldStats(torch.device("cpu"), None, watch)
    for _ in range(steps):
        times = types.SimpleNamespace(busy_s=rank + 1.0, wall_s=20.0)
        stats.issue({}, times, 10.0 if rank == 2 else 0.0)
    stats.settle()
    return len(calls), stats.watch.report(steps) if stats.watch else None


def test_rank_times_ride_in_the_step_gather_and_the_slow_rank_is_named():
    """Each step issues one all-gather, as before; rank 0 sums every rank's seconds from it and
    names rank 2 (13 s a step against the median 2 s), not rank 1 (2 s)."""
    results = run_ranks(_stats, 3, 4)
    assert [n for n, _ in results] == [4, 4, 4]
    lines = results[0][1]
    assert lines == ["hcp: straggler: rank 2 took 13.000 s per step (compute 3.000 s + data wait "
                     "10.000 s) over steps 1-4, 6.5x the median rank's 2.000 s "
                     "(trainer.straggler_factor=2)"]


def _cp_ranges(rank, world):
    """Names of the profiler ranges of one CP attention forward + backward per `cp_comm`."""
    import torch.distributed as dist

    from hcp.model.cp_attention import build_cp_plan, cp_attention
    from test_cp_attention import MIX, local_run, qkvw

    names = {}
    for comm in ("allgather", "p2p"):
        plan = build_cp_plan(qkvw(MIX)[0], dist.group.WORLD, comm)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            local_run(MIX, torch.float32, world, rank, lambda q, k, v: cp_attention(q, k, v, plan))
        names[comm] = {e.name for e in prof.events() if e.name.startswith("hcp.")}
    return names


def test_cp_attention_forward_and_backward_are_named_ranges_in_a_profile():
    for names in run_ranks(_cp_ranges, 2, timeout=80):
        for comm in ("allgather", "p2p"):
            assert names[comm] == {f"hcp.cp_attention_forward {comm}",
                                   f"hcp.cp_attention_backward {comm}"}


@pytest.mark.parametrize("override", ["profile.steps=[3,2]", "profile.steps=[0]",
                                      "profile.steps=[2,500]", "profile.steps=[1,2,3]",
                                      "trainer.straggler_factor=0.5", "trainer.loss_spike_factor=1",
                                      "trainer.max_skipped_steps=-1"])
def test_bad_long_run_values_name_field_value_and_fix(override):
    field = override.split("=")[0]
    from hcp.config.errors import ConfigError
    from hcp.config.validate import validate

    with pytest.raises(ConfigError) as err:
        validate(compose_cfg([override]), 4)
    assert str(err.value).startswith(f"{field}=") and "Fix:" in str(err.value)
    validate(compose_cfg(["profile.steps=[2,3]", "trainer.straggler_factor=0",
                          "trainer.loss_spike_factor=5", "trainer.max_skipped_steps=null"]), 4)


def _not_a_collective(rank, world):
    """A timeout raised outside torch.distributed, and a collective's, on gloo ranks."""
    from hcp.launch.watchdog import stuck_collective

    import torch.distributed as dist

    dist.all_reduce(torch.ones(3))
    try:
        raise TimeoutError("data loader timed out")
    except TimeoutError as e:
        return stuck_collective(e, 5.0, 1)


def test_a_timeout_outside_torch_distributed_is_not_called_a_stuck_collective():
    assert run_ranks(_not_a_collective, 2) == [None, None]


def test_a_loss_spike_is_said_with_its_batch_once_the_window_is_full(capsys, monkeypatch):
    """A high first loss is no spike (no window yet); then 20 steps at loss 2.0 fill the window
    and 9.0 at step 22 is 4.5x their mean: one line naming the step and its batch, and the update
    goes on. With the factor 0 (the default) nothing is said."""
    from hcp.train.failures import NonFiniteGuard

    monkeypatch.setenv("RANK", "0")
    said = {}
    for factor in (3.0, 0.0):
        guard = NonFiniteGuard("stop", torch.nn.Linear(1, 1), "/nonexistent", spike_factor=factor)
        assert guard.update_ok(1, 9.0, 1.0, [0])
        assert all(guard.update_ok(s, 2.0, 1.0, [s]) for s in range(2, 22))
        assert guard.update_ok(22, 9.0, 1.0, [7, 3])
        said[factor] = [x for x in capsys.readouterr().err.splitlines() if "loss spike" in x]
    assert said == {3.0: ["hcp: step 22: loss spike: 9 is 4.5x the mean 2 of the previous 20 steps "
                          "(trainer.loss_spike_factor=3; the update goes on); global batch: "
                          "samples [7, 3]"], 0.0: []}


def test_the_commands_of_docs_long_runs_compose_and_validate():
    import re
    import shlex

    from hcp.config.validate import validate

    with open(os.path.join(REPO, "docs", "long_runs.md")) as f:
        blocks = re.findall(r"```bash\n(.*?)```", f.read(), re.S)
    lines = [line for block in blocks for line in block.strip().splitlines()]
    assert len(lines) == 3
    for line in lines:
        args = shlex.split(line)
        validate(compose_cfg(args[args.index("train.py") + 1:]), 4)
