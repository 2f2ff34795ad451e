"""A real single-host Slurm for the tests: munged, slurmctld and slurmd started from a minimal
slurm.conf under a temporary directory (their own ports, spool, state, logs and munge socket;
nothing under /etc or /var is used), and stopped again. Every daemon it starts, and every
task of the jobs they run, carries ``GPULAUNCH_SLURM_TEST=<root>`` in its environment;
slurmstepd (detached from slurmd, empty environment) runs in slurmd's working directory, the
root. That is how :meth:`SlurmCluster.stop` finds and kills whatever is left.

Debian/Ubuntu: ``apt-get install -y slurm-wlm munge`` (``.ci/run`` does it when missing).
Tested with Slurm 22.05 and munge 0.5.15 as root in a container without systemd.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

import psutil

BINARIES = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "sinfo", "squeue", "scancel")
MARKER = "GPULAUNCH_SLURM_TEST"
START_TIMEOUT_S = 60.0      # under load (2 shared cores) registration can take a while


class NotStartable(Exception):
    """Slurm cannot run here; the message says why (a missing binary, a daemon's log tail)."""


def which(name: str) -> str | None:
    """``name`` on PATH, or in the sbin directories a non-login PATH may lack (the daemons)."""
    extra = os.pathsep.join(["/usr/local/sbin", "/usr/sbin", "/sbin"])
    return shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), extra]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"({path.name}: no log)"
    return f"--- {path.name} (last {lines} lines)\n" + "\n".join(text[-lines:])


def clean_env(base: dict | None = None) -> dict:
    """``base`` (default: this process's environment) without any Slurm job variables, so that
    a test run inside a real Slurm job does not hand that job's ids to our srun."""
    env = dict(os.environ if base is None else base)
    for k in list(env):
        if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")):
            del env[k]
    return env


class SlurmCluster:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.host = socket.gethostname().split(".")[0]
        self.cpus = len(os.sched_getaffinity(0))
        self.conf = self.root / "slurm.conf"
        self.logs = self.root / "log"
        self.procs: dict[str, subprocess.Popen] = {}
        self.version = ""

    # ------------------------------------------------------------------ setup
    def write_conf(self) -> None:
        r = self.root
        for d in ("state", "spool", "log", "munge-key", "munge-run"):
            (r / d).mkdir(parents=True, exist_ok=True)
        os.chmod(r / "munge-key", 0o700)
        os.chmod(r / "munge-run", 0o755)
        key = r / "munge-key" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        user = psutil.Process().username()
        self.conf.write_text(f"""\
# Minimal single-host Slurm for gpulaunch's tests (tests/slurm_cluster.py)
ClusterName=gpulaunch-test
SlurmctldHost={self.host}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={r / "munge-run" / "munge.socket"}
StateSaveLocation={r / "state"}
SlurmdSpoolDir={r / "spool"}
SlurmctldPidFile={r / "slurmctld.pid"}
SlurmdPidFile={r / "slurmd.pid"}
SlurmctldLogFile={self.logs / "slurmctld.log"}
SlurmdLogFile={self.logs / "slurmd.log"}
# no cgroups, no accounting: what a container without systemd allows
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/linear
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
SlurmctldDebug=info
SlurmdDebug=info
NodeName={self.host} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN
PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP
""")

    def env(self, extra: dict | None = None, base: dict | None = None) -> dict:
        """An environment for Slurm commands (and, through srun, for the job)."""
        env = clean_env(base)
        env.update({"SLURM_CONF": str(self.conf), MARKER: str(self.root)})
        env.update(extra or {})
        return env

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.logs / f"{name}.out", "ab")
        self.procs[name] = subprocess.Popen(argv, env=self.env(), stdout=log,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True, cwd=self.root)
        log.close()

    def _check_alive(self) -> None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                raise NotStartable(f"{name} exited with code {p.returncode}\n" + self.log_tail())

    def start(self) -> None:
        missing = [b for b in BINARIES if which(b) is None]
        if missing:
            raise NotStartable(f"not installed: {', '.join(missing)} (apt-get install -y "
                               "slurm-wlm munge; .ci/run installs them)")
        if os.geteuid() != 0:
            raise NotStartable("slurmd needs root to start job steps; run the tests as root")
        self.write_conf()
        m = self.root / "munge-run"
        self._spawn("munged", [which("munged"), "--foreground", "--force",
                               f"--key-file={self.root / 'munge-key' / 'munge.key'}",
                               f"--socket={m / 'munge.socket'}", f"--pid-file={m / 'munged.pid'}",
                               f"--seed-file={m / 'munged.seed'}",
                               f"--log-file={self.logs / 'munged.log'}"])
        self._wait(lambda: (m / "munge.socket").exists(), "munged's socket")
        self._spawn("slurmctld", [which("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        self._spawn("slurmd", [which("slurmd"), "-D", "-f", str(self.conf), "-N", self.host])
        self._wait(lambda: self.node_state() == "idle", f"node {self.host} idle in sinfo")
        self.version = self.cmd(["sinfo", "--version"]).stdout.strip()

    def _wait(self, ready, what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready():
            self._check_alive()
            if time.monotonic() > deadline:
                raise NotStartable(f"no {what} after {START_TIMEOUT_S:.0f} s (sinfo: "
                                   f"{self.node_state()!r})\n" + self.log_tail())
            time.sleep(0.2)

    def node_state(self) -> str:
        try:
            out = self.cmd(["sinfo", "-h", "-N", "-o", "%T"], timeout=20).stdout
        except subprocess.TimeoutExpired:
            return "(sinfo timed out)"
        return out.strip().rstrip("*")

    def log_tail(self) -> str:
        names = ["munged.out", "slurmctld.log", "slurmctld.out", "slurmd.log", "slurmd.out"]
        return "\n".join(_tail(self.logs / n) for n in names)

    # ------------------------------------------------------------------ use
    def cmd(self, argv: list[str], *, env: dict | None = None, timeout: float = 60,
            **kw) -> subprocess.CompletedProcess:
        return subprocess.run(argv, env=env or self.env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                              timeout=timeout, **kw)

    def job(self, argv: list[str], *, env: dict, timeout: float = 120, **kw):
        """Run ``srun ...``/``sbatch --wait ...`` with a fresh step marker in the job's
        environment; returns (completed process, marker). A timeout cancels the job."""
        step = uuid.uuid4().hex
        try:
            p = self.cmd(argv, env={**env, "GPULAUNCH_SLURM_STEP": step}, timeout=timeout, **kw)
        except subprocess.TimeoutExpired:
            self.cmd(["scancel", "--full", "-u", str(os.getuid())], timeout=30)
            raise
        return p, step

    @staticmethod
    def processes_with(name: str, value: str) -> list[psutil.Process]:
        """Live processes whose environment has ``name=value``."""
        found = []
        for p in psutil.process_iter():
            try:
                if p.pid != os.getpid() and p.status() != psutil.STATUS_ZOMBIE \
                        and p.environ().get(name) == value:
                    found.append(p)
            except (psutil.Error, OSError):
                pass
        return found

    def processes_of_cluster(self) -> list[psutil.Process]:
        """The daemons, the jobs' tasks (marker in their environment) and slurmstepd (which
        has an empty environment but runs in slurmd's working directory, ``root``)."""
        found = {p.pid: p for p in self.processes_with(MARKER, str(self.root))}
        for p in psutil.process_iter():
            try:
                if p.pid not in found and p.status() != psutil.STATUS_ZOMBIE \
                        and p.cwd() == str(self.root):
                    found[p.pid] = p
            except (psutil.Error, OSError):
                pass
        return list(found.values())

    def leftovers_of(self, step: str, wait: float = 10.0) -> list[str]:
        """Processes of a job step still alive after ``wait`` seconds: ``pid name cmdline``."""
        deadline = time.monotonic() + wait
        while True:
            left = self.processes_with("GPULAUNCH_SLURM_STEP", step)
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        return [_describe(p) for p in left]

    @staticmethod
    def job_id(text: str) -> str | None:
        m = re.search(r"Submitted batch job (\d+)", text)
        return m.group(1) if m else None

    # ------------------------------------------------------------------ teardown
    def stop(self) -> list[str]:
        """Cancel every job, stop the daemons (TERM, then KILL), then kill anything still
        carrying this cluster's marker (slurmstepd, job tasks). Returns what had to be killed
        that way (empty when the daemons cleaned up after themselves)."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            try:
                self.cmd(["scancel", "--full", "-u", str(os.getuid())], timeout=20)
            except (subprocess.TimeoutExpired, OSError):
                pass
        for name in ("slurmd", "slurmctld", "munged"):
            p = self.procs.get(name)
            if p is None or p.poll() is not None:
                continue
            p.terminate()
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=15)
        left = self.processes_of_cluster()
        names = [_describe(p) for p in left]
        for p in left:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(left, timeout=10)
        return names


def _describe(p: psutil.Process) -> str:
    try:
        return f"{p.pid} {p.name()} {' '.join(p.cmdline())[:120]}"
    except psutil.Error:
        return f"{p.pid} (gone)"
