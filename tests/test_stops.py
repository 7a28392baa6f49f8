"""How local ranks stop (hcp.launch.supervise): a signal to the launching process alone reaches
every rank, a rank that dies is named with its step, and the hint names what is on disk.

The toy launches run `start_local_ranks` in a subprocess (the launcher a signal is sent to) with
ranks that only wait; `train.py` runs check the same with real training."""
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time
import types

import pytest

from cfg_utils import REPO

TOY = textwrap.dedent("""
    import os, signal, sys, time
    from hcp.launch.launch import start_local_ranks
    from hcp.launch.supervise import Interrupted, RankDied, record_step

    def rank(out):
        r = os.environ["RANK"]
        def mark(signum, frame):  # what reached this rank, written at once
            open(os.path.join(out, signal.Signals(signum).name + r), "w").close()
            sys.exit(128 + signum)
        signal.signal(signal.SIGINT, mark)
        signal.signal(signal.SIGUSR2, mark)
        if os.environ["WORLD_SIZE"] != "1":  # torch's terminate-on-failure races the marks
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        record_step(3)
        open(os.path.join(out, "pid" + r), "w").write(str(os.getpid()))
        time.sleep(120)

    if __name__ == "__main__":
        try:
            start_local_ranks(rank, int(sys.argv[2]), sys.argv[1])
        except Interrupted as e:
            print("interrupted", signal.Signals(e.signum).name)
        except RankDied as e:
            print("died:", e)
""")


def _toy(tmp_path, nproc=2):
    """The toy launcher, started; returns it once its ranks wait (their pids by rank)."""
    (tmp_path / "toy.py").write_text(TOY)
    proc = subprocess.Popen([sys.executable, str(tmp_path / "toy.py"), str(tmp_path), str(nproc)], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": REPO}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 120
    ranks = [str(r) for r in range(nproc)]
    while not all((tmp_path / f"pid{r}").exists() for r in ranks) and time.time() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    time.sleep(0.5)  # the pid files written in full
    return proc, [int((tmp_path / f"pid{r}").read_text()) for r in ranks]


def _finish(proc):
    try:
        return proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("the launcher did not end within 60 s: " + str(proc.communicate()))


@pytest.mark.slow
@pytest.mark.parametrize("sent, received", [("SIGINT", "SIGINT"), ("SIGTERM", "SIGUSR2")])
def test_a_signal_to_the_launcher_alone_reaches_every_rank(tmp_path, sent, received):
    """SIGINT goes on as SIGINT (stop now), SIGTERM as the preemption signal (save, then stop);
    the launcher returns only once every rank has stopped."""
    proc, _ = _toy(tmp_path)
    os.kill(proc.pid, getattr(signal, sent))
    out, err = _finish(proc)
    assert out.strip() == f"interrupted {sent}", err[-2000:]
    assert (tmp_path / f"{received}0").exists() and (tmp_path / f"{received}1").exists()


def test_a_signal_to_a_one_rank_launch_reaches_its_rank_in_process(tmp_path):
    """One rank runs in the launching process: SIGTERM still reaches the preemption handler
    (save, then stop), as SIGTERM so that its line names it, and the launcher reports the
    interruption, as with several ranks."""
    proc, pids = _toy(tmp_path, nproc=1)
    assert pids == [proc.pid]
    os.kill(proc.pid, signal.SIGTERM)
    out, err = _finish(proc)
    assert out.strip() == "interrupted SIGTERM", err[-2000:]
    assert (tmp_path / "SIGTERM0").exists()


@pytest.mark.slow
def test_a_killed_rank_is_named_with_its_signal_and_step(tmp_path):
    proc, pids = _toy(tmp_path)
    os.kill(pids[1], signal.SIGKILL)
    out, err = _finish(proc)
    assert out.strip() == ("died: rank 1/2 was killed by SIGKILL (sent by a user, a scheduler or "
                           "the out-of-memory killer) during step 4; the other ranks were stopped"), err[-2000:]


def test_the_killed_rank_is_named_even_when_a_peer_failed_first(tmp_path):
    """A peer that raised (it saw the killed rank's connection close) is not the cause; torch's
    own SIGTERM to the others is not either."""
    from hcp.launch.supervise import _died

    (tmp_path / "raised").write_text("traceback")
    procs = [types.SimpleNamespace(exitcode=c) for c in (1, -signal.SIGKILL, -signal.SIGTERM)]
    context = types.SimpleNamespace(processes=procs, error_files=[str(tmp_path / "raised"),
                                                                  str(tmp_path / "none1"), str(tmp_path / "none2")])
    assert str(_died(context, [5, 5, 5], 0)).startswith("rank 1/3 was killed by SIGKILL")
    procs[1].exitcode = 0
    assert _died(context, [5, 5, 5], 0) is None  # every failed rank raised: torch's traceback says it
    procs[2].exitcode = 3
    assert str(_died(context, [5, 5, -1], 0)) == ("rank 2/3 exited with code 3 before its first "
                                                   "training step; the other ranks were stopped")


def test_the_resume_hint_is_a_command_that_finds_the_checkpoint(tmp_path):
    """The default checkpoint.dir lies in the run directory, which a new run does not reuse: the
    hint names checkpoint.dir, quotes what the shell would change, and replaces resume=."""
    from hcp.entry import resume_hint

    ckpt = tmp_path / "ckpt"
    empty = resume_hint(str(ckpt), ["optim.lr=1e-3"])
    assert "no checkpoint was saved" in empty and "step 0" in empty and "resume=auto" not in empty
    (ckpt / "step_00000004").mkdir(parents=True)
    overrides = ["+recipe=llama_tiny", "graph.edges=[[vision,projector]]", "resume=PATH", "mode=train"]
    hint = resume_hint(str(ckpt), overrides)
    assert hint == (f"the last complete checkpoint is {ckpt / 'step_00000004'}; resume with `python "
                    f"train.py +recipe=llama_tiny 'graph.edges=[[vision,projector]]' resume=auto "
                    f"checkpoint.dir={ckpt}`")


def test_more_cpu_ranks_than_cores_warn_once_and_gpu_ranks_never():
    from hcp.launch.launch import oversubscribed

    cpu = types.SimpleNamespace(backend="gloo", nproc_per_node=16)
    assert oversubscribed(16, cpu, cores=2) == (
        "launcher.nproc_per_node=16 starts 16 CPU ranks on 2 cores: they take turns on the cores, "
        "so each step is slower than with at most 2 ranks (the results are the same)")
    assert oversubscribed(2, cpu, cores=2) is None
    assert oversubscribed(16, types.SimpleNamespace(backend="nccl", nproc_per_node=16), cores=2) is None


def test_the_default_run_on_two_cores_is_quiet_and_bf16_on_cpu_is_said():
    """The default (`nproc_per_node=auto`: 4 CPU ranks, what the default layouts need) on 2 cores
    warns of nothing; bf16 on CPU ranks, several times slower per step, is said; GPU ranks
    neither."""
    from hcp.launch.launch import oversubscribed, slow_precision

    default = types.SimpleNamespace(backend="auto", nproc_per_node="auto")
    assert oversubscribed(4, default, cores=2) is None
    assert "several times slower than with precision=fp32" in slow_precision("bf16", default)
    assert slow_precision("fp32", default) is None
    assert slow_precision("bf16", types.SimpleNamespace(backend="nccl", nproc_per_node=8)) is None


FAST = ["+recipe=llama_tiny", "launcher.nproc_per_node=2", "logger=none", "trainer.global_batch_size=4",
        "trainer.eval_every=0", "trainer.eval_samples=4", "trainer.progress_bar=false", "trainer.save_every=2"]


def _train_until_a_checkpoint(cwd, *args):
    """`python train.py FAST args` from `cwd` (default run directory) in its own session, once its
    step 2 checkpoint is on disk: (process, checkpoint folder)."""
    proc = subprocess.Popen([sys.executable, os.path.join(REPO, "train.py"), *FAST, *args], cwd=cwd,
                            env={**os.environ, "PYTHONPATH": REPO}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        found = list(cwd.glob("outputs/*/*/checkpoints/step_00000002"))
        if found:
            return proc, found[0].parent
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail("no step 2 checkpoint within 300 s: " + proc.communicate()[1][-3000:])


def _all_gone(proc) -> bool:
    """Every process of the launch's session has ended (no rank trains on)."""
    try:
        os.killpg(proc.pid, 0)
    except ProcessLookupError:
        return True
    os.killpg(proc.pid, signal.SIGKILL)
    return False


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("sent", ["SIGINT", "SIGTERM"])
def test_a_signal_to_the_launcher_stops_every_rank_and_its_hint_resumes(tmp_path, sent):
    """SIGINT or SIGTERM to the launching process alone (an IDE's stop button, a supervisor):
    every rank stops (under SIGTERM after saving at the next step boundary); the hint names the
    newest checkpoint on disk once all have stopped, and its command (default checkpoint.dir,
    inside the run directory) resumes from it."""
    from hcp.train.checkpoint import latest

    proc, ckpts = _train_until_a_checkpoint(tmp_path, "trainer.max_steps=400")
    os.kill(proc.pid, getattr(signal, sent))
    out, err = _finish(proc)
    assert proc.returncode == 128 + getattr(signal, sent) and _all_gone(proc), err[-3000:]
    m = re.fullmatch(rf"hcp: interrupted by {sent}; the last complete checkpoint is (\S+); "
                     r"resume with `(.+)`", err.strip().splitlines()[-1])
    assert m, err[-3000:]
    assert m[1] == latest(str(ckpts)) and m[1] >= str(ckpts / "step_00000002"), os.listdir(ckpts)
    time.sleep(3)
    assert latest(str(ckpts)) == m[1]  # no rank trains on
    if sent == "SIGINT":
        return
    step = int(m[1][-8:])  # saved on the way out, at the step boundary after the signal
    # the signal the launcher got is named, not the one it forwarded (SIGUSR2)
    assert f"hcp: SIGTERM at step {step}: checkpoint saved in {ckpts}; " in err, err[-3000:]
    cmd = shlex.split(m[2])
    assert cmd[:2] == ["python", "train.py"] and f"checkpoint.dir={ckpts}" in cmd
    cmd = [sys.executable, os.path.join(REPO, "train.py"),
           *[a for a in cmd[2:] if not a.startswith("trainer.max_steps=")], f"trainer.max_steps={step + 1}"]
    resumed = subprocess.run(["taskset", "-c", "0", *cmd], cwd=tmp_path, capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": REPO}, timeout=400)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from step {step} " in resumed.stdout, resumed.stdout[-3000:]
    # on one core the two CPU ranks take turns: said once, before they start
    assert resumed.stderr.count("hcp: warning: launcher.nproc_per_node=2 starts 2 CPU ranks on 1 core:") == 1
    if len(os.sched_getaffinity(0)) >= 2:
        assert "hcp: warning" not in err  # two ranks on two cores or more: nothing to say


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_killed_rank_ends_the_run_in_one_line_naming_it_its_step_and_the_checkpoint(tmp_path):
    from hcp.train.checkpoint import latest

    proc, ckpts = _train_until_a_checkpoint(tmp_path, "trainer.max_steps=400")
    rank1 = max(int(p) for p in open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split())
    os.kill(rank1, signal.SIGKILL)
    out, err = _finish(proc)
    assert proc.returncode == 1 and _all_gone(proc), err[-3000:]
    last = err.strip().splitlines()[-1]
    m = re.fullmatch(r"hcp: rank 1/2 was killed by SIGKILL \(sent by a user, a scheduler or the "
                     r"out-of-memory killer\) during step (\d+); the other ranks were stopped; the last "
                     r"complete checkpoint is (\S+); resume with `python train.py .* resume=auto "
                     r"checkpoint.dir=(\S+)`", last)
    assert m and m[2] == latest(str(ckpts)) and m[3] == str(ckpts), err[-3000:]
    assert int(m[1]) > int(m[2][-8:]) >= 2
    assert "Traceback" not in err and "HYDRA_FULL_ERROR" not in err, err[-3000:]


PLAIN = textwrap.dedent("""
    import os, signal, sys, time
    import torch, torch.distributed as dist
    import hcp.launch.supervise as supervise
    from hcp.launch.launch import start_local_ranks
    from hcp.launch.supervise import Interrupted
    from hcp.train.failures import report_rank_failure

    def rank(args):
        out, how = args
        r = int(os.environ["RANK"])
        with report_rank_failure():
            if how == "raise":
                dist.init_process_group("gloo")
                open(os.path.join(out, f"pid{r}"), "w").write(str(os.getpid()))
                if r == 1:
                    time.sleep(1)
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
                dist.all_reduce(torch.ones(1))  # the survivors: their peer vanishes
            if how == "deaf":  # a rank that ignores SIGINT (stuck, or its own handler)
                signal.signal(signal.SIGINT, signal.SIG_IGN)
            open(os.path.join(out, f"pid{r}"), "w").write(str(os.getpid()))
            time.sleep(120)

    if __name__ == "__main__":
        supervise.KILL_GRACE_S = 1.0
        if sys.argv[2] != "raise":  # started in the background of a shell script
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            start_local_ranks(rank, 3, (sys.argv[1], sys.argv[2]))
        except Interrupted as e:
            print("interrupted", signal.Signals(e.signum).name, file=sys.stderr)
        except Exception as e:  # hcp.launch.supervise.RankRaised
            print("hcp:", e, file=sys.stderr)
""")


def _plain(tmp_path, how):
    (tmp_path / "plain.py").write_text(PLAIN)
    proc = subprocess.Popen([sys.executable, str(tmp_path / "plain.py"), str(tmp_path), how],
                            cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    return proc


@pytest.mark.slow
def test_the_rank_that_raised_first_is_the_first_line_not_its_peers_lost_connections(tmp_path):
    """Rank 1 raises (an out-of-memory) while ranks 0 and 2 wait in a gloo all_reduce, which then
    fails on the closed connection: the first line of the launcher's output names rank 1 and its
    error; torch's "Terminating process" warnings and the survivors' own lines are not printed."""
    out, err = _finish(_plain(tmp_path, "raise"))
    lines = err.strip().splitlines()
    assert lines[0].startswith("hcp: rank 1/3 failed before its first training step: "
                               "torch.OutOfMemoryError: CUDA out of memory"), err[-3000:]
    assert "Terminating process" not in err and "hcp: rank 0/3" not in err, err[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["default", "deaf"])
def test_a_forwarded_sigint_stops_ranks_that_inherited_or_chose_to_ignore_it(tmp_path, how):
    """The launcher was started with SIGINT ignored (a background job of a shell script): its
    ranks still stop on the SIGINT it forwards. A rank that ignores SIGINT itself gets SIGTERM
    after the grace period (1 s here): the launcher never waits forever."""
    proc = _plain(tmp_path, how)
    deadline = time.time() + 120
    while not all((tmp_path / f"pid{r}").exists() for r in range(3)) and time.time() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    time.sleep(0.5)
    os.kill(proc.pid, signal.SIGINT)
    out, err = _finish(proc)
    assert err.strip().splitlines()[-1] == "interrupted SIGINT", err[-3000:]
    assert ("still running after SIGINT: sent SIGTERM" in err) == (how == "deaf"), err[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("sent", ["SIGTERM", "SIGUSR2"])
def test_a_plain_kill_of_torchrun_saves_and_stops_its_workers(tmp_path, sent):
    """torchrun forwards the signals of `--signals-to-handle` (SIGTERM by default; SIGUSR2 when
    listed) to its workers: they save at the next step boundary, then stop, before torchrun's
    `--shutdown-timeout` (30 s) runs out; no worker trains on."""
    listed = "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2"
    handle = [listed] if sent == "SIGUSR2" else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", *handle,
           os.path.join(REPO, "train.py"), *FAST, "trainer.max_steps=400"]
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 300
    saved = "outputs/*/checkpoints/step_00000002"
    while time.time() < deadline and proc.poll() is None and not list(tmp_path.glob(saved)):
        time.sleep(0.5)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    os.kill(proc.pid, getattr(signal, sent))
    out, err = _finish(proc)
    assert _all_gone(proc), err[-3000:]
    m = re.search(rf"hcp: {sent} at step (\d+): checkpoint saved in (\S+); ", err)
    assert m, err[-3000:]
    assert os.path.isdir(os.path.join(m[2], f"step_{int(m[1]):08d}"))
