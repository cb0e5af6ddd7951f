"""A real Slurm cluster on simulated hosts (tests/hosts.py): munged and slurmctld in the services host (the login
node: jobs are submitted from there), a slurmd in each host, a munge key made here, every file under the harness's
folder. `close()` cancels every job; the harness's own close ends the daemons and what runs in its namespaces.

    with Hosts(tmp, ["a", "b"]) as hosts, SlurmCluster(hosts) as slurm:
        slurm.run(["sinfo"]).stdout, slurm.env()  # SLURM_CONF, for commands run in the services host
"""

from __future__ import annotations

import os
import shutil
import time

from hosts import Hosts

SLURM_PROGRAMS = ["munged", "slurmctld", "slurmd", "slurmstepd", "sbatch", "squeue", "scancel", "sinfo", "srun"]
PARTITION = "debug"


def missing_programs() -> list[str]:
    return [p for p in SLURM_PROGRAMS if shutil.which(p) is None]


class SlurmCluster:
    """slurmctld and munged in `hosts.services`, one slurmd per simulated host, partition PARTITION of them all."""

    def __init__(self, hosts: Hosts, cpus: int = 2):
        self.hosts, self.cpus = hosts, cpus
        self.root = hosts.root / "slurm"
        self.conf = self.root / "slurm.conf"
        self.socket = hosts.run_dir / "munge.sock"

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf), **(extra or {})}

    def run(self, cmd: list[str], timeout: float = 60):
        """A Slurm command in the services host (the login node)."""
        return self.hosts.services.run(cmd, env=self.env(), timeout=timeout)

    def __enter__(self) -> SlurmCluster:
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o600)
        self.conf.write_text(self._conf())
        svc = self.hosts.services
        munge = ["munged", "-F", "-f", f"--socket={self.socket}", f"--key-file={key}"]
        munge += [f"--log-file={self.root / 'munged.log'}", f"--pid-file={self.root / 'munged.pid'}"]
        svc.start([*munge, f"--seed-file={self.root / 'munged.seed'}"], "munged.log")
        self._wait(lambda: self.socket.exists(), "munged's socket")
        svc.start(["slurmctld", "-D", "-c", "-f", str(self.conf)], "slurmctld.log", env=self.env())
        for host in self.hosts.hosts:
            host.start(["slurmd", "-D", "-N", host.hostname, "-f", str(self.conf)], "slurmd.log", env=self.env())
        self._wait(self._all_idle, "every node idle in sinfo", timeout_s=120)
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _all_idle(self) -> bool:
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"])
        states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
        return sorted(states) == sorted(h.hostname for h in self.hosts.hosts) and set(states.values()) == {"idle"}

    def _wait(self, ready, what: str, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if time.monotonic() > deadline:
                logs = "\n".join(
                    f"--- {p}\n{p.read_text()[-1500:]}" for p in self.hosts.root.rglob("*.log") if "slurm" in p.name
                )
                raise RuntimeError(f"the Slurm cluster did not come up ({what}):\n{logs}")
            time.sleep(0.5)

    def jobs(self) -> list[str]:
        """`id state` of every job slurmctld lists."""
        return [line for line in self.run(["squeue", "-h", "-o", "%i %T"]).stdout.splitlines() if line.strip()]

    def idle(self, timeout_s: float = 60) -> list[str]:
        """The jobs still listed once none is, or `timeout_s` has passed (a cancelled job completes first)."""
        deadline = time.monotonic() + timeout_s
        while (jobs := self.jobs()) and time.monotonic() < deadline:
            time.sleep(0.5)
        return jobs

    def close(self) -> None:
        """Cancel every job and wait until none is listed (the harness ends the daemons)."""
        if not self.conf.exists():
            return
        self.run(["scancel", "--user=root"])
        self.idle()

    def _conf(self) -> str:
        svc, r = self.hosts.services, self.root
        nodes = "\n".join(
            f"NodeName={h.hostname} NodeAddr={h.addr} CPUs={self.cpus} State=UNKNOWN" for h in self.hosts.hosts
        )
        names = ",".join(h.hostname for h in self.hosts.hosts)
        return f"""ClusterName=lmyard
SlurmctldHost={svc.hostname}({svc.addr})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.socket}
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool-%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd-%n.pid
SlurmctldLogFile={r}/slurmctld.log
SlurmdLogFile={r}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=30
MinJobAge=60
{nodes}
PartitionName={PARTITION} Nodes={names} Default=YES MaxTime=INFINITE State=UP
"""
