"""The follower: follows one job of any backend to its end, and turns its end into a result or an error.

`Follower(job, cfg, on_line).run()` does everything alike for every backend's `Job` (lmyard.launch.job):
output, progress, the watchdog, cancellation and cleanup, and the result (or the exception of lmyard.errors that
its exit code names); `stop_all()` asks every job this process follows to stop.

Design notes: docs/launch.md, `lmyard/launch/follower.py`.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable

from pydantic import BaseModel

from lmyard.config import RunConfig
from lmyard.errors import ExitCode, TrainingFailed, error_for
from lmyard.launch import watchdog
from lmyard.launch.cause import AGENT, first_cause, rank_ends
from lmyard.launch.job import Job
from lmyard.stages import StageError, Started, TrainSpec, read_result
from lmyard.stages.runtime import OUTPUT_LINES, RANK_LINE

POLL_S = 1.0  # how often the exchange folder is read (heartbeats, progress)
_ACTIVE: set[Follower] = set()
_ACTIVE_LOCK = threading.Lock()


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
