"""A real SLURM cluster on this machine: munged, slurmctld and two slurmd as fake nodes n1 and n2.

Started from the Debian packages (`scripts/setup-slurm.sh` installs them), in a private folder with its own
slurm.conf, munge socket and free ports, and stopped by the PIDs it started. Node names do not resolve here, so
jobs reach JAX's coordinator through JAX_COORDINATOR_ADDRESS on loopback, as a site whose node names do not
resolve on the training network would set it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from maxtext_moe.run.distributed import free_port

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue")
KILL_WAIT_S = 10  # SIGTERM to SIGKILL when SLURM ends a step: the time a process has to save and stop
# A job credential's lifetime, which is also how long a requeued job waits before it starts again (120 s by default;
# a requeued job started sooner is killed with "Job credential revoked").
CRED_EXPIRE_S = 10


def missing() -> list[str]:
    return [d for d in DAEMONS if shutil.which(d) is None and not Path(f"/usr/sbin/{d}").exists()]


def _free_ports(n: int) -> list[int]:
    """n distinct ports for the daemons, which bind them in processes of their own, as a coordinator does."""
    ports: list[int] = []
    while len(ports) < n:
        if (port := free_port()) not in ports:
            ports.append(port)
    return ports


CONF = """\
ClusterName=mtmtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={dir}/munge.sock,cred_expire={cred_expire}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool-%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd-%n.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd-%n.log
MpiDefault=none
ReturnToService=2
KillWait={kill_wait}
JobRequeue=1
SchedulerType=sched/builtin
NodeName=n1 NodeHostname={host} NodeAddr=127.0.0.1 Port={n1_port} CPUs=2 State=UNKNOWN
NodeName=n2 NodeHostname={host} NodeAddr=127.0.0.1 Port={n2_port} CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class Cluster:
    dir: Path
    procs: list[subprocess.Popen] = field(default_factory=list)
    munged_pid: int | None = None

    @property
    def env(self) -> dict[str, str]:
        return dict(os.environ, SLURM_CONF=str(self.dir / "slurm.conf"))

    def run(self, *cmd: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, env=kw.pop("env", self.env), text=True, capture_output=True, check=check, **kw)

    def start(self) -> Cluster:
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "state").mkdir(exist_ok=True)
        shutil.chown(self.dir, "munge")  # munged runs as munge; its socket and pid file live here
        self.dir.chmod(0o755)
        ctld, n1, n2 = _free_ports(3)
        conf = CONF.format(
            host=socket.gethostname(),
            dir=self.dir,
            ctld_port=ctld,
            n1_port=n1,
            n2_port=n2,
            kill_wait=KILL_WAIT_S,
            cred_expire=CRED_EXPIRE_S,
        )
        (self.dir / "slurm.conf").write_text(conf)
        subprocess.run(
            [
                "runuser", "-u", "munge", "--", "/usr/sbin/munged",
                f"--socket={self.dir}/munge.sock", f"--pid-file={self.dir}/munged.pid",
                f"--log-file={self.dir}/munged.log", f"--seed-file={self.dir}/munged.seed",
            ],
            check=True,
        )  # fmt: skip
        self.munged_pid = int((self.dir / "munged.pid").read_text())
        log = (self.dir / "daemons.out").open("w")
        for cmd in (["slurmctld", "-D", "-i"], ["slurmd", "-D", "-N", "n1"], ["slurmd", "-D", "-N", "n2"]):
            self.procs.append(subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.time() + 60
        while time.time() < deadline:
            out = self.run("sinfo", "-h", "-o", "%T", check=False).stdout.split()
            if out and all(s == "idle" for s in out):
                return self
            time.sleep(0.5)
        raise RuntimeError(f"SLURM nodes not idle after 60 s: {out}; see {self.dir}")

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
        if self.munged_pid:
            try:
                os.kill(self.munged_pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def log_tail(self, lines: int = 40) -> str:
        """The end of slurmctld's log, for a failure message."""
        text = (self.dir / "slurmctld.log").read_text(errors="replace").splitlines()
        return "\n--- slurmctld.log ---\n" + "\n".join(text[-lines:])

    def sbatch(self, script: Path, *args: str, env: dict | None = None) -> int:
        r = self.run("sbatch", "--parsable", str(script), *args, env=dict(self.env, **(env or {})), cwd=script.parent)
        return int(r.stdout.strip().split(";")[0])

    def state(self, job: int) -> str:
        out = self.run("scontrol", "show", "job", str(job), check=False).stdout
        m = re.search(r"JobState=(\w+)", out)
        return m.group(1) if m else "GONE"

    def wait(self, job: int, timeout: float, done=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")) -> str:
        deadline = time.time() + timeout
        while time.time() < deadline:
            state = self.state(job)
            if state in done:
                return state
            time.sleep(0.5)
        raise TimeoutError(f"job {job} still {self.state(job)} after {timeout} s")
