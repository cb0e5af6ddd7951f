"""The Slurm backend's Job: each stage one Slurm job submitted with `sbatch` from this machine (a login node).

The job's batch script runs `srun` with one task per node; each task is `python -m lmyard.launch.slurm_node`,
which fills in the rendezvous (the job's first node, by its NodeAddr) and runs the node's command (torchrun for
training, `python -m lmyard.stages STAGE` otherwise) with the node's own exchange folder, `node-<i>/` of the
job folder (launch.slurm.job_dir, a filesystem the nodes share with this machine). This side follows the job
through that folder: each node's output, its exit code, and the files the Follower reads (progress,
heartbeats, the result), and through `squeue` for the job's state.

Design notes: docs/launch.md, `lmyard/launch/slurm.py`.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from lmyard.config import RunConfig
from lmyard.errors import UserError
from lmyard.launch import jobdirs
from lmyard.launch.job import stage_command, stage_env
from lmyard.stages import EXCHANGE_ENV, StageSpec, TrainSpec, read_beats, write_json

# squeue's reasons for a pending job that waiting does not clear: the job can never start as asked
NEVER = {
    "PartitionNodeLimit",
    "PartitionTimeLimit",
    "PartitionConfig",
    "BadConstraints",
    "InvalidAccount",
    "InvalidQOS",
    "AccountNotAllowed",
    "QOSMaxNodePerJobLimit",
}
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL"}
HEAD, SELF = "{head}", "{self}"  # filled in on each node by lmyard.launch.slurm_node
POLL_S = 0.5


def _slurm(cmd: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    """A Slurm command; a missing one is a user error naming it."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise UserError(
            f"launch.backend=slurm needs Slurm's `{cmd[0]}` on this machine (a login node of the cluster)"
        ) from None


def node_plan(cfg: RunConfig, spec: StageSpec, folder: str) -> dict:
    """What each node runs (`argv`, with HEAD and SELF for the addresses only the nodes know) and its environment."""
    sc, n = cfg.launch.slurm, spec.nodes()
    python = "python3" if sc.container_image else sys.executable
    spec_path = os.path.join(folder, "spec.json")
    if isinstance(spec, TrainSpec) and n > 1:
        endpoint, rdzv_id = f"{HEAD}:{sc.rdzv_port}", "slurm-{job}"  # filled in on the node
        argv = [
            stage_command(cfg, spec, python=python, rdzv_endpoint=endpoint, rdzv_id=rdzv_id, node=i,
                          local_addr=SELF, spec_path=spec_path)
            for i in range(n)
        ]  # fmt: skip
    else:
        argv = [stage_command(cfg, spec, python=python, spec_path=spec_path)]
    env = stage_env(cfg)
    if sc.socket_ifname:
        env.update(NCCL_SOCKET_IFNAME=sc.socket_ifname, GLOO_SOCKET_IFNAME=sc.socket_ifname)
    return {"argv": argv, "env": env, "exchange_env": EXCHANGE_ENV}


def sbatch_options(cfg: RunConfig, spec: StageSpec, folder: str) -> list[str]:
    """sbatch's options for `spec`'s job: nodes, one task each, the site's settings, the signal before the limit."""
    sc = cfg.launch.slurm
    opts = [
        f"--job-name=lmyard-{spec.stage}-{cfg.run_name}",
        f"--nodes={spec.nodes()}",
        "--ntasks-per-node=1",
        f"--cpus-per-task={sc.cpus_per_node or cfg.launch.nproc_per_node}",
        f"--signal=TERM@{int(cfg.launch.grace_s) + 60}",
        "--no-requeue",
        "--export=ALL",
        f"--chdir={os.getcwd()}",
        f"--output={os.path.join(folder, 'slurm-%j.out')}",
    ]
    opts += [f"--partition={sc.partition}"] if sc.partition else []
    opts += [f"--account={sc.account}"] if sc.account else []
    opts += [f"--time={sc.time_limit}"] if sc.time_limit else []
    opts += [f"--gpus-per-node={sc.gpus_per_node}"] if sc.gpus_per_node else []
    return [*opts, *sc.sbatch_args]


def batch_script(cfg: RunConfig, spec: StageSpec, folder: str) -> str:
    """The job's batch script: one srun task per node, each `python -m lmyard.launch.slurm_node FOLDER`."""
    sc, n = cfg.launch.slurm, spec.nodes()
    srun = ["srun", f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1", "--kill-on-bad-exit=0"]
    python = sys.executable
    if sc.container_image:
        mounts = ",".join([f"{folder}:{folder}", *sc.container_mounts])
        srun += [f"--container-image={sc.container_image}", f"--container-mounts={mounts}"]
        python = "python3"
    cmd = " ".join(shlex.quote(a) for a in [*srun, python, "-m", "lmyard.launch.slurm_node", folder])
    return f"#!/bin/sh\nexec {cmd}\n"


class SlurmJob:
    """One stage as one Slurm job (see the module's docstring)."""

    def __init__(self, cfg: RunConfig, spec: StageSpec, on_line: Callable[[str], None]):
        self.cfg, self.spec, self.on_line = cfg, spec, on_line
        self.nodes = spec.nodes()
        self.partition = cfg.launch.slurm.partition
        self.folder = jobdirs.new_job_folder(spec.stage, root=cfg.launch.slurm.job_dir)
        write_json(os.path.join(self.folder, "spec.json"), spec)
        with open(os.path.join(self.folder, "plan.json"), "w") as f:
            json.dump(node_plan(cfg, spec, self.folder), f)
        self.job_id: str | None = None
        self.done = threading.Event()
        self.pump: threading.Thread | None = None

    @classmethod
    def for_stage(
        cls, cfg: RunConfig, spec: StageSpec, on_line: Callable[[str], None], *, flow_run_id: str | None
    ) -> SlurmJob:
        return cls(cfg, spec, on_line)

    def start(self, events: queue.Queue) -> None:
        script = os.path.join(self.folder, "job.sh")
        with open(script, "w") as f:
            f.write(batch_script(self.cfg, self.spec, self.folder))
        submitted = _slurm(["sbatch", "--parsable", *sbatch_options(self.cfg, self.spec, self.folder), script])
        if submitted.returncode != 0:
            why = (submitted.stderr.strip().splitlines() or ["no reason given"])[-1]
            why = why.removeprefix("sbatch: error: ").removeprefix("Batch job submission failed: ")
            raise UserError(
                f"Slurm refused the {self.spec.stage} job ({self.nodes} node(s), partition "
                f"{self.partition or 'default'}): {why}; check launch.slurm.partition, launch.nnodes and "
                "launch.slurm.sbatch_args against `sinfo`"
            )
        self.job_id = submitted.stdout.strip().split(";")[0]
        self.on_line(f"Slurm job {self.job_id}: {self.spec.stage} on {self.nodes} node(s)")
        self._wait_running()
        self.pump = threading.Thread(target=self._follow, args=(events,), daemon=True, name="slurm-job")
        self.pump.start()

    def state(self) -> tuple[str | None, str, str]:
        """The job's state, squeue's reason and its partition; state None once Slurm no longer lists it."""
        out = _slurm(["squeue", "-h", "-j", str(self.job_id), "-o", "%T|%r|%P"])
        fields = out.stdout.strip().split("|") if out.returncode == 0 and out.stdout.strip() else []
        if len(fields) != 3:
            return None, "", self.partition or ""
        return fields[0], fields[1], fields[2]

    def _wait_running(self) -> None:
        """Until the job leaves PENDING; a reason that never clears, or pending_timeout_s, cancels it in one line."""
        t0, limit = time.monotonic(), self.cfg.launch.slurm.pending_timeout_s
        while True:
            state, reason, partition = self.state()
            if state != "PENDING":
                return
            waited = time.monotonic() - t0
            if reason in NEVER or waited > limit:
                self._cancel()
                fix = "lower launch.nnodes or change the partition" if reason in NEVER else (
                    "raise launch.slurm.pending_timeout_s or choose another partition")  # fmt: skip
                raise UserError(
                    f"Slurm job {self.job_id} pending {waited:.0f} s in partition {partition}: {reason} "
                    f"(squeue); cancelled it: {fix}"
                )
            time.sleep(1)

    def _follow(self, events: queue.Queue) -> None:
        """Each node's new output lines and its exit code onto `events`, until every node has exited."""
        offsets, rest = [0] * self.nodes, [""] * self.nodes
        exited: set[int] = set()
        last_state, gone_at = 0.0, None
        while len(exited) < self.nodes and not self.done.is_set():
            for i in range(self.nodes):
                rest[i] = self._lines(i, offsets, rest[i], events)
                if i not in exited and (code := self._exit_code(i)) is not None:
                    exited.add(i)
                    events.put(("exit", i, code))
            if time.monotonic() - last_state > 2:
                last_state = time.monotonic()
                state, _, _ = self.state()
                if state is None or state in ENDED:
                    gone_at = gone_at or time.monotonic()
            if gone_at is not None and time.monotonic() - gone_at > 5:  # ended without a node's exit code
                self._ended_without(exited, events)
                return
            time.sleep(POLL_S)

    def _ended_without(self, exited: set[int], events: queue.Queue) -> None:
        """The job ended but nodes wrote no exit code (never started, or killed): the batch output, then 137."""
        with contextlib.suppress(OSError), open(os.path.join(self.folder, f"slurm-{self.job_id}.out")) as f:
            for line in f.read().splitlines()[-20:]:
                events.put(("line", 0, line))
        for i in range(self.nodes):
            if i not in exited:
                events.put(("exit", i, 137))

    def _lines(self, node: int, offsets: list[int], rest: str, events: queue.Queue) -> str:
        try:
            with open(os.path.join(self.folder, f"node-{node}", "output.log"), "rb") as f:
                f.seek(offsets[node])
                data = f.read()
        except OSError:
            return rest
        offsets[node] += len(data)
        *lines, rest = (rest + data.decode(errors="replace")).split("\n")
        for line in lines:
            events.put(("line", node, line))
        return rest

    def _exit_code(self, node: int) -> int | None:
        with contextlib.suppress(OSError, ValueError), open(os.path.join(self.folder, f"node-{node}", "exit")) as f:
            return int(f.read().strip())
        return None

    def read(self, name: str) -> bytes | None:
        try:
            with open(os.path.join(self.folder, "node-0", name), "rb") as f:
                return f.read()
        except OSError:
            return None

    def read_all(self, folder: str) -> dict[str, bytes]:
        out: dict[str, bytes] = {}
        for i in range(self.nodes):
            out.update({k: v.encode() for k, v in read_beats(os.path.join(self.folder, f"node-{i}", folder)).items()})
        return out

    def terminate(self) -> None:
        """SIGTERM to every node's task (Slurm's preemption does the same): checkpoint, exit as preempted."""
        if self.job_id:
            _slurm(["scancel", "--signal=TERM", self.job_id])

    def kill(self) -> None:
        if self.job_id:
            _slurm(["scancel", "--signal=KILL", "--full", self.job_id])
            _slurm(["scancel", self.job_id])

    def why(self, node: int, code: int) -> str:
        return " (killed)" if code in (-9, 137) else ""

    def _cancel(self, timeout_s: float = 60) -> None:
        """scancel, and wait until squeue no longer lists the job as active."""
        _slurm(["scancel", str(self.job_id)])
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state, _, _ = self.state()
            if state is None or state in ENDED:
                return
            time.sleep(0.5)

    def close(self) -> None:
        self.done.set()
        if self.job_id:
            self._cancel()
        if self.pump is not None:
            self.pump.join(timeout=10)
        shutil.rmtree(self.folder, ignore_errors=True)
