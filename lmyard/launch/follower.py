"""Launchers: start a stage on every node, follow the job, and turn its end into a result or an error.

Every stage (shard, train, evaluate, export; lmyard.stages) is launched the
same way: a spec (lmyard.stages.StageSpec) in, its result type out. One
interface, a backend table (lmyard.backends). A `Job` starts the nodes and reports what they print
and how they exit; `LocalJob` runs the stage as a process group here (torchrun
for training, one `python -m lmyard.dispatch STAGE` otherwise),
`lmyard.launch.containers.DockerJob` one container per node in the stage
image, `lmyard.launch.ray.RayJob` one Ray actor per node (each runs a `LocalJob`
on its node; training only). `lmyard.launch.launcher.launch` starts the table's Job of `launch.backend`.
Everything else is shared, in `Follower`:

- output: every line reaches `on_line`, prefixed `[node i]` when there are several nodes;
- progress (training, tokenize-and-shard: the spec's `progress` type) and resume (training):
  `progress.json` and `started.json` from the job's exchange folder (lmyard.stages), never parsed
  from the log;
- the heartbeat watchdog (`launch.watchdog_s`, and `launch.startup_timeout_s` from the job's start to
  every rank's first step): stalled ranks, or ranks that never start, get the job killed (stages that
  write no heartbeats are not watched);
- cancellation and cleanup: an interrupt (Ctrl-C, Prefect's cancellation) or `stop_all()` sends
  SIGTERM to every node, waits `launch.grace_s` for the checkpoint, then kills; the job's
  processes, containers and networks are removed whatever happens;
- the result: `result.json` (rank 0's, or a failing rank's own file) and the exit codes become the
  spec's result (a `TrainResult`, `EvalResult`, ...), or the exception of lmyard.errors that its exit
  code names (lmyard.stages.read_result).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import json
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
) -> list[str]:
    """torchrun running the trainer on one node: standalone for one node, else c10d rendezvous.

    `node` (when the caller knows it) tells torchrun whether this node hosts the rendezvous."""
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
    if n == 1:
        cmd.append("--standalone")
    else:
        endpoint = rdzv_endpoint or cfg.launch.rdzv_endpoint
        if not endpoint:
            raise UserError("launch.nnodes > 1 needs launch.rdzv_endpoint (host:port of node 0)")
        cmd += ["--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint, "--rdzv_id", rdzv_id or cfg.run_name]
        if node is not None:
            cmd += ["--rdzv_conf", f"is_host={int(node == 0)},join_timeout={RDZV_TIMEOUT_S}"]
        if local_addr:
            cmd += ["--local_addr", local_addr]
    return [*cmd, "-m", "lmyard.dispatch", "train", *(["--spec", spec_path] if spec_path else [])]


def stage_command(cfg: RunConfig, spec: StageSpec, *, python: str = sys.executable, **torchrun) -> list[str]:
    """The command of one node: torchrun for training (see torchrun_command), one process for the others."""
    if isinstance(spec, TrainSpec):
        return torchrun_command(cfg, python=python, **torchrun)
    spec_path = torchrun.get("spec_path")
    return [python, "-m", "lmyard.dispatch", spec.stage, *(["--spec", spec_path] if spec_path else [])]


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
        # every rank of a training writes heartbeats; the other stages write none and are not watched
        ranks = cfg.launch.nnodes * cfg.launch.nproc_per_node if isinstance(job.spec, TrainSpec) else 0
        self.dog = watchdog.Watchdog(cfg.launch.watchdog_s, startup_s=cfg.launch.startup_timeout_s, ranks=ranks)
        self.stop_requested = threading.Event()
        self.ended = threading.Event()  # set once run() has returned or raised, the job closed
        self.exits: dict[int, int] = {}
        self.started_seen, self.progress_seen = False, b""

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
        return f"{stall}; {found}" if found else stall

    def _poll(self) -> str | None:
        """Read started/progress/heartbeats; a watchdog message when the job stalled."""
        if not self.started_seen and (raw := self.job.read("started.json")):
            self.started_seen = True
            if self.on_started:
                self.on_started(Started.model_validate_json(raw))
        raw = self.job.read("progress.json")
        if raw and raw != self.progress_seen:
            self.progress_seen = raw
            if self.on_progress:
                self.on_progress(type(self.job.spec).progress.model_validate_json(raw))
        beats = {name: data.decode().strip() for name, data in self.job.read_all("heartbeat").items()}
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
        if result is not None and result.exit_code != ExitCode.CRASHED:
            raise error_for(result.exit_code, result.message, result.status)
        self._crashed(result)

    def _killed_ranks(self) -> str | None:
        """The ranks torchrun saw killed by a signal, on any node (its `exits/` files), in words."""
        exits: dict[int, int] = {}
        for raw in self.job.read_all("exits").values():
            with contextlib.suppress(ValueError, AttributeError):
                exits.update({int(r): int(c) for r, c in json.loads(raw).items()})
        return killed_by_signal(exits)

    def _crashed(self, failure: StageError | None) -> None:
        stage = self.job.spec.stage
        failed = {i: c for i, c in self.exits.items() if c != 0}
        if not failed and failure is None:
            raise TrainingFailed(f"{stage} exited without a result; last lines:\n" + "\n".join(self.tails[0]))
        i, code = next(iter(failed.items())) if failed else (0, 1)
        others = [ln for j, t in enumerate(self.tails) if j != i for ln in list(t)[-5:]]
        what = (
            f"node {i} exited with code {code}{self.job.why(i, code)}"
            if self.job.nodes > 1
            else f"{stage} exited with code {code}{self.job.why(i, code)}"
        )
        if killed := self._killed_ranks():  # they died first; the others' errors are about their absence
            what += f": {killed}; the other ranks failed after it"
            if failure is not None and failure.message and failure.message != failure.status:
                what += f" ({failure.message})"
        elif failure is not None and failure.message and failure.message != failure.status:
            what += f": {failure.message}"
        raise TrainingFailed(
            what
            + (" ; stopped the others" if self.job.nodes > 1 else "")
            + ". Last lines:\n"
            + "\n".join([*self.tails[i], *others])
        )


def killed_by_signal(exits: dict[int, int]) -> str | None:
    """Words on the ranks a signal ended (torchrun reports them with a negative code), or None."""
    killed = sorted((r, -c) for r, c in exits.items() if c < 0)
    if not killed:
        return None
    names = {signal.SIGKILL: "SIGKILL: the kernel's out-of-memory killer, or a kill -9", signal.SIGTERM: "SIGTERM"}
    words = [
        f"rank {r} was killed by signal {sig} ({names.get(signal.Signals(sig), signal.Signals(sig).name)})"
        if sig in signal.Signals._value2member_map_
        else f"rank {r} was killed by signal {sig}"
        for r, sig in killed
    ]
    return "; ".join(words)


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
    with rdzv_endpoint), `python -m lmyard.dispatch STAGE` for the others. `torchrun` takes torchrun_command's keywords: a
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
