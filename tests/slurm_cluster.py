"""A real one-node SLURM cluster for tests/test_slurm.py: munged, slurmctld and slurmd started
as root on 127.0.0.1 from a unique state folder under /tmp, stopped by pid afterwards.

`ensure_slurm()` installs the Debian packages (`slurmctld slurmd slurm-client munge`,
--no-install-recommends) when they are missing, or says why it cannot (the caller skips).
Facts this set-up relies on (found on these machines):
- SlurmdParameters=config_overrides lets the node declare 8 CPUs on 2 cores;
- ProctrackType=proctrack/linuxproc and TaskPlugin=task/none (no cgroups here);
- AuthInfo cred_expire=10 (the default 120 s delays every requeue by two minutes);
- preemption: PreemptType=preempt/partition_prio, PreemptMode=REQUEUE, a higher-priority
  partition `urgent`, and SlurmctldParameters=preempt_send_user_signal so the job's --signal
  comes at preemption;
- no accounting (no slurmdbd): `sacct` fails, so nothing here relies on it.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
BINARIES = ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "munged")


def ensure_slurm(timeout: float = 240) -> str | None:
    """None when SLURM's binaries are there (installing them if needed); else why not."""
    if all(shutil.which(b) for b in BINARIES):
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "SLURM is not installed and this is not root on Debian (apt-get)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        t0 = time.monotonic()
        subprocess.run(["apt-get", "update", "-qq"], env=env, timeout=timeout, capture_output=True, check=True)
        subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES], env=env,
                       timeout=max(30.0, timeout - (time.monotonic() - t0)), capture_output=True, check=True)
    except (subprocess.SubprocessError, OSError) as e:
        detail = getattr(e, "stderr", b"") or b""
        return f"cannot install {' '.join(PACKAGES)}: {e} {detail.decode(errors='replace')[-300:]}"
    missing = [b for b in BINARIES if not shutil.which(b)]
    return f"installed, but still missing {missing}" if missing else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CONF = """ClusterName=hcptest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge.sock,cred_expire=10
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=2
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
RequeueExit=85
KillWait=5
MessageTimeout=20
MpiDefault=none
MailProg=/bin/true
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
SlurmctldParameters=preempt_send_user_signal
NodeName={host} NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN
PartitionName=main Nodes={host} Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=120
PartitionName=urgent Nodes={host} MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
"""


class Cluster:
    """A started cluster: `env` for clients (SLURM_CONF), `run(cmd)`, `job_state(id)`,
    `wait_state(id, states, timeout)`, and `stop()` (idempotent)."""

    def __init__(self):
        self.root = tempfile.mkdtemp(prefix="hcp-slurm-", dir="/tmp")
        self.conf = os.path.join(self.root, "slurm.conf")
        self.env = {**os.environ, "SLURM_CONF": self.conf}
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, timeout: float = 30) -> "Cluster":
        r, host = self.root, socket.gethostname()
        for d in ("state", "spool"):
            os.makedirs(os.path.join(r, d))
        with open(os.path.join(r, "munge.key"), "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(os.path.join(r, "munge.key"), 0o400)
        with open(self.conf, "w") as f:
            f.write(CONF.format(host=host, root=r, ctld_port=_free_port(), d_port=_free_port()))
        self._spawn("munged", ["munged", "-F", "--force", f"--socket={r}/munge.sock",
                               f"--key-file={r}/munge.key", f"--pid-file={r}/munged.pid",
                               f"--seed-file={r}/munged.seed"])
        self._wait(lambda: os.path.exists(f"{r}/munge.sock"), 10, "munged socket")
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", self.conf])
        self._spawn("slurmd", ["slurmd", "-D", "-N", host, "-f", self.conf])
        self._wait(lambda: "idle" in self.run(["sinfo", "-h", "-o", "%T"], check=False).stdout,
                   timeout, "an idle node")
        return self

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(os.path.join(self.root, f"{name}.out"), "w")
        self.procs[name] = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)

    def _wait(self, ok, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ok():
                return
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited with {p.returncode} waiting for {what}: "
                                       + self.tail(f"{name}.out"))
            time.sleep(0.2)
        raise TimeoutError(f"no {what} after {timeout} s: " + self.tail("slurmctld.log") + self.tail("slurmd.log"))

    def tail(self, name: str, lines: int = 20) -> str:
        path = os.path.join(self.root, name)
        if not os.path.exists(path):
            return ""
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])

    def run(self, cmd: list[str], check: bool = True, timeout: float = 60, env=None) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, env={**self.env, **(env or {})}, capture_output=True, text=True,
                              timeout=timeout, check=check)

    def job(self, job_id: str) -> dict:
        """`scontrol show job` as {key: value} (JobState, Restarts, ExitCode, ...); {} if gone."""
        out = self.run(["scontrol", "-o", "show", "job", job_id], check=False).stdout
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    def wait_state(self, job_id: str, states: set[str], timeout: float) -> dict:
        """Poll until the job is in one of `states`; return its fields. Raises TimeoutError."""
        deadline, info = time.monotonic() + timeout, {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} not in {states} after {timeout} s: {info.get('JobState')} "
                           f"{info.get('Reason')}\n" + self.tail("slurmctld.log"))

    def _our_pids(self) -> list[int]:
        """Processes (job steps, their tasks) whose environment names this cluster's config."""
        mark, pids = f"SLURM_CONF={self.conf}".encode(), []
        for d in os.listdir("/proc"):
            if d.isdigit() and int(d) != os.getpid():
                try:
                    with open(f"/proc/{d}/environ", "rb") as f:
                        if mark in f.read().split(b"\0"):
                            pids.append(int(d))
                except OSError:
                    pass
        return pids

    def stop(self) -> None:
        """Cancel every job, stop slurmd, slurmctld and munged by pid, then any process still
        carrying this cluster's SLURM_CONF (job steps); remove the state folder."""
        if not self.procs:
            return
        if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            self.run(["scancel", "--user=root"], check=False, timeout=20)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and self.run(["squeue", "-h"], check=False, timeout=20).stdout.strip():
                time.sleep(0.5)
        for name in ("slurmd", "slurmctld", "munged"):
            p = self.procs.pop(name, None)
            if p and p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)
        for pid in self._our_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self.procs.clear()
        shutil.rmtree(self.root, ignore_errors=True)
