"""Launchers: start a stage on every node, follow the job, and turn its end into a result or an error.

A `Job` starts the nodes and reports what they print and how they exit (`LocalJob` here; the other backends'
Jobs in the backend table, lmyard.backends); `Follower` does everything else alike for every backend: output,
progress, the watchdog, cancellation and cleanup, and the result (or the exception of lmyard.errors that its
exit code names).

Design notes: docs/launch.md, `lmyard/launch/follower.py`.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Protocol

from pydantic import BaseModel

from lmyard.config import RunConfig
from lmyard.errors import ExitCode, TrainingFailed, UserError, error_for
from lmyard.launch import jobdirs, watchdog
from lmyard.launch.cause import AGENT, first_cause, rank_ends
from lmyard.stages import (
    EXCHANGE_ENV,
    Exchange,
    StageError,
    StageSpec,
    Started,
    TrainSpec,
    read_beats,
    read_result,
    write_json,
)
from lmyard.stages.runtime import OUTPUT_LINES, RANK_LINE
from lmyard.stages.startup import LAUNCHED_AT_ENV

RDZV_TIMEOUT_S = 600  # how long node 0 waits for the others to join
POLL_S = 1.0  # how often the exchange folder is read (heartbeats, progress)
_ACTIVE: set[Follower] = set()
_ACTIVE_LOCK = threading.Lock()


class Job(Protocol):
    """One launch of a stage on `nodes` nodes."""

    nodes: int
    spec: StageSpec

    def start(self, events: queue.Queue) -> None:
        """Start every node; then put ("line", node, text), ("exit", node, code), ("error", node, exc) on `events`."""

    def read(self, name: str) -> bytes | None:
        """A file of the exchange folder of the node that runs rank 0 (node 0 of a local or Docker job), or None."""

    def read_all(self, folder: str) -> dict[str, bytes]:
        """The files of a subfolder of every node's exchange folder, by name."""

    def terminate(self) -> None:
        """SIGTERM to every node (the trainer checkpoints and exits as preempted)."""

    def kill(self) -> None: ...

    def why(self, node: int, code: int) -> str:
        """Words on an exit code: ` (out of memory)`, ` (killed)`, or ''."""

    def close(self) -> None:
        """Remove everything the job made; tolerates what is already gone."""


class JobFactory(Protocol):
    """How the launcher makes a backend's Job (named `module:name` in the backend table, lmyard.backends): the
    job of `spec`'s stage; `flow_run_id` labels what the job makes (None outside a flow)."""

    def __call__(
        self, cfg: RunConfig, spec: StageSpec, on_line: Callable[[str], None], *, flow_run_id: str | None
    ) -> Job: ...


def torchrun_command(
    cfg: RunConfig,
    *,
    python: str = sys.executable,
    rdzv_endpoint: str | None = None,
    rdzv_id: str | None = None,
    node: int | None = None,
    local_addr: str | None = None,
    spec_path: str | None = None,
    node_rank: str | None = None,
) -> list[str]:
    """torchrun running the trainer on one node: standalone for one node, else a c10d (or static) rendezvous.

    `node` (when the caller knows it) tells torchrun whether this node hosts the rendezvous. `node_rank` instead: a
    static rendezvous at the endpoint, this node's rank as given (a placeholder the node fills in: Kubernetes'
    `$(NODE_RANK)`, lmyard.launch.kubernetes); node 0 hosts it."""
    n = cfg.launch.nnodes
    cmd = [
        python,
        "-m",
        "lmyard.launch.torchrun",  # torchrun: a preempted rank stops no other, a failed rank is one line
        "--nnodes",
        str(n),
        "--nproc_per_node",
        str(cfg.launch.nproc_per_node),
        "--max_restarts",
        "0",
    ]
    if n == 1:  # its own rendezvous; at `local_addr` where the host's name does not resolve (an elastic run's one)
        cmd += ["--standalone", *(["--local_addr", local_addr] if local_addr else [])]
    else:
        endpoint = rdzv_endpoint or cfg.launch.rdzv_endpoint
        if not endpoint:
            raise UserError("launch.nnodes > 1 needs launch.rdzv_endpoint (host:port of node 0)")
        static = node_rank is not None
        cmd += ["--rdzv_backend", "static" if static else "c10d", "--rdzv_endpoint", endpoint]
        cmd += ["--rdzv_id", rdzv_id or cfg.run_name]
        if static:
            cmd += ["--node_rank", str(node_rank), "--rdzv_conf", f"timeout={RDZV_TIMEOUT_S}"]
        elif node is not None:
            cmd += ["--rdzv_conf", f"is_host={int(node == 0)},join_timeout={RDZV_TIMEOUT_S}"]
        if local_addr:
            cmd += ["--local_addr", local_addr]
    return [*cmd, "-m", "lmyard.stages", "train", *(["--spec", spec_path] if spec_path else [])]


def stage_command(cfg: RunConfig, spec: StageSpec, *, python: str = sys.executable, **torchrun) -> list[str]:
    """The command of one node: torchrun for training (see torchrun_command), one process for the others."""
    if isinstance(spec, TrainSpec):
        return torchrun_command(cfg, python=python, **torchrun)
    spec_path = torchrun.get("spec_path")
    return [python, "-m", "lmyard.stages", spec.stage, *(["--spec", spec_path] if spec_path else [])]


def stage_env(cfg: RunConfig) -> dict[str, str]:
    """Environment every launch gives torchrun: unbuffered output, and torchrun's own grace before it kills its
    ranks after a signal a little longer than the trainer's, so the checkpoint is committed before anything is
    killed (a rank that ends preempted first stops no other: lmyard.launch.torchrun).
    OMP_NUM_THREADS: torchrun sets 1 itself when it is unset, with a 4-line banner; set, it says nothing (the
    trainer sets its threads itself: train.threads_per_rank)."""
    return {
        "PYTHONUNBUFFERED": "1",
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(int(cfg.launch.grace_s) + 10),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }


# ---------------------------------------------------------------- following (every backend)


class Follower:
    """Follows one job to its end (see the module docstring); `stop()` may be called from any thread."""

    def __init__(
        self,
        job: Job,
        cfg: RunConfig,
        on_line: Callable[[str], None],
        on_progress: Callable[[BaseModel], None] | None = None,
        on_started: Callable[[Started], None] | None = None,
        tail_lines: int = 40,
    ):
        self.job, self.cfg, self.on_line = job, cfg, on_line
        self.on_progress, self.on_started = on_progress, on_started
        self.tails: list[collections.deque[str]] = [collections.deque(maxlen=tail_lines) for _ in range(job.nodes)]
        self.rank_tails: dict[int, collections.deque[str]] = collections.defaultdict(
            lambda: collections.deque(maxlen=OUTPUT_LINES)
        )  # a training's lines by rank: `[rank R] ` starts those of every rank but 0 (lmyard.launch.cause)
        # every rank of a training writes heartbeats; the other stages write none and are not watched
        ranks = cfg.launch.nnodes * cfg.launch.nproc_per_node if isinstance(job.spec, TrainSpec) else 0
        self.dog = watchdog.Watchdog(cfg.launch.watchdog_s, startup_s=cfg.launch.startup_timeout_s, ranks=ranks)
        self.stop_requested = threading.Event()
        self.ended = threading.Event()  # set once run() has returned or raised, the job closed
        self.exits: dict[int, int] = {}
        self.lost: set[int] = set()  # nodes found lost: their engine or actor gone, or cut off from node 0
        self.cut_off: set[int] = set()  # of those, the ones that could not reach node 0's rendezvous
        self.started_seen, self.progress_seen, self.stepped = False, b"", False

    def run(self):
        """The stage's result (of the spec's result type), or the exception its exit code names."""
        events: queue.Queue = queue.Queue()
        with _ACTIVE_LOCK:
            _ACTIVE.add(self)
        try:
            self.job.start(events)  # a refusal here (an image, an engine check) has nothing to stop: close() cleans
            self.dog.arm()  # the startup timeout counts from here, not from image builds
            try:
                stalled = self._follow(events)
                self._poll()
            except BaseException:  # interrupted while the job runs: SIGTERM, grace, kill
                self._stop(events)
                raise
            return self._result(stalled)
        finally:
            try:
                self.job.close()
            finally:
                with _ACTIVE_LOCK:
                    _ACTIVE.discard(self)
                self.ended.set()

    def stop(self) -> None:
        self.stop_requested.set()

    def _line(self, node: int, text: str) -> None:
        line = f"[node {node}] {text}" if self.job.nodes > 1 else text
        self.tails[node].append(line)
        rank = RANK_LINE.match(text)
        if rank is not None or node == 0 and not text.startswith(AGENT):
            self.rank_tails[int(rank[1]) if rank else 0].append(text[rank.end() :] if rank else text)
        self.on_line(line)

    def _drain(self, events: queue.Queue, timeout: float) -> None:
        try:
            kind, node, value = events.get(timeout=timeout)
        except queue.Empty:
            return
        if kind == "line":
            self._line(node, value)
        elif kind == "exit":
            self.exits[node] = value
        else:
            self.lost.add(node)
            raise TrainingFailed(f"lost node {node}: {value}")

    def _follow(self, events: queue.Queue) -> str | None:
        """Until every node has exited; a failed node gives the others `grace_s`; returns a stall message."""
        last_poll, failed_at, terminated = 0.0, None, False
        while len(self.exits) < self.job.nodes:
            self._drain(events, 0.2)
            now = time.monotonic()
            if self.stop_requested.is_set() and not terminated:
                self.on_line(f"stopping the job: SIGTERM, {self.cfg.launch.grace_s:g} s to checkpoint")
                self.job.terminate()
                terminated, failed_at = True, now
            if failed_at is None and any(code != 0 for code in self.exits.values()):
                failed_at = now  # the others get a moment to end on their own (their peer is gone)
            if failed_at is not None and now - failed_at > (self.cfg.launch.grace_s if terminated else 10):
                self.job.kill()
                failed_at = float("inf")
            if now - last_poll >= POLL_S:
                last_poll = now
                stall = self._poll()
                if stall:
                    stall = self._where(stall)
                    self.on_line(stall + "; stopping the job")
                    self.job.kill()
                    return stall
        while not events.empty():  # lines printed just before the exits
            self._drain(events, 0)
        return None

    def _where(self, stall: str) -> str:
        """The watchdog's line, with the node (host, address) that cannot reach node 0 when the job can tell
        (a Docker job: lmyard.launch.peers)."""
        ask = getattr(self.job, "stalled_peers", None)
        found = ask() if ask is not None else None
        if not found:
            return stall
        self.lost.update(found[1])
        self.cut_off.update(found[1])
        return f"{stall}; {found[0]}"

    def _poll(self) -> str | None:
        """Read started/progress/heartbeats; a watchdog message when the job stalled."""
        if not self.started_seen and (raw := self.job.read("started.json")):
            self.started_seen = True
            if self.on_started:  # with where the nodes are, from a job that placed them itself (Ray's placed())
                placed = getattr(self.job, "placed", None)
                started = Started.model_validate_json(raw)
                self.on_started(started.model_copy(update={"hosts": placed()}) if placed else started)
        raw = self.job.read("progress.json")
        if raw and raw != self.progress_seen:
            self.progress_seen = raw
            if self.on_progress:
                self.on_progress(type(self.job.spec).progress.model_validate_json(raw))
        beats = {name: data.decode().strip() for name, data in self.job.read_all("heartbeat").items()}
        self.stepped = self.stepped or len(beats) >= self.dog.ranks > 0  # every rank has completed a step
        return self.dog.check(beats)

    def _stop(self, events: queue.Queue) -> None:
        """Interrupted: SIGTERM, wait up to grace_s for the nodes (forwarding their last lines), then kill."""
        try:
            self.on_line(f"interrupted: stopping the job (SIGTERM, up to {self.cfg.launch.grace_s:g} s to checkpoint)")
            self.job.terminate()
            deadline = time.monotonic() + self.cfg.launch.grace_s
            while len(self.exits) < self.job.nodes and time.monotonic() < deadline:
                self._drain(events, 0.2)
        except BaseException:
            pass
        finally:
            self.job.kill()

    def _result(self, stalled: str | None):
        if stalled:
            again = "a retry resumes" if self.cfg.launch.retries else "run the same command again to resume"
            raise TrainingFailed(f"{stalled}; {again} from the last checkpoint")
        raw = self.job.read("result.json")
        result = read_result(raw, type(self.job.spec).result) if raw else None
        if result is None or not isinstance(result, StageError) and any(self.exits.values()):
            failures = [read_result(b, StageError) for _, b in sorted(self.job.read_all("failures").items())]
            result = failures[0] if failures else result
        if result is not None and not isinstance(result, StageError):
            return result
        # preempted while a node failed otherwise: a rank's crash made torchrun stop the others (SIGTERM)
        stopped = result is not None and result.exit_code == ExitCode.PREEMPTED and 1 in self.exits.values()
        if result is not None and result.exit_code != ExitCode.CRASHED and not stopped:
            raise error_for(result.exit_code, result.message, result.status)
        self._crashed(result)

    def _crashed(self, failure: StageError | None) -> None:
        """A training: the rank that failed first, said once (lmyard.launch.cause). Another stage (one process per
        node): the node that failed and its record's message; its output printed as it came."""
        stage = self.job.spec.stage
        failed = {i: c for i, c in self.exits.items() if c != 0}
        killed = [i for i, c in failed.items() if self.job.why(i, c)]  # a node killed whole: its ranks said nothing
        # a node lost whole (killed, its engine gone: no torchrun file of it) is the cause: said by node below
        exits = self.job.read_all("exits") if isinstance(self.job.spec, TrainSpec) else {}
        if exits and len(exits) >= len(failed) and not killed:  # every failed node's torchrun told its ranks' ends
            records = [read_result(b, StageError) for b in self.job.read_all("failures").values()]
            records += [failure] if failure is not None and failure.rank is not None else []
            ends = rank_ends(exits, self.job.read_all("exit-times"), records)
            if ends:
                cause = first_cause(ends, {r: list(t) for r, t in self.rank_tails.items()})
                if not cause.printed:  # a traceback the rank kept to its record: its last lines, once
                    for line in [f"rank {cause.first.rank}'s last lines:", *cause.output]:
                        self.on_line(line)
                raise cause.error(stage)
        i, code = (killed[0], failed[killed[0]]) if killed else next(iter(failed.items())) if failed else (0, 1)
        what = f"node {i} exited" if self.job.nodes > 1 else f"{stage} exited"
        what += f" with code {code}{self.job.why(i, code)}" if failed else " without a result"
        if failure is not None and failure.message and failure.message != failure.status and not killed:
            what += f": {failure.message}"
        raise TrainingFailed(
            what + ("; stopped the others" if self.job.nodes > 1 and failed else ""),
            output=list(self.tails[i])[-OUTPUT_LINES:],
        )


def stop_all(wait_s: float = 0.0) -> int:
    """Ask every job this process is following to stop (SIGTERM, checkpoint, preempted); how many.

    With `wait_s`, wait up to that long for each of them to end (its ranks exited, the preemption checkpoint
    committed or its grace spent, the job closed): whoever then releases the lineage's lease must not do so while
    its own trainer still commits (a commit without the lease is refused)."""
    with _ACTIVE_LOCK:
        active = list(_ACTIVE)
    for f in active:
        f.stop()
    deadline = time.monotonic() + wait_s
    for f in active:
        f.ended.wait(max(0.0, deadline - time.monotonic()))
    return len(active)


# ---------------------------------------------------------------- here: torchrun as a process group


def _die_with_parent() -> None:
    # PR_SET_PDEATHSIG = 1: the kernel sends SIGTERM to torchrun if the launching process dies,
    # and torchrun then stops its workers.
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except OSError:
        pass


class LocalJob:
    """The stage as a child process group of this process: torchrun for training (one node, or one of several
    with rdzv_endpoint), `python -m lmyard.stages STAGE` for the others. `torchrun` takes torchrun_command's keywords: a
    Ray node's actor names its rendezvous and address."""

    nodes = 1

    def __init__(self, cfg: RunConfig, spec: StageSpec, **torchrun):
        self.spec = spec
        self.folder = jobdirs.new_job_folder(spec.stage)  # removed by close(); a dead launcher's, by the next job
        self.exchange = Exchange(self.folder)
        write_json(self.exchange.path("spec.json"), spec)
        self.cmd = stage_command(cfg, spec, spec_path=self.exchange.path("spec.json"), **torchrun)
        self.env = {**os.environ, **stage_env(cfg), EXCHANGE_ENV: self.folder}
        self.proc: subprocess.Popen | None = None

    @classmethod
    def for_stage(
        cls, cfg: RunConfig, spec: StageSpec, on_line: Callable[[str], None], *, flow_run_id: str | None
    ) -> LocalJob:
        return cls(cfg, spec)

    def start(self, events: queue.Queue) -> None:
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            env={**self.env, LAUNCHED_AT_ENV: f"{time.time():.3f}"},  # the trainer's startup parts start here
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )

        def pump() -> None:
            assert self.proc and self.proc.stdout
            for raw in self.proc.stdout:
                events.put(("line", 0, raw.rstrip("\n")))
            events.put(("exit", 0, self.proc.wait()))

        threading.Thread(target=pump, daemon=True, name=f"{self.spec.stage}-output").start()

    def read(self, name: str) -> bytes | None:
        try:
            with open(self.exchange.path(name), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def read_all(self, folder: str) -> dict[str, bytes]:
        return {k: v.encode() for k, v in read_beats(self.exchange.path(folder)).items()}

    def _signal(self, sig: int) -> None:
        """`sig` to torchrun's process group and to every process under torchrun: torch's elastic agent starts
        each rank in a session of its own, which a signal to torchrun's group alone does not reach (a SIGKILLed
        torchrun would leave its ranks running)."""
        import psutil

        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            tree = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            tree = []
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        for p in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(sig)

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()

    def why(self, node: int, code: int) -> str:
        return " (killed)" if code in (-9, 137) else ""

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.folder, ignore_errors=True)


def run_local(cfg: RunConfig, spec: StageSpec | dict, on_line: Callable[[str], None] = print, **callbacks):
    """Run a stage here and follow it (a dict is a TrainSpec); its result, or the error its exit code names."""
    spec = spec if isinstance(spec, StageSpec) else TrainSpec.model_validate(spec)
    return Follower(LocalJob(cfg, spec), cfg, on_line, **callbacks).run()
